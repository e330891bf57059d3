// Device weights in their release format and the linear layer over them (weights.cu).
//
// A Lin is a view of rows [row0, row0 + R) of one stored [*, C] tensor on the device: BF16 bits, F32,
// FP8 E4M3 codes with block-128 f32 scale_inv, or MXFP4 nibbles with E8M0 scales per 32 columns.
// linear() computes Y[t][r] = cdot(W[r], X[t]) (optionally rounded to BF16) for every token row,
// decoding the weights in registers inside the dot: eight threads per output row, thread g reads
// columns 64c + 8g .. 64c + 8g + 7 of chunk c (one 8-, 16- or 4-byte load), decodes them, and FMAs
// them into its eight lane accumulators for each of up to TT token rows; then group_fold.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "cdot.cuh"
#include "expf.cuh"
#include "formats.cuh"

namespace glm::cuda {

enum WFmt : int { W_BF16 = 0, W_F32 = 1, W_FP8 = 2, W_MXFP4 = 3 };

const char* wfmt_name(int f);
int parse_release(const std::string& release);  // "bf16" | "f32" | "fp8" | "mxfp4" -> WFmt

// Stored bytes of one row, and of the scales of `rows` rows (FP8: the 128-row blocks they span).
__host__ __device__ inline int64_t row_bytes(int fmt, int64_t C) {
    return fmt == W_BF16 ? 2 * C : (fmt == W_F32 ? 4 * C : (fmt == W_FP8 ? C : C / 2));
}
inline int64_t scale_bytes(int fmt, int64_t rows, int64_t C) {
    return fmt == W_FP8 ? ((rows + 127) / 128) * ((C + 127) / 128) * 4 : (fmt == W_MXFP4 ? rows * (C / 32) : 0);
}

struct Lin {
    int fmt = W_BF16;
    int64_t R = 0, C = 0;
    int64_t row0 = 0;
    const void* data = nullptr;   // device
    const void* scale = nullptr;  // device
    bool int_decode = false;      // fp8: the integer decode applies (no NaN code, every scale below 2^8);
                                  // mxfp4: the placement decode applies (every scale at most 240)
    bool empty() const { return data == nullptr; }
    Lin rows(int64_t r0, int64_t n) const {
        Lin v = *this;
        v.row0 = row0 + r0;
        v.R = n;
        return v;
    }
    size_t bytes() const;  // stored bytes of this view's rows (+ scales)
};

// A routed-expert weight of one layer: the same format and shape for every expert, one pointer each.
struct ExpertTable {
    int fmt = W_BF16;
    int64_t R = 0, C = 0;
    const void* const* data = nullptr;   // device array [E]
    const void* const* scale = nullptr;  // device array [E]
    bool int_decode = false;             // fp8: the integer decode applies to every expert
    int E = 0;                           // entries (the routed experts, and the shared one where it is an entry)
};

// Which one-token kernel a launch uses: a kind of weights.cu's kernel table (kLinKernels, which names,
// parses, applies and launches each kind and lists its tuning variants) and the variant's parameters.
enum class LinKind : int {
    Auto = 0,  // the engine's choice (the measured one, weights.cu: tuned_choice)
    Register,  // k_linear: eight threads per row, weights decoded in registers
    Staged,    // k_linear_st: rows staged through shared memory
    Tiled,     // k_linear_mt with one token
    RegOcc,    // k_linear bounded to bps (5 or 6) blocks per SM
    Wide,      // k_linear_wide: lpt (4 or 2) lanes per thread
    Stream,    // k_linear_stream: persistent warps, bps (1, 2 or 3) blocks per SM
    Gemm,      // k_linear_gemm: several tokens, register tiles of rows x tokens x chains (never one token)
    Lanes,     // k_linear_lanes: dense, several tokens, one lane's chains at a time (never one token)
    Pairs,     // k_linear_pairs: FP8 routed-expert items of up to 8 pairs, weights decoded into registers
};
struct LinChoice {
    LinKind kind = LinKind::Auto;
    int lpt = 0;   // staged: 8, 4 or 2 lanes of one accumulator per thread (0: 8); wide: 4 or 2
    int xs = -1;   // staged: stage x too (1) or read it through L1 (0); stream: x staged per block (1)
    int rpb = 0;   // staged: rows per block (0: the engine's)
    int cps = 0;   // staged: chunks per stage (0: the engine's)
    int bps = 0;   // register:occ, stream: blocks per SM
    int dec = -1;  // another exact decode path (weights.cu: Dec) than the launch's, or -1
};

// Everything one linear launch needs (passed by value to the kernel).
struct LinArgs {
    int fmt = W_BF16;
    int64_t C = 0;
    const void* data = nullptr;
    const void* scale = nullptr;
    int64_t row0 = 0;
    int R = 0;                                 // output rows
    int rh = 1 << 30;                          // rows per head (output row r belongs to head r / rh)
    int64_t hstride = 0, woff = 0;             // weight row of r: row0 + (r/rh)*hstride + woff + r%rh
    const float* X = nullptr;
    int64_t ldx = 0, xhs = 0;                  // x of (row r, token t): X + t*ldx + (r/rh)*xhs
    float* Y = nullptr;
    int64_t ldy = 0;                           // Y[t*ldy + r]
    int T = 0;
    bool round = true;
    // routed experts: work items (expert, first pair, pairs) over pairs grouped by expert
    const void* const* dtab = nullptr;
    const void* const* stab = nullptr;
    const int* items = nullptr;                // [max_items][3]
    const int* n_items = nullptr;              // device scalar
    const int* pairs = nullptr;                // pair ids (t*k + j)
    int xdiv = 1;                              // x row of pair p: X + (p / xdiv) * ldx; y row: Y + p*ldy
    int p_split = 1 << 30;                     // pairs p >= p_split (the shared expert's) read x row p - p_split
    // a second matrix over the same x and work list (gate and up in one launch): the blocks of
    // blockIdx.z == 1 take its tables and write Y2 (same ldy)
    const void* const* dtab2 = nullptr;
    const void* const* stab2 = nullptr;
    float* Y2 = nullptr;
    int max_items = 0;
    int item0 = 0, item_count = 1 << 30;       // the lane-pass kernel's launch: items item0 .. + item_count
    int lanes_group = 0;                       // ... and its items per launch (0: as many as kLanesItemsGroup floats)
    int tile_pairs = 1;                        // pairs per work item (at most)
    int experts = 0;                           // expert launches: the tables' entries (the few-pair kernel's rule)
    bool no_staged = false;                    // keep the register kernel (tests compare the two)
    LinChoice choice;                          // a kernel forced by a test or benchmark
    int dec = 0;                               // fp8 / mxfp4 decode path (weights.cu: Dec)
    bool hw8 = false;                          // the hardware E4M3 conversion may replace the integer decode
    bool early = false;                        // streaming kernel, dense: first weights before the PDL wait
};

// True when every one of the n E8M0 scales (host) is at most 240: the MXFP4 placement decode folds 2^14
// into the scale (weights.cu, e8m0_folded).
bool mxfp4_scales_foldable(const uint8_t* scale, size_t n);
// True when no byte of the n at `data` (device) is an E4M3 NaN code (0x7F, 0xFF).
bool e4m3_nan_free_device(const void* data, size_t n);
// True when every one of the n scales (host) times 2^120 is finite: the integer FP8 decode folds 2^120
// into the scale (weights.cu, scale_fp8).
bool fp8_scales_foldable(const float* scale, size_t n);

// Y = W X for T token rows. hw8: decode E4M3 with the hardware conversion.
void linear(const Lin& W, const float* X, int64_t ldx, float* Y, int64_t ldy, int T, bool round, const Nm& nm,
            bool hw8);
// Head-blocked: output r uses weight row row0 + (r/rh)*hstride + woff + r%rh and x offset (r/rh)*xhs.
void linear_heads(const Lin& W, int R, int rh, int64_t hstride, int64_t woff, const float* X, int64_t ldx,
                  int64_t xhs, float* Y, int64_t ldy, int T, bool round, const Nm& nm, bool hw8);
// Routed experts: for each work item, rows [0, R) of expert e applied to its pairs. Pair p reads x row
// p / xdiv below p_split and p - p_split from there on.
void linear_experts(const ExpertTable& W, const int* items, const int* n_items, int max_items, const int* pairs,
                    const float* X, int64_t ldx, int xdiv, int p_split, float* Y, int64_t ldy, int tile,
                    const Nm& nm, bool hw8);

// Pairs per routed-expert work item for T tokens routed to k of E experts (moe.cu and the benchmark's
// items): 1 when the experts average less than half a pair (b8: 64 pairs over 288 experts): the one-token
// kernels, an expert chosen twice read twice. Else 8: an item's weights are read once for its pairs (the
// register-tiled kernel's 64 x 8 tiles, computing the item's pairs rounded up to a power of two; the tiled
// kernel where that does not apply, computing all 8 slots; measured on the H200, slice FP8: b32 3632-3652
// tok/s with 8 against 3237 with 1, b8 1894 against 2207-2340; docs/perf.md "Session 16"). 16 where
// experts_may_take16 and gemm16 (the register-tiled kernel takes the tables: experts_take_gemm): 32 rows x
// 16 pairs a block, each weight decoded once for 16 pairs. Every tile gives the same bits.
int expert_tile(int T, int k, int E, bool gemm16);
// Items of 64 pairs through the lane-pass kernel: every item so only where the engine option expert_tile
// asks (64; their x re-laid per item by the launch: lin_lanes.cuh, k_items_lanes). At prefill 2048 on the slice (top-8 of 288, 57
// pairs an expert) they were slower end to end than items of 16: an item costs its 64 slots whatever it
// holds, and real routing leaves many experts a second, nearly empty item (docs/perf.md, "Session 15").
constexpr int kLanesItem = 64;
// Big items beside small ones (the engine's rule), of `big` pairs: of an expert's c pairs, its whole bigs go
// to items of `big`, and the rest too when they number at least `min`; what remains takes items of the small
// tile. Returns the pairs that go to big items. Two uses (moe.cu):
//   * lane items (option lanes_items, big = kLanesItem) beside items of 16 through the register-tiled kernel,
//     where the experts take items of 16. An item costs its slots whatever it holds, and per slot the
//     lane-pass kernel is the faster (each decoded weight serves 64 pairs, not 16; H200, bench_gemm at 2048
//     tokens: 6 %), so a nearly empty item of 64 is what is kept out: a remainder of 32 or more takes one.
//     (48 until session 41, when 32 and 64 were slower end to end, docs/perf.md "Session 28"; with the
//     16-token lane-pass kernel 32 measured faster: prefill 2048 +0.8 %, 8192 +0.2 %, "Session 41".)
//   * items of 16 (option items16, big = 16) beside items of 8, both through the register-tiled kernel,
//     where the experts take items of 8 (fewer than 16 pairs an expert on average: a 512-token prefill of
//     the real model's 288 experts holds ~14) and those go to the register-tiled kernel, not the few-pair
//     one (experts_take_pairs: MXFP4 always, whose prefill 512 lost 2.8 % with them). Each weight an item
//     of 16 decodes serves 16 pairs, not 8, but an item of 16 computes all its 16 slots where one of 8
//     computes its pairs rounded up to 1, 2, 3, 4, 6 or 8: a remainder under 13 stays in items of 8
//     (per slot, items of 16 cost ~0.88 of items of 8; docs/perf.md, "Session 33").
__host__ __device__ inline int big_item_pairs(int c, int big, int min) {
    const int r = c % big;
    return r >= min ? c : c - r;
}
// True when the lane-pass kernel takes items of 64 pairs of table W with x rows X (ldx floats apart).
bool experts_take_lanes(const ExpertTable& W, const float* X, int64_t ldx);
// Rows as the lane-pass kernel's x: Xp[((l * nch + c) * 8 + g) * ldT + t] = X[t][64c + 8g + l] for t < T,
// 0 for T <= t < ldT (a multiple of 32): a lane's (chunk, chain) values of consecutive rows contiguous.
void x_lanes(const float* X, int64_t ldx, int T, int nch, int64_t ldT, float* Xp);
// Items of 16 pairs where the experts average 16 pairs or more (T * k >= 16 E); below, items of 8 through
// the same kernel were as fast or faster (docs/perf.md, "Session 14").
bool experts_may_take16(int T, int k, int E);
// True when items of 8 pairs of table W with x rows X (ldx floats apart), at most max_items of them, take
// the few-pair kernel (the engine option pairs on, and its rule: lin_pairs.cuh, pairs_chosen).
bool experts_take_pairs(const ExpertTable& W, const float* X, int64_t ldx, int max_items);
// True when the register-tiled kernel takes items of 16 pairs of table W with x rows X (ldx floats
// apart) and the engine option gemm is on.
bool experts_take_gemm(const ExpertTable& W, const float* X, int64_t ldx);

// Two tables over the same pairs (a layer's gate and up): W into Y, W2 into Y2, each row the same
// operations as linear_experts; one launch when the tables share format and shape, else two.
void linear_experts2(const ExpertTable& W, const ExpertTable& W2, const int* items, const int* n_items, int max_items,
                     const int* pairs, const float* X, int64_t ldx, int xdiv, int p_split, float* Y, float* Y2,
                     int64_t ldy, int tile, const Nm& nm, bool hw8);

// One element decoded exactly (any format).
GLM_DEV float decode_elem(int fmt, const void* data, const void* scale, int64_t ar, int64_t col, int64_t C) {
    switch (fmt) {
        case W_BF16: return bf16_to_f32(static_cast<const uint16_t*>(data)[ar * C + col]);
        case W_F32: return static_cast<const float*>(data)[ar * C + col];
        case W_FP8: {
            const uint8_t q = static_cast<const uint8_t*>(data)[ar * C + col];
            const float s = static_cast<const float*>(scale)[(ar / 128) * ((C + 127) / 128) + col / 128];
            return fmul(e4m3_sw(q), s);
        }
        default: {
            const uint8_t b = static_cast<const uint8_t*>(data)[ar * (C / 2) + col / 2];
            const uint32_t nib = (col & 1) ? (b >> 4) : (b & 15u);
            return mxfp4_w(nib, e8m0(static_cast<const uint8_t*>(scale)[ar * (C / 32) + col / 32]));
        }
    }
}

// ---- benchmark timing (weights.cu's kernel benchmarks, the indexer's) --------------------------

// Evict the L2 (a 96 MB memset on the default stream).
void flush_l2();

// The benchmarks' timing: two untimed passes, then the median of `reps` launches (device events), each
// after an L2 eviction when `flush` (decode streams every weight from HBM: no rep may find it in L2).
template <class F>
double median_us(int reps, bool flush, F&& once) {
    for (int i = 0; i < 2; ++i) once();  // two untimed passes
    check(cudaDeviceSynchronize(), "bench warm-up");
    cudaEvent_t e0, e1;
    check(cudaEventCreate(&e0), "event");
    check(cudaEventCreate(&e1), "event");
    std::vector<float> ms;
    for (int i = 0; i < reps; ++i) {
        if (flush) flush_l2();
        check(cudaEventRecord(e0, 0), "event");
        once();
        check(cudaEventRecord(e1, 0), "event");
        check(cudaEventSynchronize(e1), "bench");
        float t = 0;
        check(cudaEventElapsedTime(&t, e0, e1), "event");
        ms.push_back(t);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    std::sort(ms.begin(), ms.end());
    return 1e3 * static_cast<double>(ms[ms.size() / 2]);
}

}  // namespace glm::cuda
