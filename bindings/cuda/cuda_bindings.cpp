// pybind11 glue of the CUDA engine: the extension module fast._cuda (fast._cuda_emu for the CPU
// emulation build, bindings/cuda/emu). Compiled by the host compiler; it sees only engine_api.hpp.
//
// fast._cuda._Engine has the CPU engine's interface (bindings/engine_bindings.cpp) method for method,
// so fast/cuda.py is fast/engine.py over another core. Every entry point checks its arguments and
// raises ValueError; the step releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../pyglue.hpp"
#include "../state_glue.hpp"
#include "engine_api.hpp"

#ifndef GLM_CUDA_MODULE
#define GLM_CUDA_MODULE _cuda
#endif

namespace py = pybind11;
using namespace glm::cuda;

namespace {

using glm::pyglue::bad;
using glm::pyglue::checked;
using glm::pyglue::translate;
using glm::pyglue::get;
using glm::pyglue::shape_of;

Config config_from_dict(const py::dict& d) { return glm::pyglue::config_from_dict<Config>(d); }

// Page-locked buffers for decode-sized logits, reused: a step's logits are copied by the device straight
// into the array it returns (no staging buffer and host copy per step, and no fresh pages to fault in).
// An array's buffer comes back to the pool when numpy frees the array; the pool lives while any does.
class PinnedPool {
   public:
    ~PinnedPool() {
        for (auto& kv : free_)
            for (void* p : kv.second) host_pinned_free(p);
    }
    // nullptr when kMaxOut buffers are out already (kept logits of a long generation would otherwise
    // pin host memory without bound): the caller then makes an ordinary array
    void* take(size_t bytes) {
        std::lock_guard<std::mutex> lock(mu_);
        if (out_ >= kMaxOut) return nullptr;
        ++out_;
        auto it = free_.find(bytes);
        if (it != free_.end() && !it->second.empty()) {
            void* p = it->second.back();
            it->second.pop_back();
            return p;
        }
        try {
            return host_pinned_alloc(bytes);
        } catch (...) {
            --out_;
            throw;
        }
    }
    void give(void* p, size_t bytes) {
        std::lock_guard<std::mutex> lock(mu_);
        --out_;
        std::vector<void*>& v = free_[bytes];
        if (v.size() < 4) v.push_back(p);
        else host_pinned_free(p);
    }

   private:
    static constexpr int kMaxOut = 32;
    std::mutex mu_;
    int out_ = 0;
    std::map<size_t, std::vector<void*>> free_;
};
constexpr size_t kPinnedLogitsMax = size_t{16} << 20;  // larger (prefill) logits: an ordinary array

struct PyEngine {
    std::unique_ptr<Engine> eng;
    unsigned threads = 1;
    int64_t vocab = 0;
    std::shared_ptr<PinnedPool> pool = std::make_shared<PinnedPool>();
};

// The engine options (engine_api.hpp: EngineOptions) by name: the flags, then the integers.
struct FlagOption {
    const char* name;
    bool EngineOptions::*field;
};
struct IntOption {
    const char* name;
    int EngineOptions::*field;
};
constexpr IntOption kIntOptions[] = {{"expert_tile", &EngineOptions::expert_tile},
                                     {"lanes_items", &EngineOptions::lanes_items},
                                     {"items16", &EngineOptions::items16},
                                     {"lanes_tn", &EngineOptions::lanes_tn}};
constexpr FlagOption kFlagOptions[] = {{"pdl", &EngineOptions::pdl},
                                       {"tune", &EngineOptions::tune},
                                       {"stream_early", &EngineOptions::stream_early},
                                       {"hc_fuse", &EngineOptions::hc_fuse},
                                       {"pinned_logits", &EngineOptions::pinned_logits},
                                       {"gemm", &EngineOptions::gemm},
                                       {"lanes", &EngineOptions::lanes},
                                       {"idx_tiled", &EngineOptions::idx_tiled},
                                       {"attn_tiled", &EngineOptions::attn_tiled},
                                       {"head_bound", &EngineOptions::head_bound},
                                       {"pairs", &EngineOptions::pairs}};

// From a dict of some of their names; unknown names and wrong types are refused.
EngineOptions options_from_dict(const py::dict& d) {
    EngineOptions o;
    for (const auto& kv : d) {
        const std::string k = py::str(kv.first);
        const py::handle v = kv.second;
        const FlagOption* f = nullptr;
        for (const FlagOption& c : kFlagOptions)
            if (k == c.name) f = &c;
        const IntOption* n = nullptr;
        for (const IntOption& c : kIntOptions)
            if (k == c.name) n = &c;
        if (f) {
            if (!py::isinstance<py::bool_>(v)) bad("options: " + k + " must be True or False");
            o.*(f->field) = v.cast<bool>();
        } else if (n) {
            if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v)) bad("options: " + k + " must be an int");
            o.*(n->field) = v.cast<int>();
        } else {
            std::string names;
            for (const FlagOption& c : kFlagOptions) names += std::string(c.name) + ", ";
            for (const IntOption& c : kIntOptions) names += std::string(c.name) + ", ";
            names.resize(names.size() - 2);
            bad("options: unknown option '" + k + "' (" + names + ")");
        }
    }
    return o;
}
py::dict options_dict(const EngineOptions& o) {
    py::dict d;
    for (const FlagOption& c : kFlagOptions) d[c.name] = o.*(c.field);
    for (const IntOption& c : kIntOptions) d[c.name] = o.*(c.field);
    return d;
}

