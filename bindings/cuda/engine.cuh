// The CUDA engine's internals: stages, device weights, per-sequence device state, and the step
// context handed to every module (mhc.cu, norm.cu, kda.cu, mla.cu, indexer.cu, moe.cu, head.cu;
// model.cu holds the executor, load.cu the weights registration, memory.cu the device memory,
// numerics_api.cu the numerics entry points). The structure follows the CPU engine
// (bindings/cpu/engine.hpp) module for module and stage for stage.
//
// One step runs every row of a batch (rows of several sequences, each sequence's rows consecutive
// and in position order) through all layers as a sequence of kernel launches on one stream; the
// host only enqueues. Stage values pass through Step::emit right after they are computed: it applies
// the optional fault injection (a one-element kernel) and copies the rows asked for back to the host.
#pragma once

#include <initializer_list>
#include <map>
#include <string>
#include <memory>
#include <vector>

#include "engine_api.hpp"
#include "weights.cuh"

namespace glm::cuda {

// The stages (enum Stage, kStages) are bindings/engine_types.hpp's, shared with the CPU engine.

// ---- device memory --------------------------------------------------------------------------------

// Owning device allocation.
struct DBuf {
    void* p = nullptr;
    size_t n = 0;
    DBuf() = default;
    explicit DBuf(size_t bytes);
    DBuf(DBuf&& o) noexcept : p(o.p), n(o.n) {
        o.p = nullptr;
        o.n = 0;
    }
    DBuf& operator=(DBuf&& o) noexcept;
    DBuf(const DBuf&) = delete;
    DBuf& operator=(const DBuf&) = delete;
    ~DBuf();
    template <class T>
    T* as() const {
        return static_cast<T*>(p);
    }
};

// Freed sequences' state buffers, kept for the next sequences: a new sequence's KDA state, an MLA cache's
// growth and a fork's copies take a kept buffer of the same size before cudaMalloc. A prefill into a new
// cache paid six cudaMalloc and six cudaFree (~0.5 ms of host time with the device idle; cudaFree waits for
// the device): docs/perf.md, "Session 33". Reuse follows stream order: every use of a sequence's state is
// on the legacy stream (or the side stream forked from it), so a buffer's next owner's work comes after its
// last owner's. At most kCap bytes are kept; an allocation that fails empties the pool and tries again.
class BufPool {
   public:
    static constexpr size_t kCap = size_t{2} << 30;
    DBuf take(size_t bytes);  // a kept buffer of exactly `bytes`, else a new one (contents undefined)
    void give(DBuf&& b);      // kept while under kCap, else freed
    void clear();
    size_t bytes() const { return bytes_; }

   private:
    std::multimap<size_t, DBuf> free_;
    size_t bytes_ = 0;
};

// Bump allocator over large device chunks (weights: allocated once, freed with the engine).
class Arena {
   public:
    void* alloc(size_t bytes);
    size_t used() const { return used_; }

   private:
    std::vector<DBuf> chunks_, extra_big_;
    size_t off_ = 0, used_ = 0;
};

// Per-step scratch: device memory and pinned host staging, reset after every step (the step ends
// with a synchronization, so nothing in flight still reads them).
class Scratch {
   public:
    ~Scratch();
    void* dev(size_t bytes);
    template <class T>
    T* d(size_t n) {
        return static_cast<T*>(dev(n * sizeof(T)));
    }
    // Copy host bytes to fresh device scratch through pinned staging (asynchronous, stream order).
    void* upload(const void* host, size_t bytes);
    // Pinned host memory valid until reset() (device-to-host copies at full speed).
    void* pinned(size_t bytes);
    template <class T>
    T* up(const std::vector<T>& v) {
        return static_cast<T*>(upload(v.data(), v.size() * sizeof(T)));
    }
    void reset();
    // Deferred mode (Engine::greedy): steps follow each other without a synchronization, so reset()
    // restarts the device scratch only (stream order makes its reuse safe), keeps the pinned staging
    // (the previous steps' uploads may still be pending) and retires extra buffers until end_deferred(),
    // which the caller runs after synchronizing.
    void begin_deferred() { deferred_ = true; }
    void end_deferred();

