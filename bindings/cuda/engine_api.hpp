// The CUDA engine's host interface (plain C++: the pybind11 glue in cuda_bindings.cpp includes only
// this header, so it compiles with the host compiler and never sees CUDA types).
//
// The executor mirrors the CPU engine (bindings/cpu/engine.hpp) call for call: the same config,
// the same tensor roles, the same stage table (names and dtypes, oracle/stages.py), the same
// injection spec and the same step interface, so that fast/cuda.py is fast/engine.py over another
// core. Weights are uploaded once, in their release format; every sequence's state (KDA conv
// windows and recurrent state, MLA latents, indexer keys and pools) lives on the GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../engine_types.hpp"
#include "../state_io.hpp"

namespace glm::cuda {

// The config, the stage table, the injection spec, capture records and a step's output are the CPU
// engine's (bindings/engine_types.hpp).
using Config = glm::EngineConfig;
using glm::SDType;
using glm::Injection;
using glm::CaptureRecord;
using glm::StepOutput;
using glm::StateTensor;

// Expert parallelism (docs/ep.md, "GPU"): the hook moves rows between ranks. send: [rows][D] BF16 bits
// (uint16) on the device, this rank's routed slots filled and the others zero; recv: [ranks][rows][D]
// on the device, every rank's send (recv[rank] included), written by the hook. Ordered on the engine's
// stream (the legacy default stream): work the hook enqueues there runs after the packing and before
// the unpacking, without a host synchronization. Under the CPU emulation the pointers are host memory.
using DeviceExchangeFn = std::function<void(int layer, uintptr_t send, uintptr_t recv, size_t rows, size_t D)>;
using glm::EpStats;
using glm::ExpertPartition;

// Per-stage device time of the last step(s) (timing mode only): name -> milliseconds.
struct StageTimes {
    std::vector<std::string> names;
    std::vector<double> ms;
};

// The engine's runtime knobs, fixed at construction (fast.cuda.CudaEngine(cuda_options=...); the
// engine's options show them). None changes a bit of any result: they choose between equal ways of
// computing it (A/B switches and benchmark knobs).
struct EngineOptions {
    bool pdl = true;            // launches may overlap the previous kernel's tail (programmatic dependent launch)
    bool tune = true;           // one-token linear kernel timed per shape on first use (never under the emulation)
    bool stream_early = false;  // streaming linear kernel, dense: first weights requested before the PDL wait
    bool hc_fuse = true;        // hc_expand deferred into the next site's k_hc_mix where nothing observes it
    int expert_tile = 0;        // pairs per routed-expert work item for batches: 1, 4, 8, 16 or 64; 0 the engine's rule
    int lanes_items = 32;       // where experts take items of 16: a remainder of at least this many pairs (0-64) is
                                // one more lane-pass item of 64 beside each expert's whole 64s (weights.cuh,
                                // big_item_pairs); 0: items of 16 only
    int items16 = 13;           // where experts take register-tiled items of 8: a remainder of at least this many
                                // pairs (0-16) is one more item of 16 beside each expert's whole 16s (weights.cuh,
                                // big_item_pairs); 0: items of 8 only
    bool pinned_logits = true;  // decode-sized logits copied straight into page-locked arrays (the bindings)
    bool gemm = true;           // several-token linear launches take the register-tiled kernel where it applies
    bool lanes = true;          // dense linear launches of 128+ tokens take the lane-pass kernel where it applies
    bool idx_tiled = true;      // prefill-sized indexer scoring as a tiled product (k_idx_scores_tiled)
    bool attn_tiled = true;     // prefill-sized mla.scores and mla.o_lat as tiled products (k_mla_scores_tiled, k_mla_olat_tiled)
    bool head_bound = true;     // greedy-only steps: the argmax from bounds on the logits and the candidates' exact logits
    bool pairs = true;          // FP8 routed-expert items of up to 8 pairs take the few-pair kernel (k_linear_pairs)
    int lanes_tn = 0;           // tokens a thread of the lane-pass kernel: 8 (512 threads a block) or 16 (256);
                                // 0 the engine's rule (weights.cu, lanes_tn_for)
};

class Engine {
   public:
    Engine(const Config& cfg, bool seq_dot, bool native_exp, const EngineOptions& options = EngineOptions{});
    const EngineOptions& options() const;
    ~Engine();
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    void add_tensor(const std::string& role, int layer, int expert, const std::string& release, const void* data,
                    const void* scale, const std::vector<int64_t>& shape, const std::vector<int64_t>& data_shape,
                    const std::vector<int64_t>& scale_shape);
    void finalize();

