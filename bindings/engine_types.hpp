// The types both engines share at their host interface (plain C++, no CPU intrinsics and no CUDA):
// the engine config (one struct, read from the one config dict fast/ builds, and validated by one
// function with each engine's limits), the stage table (names, dtypes, sizes), the injection spec, a
// capture record and a step's output. bindings/cpu/engine.hpp and bindings/cuda/engine_api.hpp use these.
// The config's fields, the positivity rules and the stages are oracle/schema.py's, expanded from the
// X-macro lists of glm_schema.hpp (generated into the build folder by tools/gen_headers.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "glm_schema.hpp"  // generated from oracle/schema.py (tools/gen_headers.py)

namespace glm {

// The engine config: its fields are oracle/schema.py's ENGINE_CONFIG (glm_schema.hpp, generated), read
// from the dict fast/ builds from the same schema (pyglue.hpp).
struct EngineConfig {
#define GLM_CONFIG_MEMBER(T, name) T name{};
    GLM_ENGINE_CONFIG_FIELDS(GLM_CONFIG_MEMBER)
#undef GLM_CONFIG_MEMBER

    int64_t kda_dim() const { return linear_num_heads * linear_head_dim; }
    int64_t hc_dim() const { return (2 + hc_mult) * hc_mult; }
};

// Expert parallelism (docs/ep.md): this rank's share of the routed experts, the same in both engines.
struct ExpertPartition {
    int rank = 0, ranks = 1;
    std::vector<int64_t> bounds;  // [ranks + 1]: rank r owns experts [bounds[r], bounds[r + 1])

    bool distributed() const { return ranks > 1; }
    bool owns(int64_t e) const {
        return bounds.empty() || (e >= bounds[static_cast<size_t>(rank)] && e < bounds[static_cast<size_t>(rank) + 1]);
    }
    int owner(int64_t e) const {
        if (bounds.empty()) return 0;
        for (int r = 0; r < ranks; ++r)
            if (e >= bounds[static_cast<size_t>(r)] && e < bounds[static_cast<size_t>(r) + 1]) return r;
        throw std::invalid_argument("expert " + std::to_string(e) + " is in no rank's range");
    }
    // Throws std::invalid_argument unless bounds are contiguous, ascending and cover [0, E).
    void validate(int64_t n_experts) const {
        auto bad = [](const std::string& why) { throw std::invalid_argument("expert partition: " + why); };
        if (ranks < 1) bad("ranks must be >= 1, got " + std::to_string(ranks));
        if (rank < 0 || rank >= ranks) bad("rank " + std::to_string(rank) + " outside [0, " + std::to_string(ranks) + ")");
        if (bounds.size() != static_cast<size_t>(ranks) + 1)
            bad("expected " + std::to_string(ranks + 1) + " bounds, got " + std::to_string(bounds.size()));
        if (bounds.front() != 0 || bounds.back() != n_experts)
            bad("the ranges must cover [0, " + std::to_string(n_experts) + ")");
        for (size_t i = 0; i + 1 < bounds.size(); ++i)
            if (bounds[i] > bounds[i + 1]) bad("the ranges must be ascending and contiguous");
    }
};

struct EpStats {
    uint64_t exchanges = 0;   // hook calls
    uint64_t rows_sent = 0;   // rows of D values sent by this rank (padding included)
    uint64_t bytes_sent = 0;  // bytes this rank handed to the hook
    double hook_seconds = 0;  // wall time inside the hook (CPU: Python, GIL, the collective; CUDA: enqueueing it)
    double step_seconds = 0;  // wall time of the steps (Engine::step)
};

// What an engine's kernels can hold (a config beyond them is refused, naming the field).
struct EngineLimits {
    const char* engine;                   // "CPU", "CUDA": for the messages
    int64_t max_hc_mult;
    int64_t max_context = 0;              // 0: no limit
    int64_t max_linear_head_dim = 0;      // 0: no limit
    int64_t max_routed_experts = 0;       // 0: no limit
    int64_t max_experts_per_tok = 256;
};

// Throws std::invalid_argument naming the field.
inline void validate_config(const EngineConfig& c, const EngineLimits& lim) {
    auto bad = [](const std::string& field, const std::string& why) {
        throw std::invalid_argument("config field '" + field + "': " + why);
    };
    auto pos = [&](const char* f, int64_t v) {
        if (v < 1) bad(f, "must be >= 1, got " + std::to_string(v));
    };
    auto at_most = [&](const char* f, int64_t v, int64_t limit) {
        if (limit > 0 && v > limit)
            bad(f, "must be <= " + std::to_string(limit) + " in the " + lim.engine + " engine, got " + std::to_string(v));
    };
#define GLM_CHECK_POSITIVE(name) pos(#name, c.name);
    GLM_POSITIVE_FIELDS_ANY(GLM_CHECK_POSITIVE)
    at_most("hc_mult", c.hc_mult, lim.max_hc_mult);
    at_most("max_context", c.max_context, lim.max_context);
    const size_t L = static_cast<size_t>(c.num_hidden_layers);
    if (c.is_kda.size() != L) bad("layer_types", "needs one entry per layer");
    if (c.is_moe.size() != L) bad("mlp_layer_types", "needs one entry per layer");
    if (c.has_indexer.size() != L) bad("indexer_types", "needs one entry per layer");
    bool any_kda = false, any_mla = false, any_moe = false, any_dense = false;
    for (size_t l = 0; l < L; ++l) {
        any_kda |= c.is_kda[l] != 0;
        any_mla |= c.is_kda[l] == 0;
        any_moe |= c.is_moe[l] != 0;
        any_dense |= c.is_moe[l] == 0;
        if (!c.is_kda[l] && !c.has_indexer[l] && (l == 0 || c.is_kda[l - 1] || !c.has_indexer[l - 1]))
            bad("indexer_types", "layer " + std::to_string(l) +
                                     " is a 'shared' indexed_attention layer that does not follow a 'full' one");
    }
    if (any_kda) {
        GLM_POSITIVE_FIELDS_KDA(GLM_CHECK_POSITIVE)
        at_most("linear_head_dim", c.linear_head_dim, lim.max_linear_head_dim);
    }
    if (any_mla) {
        GLM_POSITIVE_FIELDS_MLA(GLM_CHECK_POSITIVE)
        if (c.qk_rope_head_dim != 0) bad("qk_rope_head_dim", "only NoPE MLA (0) is supported");
        if (c.index_topk % c.index_kpool != 0) bad("index_topk", "must be divisible by index_kpool");
    }
    if (any_dense) {
        GLM_POSITIVE_FIELDS_DENSE(GLM_CHECK_POSITIVE)
    }
    if (any_moe) {
        GLM_POSITIVE_FIELDS_MOE(GLM_CHECK_POSITIVE)
        at_most("n_routed_experts", c.n_routed_experts, lim.max_routed_experts);
        at_most("num_experts_per_tok", c.num_experts_per_tok, lim.max_experts_per_tok);
        if (c.n_routed_experts % c.n_group != 0 || c.n_routed_experts / c.n_group < 2)
            bad("n_group", "each group needs at least 2 experts and n_routed_experts must divide evenly");
        if (c.topk_group > c.n_group) bad("topk_group", "must be <= n_group");
        if (c.num_experts_per_tok > c.topk_group * (c.n_routed_experts / c.n_group))
            bad("num_experts_per_tok", "exceeds the experts of topk_group groups");
    }
#undef GLM_CHECK_POSITIVE
}

// ---- a step's interface ---------------------------------------------------------------------------

enum class SDType : uint8_t { F32, F64, BF16, I32 };

// The stages (oracle/schema.py's STAGES, generated into glm_schema.hpp), in the model's order.
enum Stage : int {
#define GLM_STAGE_ENUM(id, name, dtype, size) id,
    GLM_STAGES(GLM_STAGE_ENUM)
#undef GLM_STAGE_ENUM
    S_COUNT
};

struct StageInfo {
    const char* name;
    SDType dtype;
};
inline constexpr StageInfo kStages[S_COUNT] = {
#define GLM_STAGE_INFO(id, name, dtype, size) {name, SDType::dtype},
    GLM_STAGES(GLM_STAGE_INFO)
#undef GLM_STAGE_INFO
};

// Elements of one position's value of a stage under config c; -1 where it depends on the position.
inline int64_t stage_size(const EngineConfig& c, int stage) {
    switch (stage) {
#define GLM_STAGE_SIZE(id, name, dtype, size) \
    case id:                                  \
        return size;
        GLM_STAGES(GLM_STAGE_SIZE)
#undef GLM_STAGE_SIZE
        default:
            return -1;
    }
}

inline int stage_by_name(const std::string& name) {  // -1 if unknown
    for (int i = 0; i < S_COUNT; ++i)
        if (name == kStages[i].name) return i;
    return -1;
}

inline size_t numel(const std::vector<int64_t>& shape) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    return n;
}