   private:
    bool deferred_ = false;
    std::vector<DBuf> retired_;
    DBuf main_;
    std::vector<DBuf> extra_;
    size_t off_ = 0, need_ = 0;
    void* pinned_ = nullptr;
    size_t pinned_cap_ = 0, pinned_off_ = 0, pinned_need_ = 0;
    std::vector<void*> pinned_extra_;
};

// ---- weights --------------------------------------------------------------------------------------

struct HcW {
    double* fn = nullptr;    // [(2+hc)*hc][hc*D]
    double* base = nullptr;  // [(2+hc)*hc]
    double scale[3] = {0, 0, 0};
};

struct KdaW {
    Lin q_proj, k_proj, v_proj, f_a, f_b, b_proj, g_a, g_b, o_proj;
    Lin qkv;  // q | k | v rows as one matrix (joint placement; empty when not placed so)
    Lin fbg;  // f_a | b_proj | g_a rows as one matrix (likewise)
    float* conv = nullptr;     // [3P][K]: q | k | v channels
    float* dt_bias = nullptr;  // [P]
    float* A_log = nullptr;    // [H]
    float* decay = nullptr;    // [H] exp(A_log) with the engine's exp (finalize)
    float* o_norm = nullptr;   // [d]
};

struct MlaW {
    Lin q_a, q_b, kv_a, kv_b, o_proj;
    float* q_a_norm = nullptr;
    float* kv_a_norm = nullptr;
    // [nh*r][dn]: W_UK_h transposed (finalize), in the release's format where that keeps every value:
    // FP8 codes with their 128-blocks' scales transposed, BF16, else the decoded f32
    Lin w_uk_t;
    bool has_indexer = false;
    Lin wq_b, wk, weights_proj, kpool_gate;
    Lin kgw;  // wk | kpool_gate | weights_proj rows as one matrix (joint placement; empty when not)
    float* k_norm_w = nullptr;
    float* k_norm_b = nullptr;
    float* ape = nullptr;  // [kp][d_i]
};

struct FfnW {
    bool moe = false;
    Lin gate, up, down;
    Lin router;
    float* bias = nullptr;
    std::vector<Lin> e_gate, e_up, e_down;  // per expert (host view)
    ExpertTable t_gate, t_up, t_down;       // device pointer tables (finalize)
    Lin s_gate, s_up, s_down;
    Lin s_gu;  // the shared expert's gate and up as one matrix (a joint group; empty when not placed so)
    // The shared expert is entry E of the tables (same format and shape as the routed experts): it runs
    // as more work items of the routed launches instead of three launches of its own (moe.cu).
    bool shared_in_tables = false;
};

struct LayerW {
    HcW attn_hc, ffn_hc;
    float* attn_norm = nullptr;
    float* ffn_norm = nullptr;
    bool kda = false;
    KdaW k;
    MlaW m;
    FfnW f;
};

// ---- per-sequence device state --------------------------------------------------------------------

struct KdaState {
    DBuf conv_tail;  // [K-1][3P] the last K-1 pre-conv rows, oldest first (+0 before position 0)
    DBuf S;          // [H][d (j)][d (i)]: S[h][i][j] stored transposed, columns contiguous
};

struct MlaState {
    int64_t cap = 0;  // positions the buffers hold
    DBuf c;           // [cap][r]   the latent cache (mla.c)
    DBuf k, gate;     // [cap][d_i] indexer.k, indexer.gate
    DBuf pk;          // [cap/kp][d_i] keys of complete pools
};

struct Sequence {
    int64_t length = 0;
    std::vector<KdaState> kda;
    std::vector<MlaState> mla;
};

// Per-segment device pointers of one layer (uploaded per layer and step).
struct SegDev {
    int t0, n;
    int pos0;
    int pad_;
    float* conv;  // KDA
    float* S;
    float* c;     // MLA
    float* k;
    float* gate;
    float* pk;
};

struct Segment {
    Sequence* seq;
    int t0, n;
    int64_t pos0;
};

struct Step;

// ---- modules --------------------------------------------------------------------------------------

// RMSNorm's formulas (docs/numerics.md): inv = 1/sqrtf(ss/n + eps), y = bf16(bf16(x*inv) * w). Used by
// k_rmsnorm and by the mHC fast path, which normalizes the collapsed row it just formed.
GLM_DEV float rms_inv(float ss, int n, float eps) { return fdiv(1.0f, fsqrt(fadd(fdiv(ss, static_cast<float>(n)), eps))); }
GLM_DEV float rms_out(float x, float inv, float w) { return bf16r(fmul(bf16r(fmul(x, inv)), w)); }

void rms_norm_rows(Step& s, const float* X, int64_t ldx, int rows, int n, const float* w, float eps, float* Y,
                   int64_t ldy);                                                                        // norm.cu
void layer_norm_rows(Step& s, const float* X, int rows, int n, const float* w, const float* b, float eps, float* Y);
// The site: pre, post, comb, collapsed; with norm_w, also xn = RMSNorm(collapsed) when the fast path
// ran (returns true; otherwise the caller normalizes).
bool hc_site(Step& s, int layer, bool ffn, const HcW& w, const float* X, double* pre, double* post, double* comb,
             float* collapsed, const float* norm_w, float norm_eps, float* xn);                          // mhc.cu
// The streams after the sublayer (hc_expand): returns the buffer that holds them from now on: X (made in
// place), or spare when the next hc_site's k_hc_mix makes them (few tokens, nothing observing them in
// between; `last`: no next site). hc_flush makes a deferred one now.
float* hc_expand(Step& s, int layer, bool ffn, float* X, float* spare, const float* u, const double* post,
                 const double* comb, bool last);
void hc_flush(Step& s);
void kda_forward(Step& s, int layer, const KdaW& w, const float* x, float* out);                       // kda.cu
void mla_forward(Step& s, int layer, const MlaW& w, const float* x, float* out);                       // mla.cu
void indexer_select(Step& s, int layer, const MlaW& w, const float* x, const float* q_lat);             // indexer.cu
// gate_up: gate and up as one matrix (joint rows), one launch for one row; may be empty.
void swiglu(Step& s, const Lin& gate, const Lin& up, const Lin& down, const float* x, int rows, float* y,
            int cap_layer, const Lin& gate_up = Lin{});                                                 // moe.cu
void moe_forward(Step& s, int layer, const FfnW& w, const float* x, float* out);
void head_forward(Step& s, const float* X, const std::vector<int>& rows, float* logits);               // head.cu
const float* head_normed(Step& s, const float* X, const std::vector<int>& rows);                        // head.cu
void head_logits(Step& s, const float* normed, const std::vector<int>& rows, float* logits);            // head.cu
bool head_bound_applies(Step& s, int rows);                                                                      // head_bound.cu
void head_argmax_bounded(Step& s, const float* normed, int n, int* d_next);  // head_bound.cu: d_next [2n + 1]
// head.cu: the greedy token of each of `rows` rows of n logits, on the device (the segments' winners in
// the step's scratch)
void argmax_into(Step& s, const float* logits, int n, int* out, int rows);
int sm_count();  // weights.cu: streaming multiprocessors of the current device (once)
// head.cu: as argmax_into, and where slot[row] >= 0 (every row when slot is null: slot = row) the token's
// log-probability (oracle.sampling.log_softmax's value, bit for bit; NaN for a row with a NaN or an
// infinity) into lp[slot[row]]
void argmax_logprob_into(const float* logits, int n, int* out, float* lp, const int* slot, int rows);
void embed_rows(Step& s, const Lin& embed, int* d_tok, float* e, float* X);                                        // head.cu

// Small elementwise kernels shared by the modules (norm.cu).
// Append rows [T][n] into each row's sequence cache at its position (which: 0 = mla.c, 1 = indexer.k,
// 2 = indexer.gate) (mla.cu).
void append_rows(Step& s, int layer, const float* src, int64_t lds, int n, int which);
void copy_rows(const float* src, int64_t lds, float* dst, int64_t ldd, int rows, int n);
// Matrices that read the same x (rounded to BF16 like every projection): out[i] = lin(members[i], x),
// [T][R_i] each. For one token, one launch when they are placed as one matrix (joint, rows in member
// order; its row of outputs is then the members' outputs one after the other), else a launch each
// (model.cu).
void linear_same_x(Step& s, const Lin& joint, std::initializer_list<const Lin*> members, const float* x,
                   int64_t ldx, float** out);
void inject_value(void* p, int dtype, int64_t ulps);  // one element, bits + ulps in its dtype

// ---- the step context -----------------------------------------------------------------------------

struct EngineCore;  // weights, sequences, options (below)
constexpr int kMaxRanks = 8;  // expert parallelism: ranks of one host (EpBounds holds their ranges by value)

struct Step {
    EngineCore& E;
    const Config& c;
    Nm nm;
    bool hw8 = true;
    int T = 0;
    std::vector<Segment> segs;
    std::vector<int64_t> pos;     // [T]
    std::vector<int> seg_of;      // [T]
    std::vector<uint8_t> cap_row;
    std::vector<uint8_t> cap_mask;
    Injection inj;
    StepOutput* out = nullptr;
    Scratch& scratch;
    int* d_pos = nullptr;         // [T] device positions
    int* d_seg = nullptr;         // [T] device segment of each row