py::array_t<float> pinned_logits(const std::shared_ptr<PinnedPool>& pool, size_t n, size_t V, bool on, bool& pinned) {
    const size_t bytes = n * V * sizeof(float);
    const std::vector<py::ssize_t> shape{static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(V)};
    if (bytes > kPinnedLogitsMax || !on) {  // the option pinned_logits=False: the staging path (an A/B switch)
        pinned = false;
        return py::array_t<float>(shape);
    }
    struct Owner {
        std::shared_ptr<PinnedPool> pool;
        void* p;
        size_t bytes;
    };
    void* buf = pool->take(bytes);
    if (!buf) {
        pinned = false;
        return py::array_t<float>(shape);
    }
    auto* o = new Owner{pool, buf, bytes};
    py::capsule owner(o, [](void* q) {
        auto* w = static_cast<Owner*>(q);
        w->pool->give(w->p, w->bytes);
        delete w;
    });
    pinned = true;
    return py::array_t<float>(shape, static_cast<float*>(o->p), owner);
}

py::tuple step(PyEngine& pe, const py::object& seq_o, const py::object& tok_o, const py::object& head_o,
               const py::object& caprow_o, const py::object& mask_o, const py::object& inj_o) {
    const std::shared_ptr<PinnedPool> pool = pe.pool;
    const bool on = pe.eng->options().pinned_logits;
    return glm::pyglue::run_step(*pe.eng, static_cast<size_t>(pe.vocab), seq_o, tok_o, head_o, caprow_o, mask_o, inj_o,
                                 [pool, on](size_t n, size_t V, bool& pinned) { return pinned_logits(pool, n, V, on, pinned); });
}

}  // namespace