    int64_t new_sequence();
    int64_t fork_sequence(int64_t id);
    void free_sequence(int64_t id);
    int64_t sequence_length(int64_t id) const;
    // Room for `positions` positions in every MLA layer's cache, allocated now (no growth below it).
    void reserve_sequence(int64_t id, int64_t positions);
    // Device bytes the sequence's state holds (its buffers' sizes, not only what is filled).
    int64_t sequence_bytes(int64_t id) const;
    // The sequence's state copied to the host in the canonical layout (bindings/state_io.hpp), and its
    // length: the CPU engine's export of the same tokens, bit for bit.
    std::vector<StateTensor> export_sequence(int64_t id, int64_t& length) const;
    // A new sequence of `length` positions holding the given state (checked first: std::invalid_argument
    // naming the tensor), copied to the device; its buffers sized as a step growing it to `length` would.
    int64_t import_sequence(const std::vector<StateTensor>& arrays, int64_t length);
    size_t live_sequences() const;
    // Device bytes of freed sequences' buffers the engine keeps for new ones (free for them to take).
    size_t pooled_bytes() const;

    void step(const std::vector<int64_t>& seq_ids, const std::vector<int32_t>& tokens,
              const std::vector<uint8_t>& want_head, const std::vector<uint8_t>& cap_rows,
              const std::vector<uint8_t>& cap_mask, const Injection& inj, StepOutput& out);
    // Greedy decoding of one sequence on the device: n steps, the first reading `first`, each next one
    // the argmax of the previous step's logits (NaN first, else the lowest index of the maximum, as
    // np.argmax), kept on the device; the host enqueues step i + 1 while step i runs and synchronizes
    // once. Returns the n tokens produced (the argmax of each step's logits).
    std::vector<int32_t> greedy(int64_t seq_id, int32_t first, int n);

    // streamed bytes of the weights one decode token reads; at a position (>= 0), what a one-token step
    // there reads: while its query selects every position, the indexer's wq_b is not read
    size_t weight_bytes(int64_t position = -1) const;
    size_t device_bytes() const;         // device memory held for weights
    std::string device_name() const;
    std::string decode_path() const;     // how FP8 codes are decoded ("hardware cvt" or "software")

    // Expert parallelism: rank r owns the routed experts [bounds[r], bounds[r + 1]) of every MoE layer
    // (before add_tensor; at most 8 ranks); the exchange hook is required when ranks > 1.
    void set_expert_partition(const ExpertPartition& p);
    void set_exchange(std::shared_ptr<DeviceExchangeFn> fn);
    ExpertPartition expert_partition() const;
    EpStats ep_stats() const;
    void reset_ep_stats();

    // The bounded head (head_bound.cu): greedy rows it chose, their candidates, the largest count of
    // one row, and the steps the full head decided instead (since the last reset).
    struct HeadBoundStats {
        int64_t rows = 0, candidates = 0, max_candidates = 0, full_steps = 0;
    };
    HeadBoundStats head_bound_stats() const;
    void reset_head_bound_stats();

    // Timing: when on, each module's kernels are bracketed by events and summed per stage group.
    void set_timing(bool on);
    StageTimes stage_times() const;
    void reset_stage_times();

    struct Impl;