    // MLA selection of the current (or last full) layer: positions per row, ascending, flat.
    std::vector<int64_t> sel_off, sel_n;  // host: offset and count of each row's selection
    int64_t sel_total = 0;
    int* d_sel = nullptr;                 // device [sel_total]
    int64_t* d_sel_off = nullptr;         // device [T]
    int* d_sel_n = nullptr;               // device [T]
    bool have_sel = false;
    bool sel_dense = false;  // every row's selection is every position it sees, in order (indexer_select)

    // An hc_expand deferred into the next site's k_hc_mix (mhc.cu): the streams before it, their buffer
    // after it, the sublayer's output, post and comb; in == nullptr when none.
    struct HcPending {
        const float* in = nullptr;
        float* out = nullptr;
        const float* u = nullptr;
        const double* post = nullptr;
        const double* comb = nullptr;
    };
    HcPending hc_pending;

    Step(EngineCore& e, Scratch& sc);

    bool wants(int layer, int stage) const { return cap_mask[static_cast<size_t>(layer) * S_COUNT + stage] != 0; }
    bool wants_any(int layer, int stage) const;  // some row of the step is captured at (layer, stage)
    bool injects(int layer, int stage) const { return inj.active && inj.layer == layer && inj.stage == stage; }
    // Row t is hit by the injection at (layer, stage): the element index, or -1.
    int64_t inject_element(int layer, int stage, int t) const {
        return (inj.active && inj.layer == layer && inj.stage == stage && inj.pos == pos[static_cast<size_t>(t)])
                   ? inj.element
                   : -1;
    }
    // Injection + capture of rows [0, T) of a [T][ld] device array (f32 for F32/BF16 stages, f64 for
    // F64, i32 for I32) with per-row shape `shape`.
    void emit(int layer, int stage, void* p, int64_t ld, const std::vector<int64_t>& shape);
    // Rows of different sizes: row t starts at off[t] and has shape shapes[t].
    void emit_var(int layer, int stage, void* p, const std::vector<int64_t>& off,
                  const std::vector<std::vector<int64_t>>& shapes);
    // emit() for a subset of the step's rows: buffer row r holds step row rows[r] (the head).
    void emit_rows(int layer, int stage, void* p, int64_t ld, const std::vector<int64_t>& shape,
                   const std::vector<int>& rows);
    // Capture only (no injection) of rows [0, T) of a [T][ld] array.
    void capture(int layer, int stage, const void* p, int64_t ld, const std::vector<int64_t>& shape);
    // The per-segment device table of one layer.
    SegDev* seg_table(int layer);

