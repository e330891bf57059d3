// The CPU engine: the model executor over the canonical numerics (docs/numerics.md).
//
// One call, Engine::step, runs one forward step for a whole batch of token rows (rows of several
// sequences, each sequence's rows consecutive and in position order: a prefill chunk, or one decode
// token). Layer by layer, every stage is computed for all rows at once; each module lives in its
// own file with the oracle's stage names (mhc.cpp, norm.cpp, kda.cpp, mla.cpp, indexer.cpp, moe.cpp,
// head.cpp; model.cpp holds the step). A stage's value for one (layer, position) is a pure function
// of the weights and the tokens up to that position: which other rows share the step, how the
// prompt was chunked and how many threads run never enter the arithmetic.
//
// Stage values pass through Step::emit right after they are computed: it applies the optional
// fault injection (one element, +ulps on its bit pattern) and records the row when the caller asked
// for a capture of that (layer, stage).
#pragma once

#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "../engine_types.hpp"
#include "../state_io.hpp"
#include "cdot.hpp"
#include "ep.hpp"
#include "expf.hpp"
#include "threadpool.hpp"
#include "weights.hpp"

namespace glm::cpu {

// ---- configuration (bindings/engine_types.hpp) ---------------------------------------------------

using glm::EngineConfig;
using glm::SDType;
using glm::Stage;
using glm::kStages;
using glm::stage_by_name;
using glm::Injection;
using glm::CaptureRecord;
using glm::StepOutput;
using glm::StateTensor;

// ---- non-canonical switches (for demonstrating what the diff tool localizes) --------------------

struct Numerics {
    bool seq_dot = false;     // dot="sequential": a plain left-to-right sum instead of cdot, everywhere
    bool native_exp = false;  // expf="native": a fast polynomial exp instead of the canonical expf

    float dot(const float* a, const float* b, size_t n) const;
    double dot64(const double* a, const double* b, size_t n) const;
    float sum(const float* x, size_t n) const;     // csum
    double sum64(const double* x, size_t n) const;  // csum64
    float exp(float x) const { return native_exp ? fast_expf(x) : glm::cpu::expf(x); }
    float sigmoid(float x) const { return 1.0f / (1.0f + exp(-x)); }
    float silu(float x) const { return x / (1.0f + exp(-x)); }
    // Eight lanes at once, lane by lane the same operations (H2's expf8 is bit-identical to expf).
    __m256 exp8(__m256 x) const {
        if (!native_exp) return expf8(x);
        alignas(32) float v[8];
        _mm256_store_ps(v, x);
        for (float& e : v) e = fast_expf(e);
        return _mm256_load_ps(v);
    }
    __m256 sigmoid8(__m256 x) const {
        const __m256 one = _mm256_set1_ps(1.0f);
        return _mm256_div_ps(one, _mm256_add_ps(one, exp8(neg8(x))));
    }
    __m256 silu8(__m256 x) const {
        return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(neg8(x))));
    }
    static __m256 neg8(__m256 x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }
    static float fast_expf(float x);
};

// ---- weights ------------------------------------------------------------------------------------

struct HcWeights {  // one mHC site
    std::vector<double> fn;    // [(2+hc)*hc][hc*D]
    std::vector<double> base;  // [(2+hc)*hc]
    double scale[3] = {0, 0, 0};
};

struct KdaWeights {
    Lin q_proj, k_proj, v_proj, f_a, f_b, b_proj, g_a, g_b, o_proj;
    std::vector<float> conv;        // [3P][K]: q | k | v channels
    std::vector<float> conv_t;      // [K][3P]: the same taps transposed (eight channels per load)
    std::vector<float> dt_bias;     // [P]
    std::vector<float> A_log;       // [H]
    std::vector<float> decay_rate;  // [H] expf(A_log) (with the engine's exp)
    std::vector<float> o_norm;      // [d]
};

struct MlaWeights {
    Lin q_a, q_b, kv_a, kv_b, o_proj;
    std::vector<float> q_a_norm, kv_a_norm;
    std::vector<float> w_uk_t;  // [nh][r_kv][d_n]: W_UK_h transposed, decoded exactly
    bool has_indexer = false;
    Lin wq_b, wk, weights_proj, kpool_gate;
    std::vector<float> k_norm_w, k_norm_b;  // [d_i]
    std::vector<float> ape;                 // [kp][d_i]
};

struct FfnWeights {
    bool moe = false;
    Lin gate, up, down;  // dense SwiGLU
    Lin router;          // [E][D]
    std::vector<float> bias;
    std::vector<Lin> e_gate, e_up, e_down;  // routed experts
    Lin s_gate, s_up, s_down;               // shared expert
};

