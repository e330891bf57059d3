// Python-boundary helpers shared by the CPU glue (engine_bindings.cpp) and the CUDA glue
// (cuda/cuda_bindings.cpp): argument errors, the engine config dict, array checks, and one forward
// step (arguments in, logits and captures out). Both engines take the same config dict and the same
// step arguments from fast/engine.py, so they are read in one place.
#pragma once

#include <functional>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "engine_types.hpp"

namespace glm::pyglue {

namespace py = pybind11;

[[noreturn]] inline void bad(const std::string& msg) { throw py::value_error(msg); }

// f(), with an engine's std::invalid_argument (bad input, named) turned into Python's ValueError.
template <class F>
auto translate(F&& f) -> decltype(f()) {
    try {
        return f();
    } catch (const std::invalid_argument& e) {
        bad(e.what());
    }
}

template <class T>
T get(const py::dict& d, const char* key) {
    if (!d.contains(key)) bad(std::string("engine config: missing field '") + key + "'");
    try {
        return d[key].cast<T>();
    } catch (const py::cast_error&) {
        bad(std::string("engine config: field '") + key + "' has the wrong type");
    }
}

// Fills an engine config (glm::EngineConfig) from the dict fast/ builds: every field of
// oracle/schema.py's ENGINE_CONFIG (glm_schema.hpp), each refused by name when missing or mistyped.
template <class Config>
Config config_from_dict(const py::dict& d) {
    Config c;
#define GLM_READ_FIELD(T, name) c.name = get<T>(d, #name);
    GLM_ENGINE_CONFIG_FIELDS(GLM_READ_FIELD)
#undef GLM_READ_FIELD
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

// One checkpoint tensor into an engine (its add_tensor has the shared signature): the arrays checked
// for the release's dtypes, then handed over. Returns the arrays whose bytes the engine may keep
// reading (the CPU engine's zero-copy views keep them alive).
template <class Engine>
std::vector<py::array> add_tensor(Engine& E, const std::string& role, int layer, int expert, const std::string& release,
                                  const py::object& data_o, const py::object& scale_o,
                                  const std::vector<int64_t>& shape) {
    const size_t isz = release == "bf16" ? 2 : release == "f32" ? 4 : 1;
    const char* kinds = release == "f32" ? "f" : "uf";
    if (release != "bf16" && release != "f32" && release != "fp8" && release != "mxfp4")
        bad(role + ": unknown release '" + release + "'");
    std::vector<py::array> keep{checked(data_o, role.c_str(), kinds, isz)};
    const void* sp = nullptr;
    std::vector<int64_t> sshape;
    if (!scale_o.is_none()) {
        keep.push_back(checked(scale_o, (role + " scale").c_str(), release == "fp8" ? "f" : "u", release == "fp8" ? 4 : 1));
        sp = keep.back().data();
        sshape = shape_of(keep.back());
    }
    try {
        E.add_tensor(role, layer, expert, release, keep[0].data(), sp, shape, shape_of(keep[0]), sshape);
    } catch (const std::invalid_argument& e) {
        bad(e.what());
    }
    return keep;
}

inline const char* dtype_name(SDType t) {
    return t == SDType::F32 ? "f32" : t == SDType::F64 ? "f64" : t == SDType::BF16 ? "bf16" : "i32";
}

// The module attribute ENGINE_STAGES: [(stage name, dtype name)] in the engines' stage order.
inline py::list stage_list() {
    py::list names;
    for (int i = 0; i < S_COUNT; ++i) names.append(py::make_tuple(kStages[i].name, dtype_name(kStages[i].dtype)));
    return names;
}

// The module function stage_table(config dict): [(stage name, dtype name, elements of one position's
// value, or None where it varies)] as this build of the engine computes them (tests/test_schema.py
// holds it against oracle/schema.py).
template <class Config>
py::list stage_table(const py::dict& d) {
    const Config c = config_from_dict<Config>(d);
    py::list out;
    for (int i = 0; i < S_COUNT; ++i) {
        const int64_t n = stage_size(c, i);
        out.append(py::make_tuple(kStages[i].name, dtype_name(kStages[i].dtype),
                                  n < 0 ? py::object(py::none()) : py::object(py::int_(n))));
    }
    return out;
}

// One forward step of an engine whose step() has the shared signature (bindings/engine_types.hpp):
// the numpy arguments checked and copied, the step run without the GIL, the logits written straight
// into the array returned.
// want_head per row: 0 no head, 1 logits (returned), 2 only the greedy token (returned in `tokens`, one per
// such row in row order; the logits stay in the engine), 3 the greedy token (in `tokens` as 2) and its
// log-probability (in `logprobs`, one per want_head 3 row in row order: oracle.sampling.log_softmax's
// value at the token, bit for bit; NaN where the row holds a NaN or an infinity).
// Returns (head_rows i64[n], logits f32[n, V], [(layer, stage name, row, value)], injected, tokens i32[m],
// logprobs f32[k]).
// alloc (optional): makes the [n, V] logits array and says whether its memory is page-locked.
using LogitsAlloc = std::function<py::array_t<float>(size_t n, size_t V, bool& pinned)>;
template <class Engine>
py::tuple run_step(Engine& E, size_t V, const py::object& seq_o, const py::object& tok_o, const py::object& head_o,
                   const py::object& caprow_o, const py::object& mask_o, const py::object& inj_o,
                   const LogitsAlloc& alloc = nullptr) {
    const py::array seq = checked(seq_o, "seq_ids", "i", 8);
    const py::array tok = checked(tok_o, "tokens", "i", 4);
    const py::array head = checked(head_o, "want_head", "bu", 1);
    const py::array caprow = checked(caprow_o, "cap_rows", "b", 1);
    const py::array mask = checked(mask_o, "cap_mask", "b", 1);
    if (seq.ndim() != 1 || tok.ndim() != 1 || head.ndim() != 1 || caprow.ndim() != 1 || mask.ndim() != 1)
        bad("step: every argument must be 1-D");
    const size_t T = static_cast<size_t>(seq.shape(0));
    if (static_cast<size_t>(tok.shape(0)) != T || static_cast<size_t>(head.shape(0)) != T ||
        static_cast<size_t>(caprow.shape(0)) != T)
        bad("step: seq_ids, tokens, want_head, cap_rows must have the same length");
    auto bytes = [](const py::array& a, size_t n) {
        const uint8_t* p = static_cast<const uint8_t*>(a.data());
        return std::vector<uint8_t>(p, p + n);
    };
    const std::vector<int64_t> ids(static_cast<const int64_t*>(seq.data()), static_cast<const int64_t*>(seq.data()) + T);
    const std::vector<int32_t> toks(static_cast<const int32_t*>(tok.data()), static_cast<const int32_t*>(tok.data()) + T);
    const std::vector<uint8_t> wh = bytes(head, T), cr = bytes(caprow, T);
    const std::vector<uint8_t> cm = bytes(mask, static_cast<size_t>(mask.shape(0)));
    Injection inj;
    if (!inj_o.is_none()) {
        try {
            const py::tuple t = inj_o.cast<py::tuple>();
            if (t.size() != 5) throw py::cast_error();
            inj.layer = t[0].cast<int>();
            inj.pos = t[1].cast<int64_t>();
            inj.stage = t[2].cast<int>();
            inj.element = t[3].cast<int64_t>();
            inj.ulps = t[4].cast<int64_t>();
        } catch (const py::cast_error&) {
            bad("inject: expected (layer, pos, stage_index, element, ulps) as ints");
        }
        inj.active = true;
    }
    // the logits land in the numpy array handed back (the rows wanting them, in row order)
    size_t n_head = 0, n_tok = 0, n_lp = 0;
    for (uint8_t w : wh) {
        n_head += w == 1 ? 1 : 0;
        n_tok += w == 2 || w == 3 ? 1 : 0;
        n_lp += w == 3 ? 1 : 0;
    }
    bool pinned = false;
    py::array_t<float> logits = alloc && n_head ? alloc(n_head, V, pinned)
                                                : py::array_t<float>({static_cast<py::ssize_t>(n_head), static_cast<py::ssize_t>(V)});
    StepOutput out;
    out.logits_dst = n_head ? logits.mutable_data() : nullptr;
    out.logits_dst_pinned = pinned;
    {
        py::gil_scoped_release nogil;
        E.step(ids, toks, wh, cr, cm, inj, out);
    }
    if (out.head_rows.size() != n_head || out.tokens.size() != n_tok || out.logprobs.size() != n_lp)
        throw std::logic_error("step: head rows disagree with want_head");
    py::array_t<int64_t> rows(static_cast<py::ssize_t>(n_head));
    if (n_head) std::memcpy(rows.mutable_data(), out.head_rows.data(), n_head * 8);
    py::list caps;
    for (const CaptureRecord& r : out.captures) {
        const std::vector<py::ssize_t> shape(r.shape.begin(), r.shape.end());
        py::array a;
        switch (kStages[r.stage].dtype) {
            case SDType::F64: a = py::array_t<double>(shape); break;
            case SDType::I32: a = py::array_t<int32_t>(shape); break;
            default: a = py::array_t<float>(shape); break;
        }
        if (!r.bytes.empty()) std::memcpy(a.mutable_data(), r.bytes.data(), r.bytes.size());
        caps.append(py::make_tuple(r.layer, kStages[r.stage].name, r.row, a));
    }
    py::array_t<int32_t> tokens(static_cast<py::ssize_t>(n_tok));
    if (n_tok) std::memcpy(tokens.mutable_data(), out.tokens.data(), n_tok * 4);
    py::array_t<float> logprobs(static_cast<py::ssize_t>(n_lp));
    if (n_lp) std::memcpy(logprobs.mutable_data(), out.logprobs.data(), n_lp * 4);
    return py::make_tuple(rows, logits, caps, out.injected, tokens, logprobs);
}

}  // namespace glm::pyglue