   private:
    std::unique_ptr<Impl> p_;
};

// ---- devices ------------------------------------------------------------------------------------
// The device this process's engines use (expert parallelism: one GPU per rank), and how many there are.
void set_device(int index);
int device_count();
// (free, total) bytes of the current device's memory.
std::pair<size_t, size_t> device_memory();

// ---- numerics entry points (tests, census) ------------------------------------------------------

// y[i] = the device's canonical expf(x[i]) (native: CUDA's expf instead).
void expf_device(const float* x, float* y, size_t n, bool native);
// y[i] = canonical expf of the f32 whose bits are lo + i, for i < n (inputs made on the device).
void expf_device_bits(uint64_t lo, size_t n, float* y);
// y[i] = the device's canonical exp64(x[i]).
void exp64_device(const double* x, double* y, size_t n);
// The indexer's selection kernel for one query at `pos` over given pool scores ((pos + 1) / kp of them):
// the positions it attends, ascending (tests: against the oracle's rule on made-up scores).
std::vector<int> index_select_device(const float* scores, int64_t n_scores, int pos, int kp, int budget);
// mla.probs of rows of lens[t] positions for nh heads each (scores [t][h][position], rows one after the
// other) through one softmax kernel: "auto" (the engine's rule), "general", "rows4", "rows16", "rows64", "stream";
// and each row's csum(e), [t][h].
struct MlaSoftmax {
    std::vector<float> probs, sums;
};
MlaSoftmax mla_softmax_device(const float* scores, const std::vector<int>& lens, int nh, const std::string& kernel);
// indexer.scores of T queries of one sequence at positions pos (ascending) against its pool keys
// ([n_keys][di], n_keys >= (pos[T-1] + 1) / kp): q [T][ni][di], wts [T][ni]; the rows' scores one after
// the other. tiled: the tiled kernel (it must apply), else the per-row one. reps > 0: also the median
// device time of `reps` launches (ms) after two untimed ones, and of the selection of those rows.
struct IndexScores {
    std::vector<float> scores;
    double ms = 0, select_ms = 0;
};
IndexScores index_scores_device(const float* q, const float* wts, const float* keys, int64_t n_keys,
                                const std::vector<int>& pos, int ni, int di, int kp, int budget, bool tiled,
                                int reps);

struct CensusResult {
    uint64_t inputs = 0, differ = 0, differ_bf16 = 0, differ_nonpos = 0, nonpos_inputs = 0, max_ulps = 0;
    int64_t first = -1;  // smallest differing input bits, -1 if none
    double seconds = 0;
};
// Every f32 bit pattern in [lo, hi) through CUDA's `expf` (kind "expf") or `__expf` ("__expf"), or the
// canonical device expf itself ("canonical", a control), counted against the canonical device expf.
CensusResult expf_census(const std::string& kind, uint64_t lo, uint64_t hi);

// Decode tables computed on the device: e4m3 of all 256 codes by the path the engine uses, e2m1
// (16 codes, scale 1) and e8m0 (256 codes).
std::vector<float> decode_table_device(const std::string& which);

// Y[t][r] = cdot(W[r], X[t]) on the device through the engine's linear kernels (weights.cu): `kernel`
// "auto" (the engine's choice), "staged" (the shared-memory one-token kernel; refused where it does not
// apply; "staged:LPT:XS[:RPB:CPS]" forces its variant) or "register"; expert: through the routed-expert path (the matrix as one expert, each token
// row a work item). release "bf16" | "f32" | "fp8" | "mxfp4" with the checkpoint's layouts. decode (fp8):
// "auto" (the engine's choice), "sw", "hw" (the e4m3x2 conversion) or "int" (bit placement; NaN-free weights).
// heads (dense, as MLA's W_UK^T and W_UV): out_rows output rows by heads of rh, output row r from weight row
// (r / rh) hstride + woff + r % rh and x columns (r / rh) xhs + [0, C) of X's ldx; R is then the weight rows.
struct LinHeads {
    int64_t out_rows = 0, rh = 0, hstride = 0, woff = 0, xhs = 0, ldx = 0;
};
std::vector<float> linear_device(const std::string& release, const void* data, size_t data_bytes, const void* scale,
                                 size_t scale_bytes, int64_t R, int64_t C, const float* X, int T, bool round,
                                 const std::string& kernel, bool expert, const std::string& decode = "auto",
                                 const LinHeads* heads = nullptr);
// The one-token kernel chosen per shape by timing the candidates on first use (weights.cu), with the
// microseconds each candidate took.
struct TunedShape {
    std::string fmt, decode, choice;
    int64_t R = 0, C = 0;
    int expert_items = 0;
    int tables = 1;  // 2: two matrices in one launch (the experts' gate and up)
    bool heads = false;
    std::vector<std::pair<std::string, float>> us;
};
std::vector<TunedShape> tuned_shapes();

// Median device microseconds of one such launch over `reps` (weights made on the device; experts > 0:
// that many distinct expert matrices, one pair each, as decode at batch 1).
double linear_bench_device(const std::string& release, int64_t R, int64_t C, int experts, const std::string& kernel,
                           int reps, const std::string& decode = "auto");

// Median device microseconds (two untimed passes, L2 evicted before each timed one) of one linear launch
// over T token rows (experts > 0: that many expert matrices, each token routed to topk of them, the pairs
// grouped by expert into the engine's work items). kernel as linear(): 'auto', 'tiled', 'gemm', ...
double linear_bench_tokens_device(const std::string& release, int64_t R, int64_t C, int T, int experts, int topk,
                                  const std::string& kernel, int reps, const std::string& decode = "auto");
// The device's FP32 FMA rate (FLOP/s: 2 per FMA) from independent FMA chains, median of reps launches.
double ffma_peak_device(int reps);

// The argmax of n floats on the device (the greedy rule of Engine::greedy), for tests.
std::vector<int> argmax_device(const float* host, int n, int rows);
// The bounded head over lm_head rows w_bits ([R][C] BF16 bits) and x ([n][C] f32) on the device
// (head_bound.cu): each (token, row)'s interval [lo, hi] ([n][R]), the greedy tokens, the flag (set: the
// bounds could not decide, the tokens are not to be used) and each token's candidate count; usable is
// false (and nothing else is set) where a weight is not finite.
struct HeadBoundRun {
    bool usable = false;
    std::vector<float> lo, hi;
    std::vector<int> tokens, counts;
    int flag = 0;
};
HeadBoundRun head_bound_device(const uint16_t* w_bits, int R, int C, const float* x, int n);
// Its constants: |q| <= 2^q_bits, candidates a token keeps, the fewest greedy rows of a step it takes.
struct HeadBoundLimits {
    int q_bits, cap, min_rows;
};
HeadBoundLimits head_bound_limits();
// The greedy token of n floats and its log-probability as a step's want_head 3 computes them, for tests.
std::pair<int, float> argmax_logprob_device(const float* host, int n);

// Page-locked host memory (cudaMallocHost / cudaFreeHost): the bindings hand decode-sized logits back
// in it, so the device writes them straight into the returned array.
void* host_pinned_alloc(size_t bytes);
void host_pinned_free(void* p) noexcept;

}  // namespace glm::cuda
