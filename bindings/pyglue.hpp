// Python-boundary helpers shared by the CPU glue (engine_bindings.cpp) and the CUDA glue
// (cuda/cuda_bindings.cpp): argument errors, the engine config dict, array checks. Both engines take
// the same config dict from fast/engine.py, so it is read in one place.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace glm::pyglue {

namespace py = pybind11;

[[noreturn]] inline void bad(const std::string& msg) { throw py::value_error(msg); }

template <class T>
T get(const py::dict& d, const char* key) {
    if (!d.contains(key)) bad(std::string("engine config: missing field '") + key + "'");
    try {
        return d[key].cast<T>();
    } catch (const py::cast_error&) {
        bad(std::string("engine config: field '") + key + "' has the wrong type");
    }
}

// Fills an engine config (glm::cpu::EngineConfig or glm::cuda::Config: the same field names).
template <class Config>
Config config_from_dict(const py::dict& d) {
    Config c;
    c.vocab_size = get<int64_t>(d, "vocab_size");
    c.hidden_size = get<int64_t>(d, "hidden_size");
    c.num_hidden_layers = get<int64_t>(d, "num_hidden_layers");
    c.intermediate_size = get<int64_t>(d, "intermediate_size");
    c.moe_intermediate_size = get<int64_t>(d, "moe_intermediate_size");
    c.n_routed_experts = get<int64_t>(d, "n_routed_experts");
    c.num_experts_per_tok = get<int64_t>(d, "num_experts_per_tok");
    c.n_shared_experts = get<int64_t>(d, "n_shared_experts");
    c.n_group = get<int64_t>(d, "n_group");
    c.topk_group = get<int64_t>(d, "topk_group");
    c.norm_topk_prob = get<bool>(d, "norm_topk_prob");
    c.routed_scaling_factor = get<double>(d, "routed_scaling_factor");
    c.swiglu_limit = get<double>(d, "swiglu_limit");
    c.rms_norm_eps = get<double>(d, "rms_norm_eps");
    c.num_attention_heads = get<int64_t>(d, "num_attention_heads");
    c.q_lora_rank = get<int64_t>(d, "q_lora_rank");
    c.kv_lora_rank = get<int64_t>(d, "kv_lora_rank");
    c.qk_nope_head_dim = get<int64_t>(d, "qk_nope_head_dim");
    c.qk_rope_head_dim = get<int64_t>(d, "qk_rope_head_dim");
    c.v_head_dim = get<int64_t>(d, "v_head_dim");
    c.index_topk = get<int64_t>(d, "index_topk");
    c.index_head_dim = get<int64_t>(d, "index_head_dim");
    c.index_n_heads = get<int64_t>(d, "index_n_heads");
    c.index_kpool = get<int64_t>(d, "index_kpool");
    c.linear_num_heads = get<int64_t>(d, "linear_num_heads");
    c.linear_head_dim = get<int64_t>(d, "linear_head_dim");
    c.linear_conv_kernel_dim = get<int64_t>(d, "linear_conv_kernel_dim");
    c.linear_lower_bound = get<double>(d, "linear_lower_bound");
    c.hc_mult = get<int64_t>(d, "hc_mult");
    c.hc_eps = get<double>(d, "hc_eps");
    c.hc_sinkhorn_iters = get<int64_t>(d, "hc_sinkhorn_iters");
    c.tie_word_embeddings = get<bool>(d, "tie_word_embeddings");
    c.max_context = get<int64_t>(d, "max_context");
    c.is_kda = get<std::vector<uint8_t>>(d, "is_kda");
    c.is_moe = get<std::vector<uint8_t>>(d, "is_moe");
    c.has_indexer = get<std::vector<uint8_t>>(d, "has_indexer");
    return c;
}

inline std::vector<int64_t> shape_of(const py::array& a) {
    return std::vector<int64_t>(a.shape(), a.shape() + a.ndim());
}

// A C-contiguous numpy array whose dtype kind is one of `kind` with the given item size.
inline py::array checked(const py::object& o, const char* what, const char* kind, size_t itemsize) {
    if (!py::isinstance<py::array>(o)) bad(std::string(what) + ": expected a numpy array");
    py::array a = py::reinterpret_borrow<py::array>(o);
    const char k = a.dtype().kind();
    if (static_cast<size_t>(a.itemsize()) != itemsize || std::strchr(kind, k) == nullptr)
        bad(std::string(what) + ": unexpected dtype " + py::str(a.dtype()).cast<std::string>());
    if (!(a.flags() & py::array::c_style)) bad(std::string(what) + ": must be C-contiguous");
    return a;
}

}  // namespace glm::pyglue