    // Stage timing (set_timing): brackets of events named by module.
    void mark(const char* name);

    std::vector<SegDev*> seg_cache_;  // per layer, uploaded on first use in this step
};

// ---- the engine core --------------------------------------------------------------------------------

// A second stream for work off the critical path (the mHC Sinkhorn): fork() orders it after the main
// stream's work so far and returns it; join_later() marks its work so far; join() makes the main
// stream wait for that (once). The main stream is the legacy default stream; this one is non-blocking.
class SideStream {
   public:
    SideStream() = default;
    SideStream(const SideStream&) = delete;
    SideStream& operator=(const SideStream&) = delete;
    ~SideStream();
    cudaStream_t fork();
    void join_later();
    void join();

   private:
    cudaStream_t s_ = nullptr;
    cudaEvent_t fork_ = nullptr, join_ = nullptr;
    bool pending_ = false;
};

// The options of the engine call in progress on this thread (its launches read pdl, tune and
// stream_early through launch_options(); defaults outside engine calls, e.g. the test entry points).
const EngineOptions& launch_options();
class ActiveOptions {
   public:
    explicit ActiveOptions(const EngineOptions& o);
    ~ActiveOptions();
    ActiveOptions(const ActiveOptions&) = delete;
    ActiveOptions& operator=(const ActiveOptions&) = delete;

