// The types both engines share at their host interface (plain C++, no CPU intrinsics and no CUDA):
// the engine config (one struct, read from the one config dict fast/engine.py builds, and validated by
// one function with each engine's limits), the stage table (names, dtypes), the injection spec, a capture record and
// a step's output. bindings/cpu/engine.hpp and bindings/cuda/engine_api.hpp use these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace glm {

struct EngineConfig {
    int64_t vocab_size = 0, hidden_size = 0, num_hidden_layers = 0;
    int64_t intermediate_size = 0, moe_intermediate_size = 0;
    int64_t n_routed_experts = 0, num_experts_per_tok = 0, n_shared_experts = 0, n_group = 1, topk_group = 1;
    bool norm_topk_prob = true;
    double routed_scaling_factor = 1.0, swiglu_limit = 10.0, rms_norm_eps = 1e-5;
    int64_t num_attention_heads = 0, q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0,
            v_head_dim = 0;
    int64_t index_topk = 0, index_head_dim = 0, index_n_heads = 0, index_kpool = 1;
    int64_t linear_num_heads = 0, linear_head_dim = 0, linear_conv_kernel_dim = 1;
    double linear_lower_bound = -5.0;
    int64_t hc_mult = 4;
    double hc_eps = 1e-6;
    int64_t hc_sinkhorn_iters = 20;
    bool tie_word_embeddings = false;
    int64_t max_context = 0;
    std::vector<uint8_t> is_kda, is_moe, has_indexer;  // per layer

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
    pos("vocab_size", c.vocab_size);
    pos("hidden_size", c.hidden_size);
    pos("num_hidden_layers", c.num_hidden_layers);
    pos("hc_mult", c.hc_mult);
    at_most("hc_mult", c.hc_mult, lim.max_hc_mult);
    pos("hc_sinkhorn_iters", c.hc_sinkhorn_iters);
    pos("max_context", c.max_context);
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
        pos("linear_num_heads", c.linear_num_heads);
        pos("linear_head_dim", c.linear_head_dim);
        at_most("linear_head_dim", c.linear_head_dim, lim.max_linear_head_dim);
        pos("linear_conv_kernel_dim", c.linear_conv_kernel_dim);
    }
    if (any_mla) {
        pos("num_attention_heads", c.num_attention_heads);
        pos("q_lora_rank", c.q_lora_rank);
        pos("kv_lora_rank", c.kv_lora_rank);
        pos("qk_nope_head_dim", c.qk_nope_head_dim);
        pos("v_head_dim", c.v_head_dim);
        if (c.qk_rope_head_dim != 0) bad("qk_rope_head_dim", "only NoPE MLA (0) is supported");
        pos("index_kpool", c.index_kpool);
        pos("index_topk", c.index_topk);
        pos("index_head_dim", c.index_head_dim);
        pos("index_n_heads", c.index_n_heads);
        if (c.index_topk % c.index_kpool != 0) bad("index_topk", "must be divisible by index_kpool");
    }
    if (any_dense) pos("intermediate_size", c.intermediate_size);
    if (any_moe) {
        pos("n_routed_experts", c.n_routed_experts);
        at_most("n_routed_experts", c.n_routed_experts, lim.max_routed_experts);
        pos("moe_intermediate_size", c.moe_intermediate_size);
        pos("n_shared_experts", c.n_shared_experts);
        pos("n_group", c.n_group);
        pos("topk_group", c.topk_group);
        pos("num_experts_per_tok", c.num_experts_per_tok);
        at_most("num_experts_per_tok", c.num_experts_per_tok, lim.max_experts_per_tok);
        if (c.n_routed_experts % c.n_group != 0 || c.n_routed_experts / c.n_group < 2)
            bad("n_group", "each group needs at least 2 experts and n_routed_experts must divide evenly");
        if (c.topk_group > c.n_group) bad("topk_group", "must be <= n_group");
        if (c.num_experts_per_tok > c.topk_group * (c.n_routed_experts / c.n_group))
            bad("num_experts_per_tok", "exceeds the experts of topk_group groups");
    }
}

// ---- a step's interface ---------------------------------------------------------------------------

enum class SDType : uint8_t { F32, F64, BF16, I32 };