PYBIND11_MODULE(GLM_CUDA_MODULE, m) {
    m.doc() = "The exact CUDA engine (use fast.cuda.CudaEngine or fast.Engine(path, device='cuda')).";
#if defined(GLM_CUDA_EMU)
    m.attr("EMULATED") = true;
#else
    m.attr("EMULATED") = false;
#endif
    py::class_<PyEngine>(m, "_Engine", "The CUDA engine's executor (use fast.cuda.CudaEngine).")
        .def(py::init([](const py::dict& cfg, unsigned threads, const std::string& dot, const std::string& expf,
                         const py::dict& options) {
                 bool seq = false, native = false;
                 if (dot == "sequential")
                     seq = true;
                 else if (dot != "canonical")
                     bad("dot: expected 'canonical' or 'sequential', given '" + dot + "'");
                 if (expf == "native")
                     native = true;
                 else if (expf != "canonical")
                     bad("expf: expected 'canonical' or 'native', given '" + expf + "'");
                 if (threads < 1 || threads > 1024) bad("threads: expected 1..1024");
                 const EngineOptions opts = options_from_dict(options);
                 auto pe = std::make_unique<PyEngine>();
                 pe->threads = threads;
                 try {
                     const Config config = config_from_dict(cfg);
                     pe->eng = std::make_unique<Engine>(config, seq, native, opts);
                     pe->vocab = config.vocab_size;
                 } catch (const std::invalid_argument& e) {
                     bad(e.what());
                 }
                 return pe;
             }),
             py::arg("config"), py::arg("threads") = 1, py::arg("dot") = "canonical", py::arg("expf") = "canonical",
             py::arg("options") = py::dict())
        .def_property_readonly("options", [](PyEngine& pe) { return options_dict(pe.eng->options()); },
                               "The engine's runtime knobs (EngineOptions), every one with its value")
        .def(
            "add_tensor",
            [](PyEngine& pe, const std::string& role, int layer, int expert, const std::string& release,
               const py::object& data_o, const py::object& scale_o, const std::vector<int64_t>& shape) {
                glm::pyglue::add_tensor(*pe.eng, role, layer, expert, release, data_o, scale_o, shape);
            },
            py::arg("role"), py::arg("layer"), py::arg("expert"), py::arg("release"), py::arg("data"),
            py::arg("scale"), py::arg("shape"))
        .def("finalize", [](PyEngine& pe) { translate([&] { pe.eng->finalize(); return 0; }); })
        .def("new_sequence", [](PyEngine& pe) { return pe.eng->new_sequence(); })
        .def("fork_sequence", [](PyEngine& pe, int64_t id) { return translate([&] { return pe.eng->fork_sequence(id); }); })
        .def("free_sequence", [](PyEngine& pe, int64_t id) { pe.eng->free_sequence(id); })
        .def("sequence_length",
             [](PyEngine& pe, int64_t id) { return translate([&] { return pe.eng->sequence_length(id); }); })
        .def("reserve_sequence",
             [](PyEngine& pe, int64_t id, int64_t positions) {
                 translate([&] { pe.eng->reserve_sequence(id, positions); return 0; });
             })
        .def("sequence_bytes", [](PyEngine& pe, int64_t id) { return translate([&] { return pe.eng->sequence_bytes(id); }); })
        .def("export_sequence", [](PyEngine& pe, int64_t id) { return glm::pyglue::export_state(*pe.eng, id); },
             py::arg("id"))
        .def("import_sequence",
             [](PyEngine& pe, const py::object& arrays, const py::object& length) {
                 return glm::pyglue::import_state(*pe.eng, arrays, length);
             },
             py::arg("arrays"), py::arg("length"))
        .def_property_readonly("live_sequences", [](PyEngine& pe) { return pe.eng->live_sequences(); })
        .def_property_readonly("threads", [](PyEngine& pe) { return pe.threads; })
        .def_property_readonly("weight_bytes", [](PyEngine& pe) { return pe.eng->weight_bytes(); })
        .def("decode_weight_bytes", [](PyEngine& pe, int64_t position) { return pe.eng->weight_bytes(position < 0 ? 0 : position); })
        .def_property_readonly("device_bytes", [](PyEngine& pe) { return pe.eng->device_bytes(); })
        .def_property_readonly("pooled_bytes", [](PyEngine& pe) { return pe.eng->pooled_bytes(); })
        .def_property_readonly("device_name", [](PyEngine& pe) { return pe.eng->device_name(); })
        .def_property_readonly("decode_path", [](PyEngine& pe) { return pe.eng->decode_path(); })
        .def(
            "greedy",
            [](PyEngine& pe, int64_t seq, int32_t first, int n) {
                std::vector<int32_t> r;
                translate([&] {
                    py::gil_scoped_release nogil;
                    r = pe.eng->greedy(seq, first, n);
                    return 0;
                });
                py::array_t<int32_t> a(static_cast<py::ssize_t>(r.size()));
                if (!r.empty()) std::memcpy(a.mutable_data(), r.data(), r.size() * sizeof(int32_t));
                return a;
            },
            py::arg("seq"), py::arg("first"), py::arg("n"),
            "n greedy decode steps of one sequence on the device (first: its next token); the tokens produced.")
        // ---- expert parallelism (docs/ep.md, "GPU"; fast/distributed.py) ----
        .def(
            "set_expert_partition",
            [](PyEngine& pe, int rank, int ranks, const std::vector<int64_t>& bounds) {
                translate([&] {
                    pe.eng->set_expert_partition(ExpertPartition{rank, ranks, bounds});
                    return 0;
                });
            },
            py::arg("rank"), py::arg("ranks"), py::arg("bounds"),
            "This rank's share of the routed experts: rank r owns [bounds[r], bounds[r+1]). Before add_tensor.")
        .def(
            "set_exchange",
            [](PyEngine& pe, const py::object& fn) {
                if (fn.is_none()) {
                    pe.eng->set_exchange(nullptr);
                    return;
                }
                if (!PyCallable_Check(fn.ptr())) bad("set_exchange: expected a callable or None");
                py::object f = fn;
                // fn(layer, send, recv, rows, D): device addresses (ints) of send u16[rows, D] and recv
                // u16[ranks, rows, D]; it fills recv on the engine's stream. Runs with the GIL re-acquired.
                pe.eng->set_exchange(std::make_shared<DeviceExchangeFn>(
                    [f](int layer, uintptr_t send, uintptr_t recv, size_t rows, size_t D) {
                        py::gil_scoped_acquire gil;
                        try {
                            f(layer, send, recv, rows, D);
                        } catch (py::error_already_set& e) {
                            throw std::runtime_error(std::string("expert exchange failed: ") + e.what());
                        }
                    }));
            },
            py::arg("fn"), "The expert-row exchange hook fn(layer, send_ptr, recv_ptr, rows, D), or None.")
        .def_property_readonly("expert_partition",
                               [](PyEngine& pe) {
                                   const ExpertPartition p = pe.eng->expert_partition();
                                   return py::make_tuple(p.rank, p.ranks, p.bounds);
                               })
        .def("ep_stats",
             [](PyEngine& pe) {
                 const EpStats st = pe.eng->ep_stats();
                 py::dict d;
                 d["exchanges"] = st.exchanges;
                 d["rows_sent"] = st.rows_sent;
                 d["bytes_sent"] = st.bytes_sent;
                 d["hook_seconds"] = st.hook_seconds;
                 d["step_seconds"] = st.step_seconds;
                 return d;
             })
        .def("reset_ep_stats", [](PyEngine& pe) { pe.eng->reset_ep_stats(); })
        .def("head_bound_stats",
             [](PyEngine& pe) {
                 const Engine::HeadBoundStats st = pe.eng->head_bound_stats();
                 py::dict d;
                 d["rows"] = st.rows;
                 d["candidates"] = st.candidates;
                 d["max_candidates"] = st.max_candidates;
                 d["full_steps"] = st.full_steps;
                 return d;
             })
        .def("reset_head_bound_stats", [](PyEngine& pe) { pe.eng->reset_head_bound_stats(); })
        // where the exchange hook's buffers live: "device", or "host" under the CPU emulation
        .def_property_readonly("device_exchange",
                               [](PyEngine&) {
#if defined(GLM_CUDA_EMU)
                                   return "host";
#else
                                   return "device";
#endif
                               })
        .def("set_timing", [](PyEngine& pe, bool on) { pe.eng->set_timing(on); }, py::arg("on"))
        .def("reset_stage_times", [](PyEngine& pe) { pe.eng->reset_stage_times(); })
        .def("stage_times",
             [](PyEngine& pe) {
                 const StageTimes t = pe.eng->stage_times();
                 py::dict d;
                 for (size_t i = 0; i < t.names.size(); ++i) d[py::str(t.names[i])] = t.ms[i];
                 return d;
             })
        .def(
            "step",
            [](PyEngine& pe, const py::object& a, const py::object& b, const py::object& c, const py::object& d,
               const py::object& e, const py::object& f) { return translate([&] { return step(pe, a, b, c, d, e, f); }); },
            py::arg("seq_ids"), py::arg("tokens"), py::arg("want_head"), py::arg("cap_rows"), py::arg("cap_mask"),
            py::arg("inject"),
            "One forward step for a batch of rows -> (head_rows i64[n], logits f32[n, V], captures, injected).");

    m.attr("ENGINE_STAGES") = glm::pyglue::stage_list();
    m.def("stage_table", &glm::pyglue::stage_table<Config>, py::arg("config"),
          "[(stage, dtype, elements per position or None)] under an engine config dict");
    m.def(
        "set_device", [](int i) { translate([&] { set_device(i); return 0; }); }, py::arg("index"),
        "The device this process's engines use (expert parallelism: one per rank); before making an engine.");
    m.def("device_count", &device_count, "How many CUDA devices this process sees.");
    m.def(
        "device_memory", [] { return translate([&] { return device_memory(); }); },
        "(free, total) bytes of the current device's memory.");

    auto expf_fn = [](const py::array_t<float, py::array::c_style | py::array::forcecast>& x, bool native) {
        py::array_t<float> y(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
        {
            py::gil_scoped_release nogil;
            expf_device(x.data(), y.mutable_data(), static_cast<size_t>(x.size()), native);
        }
        return y;
    };
    m.def("expf", expf_fn, py::arg("x"), py::arg("native") = false,
          "expf(x: f32 array) -> f32 array: the canonical expf computed on the device (native=True: CUDA's expf).");
    m.def("expf_device", expf_fn, py::arg("x"), py::arg("native") = false, "Alias of expf.");
    m.def(
        "index_select",
        [](const py::array_t<float, py::array::c_style | py::array::forcecast>& scores, int pos, int kp, int budget) {
            if (scores.ndim() != 1) bad("index_select: scores must be 1-D");
            const std::vector<int> v = translate(
                [&] { return index_select_device(scores.data(), static_cast<int64_t>(scores.size()), pos, kp, budget); });
            return py::array_t<int32_t>(static_cast<py::ssize_t>(v.size()), v.data());
        },
        py::arg("scores"), py::arg("pos"), py::arg("kp"), py::arg("budget"),
        "The indexer's selection kernel for one query at `pos` over its (pos + 1) // kp pool scores: the "
        "positions it attends, ascending.");
    m.def(
        "mla_softmax",
        [](const py::array_t<float, py::array::c_style | py::array::forcecast>& scores, const std::vector<int>& lens,
           int nh, const std::string& kernel) {
            int64_t total = 0;
            for (int n : lens) total += n;
            if (scores.ndim() != 1 || scores.size() != total * nh)
                bad("mla_softmax: scores must be 1-D, nh * sum(lens) values");
            const MlaSoftmax r = translate([&] { return mla_softmax_device(scores.data(), lens, nh, kernel); });
            return py::make_tuple(py::array_t<float>(static_cast<py::ssize_t>(r.probs.size()), r.probs.data()),
                                  py::array_t<float>(static_cast<py::ssize_t>(r.sums.size()), r.sums.data()));
        },
        py::arg("scores"), py::arg("lens"), py::arg("nh"), py::arg("kernel") = "auto",
        "mla.probs through one softmax kernel: rows t of lens[t] positions, nh heads each (scores [t][h][position], "
        "one after the other); kernel 'auto' (the engine's rule), 'general', 'rows4', 'rows16', 'rows64' or 'stream'. "
        "Returns (probs, each row's csum(e) [t][h]).");
    m.def(
        "index_scores",
        [](const py::array_t<float, py::array::c_style | py::array::forcecast>& q,
           const py::array_t<float, py::array::c_style | py::array::forcecast>& wts,
           const py::array_t<float, py::array::c_style | py::array::forcecast>& keys, const std::vector<int>& pos,
           int kp, int budget, bool tiled, int reps) {
            if (q.ndim() != 3) bad("index_scores: q must be [T][ni][di]");
            const int T = static_cast<int>(q.shape(0)), ni = static_cast<int>(q.shape(1)),
                      di = static_cast<int>(q.shape(2));
            if (wts.ndim() != 2 || wts.shape(0) != T || wts.shape(1) != ni) bad("index_scores: wts must be [T][ni]");
            if (keys.ndim() != 2 || keys.shape(1) != di) bad("index_scores: keys must be [pools][di]");
            if (static_cast<int>(pos.size()) != T) bad("index_scores: one position per query");
            const IndexScores r = translate([&] {
                return index_scores_device(q.data(), wts.data(), keys.data(), static_cast<int64_t>(keys.shape(0)),
                                           pos, ni, di, kp, budget, tiled, reps);
            });
            py::dict d;
            d["scores"] = py::array_t<float>(static_cast<py::ssize_t>(r.scores.size()), r.scores.data());
            d["ms"] = r.ms;
            d["select_ms"] = r.select_ms;
            return d;
        },
        py::arg("q"), py::arg("wts"), py::arg("keys"), py::arg("pos"), py::arg("kp"), py::arg("budget"),
        py::arg("tiled"), py::arg("reps") = 0,
        "The indexer's scoring kernel (tiled or per-row) for queries of one sequence: {'scores': each row's "
        "(pos + 1) // kp pool scores one after the other, 'ms' and 'select_ms': median device times of reps "
        "launches of the scoring and of the selection (0 when reps is 0)}.");
    m.def(
        "argmax",
        [](const py::array_t<float, py::array::c_style | py::array::forcecast>& x) -> py::object {
            if ((x.ndim() != 1 && x.ndim() != 2) || x.size() < 1) bad("argmax: a non-empty 1-D or 2-D array");
            const int rows = x.ndim() == 2 ? static_cast<int>(x.shape(0)) : 1;
            const int n = static_cast<int>(x.shape(x.ndim() - 1));
            const std::vector<int> r = translate([&] { return argmax_device(x.data(), n, rows); });
            if (x.ndim() == 1) return py::int_(r[0]);
            return py::array_t<int>(static_cast<py::ssize_t>(r.size()), r.data());
        },
        py::arg("x"),
        "The greedy rule of Engine.greedy on the device (np.argmax's: NaN first, then the lowest index): an int for "
        "a row, an array of one index a row for a 2-D array.");
    m.def(
        "head_bound",
        [](const py::array_t<uint16_t, py::array::c_style>& w, const py::array_t<float, py::array::c_style | py::array::forcecast>& x) {
            if (w.ndim() != 2 || x.ndim() != 2 || w.shape(1) != x.shape(1))
                bad("head_bound: w must be [R][C] BF16 bits (uint16) and x [n][C]");
            const int R = static_cast<int>(w.shape(0)), C = static_cast<int>(w.shape(1)), n = static_cast<int>(x.shape(0));
            const HeadBoundRun r = translate([&] { return head_bound_device(w.data(), R, C, x.data(), n); });
            py::dict d;
            d["usable"] = r.usable;
            if (r.usable) {
                d["lo"] = py::array_t<float>({n, R}, r.lo.data());
                d["hi"] = py::array_t<float>({n, R}, r.hi.data());
                d["tokens"] = py::array_t<int>(static_cast<py::ssize_t>(n), r.tokens.data());
                d["counts"] = py::array_t<int>(static_cast<py::ssize_t>(n), r.counts.data());
                d["flag"] = r.flag;
            }
            return d;
        },
        py::arg("w"), py::arg("x"),
        "The bounded head (docs/engine_cuda.md) on the device: {'usable', 'lo', 'hi' ([n][R] bounds of the "
        "canonical logits), 'tokens' (np.argmax of them unless 'flag'), 'counts' (candidates per token), 'flag'}.");
    m.def(
        "head_bound_limits",
        [] {
            const HeadBoundLimits l = head_bound_limits();
            py::dict d;
            d["q_bits"] = l.q_bits;
            d["cap"] = l.cap;
            d["min_rows"] = l.min_rows;
            return d;
        },
        "The bounded head's constants: {'q_bits' (|q| <= 2^q_bits), 'cap' (candidates a token keeps), "
        "'min_rows' (the fewest greedy rows of a step it takes)}.");
    m.def(
        "argmax_logprob",
        [](const py::array_t<float, py::array::c_style | py::array::forcecast>& x) {
            if (x.ndim() != 1 || x.size() < 1) bad("argmax_logprob: a non-empty 1-D array");
            const auto r = translate([&] { return argmax_logprob_device(x.data(), static_cast<int>(x.size())); });
            return py::make_tuple(r.first, py::array_t<float>(1, &r.second)[py::int_(0)]);
        },
        py::arg("x"),
        "The greedy token (np.argmax's rule) and oracle.sampling.log_softmax(x)[token] on the device, as a step's "
        "\"argmax_logprob\" head computes them (the log-probability NaN when x holds a NaN or an infinity).");
    m.def(
        "expf_device_bits",
        [](uint64_t lo, uint64_t n) {
            if (lo + n > (uint64_t{1} << 32)) bad("expf_device_bits: lo + n must be <= 2**32");
            py::array_t<float> y(static_cast<py::ssize_t>(n));
            {
                py::gil_scoped_release nogil;
                expf_device_bits(lo, static_cast<size_t>(n), y.mutable_data());
            }
            return y;
        },
        py::arg("lo"), py::arg("n"), "The canonical device expf of the f32 bit patterns lo .. lo+n-1 (made on the device).");
    m.def(
        "exp64",
        [](const py::array_t<double, py::array::c_style | py::array::forcecast>& x) {
            py::array_t<double> y(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
            {
                py::gil_scoped_release nogil;
                exp64_device(x.data(), y.mutable_data(), static_cast<size_t>(x.size()));
            }
            return y;
        },
        py::arg("x"), "The canonical double exp of mHC, computed on the device.");
    m.def(
        "expf_census",
        [](const std::string& kind, uint64_t lo, uint64_t hi) {
            CensusResult r;
            translate([&] {
                py::gil_scoped_release nogil;
                r = expf_census(kind, lo, hi);
                return 0;
            });
            py::dict d;
            d["kind"] = kind;
            d["inputs"] = r.inputs;
            d["differ"] = r.differ;
            d["differ_bf16"] = r.differ_bf16;
            d["differ_nonpos"] = r.differ_nonpos;
            d["nonpos_inputs"] = r.nonpos_inputs;
            d["max_ulps"] = r.max_ulps;
            d["first"] = r.first < 0 ? py::object(py::none()) : py::object(py::int_(r.first));
            d["seconds"] = r.seconds;
            return d;
        },
        py::arg("kind") = "expf", py::arg("lo") = 0, py::arg("hi") = uint64_t{1} << 32,
        "Exhaustive census on the device: how many f32 inputs in [lo, hi) give a different result with CUDA's "
        "'expf' or '__expf' (or 'canonical', a control) than the canonical device expf; also after BF16 rounding "
        "and for x <= 0. Returns a dict of counts.");
    m.def(
        "decode_table",
        [](const std::string& which) {
            const std::vector<float> v = translate([&] { return decode_table_device(which); });
            py::array_t<float> a(static_cast<py::ssize_t>(v.size()));
            if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(float));
            return a;
        },
        py::arg("which"), "Decoded values of all codes on the device: 'e4m3', 'e4m3_sw', 'e2m1' (scale 1), 'e8m0'.");
    m.def(
        "linear",
        [](const std::string& release, const py::object& dobj, const py::object& sobj, const py::object& xobj,
           bool round, const std::string& kernel, bool expert, const std::string& decode, const py::object& hobj) {
            const bool bf = release == "bf16", f32 = release == "f32", fp8 = release == "fp8", mx = release == "mxfp4";
            if (!(bf || f32 || fp8 || mx)) bad("linear: release must be 'bf16', 'f32', 'fp8' or 'mxfp4'");
            const py::array W = checked(dobj, "data", bf ? "u" : (f32 ? "f" : "u"), bf ? 2 : (f32 ? 4 : 1));
            if (W.ndim() != 2) bad("data: expected a 2-d array");
            const int64_t R = W.shape(0), C = mx ? 2 * W.shape(1) : W.shape(1);
            py::array S;
            size_t sbytes = 0;
            if (fp8 || mx) {
                if (sobj.is_none()) bad("scale: required for fp8 and mxfp4");
                S = checked(sobj, "scale", fp8 ? "f" : "u", fp8 ? 4 : 1);
                const int64_t want0 = fp8 ? (R + 127) / 128 : R, want1 = fp8 ? (C + 127) / 128 : C / 32;
                if (S.ndim() != 2 || S.shape(0) != want0 || S.shape(1) != want1)
                    bad("scale: expected shape [" + std::to_string(want0) + ", " + std::to_string(want1) + "]");
                sbytes = static_cast<size_t>(S.nbytes());
            } else if (!sobj.is_none()) {
                bad("scale: must be None for bf16 and f32");
            }
            const py::array X = checked(xobj, "X", "f", 4);
            LinHeads heads;
            if (!hobj.is_none()) {
                const auto h = hobj.cast<std::vector<int64_t>>();
                if (h.size() != 5) bad("heads: (out_rows, rh, hstride, woff, xhs)");
                if (X.ndim() != 2) bad("X: expected a 2-d array");
                heads = {h[0], h[1], h[2], h[3], h[4], static_cast<int64_t>(X.shape(1))};
            } else if (X.ndim() != 2 || X.shape(1) != C) {
                bad("X: expected shape [T, " + std::to_string(C) + "]");
            }
            const int T = static_cast<int>(X.shape(0));
            std::vector<float> y = translate([&] {
                py::gil_scoped_release nogil;
                return linear_device(release, W.data(), static_cast<size_t>(W.nbytes()), sbytes ? S.data() : nullptr,
                                     sbytes, R, C, static_cast<const float*>(X.data()), T, round, kernel, expert,
                                     decode, hobj.is_none() ? nullptr : &heads);
            });
            const int64_t out_rows = hobj.is_none() ? R : heads.out_rows;
            py::array_t<float> out({static_cast<py::ssize_t>(T), static_cast<py::ssize_t>(out_rows)});
            std::memcpy(out.mutable_data(), y.data(), y.size() * sizeof(float));
            return out;
        },
        py::arg("release"), py::arg("data"), py::arg("scale"), py::arg("X"), py::arg("round") = false,
        py::arg("kernel") = "auto", py::arg("expert") = false, py::arg("decode") = "auto", py::arg("heads") = py::none(),
        "linear(release, data, scale, X: f32[T, C], round=False, kernel='auto'|'register'|'register:occ5'|"
        "'register:occ6'|'stream:1|2|3'|'tiled'|'tiled:1'|'gemm'|'lanes'|'staged'|'staged:LPT:XS[:RPB:CPS]', expert=False, "
        "decode='auto'|'sw'|'hw'|'int', heads=None | (out_rows, rh, hstride, woff, xhs): head-blocked as MLA's "
        "W_UK^T and W_UV, output row r from weight row (r / rh) hstride + woff + r % rh and X columns (r / rh) xhs + "
        "[0, C), X [T, any width]) -> "
        "f32[T, R]: Y[t, r] = cdot(W[r], X[t]) through the engine's device kernels (expert: the routed-expert "
        "path, token row t its own work item, or with 'tiled' items of 4 or 8 pairs, with 'gemm' of 16 from 16). "
        "Layouts as fast._core.linear.");
    m.def(
        "tuned",
        [] {
            py::list out;
            for (const TunedShape& t : tuned_shapes()) {
                py::dict d;
                d["fmt"] = t.fmt;
                d["R"] = t.R;
                d["C"] = t.C;
                d["expert_items"] = t.expert_items;
                d["tables"] = t.tables;
                d["heads"] = t.heads;
                d["decode"] = t.decode;
                d["choice"] = t.choice;
                py::dict us;
                for (const auto& kv : t.us) us[py::str(kv.first)] = kv.second;
                d["us"] = us;
                out.append(d);
            }
            return out;
        },
        "The one-token linear kernel chosen per shape (timed on first use; the engine option tune=False turns it off), with "
        "the microseconds of each candidate.");
    m.def(
        "linear_bench",
        [](const std::string& release, int64_t R, int64_t C, int experts, const std::string& kernel, int reps,
           const std::string& decode) {
            return translate([&] {
                py::gil_scoped_release nogil;
                return linear_bench_device(release, R, C, experts, kernel, reps, decode);
            });
        },
        py::arg("release"), py::arg("R"), py::arg("C"), py::arg("experts") = 0, py::arg("kernel") = "auto",
        py::arg("reps") = 20, py::arg("decode") = "auto",
        "Median device microseconds of one linear launch (R x C weights made on the device; experts > 0: that many "
        "expert matrices, one pair each). kernel as linear().");
    m.def(
        "linear_bench_tokens",
        [](const std::string& release, int64_t R, int64_t C, int T, int experts, int topk, const std::string& kernel,
           int reps, const std::string& decode) {
            return translate([&] {
                py::gil_scoped_release nogil;
                return linear_bench_tokens_device(release, R, C, T, experts, topk, kernel, reps, decode);
            });
        },
        py::arg("release"), py::arg("R"), py::arg("C"), py::arg("T"), py::arg("experts") = 0, py::arg("topk") = 8,
        py::arg("kernel") = "auto", py::arg("reps") = 5, py::arg("decode") = "auto",
        "Median device microseconds of one several-token linear launch (T token rows; experts > 0: each token routed "
        "to topk of that many expert matrices, the engine's work items). Two untimed passes first.");
    m.def(
        "bench_ffma",
        [](int reps) {
            return translate([&] {
                py::gil_scoped_release nogil;
                return ffma_peak_device(reps);
            });
        },
        py::arg("reps") = 5, "The device's FP32 FMA rate in FLOP/s (independent FMA chains; median of reps launches).");
}
