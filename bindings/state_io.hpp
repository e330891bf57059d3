// A sequence's state as named arrays (export_sequence / import_sequence of both engines): the one
// canonical layout, defined here once, that the CPU and the CUDA engine both produce and accept
// (docs/engine_cpu.md, "Exporting a sequence's state"). Plain C++ (nvcc and the host compiler).
//
// For a sequence of `length` positions, every array f32, in this order, layer by layer:
//   KDA layer l:              layers.{l}.kda.conv_tail     [K-1, 3P]  the last K-1 pre-conv rows, oldest first
//                             layers.{l}.kda.S             [H, d, d]  S[h][i][j] (key dim i, value dim j)
//   MLA layer l:              layers.{l}.mla.c             [length, r_kv]
//   MLA layer with an indexer: layers.{l}.indexer.k        [length, d_i]
//                             layers.{l}.indexer.gate      [length, d_i]
//                             layers.{l}.indexer.pool_keys [length // kpool, d_i]
// Both engines hold S transposed (S[h][j][i], columns contiguous); the layout is the contract's S[h][i][j].
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <map>
#include <vector>

#include "engine_types.hpp"

namespace glm {

enum class StatePart : uint8_t { ConvTail, S, C, IndexK, IndexGate, PoolKeys };

struct StateSpec {
    std::string name;
    std::vector<int64_t> shape;
    int layer;
    StatePart part;
};

struct StateTensor {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> data;  // numel(shape) values, row-major
};

inline std::vector<StateSpec> state_layout(const EngineConfig& c, int64_t length) {
    std::vector<StateSpec> out;
    const int64_t P = c.kda_dim(), H = c.linear_num_heads, d = c.linear_head_dim, K = c.linear_conv_kernel_dim;
    const int64_t r = c.kv_lora_rank, di = c.index_head_dim, kp = c.index_kpool > 0 ? c.index_kpool : 1;
    for (int l = 0; l < static_cast<int>(c.num_hidden_layers); ++l) {
        const std::string pre = "layers." + std::to_string(l) + ".";
        if (c.is_kda[static_cast<size_t>(l)]) {
            out.push_back({pre + "kda.conv_tail", {K - 1, 3 * P}, l, StatePart::ConvTail});
            out.push_back({pre + "kda.S", {H, d, d}, l, StatePart::S});
            continue;
        }
        out.push_back({pre + "mla.c", {length, r}, l, StatePart::C});
        if (c.has_indexer[static_cast<size_t>(l)]) {
            out.push_back({pre + "indexer.k", {length, di}, l, StatePart::IndexK});
            out.push_back({pre + "indexer.gate", {length, di}, l, StatePart::IndexGate});
            out.push_back({pre + "indexer.pool_keys", {length / kp, di}, l, StatePart::PoolKeys});
        }
    }
    return out;
}

// The given arrays against the layout of `length` positions: every name present once, no other
// name, each shape and size exact. Returns them in layout order; throws std::invalid_argument naming
// the first offending tensor.
inline std::vector<const StateTensor*> check_state(const EngineConfig& c, const std::vector<StateTensor>& given,
                                                   int64_t length) {
    if (length < 0 || length > c.max_context)
        throw std::invalid_argument("import: length " + std::to_string(length) + " is outside [0, " +
                                    std::to_string(c.max_context) + "]");
    std::map<std::string, const StateTensor*> by_name;
    for (const StateTensor& t : given)
        if (!by_name.emplace(t.name, &t).second)
            throw std::invalid_argument("import: state tensor '" + t.name + "' given twice");
    std::vector<const StateTensor*> out;
    for (const StateSpec& s : state_layout(c, length)) {
        auto it = by_name.find(s.name);
        if (it == by_name.end()) throw std::invalid_argument("import: state tensor '" + s.name + "' is missing");
        const StateTensor& t = *it->second;
        if (t.shape != s.shape)
            throw std::invalid_argument("import: state tensor '" + s.name + "' has shape " + shape_str(t.shape) +
                                        ", expected " + shape_str(s.shape) + " (for " + std::to_string(length) +
                                        " positions)");
        if (t.data.size() != numel(s.shape))
            throw std::invalid_argument("import: state tensor '" + s.name + "' holds " + std::to_string(t.data.size()) +
                                        " values, its shape " + std::to_string(numel(s.shape)));
        out.push_back(&t);
        by_name.erase(it);
    }
    if (!by_name.empty())
        throw std::invalid_argument("import: unexpected state tensor '" + by_name.begin()->first +
                                    "' (not in this model's state layout)");
    return out;
}

// [H][a][b] -> [H][b][a] (the engines' S[h][j][i] <-> the layout's S[h][i][j]; its own inverse).
inline void transpose_heads(const float* src, float* dst, int64_t H, int64_t d) {
    for (int64_t h = 0; h < H; ++h)
        for (int64_t a = 0; a < d; ++a)
            for (int64_t b = 0; b < d; ++b) dst[(h * d + b) * d + a] = src[(h * d + a) * d + b];
}

}  // namespace glm