struct LayerWeights {
    HcWeights attn_hc, ffn_hc;
    std::vector<float> attn_norm, ffn_norm;
    bool kda = false;
    KdaWeights k;
    MlaWeights m;
    FfnWeights f;
};

// ---- per-sequence state (the cache) -------------------------------------------------------------

struct KdaState {
    std::vector<float> conv_tail;  // [K-1][3P] the last K-1 pre-conv rows, oldest first (+0 before position 0)
    std::vector<float> S;          // [H][d (j)][d (i)]: S[h][i][j] stored transposed, columns contiguous
};

struct MlaState {
    std::vector<float> c;          // [len][r_kv] the latent cache (mla.c)
    std::vector<float> k, gate;    // [len][d_i] indexer.k, indexer.gate
    std::vector<float> pool_keys;  // [n_pools][d_i] keys of complete pools
};

struct Sequence {
    int64_t length = 0;
    bool broken = false;        // a step failed half-way through this sequence: its state is unusable
    std::vector<KdaState> kda;  // by layer (empty entries for MLA layers)
    std::vector<MlaState> mla;  // by layer (empty entries for KDA layers)
};

// ---- capture and injection ----------------------------------------------------------------------

class Engine;

struct Segment {
    Sequence* seq;
    size_t t0, n;  // rows [t0, t0 + n) of the step
    int64_t pos0;  // position of row t0
};

// The context of one step, handed to every module.
struct Step {
    const Engine& E;
    const EngineConfig& c;
    ThreadPool& pool;
    const Numerics& nm;
    size_t T = 0;
    std::vector<Segment> segs;
    std::vector<int64_t> pos;       // [T] position of each row
    std::vector<uint32_t> seg_of;   // [T] segment of each row
    std::vector<uint8_t> cap_row;   // [T] rows whose values may be captured
    std::vector<uint8_t> cap_mask;  // [(L+1) * S_COUNT]
    Injection inj;
    StepOutput* out = nullptr;
    std::mutex cap_mutex;

    Step(const Engine& e, ThreadPool& p, const Numerics& n);

    bool wants(int layer, int stage) const {
        return cap_mask[static_cast<size_t>(layer) * S_COUNT + stage] != 0;
    }
    bool wants_row(int layer, int stage, size_t t) const { return cap_row[t] && wants(layer, stage); }
    // The injection hits (layer, stage) at row t: returns the element index, or -1.
    int64_t inject_element(int layer, int stage, size_t t) const {
        return (inj.active && inj.layer == layer && inj.stage == stage && inj.pos == pos[t]) ? inj.element : -1;
    }
    // Apply the injection to elements [off, off + n) of row t of a stage held in f32 (F32 or BF16).
    void inject_f32(int layer, int stage, size_t t, float* p, size_t off, size_t n);
    void inject_f64(int layer, int stage, size_t t, double* p, size_t off, size_t n);
    // Injection + capture of one row.
    void emit(int layer, int stage, size_t t, float* p, std::vector<int64_t> shape);
    void emit64(int layer, int stage, size_t t, double* p, std::vector<int64_t> shape);
    // int32 stages (mla.selected, moe.selected): an injection adds ulps to the integer itself.
    void emit_i32(int layer, int stage, size_t t, int32_t* p, std::vector<int64_t> shape);
    // Capture only (the injection was applied where the value was computed).
    void capture(int layer, int stage, size_t t, const void* p, size_t elem_bytes, std::vector<int64_t> shape);
    // emit() for rows [0, T) of a [T][n] array with row stride ld.
    void emit_rows(int layer, int stage, float* p, size_t n, size_t ld, std::vector<int64_t> shape);

    // ---- shared building blocks (norm.cpp, model.cpp) ----
    // Y[t][r] = cdot(W[r], X[t]) (+ bf16 rounding when round), rows split over the pool.
    void linear(const Lin& W, const float* X, size_t ldx, float* Y, size_t ldy, bool round, size_t rows) const;
    void linear(const Lin& W, const float* X, size_t ldx, float* Y, size_t ldy, bool round) const {
        linear(W, X, ldx, Y, ldy, round, T);
    }
};

// RMSNorm and friends (norm.cpp)
void rms_norm_row(const Numerics& nm, const float* x, size_t n, const float* w, float eps, float* y);
void rms_norm_rows(Step& s, const float* X, size_t rows, size_t n, const float* w, float eps, float* Y);
void layer_norm_row(const Numerics& nm, const float* x, size_t n, const float* w, const float* b, float eps,
                    float* y);

// Modules
void hc_site(Step& s, int layer, bool ffn, const HcWeights& w, const float* X, double* pre, double* post,
             double* comb, float* collapsed);                                                         // mhc.cpp