   private:
    const EngineOptions* prev_;
};

// The bounded head's one-byte lm_head and row statistics (head_bound.cu), made on first use.
struct HeadBound {
    bool tried = false, usable = false;
    int KS = 0;          // 32-column steps of a row
    DBuf wq, sw, n2, e2, l1;  // h in fragment order; per row: s_w, ||w||_2, ||e||_2, ||w^||_1
    double n2max = 0.0;  // the largest ||w||_2
    Engine::HeadBoundStats stats;
};

struct EngineCore {
    Config cfg;
    EngineOptions opts;
    Nm nm;
    bool hw8 = true;
    std::string decode_path = "software";
    Arena arena;
    std::vector<LayerW> layers;
    Lin embed, lm_head;
    HeadBound head_bound;
    float* final_norm = nullptr;
    BufPool state_pool;  // (before seqs: a sequence's buffers are freed, at the engine's end, before the pool's)
    std::map<int64_t, std::unique_ptr<Sequence>> seqs;
    int64_t next_id = 1;
    bool finalized = false;
    std::map<std::string, int> have;
    std::vector<DBuf> tables;  // expert pointer tables
    SideStream side;
    // Weights that read the same x, placed as consecutive rows of one matrix (data, and scales in the
    // same order) so that one launch computes them all: the slot of each (layer, group) (load.cu).
    struct JointSlot {
        int fmt = -1;
        int64_t C = 0, total = 0;
        std::vector<int64_t> off, rows;
        std::vector<uint8_t> have, int_decode;
        char* data = nullptr;
        char* scale = nullptr;
    };
    std::map<std::pair<int, std::string>, JointSlot> joints;
    // expert parallelism (moe.cu: ep_exchange): this rank's share of the routed experts and the hook
    struct Ep {
        ExpertPartition part;
        std::shared_ptr<DeviceExchangeFn> hook;  // required when part.distributed()
        EpStats stats;
    } ep;
    DBuf ep_bad;               // set by k_ep_unpack when a rank's own rows came back altered
    int* ep_flag();            // (allocated and zeroed on first use)
    void ep_check();           // after a step's synchronization: throws (and clears) when set
    DBuf tickets;              // per-token counters of the mHC fast path (zero between launches)
    unsigned* hc_tickets(int T);
    Scratch scratch;
    // timing
    bool timing = false;
    std::vector<std::pair<std::string, cudaEvent_t>> marks;
    std::map<std::string, double> stage_ms;
    std::vector<std::string> stage_order;
    std::vector<cudaEvent_t> event_pool;
    size_t event_next = 0;

    int E() const { return static_cast<int>(cfg.n_routed_experts); }
};

// The engine's state behind its host interface (engine_api.hpp): model.cu, load.cu.
struct Engine::Impl : EngineCore {};

}  // namespace glm::cuda