// The stages, in the model's order, with their names and dtypes as oracle/stages.py.
enum Stage : int {
    S_EMBED,
    S_ATTN_HC_PRE, S_ATTN_HC_POST, S_ATTN_HC_COMB, S_ATTN_HC_COLLAPSED, S_ATTN_NORM,
    S_KDA_Q_PROJ, S_KDA_K_PROJ, S_KDA_V_PROJ, S_KDA_Q, S_KDA_K, S_KDA_V, S_KDA_G, S_KDA_BETA, S_KDA_STATE,
    S_KDA_O, S_KDA_GATE, S_KDA_O_NORM, S_KDA_OUT,
    S_MLA_Q_LAT, S_MLA_Q, S_MLA_C, S_MLA_Q_ABS, S_IDX_Q, S_IDX_K, S_IDX_GATE, S_IDX_WEIGHTS, S_IDX_SCORES,
    S_MLA_SELECTED, S_MLA_SCORES, S_MLA_PROBS, S_MLA_O_LAT, S_MLA_O, S_MLA_OUT,
    S_ATTN_HC_STREAMS,
    S_FFN_HC_PRE, S_FFN_HC_POST, S_FFN_HC_COMB, S_FFN_HC_COLLAPSED, S_FFN_NORM,
    S_MLP_GATE, S_MLP_UP, S_MLP_OUT,
    S_MOE_LOGITS, S_MOE_SELECTED, S_MOE_WEIGHTS, S_MOE_EXPERTS, S_MOE_ROUTED, S_MOE_SHARED, S_MOE_OUT,
    S_FFN_HC_STREAMS,
    S_HEAD_MEAN, S_FINAL_NORM, S_LOGITS,
    S_COUNT
};

struct StageInfo {
    const char* name;
    SDType dtype;
};
inline constexpr StageInfo kStages[S_COUNT] = {
    {"embed", SDType::BF16},
    {"attn_hc.pre", SDType::F64}, {"attn_hc.post", SDType::F64}, {"attn_hc.comb", SDType::F64},
    {"attn_hc.collapsed", SDType::BF16}, {"attn_norm", SDType::BF16},
    {"kda.q_proj", SDType::BF16}, {"kda.k_proj", SDType::BF16}, {"kda.v_proj", SDType::BF16},
    {"kda.q", SDType::BF16}, {"kda.k", SDType::BF16}, {"kda.v", SDType::BF16},
    {"kda.g", SDType::F32}, {"kda.beta", SDType::F32}, {"kda.state", SDType::F32}, {"kda.o", SDType::F32},
    {"kda.gate", SDType::BF16}, {"kda.o_norm", SDType::BF16}, {"kda.out", SDType::BF16},
    {"mla.q_lat", SDType::BF16}, {"mla.q", SDType::BF16}, {"mla.c", SDType::BF16}, {"mla.q_abs", SDType::BF16},
    {"indexer.q", SDType::BF16}, {"indexer.k", SDType::BF16}, {"indexer.gate", SDType::BF16},
    {"indexer.weights", SDType::F32}, {"indexer.scores", SDType::F32},
    {"mla.selected", SDType::I32}, {"mla.scores", SDType::F32}, {"mla.probs", SDType::BF16},
    {"mla.o_lat", SDType::BF16}, {"mla.o", SDType::BF16}, {"mla.out", SDType::BF16},
    {"attn_hc.streams", SDType::BF16},
    {"ffn_hc.pre", SDType::F64}, {"ffn_hc.post", SDType::F64}, {"ffn_hc.comb", SDType::F64},
    {"ffn_hc.collapsed", SDType::BF16}, {"ffn_norm", SDType::BF16},
    {"mlp.gate", SDType::BF16}, {"mlp.up", SDType::BF16}, {"mlp.out", SDType::BF16},
    {"moe.logits", SDType::F32}, {"moe.selected", SDType::I32}, {"moe.weights", SDType::F32},
    {"moe.experts", SDType::BF16}, {"moe.routed", SDType::BF16}, {"moe.shared", SDType::BF16},
    {"moe.out", SDType::BF16},
    {"ffn_hc.streams", SDType::BF16},
    {"head.mean", SDType::BF16}, {"final_norm", SDType::BF16}, {"logits", SDType::F32},
};

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
    std::vector<int64_t> head_rows;  // rows whose logits were computed, ascending
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