void hc_expand(Step& s, int layer, bool ffn, float* X, const float* u, const double* post, const double* comb);
void kda_forward(Step& s, int layer, const KdaWeights& w, const float* x, float* out);                // kda.cpp
using Selection = std::vector<std::vector<int32_t>>;
void mla_forward(Step& s, int layer, const MlaWeights& w, const float* x, float* out, Selection& sel);  // mla.cpp
void indexer_select(Step& s, int layer, const MlaWeights& w, const float* x, const float* q_lat,
                    Selection& sel);                                                                   // indexer.cpp
void swiglu(Step& s, const Lin& gate, const Lin& up, const Lin& down, const float* x, size_t ldx, size_t rows,
            float* y, int cap_layer);                                                                  // moe.cpp
void moe_forward(Step& s, int layer, const FfnWeights& w, const float* x, float* out);
void head_forward(Step& s, const float* X, const std::vector<size_t>& rows, float* logits);            // head.cpp

// ---- the engine ---------------------------------------------------------------------------------

class Engine {
   public:
    // inline_work: jobs below this many multiply-adds run on the calling thread (0: split every job;
    // the tests use it to exercise the threads on tiny models).
    Engine(const EngineConfig& cfg, unsigned threads, Numerics nm, size_t inline_work = ThreadPool::kInlineWork);

    const EngineConfig& config() const { return cfg_; }
    const Numerics& numerics() const { return nm_; }
    unsigned threads() const { return pool_->size(); }

    // Register one tensor by its role (oracle/names.py) and layer/expert (-1: none), in its stored
    // release format ("bf16", "f32", "fp8", "mxfp4"), with its logical shape. The bytes must stay
    // alive as long as the engine (the bindings keep the arrays).
    void add_tensor(const std::string& role, int layer, int expert, const std::string& release, const void* data,
                    const void* scale, const std::vector<int64_t>& shape, const std::vector<int64_t>& data_shape,
                    const std::vector<int64_t>& scale_shape);
    void finalize();  // every tensor present, small tensors decoded

    int64_t new_sequence();
    int64_t fork_sequence(int64_t id);
    void free_sequence(int64_t id);
    int64_t sequence_length(int64_t id) const;
    // Room for `positions` positions in every MLA layer's cache, allocated now (no growth below it).
    void reserve_sequence(int64_t id, int64_t positions);
    // Bytes the sequence's state holds (the capacity of its buffers, not only what is filled).
    int64_t sequence_bytes(int64_t id) const;
    // The sequence's state in the canonical layout (bindings/state_io.hpp), and its length.
    std::vector<StateTensor> export_sequence(int64_t id, int64_t& length) const;
    // A new sequence of `length` positions holding the given state (checked against the layout first:
    // std::invalid_argument naming the tensor) -> its id.
    int64_t import_sequence(const std::vector<StateTensor>& arrays, int64_t length);
    size_t live_sequences() const {
        std::lock_guard<std::mutex> lk(mu_);
        return seqs_.size();
    }

    // One forward step. seq_ids/tokens: one entry per row; rows of one sequence consecutive.
    // want_head: rows whose logits are wanted; cap_rows: rows whose stages may be captured;
    // cap_mask: [(L+1) * S_COUNT] wanted (layer, stage) pairs.
    void step(const std::vector<int64_t>& seq_ids, const std::vector<int32_t>& tokens,
              const std::vector<uint8_t>& want_head, const std::vector<uint8_t>& cap_rows,
              const std::vector<uint8_t>& cap_mask, const Injection& inj, StepOutput& out);

    // weights (read by the modules)
    std::vector<LayerWeights> layers;
    Lin embed, lm_head;
    std::vector<float> final_norm;

    // Streamed bytes of the weights a decode token reads (for the benchmark).
    size_t weight_bytes() const;

    // Expert parallelism (ep.hpp, docs/ep.md): this rank's expert range and the exchange hook.
    // Set the partition before add_tensor (only the owned experts are registered and required).
    // Mutable: the step (const modules) counts its exchanges in ep.stats.
    void set_expert_partition(const ExpertPartition& p);
    mutable ExpertParallel ep;

   private:
    void run_step(Step& s, const std::vector<int32_t>& tokens, const std::vector<uint8_t>& want_head,
                  StepOutput& out) const;
    Sequence make_sequence() const;
    void check_hw() const;

    EngineConfig cfg_;
    Numerics nm_;
    std::unique_ptr<ThreadPool> pool_;
    std::map<int64_t, std::unique_ptr<Sequence>> seqs_;
    int64_t next_id_ = 1;
    bool finalized_ = false;
    std::map<std::string, int> have_;  // registered tensors by key
    mutable std::mutex mu_;            // one step (or sequence operation) at a time
};

}  // namespace glm::cpu
