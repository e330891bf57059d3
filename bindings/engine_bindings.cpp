// pybind11 glue of the CPU engine: fast._core._Engine (used by fast/engine.py, the thin Python API)
// and a few test hooks. Registered into fast._core by bindings/module.cpp through register_engine().
//
// Every entry point checks its arguments (types, dtypes, shapes, ranges) and raises ValueError;
// nothing reaches the executor unchecked. The step releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "pyglue.hpp"
#include "state_glue.hpp"
#include "cpu/engine.hpp"
#include "cpu/exp64.hpp"
#include "cpu/formats.hpp"
#include "cpu/matvec.hpp"
#include "cpu/smalldot.hpp"

namespace py = pybind11;
using namespace glm::cpu;

namespace {

using glm::pyglue::bad;
using glm::pyglue::checked;
using glm::pyglue::get;
using glm::pyglue::shape_of;
using glm::pyglue::translate;

EngineConfig config_from_dict(const py::dict& d) { return glm::pyglue::config_from_dict<EngineConfig>(d); }

// Holds the engine and the arrays whose bytes it reads.
struct PyEngine {
    std::unique_ptr<Engine> eng;
    std::vector<py::object> keep;
};

py::tuple step(PyEngine& pe, const py::object& seq_o, const py::object& tok_o, const py::object& head_o,
               const py::object& caprow_o, const py::object& mask_o, const py::object& inj_o) {
    Engine& E = *pe.eng;
    return glm::pyglue::run_step(E, static_cast<size_t>(E.config().vocab_size), seq_o, tok_o, head_o, caprow_o,
                                 mask_o, inj_o);
}

py::array exp64_array(const py::array_t<double, py::array::c_style | py::array::forcecast>& x) {
    py::array_t<double> y(x.size());
    const double* in = x.data();
    double* o = y.mutable_data();
    for (py::ssize_t i = 0; i < x.size(); ++i) o[i] = exp64(in[i]);
    return std::move(y);
}

using F32Arr = py::array_t<float, py::array::c_style | py::array::forcecast>;
using F64Arr = py::array_t<double, py::array::c_style | py::array::forcecast>;

// Test hooks: the engine's reductions for n <= 8 (closed form, smalldot.hpp) and its dispatch.
py::array dot_columns(const F32Arr& A, const F32Arr& B) {
    if (A.ndim() != 2 || B.ndim() != 2 || A.shape(0) != B.shape(0) || A.shape(1) != B.shape(1) || A.shape(0) > 8)
        bad("A, B: expected two [n, m] arrays with n <= 8");
    const size_t n = static_cast<size_t>(A.shape(0)), m = static_cast<size_t>(A.shape(1));
    py::array_t<float> y(static_cast<py::ssize_t>(m));
    float* o = y.mutable_data();
    __m256 a[8], b[8];
    size_t j = 0;
    for (; j + 8 <= m; j += 8) {
        for (size_t l = 0; l < n; ++l) {
            a[l] = _mm256_loadu_ps(A.data() + l * m + j);
            b[l] = _mm256_loadu_ps(B.data() + l * m + j);
        }
        _mm256_storeu_ps(o + j, cdot_small8(a, b, n));
    }
    for (; j < m; ++j) {
        float ca[8], cb[8];
        for (size_t l = 0; l < n; ++l) ca[l] = A.data()[l * m + j], cb[l] = B.data()[l * m + j];
        o[j] = cdot_small(ca, cb, n);
    }
    return std::move(y);
}

py::array dot64_columns(const F64Arr& A, const F64Arr& B) {
    if (A.ndim() != 2 || B.ndim() != 2 || A.shape(0) != B.shape(0) || A.shape(1) != B.shape(1) || A.shape(0) > 8)
        bad("A, B: expected two [n, m] arrays with n <= 8");
    const size_t n = static_cast<size_t>(A.shape(0)), m = static_cast<size_t>(A.shape(1));
    py::array_t<double> y(static_cast<py::ssize_t>(m));
    double* o = y.mutable_data();
    __m256d a[8], b[8];
    size_t j = 0;
    for (; j + 4 <= m; j += 4) {
        for (size_t l = 0; l < n; ++l) {
            a[l] = _mm256_loadu_pd(A.data() + l * m + j);
            b[l] = _mm256_loadu_pd(B.data() + l * m + j);
        }
        _mm256_storeu_pd(o + j, cdot64_small4(a, b, n));
    }
    for (; j < m; ++j) {
        double ca[8], cb[8];
        for (size_t l = 0; l < n; ++l) ca[l] = A.data()[l * m + j], cb[l] = B.data()[l * m + j];
        o[j] = cdot64_small(ca, cb, n);
    }
    return std::move(y);
}

// ---- benchmark hooks (tools/bench_cpu.py) ----

// Best time of `reps` copies of an nbytes buffer, split over `threads` threads in contiguous blocks.
double bench_copy(size_t nbytes, unsigned threads, unsigned reps) {
    if (nbytes == 0 || threads < 1 || threads > 1024 || reps < 1) bad("bench_copy: nbytes, threads, reps >= 1");
    std::vector<uint8_t> src(nbytes, 1), dst(nbytes, 0);
    ThreadPool pool(threads);
    double best = 1e300;
    for (unsigned r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        pool.parallel_for(threads, ThreadPool::kInlineWork, [&](size_t a, size_t b) {
            for (size_t t = a; t < b; ++t) {
                const size_t lo = nbytes * t / threads, hi = nbytes * (t + 1) / threads;
                std::memcpy(dst.data() + lo, src.data() + lo, hi - lo);
            }
        });
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
}

// Best time of `reps` single-token matvecs y = W x over a release-format weight (the engine's decode
// path: H2's kernels decoding in registers, rows split over `threads` threads).
double bench_linear(const std::string& release, const py::array& data, const py::object& scale_o, size_t R, size_t C,
                    unsigned threads, unsigned reps) {
    Lin w;
    w.R = R;
    w.C = C;
    w.data = data.data();
    size_t need = 0;
    if (release == "bf16") w.fmt = WFmt::BF16, need = R * C * 2;
    else if (release == "fp8") w.fmt = WFmt::FP8, need = R * C;
    else if (release == "mxfp4") w.fmt = WFmt::MXFP4, need = R * C / 2;
    else bad("bench_linear: release bf16, fp8 or mxfp4");
    if (static_cast<size_t>(data.nbytes()) != need || !(data.flags() & py::array::c_style)) bad("bench_linear: data size");
    py::array scale;
    if (w.fmt != WFmt::BF16) {
        scale = py::reinterpret_borrow<py::array>(scale_o);
        const size_t sneed = w.fmt == WFmt::FP8 ? ((R + 127) / 128) * ((C + 127) / 128) * 4 : R * (C / 32);
        if (static_cast<size_t>(scale.nbytes()) != sneed || !(scale.flags() & py::array::c_style))
            bad("bench_linear: scale size");
        w.scale = scale.data();
    }
    if (w.fmt == WFmt::MXFP4 && C % 32) bad("bench_linear: mxfp4 needs C % 32 == 0");
    if (threads < 1 || threads > 1024 || reps < 1) bad("bench_linear: threads, reps >= 1");
    std::vector<float> x(C), y(R);
    for (size_t i = 0; i < C; ++i) x[i] = 1.0f / static_cast<float>(1 + i % 7);
    ThreadPool pool(threads);
    double best = 1e300;
    py::gil_scoped_release nogil;
    for (unsigned r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        pool.parallel_for(R, C, [&](size_t a, size_t b) { w.matvec(a, b, x.data(), y.data() + a); });
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
}

// The cores' FP32 FMA peak, the yardstick of the linear kernels' multiply-adds (tools/bench_cpu.py): every thread
// runs kFmaChains independent FMA chains in the widest vectors of one build of the linear kernels (`kernels`, one of
// kLinKernelNames; empty: the build this process runs, lin_kernels()); best of `reps`. Returns multiply-adds per
// nanosecond over all threads.
double bench_fma(unsigned threads, unsigned reps, const std::string& kernels) {
    if (threads < 1 || threads > 1024 || reps < 1) bad("bench_fma: threads, reps >= 1");
    const LinKernels* k = kernels.empty() ? &lin_kernels() : lin_kernels_named(kernels.c_str());
    if (k == nullptr) bad("bench_fma: kernels='" + kernels + "' " + lin_kernels_refusal(kernels.c_str()));
    constexpr long kIters = 1L << 22;
    ThreadPool pool(threads);
    std::atomic<int> sink{0};
    double best = 1e300;
    py::gil_scoped_release nogil;
    for (unsigned r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        pool.run_all([&](unsigned t) {
            if (k->fma_chains(kIters, static_cast<float>(t)) == 1.2345f) sink.fetch_add(1);  // (never: keeps the chains alive)
        });
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return static_cast<double>(threads) * kIters * kFmaChains * k->fma_lanes / best / 1e9;
}

}  // namespace

void register_engine(py::module_& m) {
    py::class_<PyEngine>(m, "_Engine", "The CPU engine's executor (use fast.Engine).")
        .def(py::init([](const py::dict& cfg, unsigned threads, const std::string& dot, const std::string& expf,
                         int64_t inline_work) {
                 Numerics nm;
                 if (dot == "sequential")
                     nm.seq_dot = true;
                 else if (dot != "canonical")
                     bad("dot: expected 'canonical' or 'sequential', given '" + dot + "'");
                 if (expf == "native")
                     nm.native_exp = true;
                 else if (expf != "canonical")
                     bad("expf: expected 'canonical' or 'native', given '" + expf + "'");
                 if (threads < 1 || threads > 1024) bad("threads: expected 1..1024");
                 if (inline_work < -1) bad("inline_work: expected >= 0 (or -1: the default)");
                 auto pe = std::make_unique<PyEngine>();
                 translate([&] {
                     pe->eng = std::make_unique<Engine>(
                         config_from_dict(cfg), threads, nm,
                         inline_work < 0 ? ThreadPool::kInlineWork : static_cast<size_t>(inline_work));
                 });
                 return pe;
             }),
             py::arg("config"), py::arg("threads"), py::arg("dot") = "canonical", py::arg("expf") = "canonical",
             py::arg("inline_work") = -1)
        .def(
            "add_tensor",
            [](PyEngine& pe, const std::string& role, int layer, int expert, const std::string& release,
               const py::object& data_o, const py::object& scale_o, const std::vector<int64_t>& shape) {
                for (py::array& a : glm::pyglue::add_tensor(*pe.eng, role, layer, expert, release, data_o, scale_o, shape))
                    pe.keep.push_back(a);
            },
            py::arg("role"), py::arg("layer"), py::arg("expert"), py::arg("release"), py::arg("data"),
            py::arg("scale"), py::arg("shape"))
        .def("finalize", [](PyEngine& pe) { translate([&] { pe.eng->finalize(); }); })
        .def("new_sequence", [](PyEngine& pe) { return pe.eng->new_sequence(); })
        .def("fork_sequence", [](PyEngine& pe, int64_t id) { return translate([&] { return pe.eng->fork_sequence(id); }); })
        .def("free_sequence", [](PyEngine& pe, int64_t id) { pe.eng->free_sequence(id); })
        .def("sequence_length", [](PyEngine& pe, int64_t id) { return translate([&] { return pe.eng->sequence_length(id); }); })
        .def("reserve_sequence",
             [](PyEngine& pe, int64_t id, int64_t positions) { translate([&] { pe.eng->reserve_sequence(id, positions); }); })
        .def("sequence_bytes", [](PyEngine& pe, int64_t id) { return translate([&] { return pe.eng->sequence_bytes(id); }); })
        .def(
            "export_sequence", [](PyEngine& pe, int64_t id) { return glm::pyglue::export_state(*pe.eng, id); },
            py::arg("id"), "The sequence's state -> (length, {name: f32 array}) (bindings/state_io.hpp's layout).")
        .def(
            "import_sequence",
            [](PyEngine& pe, const py::object& arrays, const py::object& length) {
                return glm::pyglue::import_state(*pe.eng, arrays, length);
            },
            py::arg("arrays"), py::arg("length"), "A new sequence holding an exported state -> its id.")
        .def_property_readonly("live_sequences", [](PyEngine& pe) { return pe.eng->live_sequences(); })
        .def_property_readonly("threads", [](PyEngine& pe) { return pe.eng->threads(); })
        .def_property_readonly("weight_bytes", [](PyEngine& pe) { return pe.eng->weight_bytes(); })
        // ---- expert parallelism (bindings/cpu/ep.hpp, fast/distributed.py, docs/ep.md) ----
        .def(
            "set_expert_partition",
            [](PyEngine& pe, int rank, int ranks, const std::vector<int64_t>& bounds) {
                ExpertPartition p;
                p.rank = rank;
                p.ranks = ranks;
                p.bounds = bounds;
                try {
                    pe.eng->set_expert_partition(p);
                } catch (const std::invalid_argument& e) {
                    bad(e.what());
                } catch (const std::logic_error& e) {
                    bad(e.what());
                }
            },
            py::arg("rank"), py::arg("ranks"), py::arg("bounds"),
            "This rank's share of the routed experts: rank r owns [bounds[r], bounds[r+1]). Before add_tensor.")
        .def(
            "set_exchange",
            [](PyEngine& pe, const py::object& fn) {
                if (fn.is_none()) {
                    pe.eng->ep.hook.reset();
                    return;
                }
                if (!PyCallable_Check(fn.ptr())) bad("set_exchange: expected a callable or None");
                Engine* eng = pe.eng.get();
                py::object f = fn;
                // fn(layer, send u16[m, D], recv u16[ranks, m, D]) fills recv; the arrays are views of the
                // executor's buffers, valid during the call only. Runs with the GIL re-acquired.
                pe.eng->ep.hook = std::make_shared<ExchangeFn>(
                    [eng, f](int layer, const uint16_t* send, uint16_t* recv, size_t m, size_t D) {
                        py::gil_scoped_acquire gil;
                        try {
                            const auto R = static_cast<py::ssize_t>(eng->ep.part.ranks);
                            const auto pm = static_cast<py::ssize_t>(m), pD = static_cast<py::ssize_t>(D);
                            py::capsule none(const_cast<uint16_t*>(send), [](void*) {});
                            py::array_t<uint16_t> sa({pm, pD}, send, none);
                            py::array_t<uint16_t> ra({R, pm, pD}, recv, none);
                            f(layer, sa, ra);
                        } catch (py::error_already_set& e) {
                            throw std::runtime_error(std::string("expert exchange failed: ") + e.what());
                        }
                    });
            },
            py::arg("fn"), "The expert-row exchange hook fn(layer, send[m, D] u16, recv[ranks, m, D] u16), or None.")
        .def_property_readonly("expert_partition",
                               [](PyEngine& pe) {
                                   const ExpertPartition& p = pe.eng->ep.part;
                                   return py::make_tuple(p.rank, p.ranks, p.bounds);
                               })
        .def("ep_stats",
             [](PyEngine& pe) {
                 const EpStats& st = pe.eng->ep.stats;
                 py::dict d;
                 d["exchanges"] = st.exchanges;
                 d["rows_sent"] = st.rows_sent;
                 d["bytes_sent"] = st.bytes_sent;
                 d["hook_seconds"] = st.hook_seconds;
                 d["step_seconds"] = st.step_seconds;
                 return d;
             })
        .def("reset_ep_stats", [](PyEngine& pe) { pe.eng->ep.stats = EpStats{}; })
        .def(
            "step",
            [](PyEngine& pe, const py::object& a, const py::object& b, const py::object& c, const py::object& d,
               const py::object& e, const py::object& f) {
                return translate([&] { return step(pe, a, b, c, d, e, f); });
            },
            py::arg("seq_ids"), py::arg("tokens"), py::arg("want_head"), py::arg("cap_rows"), py::arg("cap_mask"),
            py::arg("inject"),
            "One forward step for a batch of rows -> (head_rows i64[n], logits f32[n, V], captures, injected).");

    m.attr("ENGINE_STAGES") = glm::pyglue::stage_list();
    m.def("stage_table", &glm::pyglue::stage_table<EngineConfig>, py::arg("config"),
          "[(stage, dtype, elements per position or None)] under an engine config dict");
    m.def("engine_exp64", &exp64_array, py::arg("x"), "The engine's canonical double exp (mHC), elementwise.");
    m.def("engine_bench_copy", &bench_copy, py::arg("nbytes"), py::arg("threads"), py::arg("reps"),
          py::call_guard<py::gil_scoped_release>(),
          "Benchmark hook: best seconds of one memcpy of nbytes split over threads.");
    m.def("engine_bench_fma", &bench_fma, py::arg("threads"), py::arg("reps"), py::arg("kernels") = "",
          "Benchmark hook: the cores' FP32 FMA peak in one build's widest vectors (kernels: 'avx2', 'avx512'; "
          "default the build this process runs), multiply-adds per ns over `threads` threads (best of reps).");
    m.def("engine_bench_linear", &bench_linear, py::arg("release"), py::arg("data"), py::arg("scale"), py::arg("R"),
          py::arg("C"), py::arg("threads"), py::arg("reps"),
          "Benchmark hook: best seconds of one single-token matvec over a release-format weight.");
    m.def(
        "engine_decode_rows",
        [](const std::string& release, const py::array& data, const py::object& scale_o, size_t R, size_t C) {
            Lin w;
            w.R = R;
            w.C = C;
            w.data = data.data();
            py::array scale;
            size_t need = R * C * (release == "bf16" ? 2 : release == "f32" ? 4 : 1);
            if (release == "bf16") w.fmt = WFmt::BF16;
            else if (release == "f32") w.fmt = WFmt::F32;
            else if (release == "fp8") w.fmt = WFmt::FP8;
            else if (release == "mxfp4") w.fmt = WFmt::MXFP4, need = R * C / 2;
            else bad("release: bf16, f32, fp8 or mxfp4");
            if (static_cast<size_t>(data.nbytes()) != need || !(data.flags() & py::array::c_style)) bad("data size");
            if (w.fmt == WFmt::FP8 || w.fmt == WFmt::MXFP4) {
                scale = py::reinterpret_borrow<py::array>(scale_o);
                const size_t sneed = w.fmt == WFmt::FP8 ? ((R + 127) / 128) * ((C + 127) / 128) * 4 : R * (C / 32);
                if (static_cast<size_t>(scale.nbytes()) != sneed || !(scale.flags() & py::array::c_style)) bad("scale size");
                w.scale = scale.data();
                if (w.fmt == WFmt::MXFP4 && C % 32) bad("mxfp4 needs C % 32 == 0");
                if (w.fmt == WFmt::FP8) w.fp8_nan_free = !has_e4m3_nan(static_cast<const uint8_t*>(w.data), R * C);
            }
            py::array_t<float> out({static_cast<py::ssize_t>(R), static_cast<py::ssize_t>(C)});
            for (size_t r = 0; r < R; ++r) w.decode_row(r, out.mutable_data() + r * C);
            return out;
        },
        py::arg("release"), py::arg("data"), py::arg("scale"), py::arg("R"), py::arg("C"),
        "Test hook: the engine's exact row decode of a release-format weight -> f32 [R, C].");
    m.def("engine_dot_columns", &dot_columns, py::arg("A"), py::arg("B"),
          "Test hook: cdot of each column of A, B [n <= 8, m] by the engine's closed-form kernels.");
    m.def("engine_dot64_columns", &dot64_columns, py::arg("A"), py::arg("B"),
          "Test hook: cdot64 of each column of A, B [n <= 8, m] by the engine's closed-form kernels.");
    m.def(
        "engine_reduce",
        [](const std::string& what, const py::object& a, const py::object& b) -> py::object {
            Numerics nm;
            if (what == "dot") {
                const F32Arr x = F32Arr::ensure(a), y = F32Arr::ensure(b);
                if (!x || !y || x.ndim() != 1 || y.ndim() != 1 || x.shape(0) != y.shape(0))
                    bad("a, b: two 1-D arrays of one length");
                return py::float_(nm.dot(x.data(), y.data(), static_cast<size_t>(x.shape(0))));
            }
            if (what == "sum") {
                const F32Arr x = F32Arr::ensure(a);
                if (!x || x.ndim() != 1) bad("a: a 1-D array");
                return py::float_(nm.sum(x.data(), static_cast<size_t>(x.shape(0))));
            }
            if (what == "dot64") {
                const F64Arr x = F64Arr::ensure(a), y = F64Arr::ensure(b);
                if (!x || !y || x.ndim() != 1 || y.ndim() != 1 || x.shape(0) != y.shape(0))
                    bad("a, b: two 1-D arrays of one length");
                return py::float_(nm.dot64(x.data(), y.data(), static_cast<size_t>(x.shape(0))));
            }
            if (what == "sum64") {
                const F64Arr x = F64Arr::ensure(a);
                if (!x || x.ndim() != 1) bad("a: a 1-D array");
                return py::float_(nm.sum64(x.data(), static_cast<size_t>(x.shape(0))));
            }
            bad("what: dot, sum, dot64 or sum64");
        },
        py::arg("what"), py::arg("a"), py::arg("b") = py::none(),
        "Test hook: the engine's reduction dispatch (closed form for n <= 8, H2's cdot/cdot64 beyond).");
    m.def(
        "engine_fast_expf",
        [](const py::array_t<float, py::array::c_style | py::array::forcecast>& x) {
            py::array_t<float> y(x.size());
            for (py::ssize_t i = 0; i < x.size(); ++i) y.mutable_data()[i] = Numerics::fast_expf(x.data()[i]);
            return y;
        },
        py::arg("x"), "The non-canonical expf of expf='native' (for tests and the diff tool's demo).");
}