// As Python prints a tuple. std::to_string, not an ostringstream: stream output goes through the
// locale's facets, found by per-library facet ids, and a module that carries its own (static) libstdc++
// in a process holding another one can look up the wrong facet and crash (fast._core built with the
// GPU machine's toolchain did, on every call that formatted a shape).
inline std::string shape_str(const std::vector<int64_t>& s) {
    std::string o = "(";
    for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
    return o + (s.size() == 1 ? ",)" : ")");
}

struct Injection {
    bool active = false;
    int layer = -1;
    int64_t pos = -1;
    int stage = -1;
    int64_t element = 0;
    int64_t ulps = 0;
};

struct CaptureRecord {
    int layer;
    int stage;
    int64_t row;  // row of the step
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;  // f32 for F32/BF16 stages, f64 for F64, i32 for I32
};

struct StepOutput {
    std::vector<int64_t> head_rows;  // rows whose logits go to the caller (want_head 1), ascending
    std::vector<int64_t> token_rows; // rows that want only their greedy token (want_head 2 or 3), ascending
    std::vector<int32_t> tokens;     // those rows' argmax (num::argmax_better's rule), logits not copied
    std::vector<float> logprobs;     // the want_head 3 rows' (ascending) log_softmax at their token
                                     // (num::logprob_from); NaN where the row holds a NaN or an infinity
    std::vector<float> logits;       // [head_rows.size()][V] (left empty when logits_dst is given)
    float* logits_dst = nullptr;     // the caller's buffer of (rows wanting logits) x V floats, written instead
    bool logits_dst_pinned = false;  // logits_dst is page-locked host memory (the CUDA engine copies into it directly)
    std::vector<CaptureRecord> captures;
    int64_t injected = 0;  // elements the injection perturbed in this step
    float* logits_out(size_t n) {  // where the step writes its n logits
        if (logits_dst) return logits_dst;
        logits.assign(n, 0.0f);
        return logits.data();
    }
};

}  // namespace glm
