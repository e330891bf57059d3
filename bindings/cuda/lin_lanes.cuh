// The lane-pass kernel (k_linear_lanes) and the x re-layout it reads (k_x_lanes).
// Part of weights.cu's translation unit (included there once, inside its anonymous namespace, so
// that every kernel keeps one definition and its name); not a header for other files.
#pragma once

#include "lanes_core.cuh"

namespace glm::cuda {
namespace {

// ---- the lane-pass kernel -----------------------------------------------------------------------
//
// Y[t][r] = cdot(W[r], X[t]) for dense launches of many tokens. The register-tiled kernel (lin_gemm.cuh)
// keeps all 64 chains P[g][l] of an output live at once, so a block's registers hold only 512 outputs
// (32 rows x 16 tokens) and every decoded weight serves 16 tokens. But the canonical fold adds the
// eight accumulators of one lane first (P[g] += P[g + w], lane-wise), then the lanes: lane l's eight
// chains (columns 64c + 8g + l) fold into one partial Q[l] without any other lane. So a block walks K
// eight times, once per lane, with only that lane's eight chains live: 4096 outputs a block (64 rows x
// 64 tokens, or 32 x 128), each decoded weight serving BN tokens (64 or 128) instead of 16.
//
// A thread owns chain g of lane l for 8 rows x TN tokens (TN 8: 64 accumulators, two 16-byte loads each of
// W^T and X^T per 64 FMAs; TN 16: 128, two and four per 128 FMAs); a warp is the 8 chains of 4 such tiles,
// so the fold of a lane is a reduce-scatter over shuffles (g ^ 4, g ^ 2, g ^ 1: the canonical tree, a + b =
// b + a bit for bit), after which thread g holds Q[l] of 2 rows x TN / 2 tokens of its tile (W^T's and X^T's
// halves placed so that the first two steps need no selects: lane_swap_a, lane_swap_b). The lanes run in the
// order 0 4 2 6 1 5 3 7, so that their partials fold as they arrive ((Q0 + Q4) + (Q2 + Q6)) + ((Q1 + Q5) +
// (Q3 + Q7)), three of them parked per thread in shared memory.
//
// The weights stay in their stored layout: every lane pass copies whole chunks of the block's rows
// (cp.async) and decodes its lane's weights (FP8: one 16-byte load gives two, MXFP4 four, BF16 one 2-byte
// load one), so the raw rows cross L2 eight times; x is re-laid once per launch into Xp[l][c][g][token]
// (f32; dense: k_x_lanes; expert items: k_items_lanes, each item's 64 pair slots as its tokens), so a
// lane's x^T arrives by plain 16-byte copies, nothing transposed in the kernel. Per 64 FMAs a thread
// spends 4 shared loads, ~1 decoded weight (BN 64; half with BN 128) and a fraction of a copy.
//
// Shared memory: ST stages of [raw rows BM x S chunks] + [X^T S x 8 x XS f32]; two decoded W^T buffers
// S x 8 x WS; the parked partials [3][TN][threads] (3 x 4096 floats). A warp's 32 rows' 16-byte decode loads must fall on
// distinct banks, and a half warp's 4 chains x 2 tiles x 16 bytes of W^T or X^T must cover the 32 banks
// once (a thread's rows and tokens are two groups of four, half a tile apart): dense launches pad (raw rows
// an odd number of 16-byte pieces, XS = BN + 8, WS = BM + 8), expert items swizzle (ln_swz, ln_piece),
// which leaves them room for slabs of 8.
// Tokens a thread (TN, its tile 8 rows x TN): 8, 512 threads a block and at most 128 registers a thread; 16,
// 256 threads and up to 255 (room for the 128 accumulators and the joined decode block without a spill; the
// compiler still recomputes the decode's addresses per task). A block holds 4096 outputs either way.
constexpr int ln_threads(int TN) { return 4096 / TN; }
// Chunks per slab: 8 for FP8 rows at 128 tokens and for FP8 and MXFP4 expert items, else 4. A slab's
// cursor, copy and barrier logic costs the same whatever its length (ncu, q|k|v FP8 at 128 tokens: 286
// instructions for a slab's 256 FFMAs, and ~150 more of that logic), so longer slabs spend fewer
// instructions a multiply; BF16 rows are twice as long, and dense blocks of 64 tokens take twice the rows.
// Expert items fit slabs of 8 in three stages because their x arrives as X^T (k_items_lanes) and their
// buffers are swizzled instead of padded (ln_swz).
template <int FMT, int BN, bool EXPERT>
constexpr int ln_slab() {
    return EXPERT ? (FMT == W_BF16 ? 4 : 8) : (FMT == W_FP8 && BN == 128 ? 8 : 4);
}
template <int BN>
constexpr int ln_rows() {  // rows per block: 4096 outputs
    return 4096 / BN;
}
template <int FMT, int BN, bool EXPERT>
constexpr int ln_raw_row() {  // bytes per staged raw row (dense: padded to an odd number of 16-byte pieces)
    return ln_slab<FMT, BN, EXPERT>() * chunk_bytes<FMT>() + (EXPERT ? 0 : 16);
}
// Floats per W^T and X^T row (one (chunk, chain) of the block's rows or tokens): dense, 8 past a multiple
// of 32; experts, unpadded and swizzled.
template <int N, bool EXPERT>
constexpr int ln_ld() {
    return EXPERT ? N : N + 8;
}
template <int FMT, int BN, bool EXPERT>
constexpr int ln_stage_bytes() {  // raw rows, then X^T [S][8][XS]
    constexpr int S = ln_slab<FMT, BN, EXPERT>();
    return ln_rows<BN>() * ln_raw_row<FMT, BN, EXPERT>() + S * 8 * ln_ld<BN, EXPERT>() * 4;
}
template <int FMT, int BN, bool EXPERT>
constexpr int ln_fixed_bytes() {  // the two W^T buffers and the parked partials
    constexpr int S = ln_slab<FMT, BN, EXPERT>();
    return 2 * S * 8 * ln_ld<ln_rows<BN>(), EXPERT>() * 4 + 3 * 4096 * 4;  // (parked: 3 slots of 4096 outputs)
}
template <int FMT, int BN, bool EXPERT>
constexpr int ln_stages() {
    return 4 * ln_stage_bytes<FMT, BN, EXPERT>() + ln_fixed_bytes<FMT, BN, EXPERT>() <= 227 * 1024 ? 4 : 3;
}
template <int FMT, int BN, bool EXPERT>
constexpr int ln_smem_bytes() {
    return ln_stages<FMT, BN, EXPERT>() * ln_stage_bytes<FMT, BN, EXPERT>() + ln_fixed_bytes<FMT, BN, EXPERT>();
}
// The swizzles of expert items (dense launches pad instead: none). A W^T or X^T row (chunk u, chain c)
// holds column j at j ^ 8 (c & 3): a half warp's 4 chains x 2 tiles of 16-byte loads still cover the 32
// banks once, and a row's halves (HA, HB = 32) stay apart. A raw row holds 16-byte piece q at q ^ (row & 7):
// a warp's decode loads (32 rows of one piece) and copies (one row's pieces) meet each bank group once.
template <bool EXPERT>
GLM_DEV int ln_swz(int chain) {
    return EXPERT ? 8 * (chain & 3) : 0;
}
template <bool EXPERT>
GLM_DEV int ln_piece(int q, int row) {
    return EXPERT ? q ^ (row & 7) : q;
}
// Chunks of x a dense launch re-lays (k_x_lanes) and reads: a head-blocked one's every head's columns
// (head h's from chunk h xhs / 64), else one row's.
__host__ __device__ inline int64_t lanes_x_chunks(const LinArgs& a) {
    return a.rh < a.R ? ((a.R - 1) / a.rh * a.xhs + a.C) / 64 : a.C / 64;
}

// Xp[((l * nch + c) * 8 + g) * ldT + t] = X[t][64c + 8g + l] for t < T, 0 for T <= t < ldT.
// A block: 32 tokens of one chunk, read by rows, written by (lane, chain) rows of 32 tokens.
__global__ void __launch_bounds__(256) k_x_lanes(const float* __restrict__ X, int64_t ldx, int T, int nch, int64_t ldT,
                                                 float* __restrict__ Xp) {
    pdl_enter();
    __shared__ float tile[32][65];
    const int t0 = static_cast<int>(blockIdx.x) * 32, c = static_cast<int>(blockIdx.y), tid = static_cast<int>(threadIdx.x);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        const int idx = tid + 256 * n, t = idx >> 6, col = idx & 63;
        tile[t][col] = t0 + t < T ? X[static_cast<int64_t>(t0 + t) * ldx + 64 * c + col] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        const int idx = tid + 256 * n, t = idx & 31, lg = idx >> 5, l = lg >> 3, g = lg & 7;
        Xp[(static_cast<int64_t>(l) * nch + c) * 8 * ldT + g * ldT + t0 + t] = tile[t][8 * g + l];
    }
}

// Expert items as the lane-pass kernel's x: Xi[i][((l * nch + c) * 8 + g) * kLanesItem + j] = x of item
// item0 + i's pair j at column 64c + 8g + l (pair_xrow), 0 past the item's pairs. A block: one chunk of
// one item, read by rows (the pairs' x rows gathered), written by (lane, chain) rows of the item's slots.
__global__ void __launch_bounds__(256) k_items_lanes(LinArgs a, int nch, float* __restrict__ Xi) {
    pdl_enter();
    const int it = a.item0 + static_cast<int>(blockIdx.x);
    if (it >= *a.n_items) return;
    __shared__ float tile[kLanesItem][65];
    __shared__ int64_t xr[kLanesItem];
    const int c = static_cast<int>(blockIdx.y), tid = static_cast<int>(threadIdx.x);
    const int start = a.items[3 * it + 1], cnt = a.items[3 * it + 2];
    if (tid < kLanesItem) xr[tid] = tid < cnt ? pair_xrow(a, a.pairs[start + tid]) : -1;
    __syncthreads();
#pragma unroll
    for (int n = 0; n < 16; ++n) {
        const int idx = tid + 256 * n, j = idx >> 6, col = idx & 63;
        tile[j][col] = xr[j] >= 0 ? a.X[xr[j] * a.ldx + 64 * c + col] : 0.0f;
    }
    __syncthreads();
    float* const out = Xi + static_cast<int64_t>(blockIdx.x) * kLanesItem * 64 * nch;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
        const int idx = tid + 256 * n, j = idx & 63, lg = idx >> 6, l = lg >> 3, g = lg & 7;
        out[((static_cast<int64_t>(l) * nch + c) * 8 + g) * kLanesItem + j] = tile[j][8 * g + l];
    }
}

// Dense: a.X is Xp (k_x_lanes) with a.ldx = ldT; a.Y the launch's first token row; a.T its tokens. Head-blocked
// (a.rh < a.R): Xp of x's whole width, every head's columns.
// Experts (items of up to BN pairs): a.X is Xi (k_items_lanes) of items a.item0 .. a.item0 + a.item_count.
template <int FMT, bool EXPERT, int DEC, int BN, int TN = 8>
__global__ void __launch_bounds__(ln_threads(TN), 1) k_linear_lanes(LinArgs a) {
    pdl_enter();
    GLM_DYN_SMEM(unsigned char, sm);
    constexpr int CB = chunk_bytes<FMT>(), BM = ln_rows<BN>(), S = ln_slab<FMT, BN, EXPERT>(), ST = ln_stages<FMT, BN, EXPERT>();
    constexpr int RW = ln_raw_row<FMT, BN, EXPERT>(), WS = ln_ld<BM, EXPERT>(), XS = ln_ld<BN, EXPERT>();
    constexpr int SB = ln_stage_bytes<FMT, BN, EXPERT>(), XOFF = BM * RW;
    constexpr int NTH = ln_threads(TN);
    static_assert(TN == 8 || TN == 16, "8 or 16 tokens a thread");
    // decode tasks: PT 16-byte pieces of a row, each giving FP8 two weights (piece q: chains 2q, 2q + 1),
    // MXFP4 four (4q .. 4q + 3), BF16 one; a warp's 32 tasks are 32 rows of the same pieces. (Two pieces a
    // task: what a task sets up, its lane's selector and its buffers' addresses, is recomputed per task
    // beside the 128 registers the kernel holds. FP8 expert items with 16 tokens a thread take a row's whole
    // chunk a task, its eight chains: its pieces' offsets are one register XOR constants, piece_src.)
    constexpr int WPT = FMT == W_FP8 ? 2 : (FMT == W_MXFP4 ? 4 : 1);  // weights a piece gives
    constexpr int PT = FMT == W_FP8 && EXPERT && TN == 16 ? 4 : 2;     // pieces a task
    constexpr int TPC = 8 / (WPT * PT);                                // tasks per row and chunk
    constexpr int TASKS = BM * TPC * S, NT = (TASKS + NTH - 1) / NTH;
    // the slab's compute and the next slab's decode in one block of code (compute_decode): dense FP8 launches,
    // and with 16 tokens a thread every kernel whose slab's tasks spread over its chunks
    constexpr bool JOIN = TN == 16 ? S % NT == 0 && S / NT >= 2 : FMT == W_FP8 && !EXPERT;
    static_assert(!JOIN || (S % NT == 0 && S / NT >= 2), "a whole slab's decode tasks spread over its chunks (compute_decode)");
    constexpr int PPR = S * CB / 16, WPIECES = BM * PPR, NWP = (WPIECES + NTH - 1) / NTH;
    constexpr int XPIECES = S * 8 * BN / 4, NXP = XPIECES / NTH;
    static_assert(FMT == W_BF16 || FMT == W_FP8 || FMT == W_MXFP4, "BF16, FP8 or MXFP4");
    static_assert(XPIECES % NTH == 0 && BM % 32 == 0, "whole copy rounds; 32-row decode warps");
    static_assert(EXPERT || ((RW / 16) % 2 == 1 && (WS / 4) % 8 == 2 && (XS / 4) % 8 == 2), "bank spreads");
    static_assert(!EXPERT || (BN == kLanesItem && BM == 64 && PPR >= 8 && RW % 128 == 0), "expert items: the swizzles' shapes");
    static_assert(ln_smem_bytes<FMT, BN, EXPERT>() + BM * 8 + (EXPERT ? BN * 4 : 4) <= 227 * 1024, "shared memory");
    static_assert(!EXPERT || 2 * (ln_smem_bytes<FMT, BN, EXPERT>() + BM * 8) > 228 * 1024,
                  "one block an SM: launch_lanes_bn's resident grid of expert units");
    __shared__ const unsigned char* rowp[BM];
    __shared__ int prow[EXPERT ? BN : 1];  // expert items: the unit's pairs' output rows (pairs[start + t])
    float* const Wt = reinterpret_cast<float*>(sm + ST * SB);  // [2][S][8][WS]
    float* const park = Wt + 2 * S * 8 * WS;                   // [3][8][threads]
    const int64_t C = a.C;
    const int nch = static_cast<int>(C / 64), nst = (nch + S - 1) / S, total = 8 * nst;
    const int tid = static_cast<int>(threadIdx.x);
    const LaneSeat seat = lane_seat(tid, BM / 16);  // (BM / 16 warps across the rows)
    const int g = seat.g, rg = seat.rg, tg = seat.tg;
    // the block's first row (expert items: its unit's, set per unit below)
    int row_base = EXPERT ? 0 : static_cast<int>(blockIdx.x) * BM;
    const int64_t rb = row_bytes(FMT, C);
    auto abs_row = [&](int r) {  // rows past R read the last row (computed, never stored)
        return weight_row(a, r < a.R ? r : a.R - 1);
    };
    const uint32_t sm_s = smem_u32(sm);
    // this thread's copies of a slab, the same places in every slab (kept as a base and a step, not one
    // register a copy: slabs of 8 spilled so): weight pieces p = tid + n NTH, row p / PPR and 16-byte
    // piece p % PPR, RPN rows apart from one n to the next; x pieces likewise, chunk p / 2BN, chain
    // (p / (BN / 4)) % 8, tokens 4 (p % (BN / 4)) .., UPN chunks apart
    constexpr int RPN = NTH / PPR, UPN = NTH / (2 * BN);
    static_assert(NTH % PPR == 0 && NTH % (2 * BN) == 0 && (NTH / (BN / 4)) % 8 == 0 &&
                      (!EXPERT || RPN % 8 == 0),
                  "copies: each n the same piece and chain, rows RPN and chunks UPN further (experts: row & 7 kept)");
    const int wrow = tid / PPR, woff = 16 * (tid % PPR);
    const int wdst = wrow * RW + 16 * ln_piece<EXPERT>(tid % PPR, wrow);
    const int xu = tid / (2 * BN), xg = (tid / (BN / 4)) % 8, xj4 = tid % (BN / 4);
    const int xdst = XOFF + 4 * ((xu * 8 + xg) * XS + (4 * xj4 ^ ln_swz<EXPERT>(xg) ^ lane_swap_b(xg, BN / 2)));
    // A block whose rows all lie below R (whole) finds its rows one after the other in memory (a head-blocked
    // launch's block lies in one head: lanes_applies), so its whole slabs' copies take their rows from the
    // thread's first row's address; others read each row's address from rowp (rows past R: the last row's).
    // (A row address loaded from shared memory cost each copy a load and three issue slots before it; the
    // first row's address kept in registers instead made the FP8 expert kernel spill.)
    bool whole = row_base + BM <= a.R;
    int start = 0, cnt = 0;  // the item's first token (pair slot) and how many
    const float* xb = a.X;   // x of the block's tokens (dense: Xp; experts: the item's Xi)
    const int64_t ldx = EXPERT ? BN : a.ldx;
    const int64_t xsrc = (xu * 8 + xg) * ldx + 4 * xj4;
    auto chunks_of = [&](int s) { return nch - s * S < S ? nch - s * S : S; };
    // (slabs are named by their position: s within pass p, and their stage; no division per slab)
    // xo: the issued slab's x offset (floats; lane ln_lane(p), chunk S s: issue_next keeps it)
    // (a whole slab: its copies without tests, a separate branch-free path; with one tested path for
    // all, dense q|k|v FP8 at 2048 tokens ran 24.5 TFLOP/s against 25.2, another device session)
    auto wvalid = [&](int n) { return WPIECES % NTH == 0 || tid + n * NTH < WPIECES; };
    auto issue = [&](int s, int64_t xo, int stage) {
        const int nc = chunks_of(s), c0 = s * S;
        const uint32_t buf = sm_s + static_cast<uint32_t>(stage * SB);
        const float* const xs = xb + xo + xsrc;
        if (nc == S && whole) {  // (copy n's row RPN n rows below the thread's first: one row address loaded)
            const unsigned char* const w = rowp[wrow] + (woff + c0 * CB);
            const int step = RPN * static_cast<int>(rb);  // (32 bits: one multiply-add a copy; RPN rows of C <= 2^26)
#pragma unroll
            for (int n = 0; n < NWP; ++n)
                if (wvalid(n)) cp_async16_s(buf + wdst + n * RPN * RW, w + n * step);
#pragma unroll
            for (int n = 0; n < NXP; ++n) cp_async16_s(buf + xdst + 4 * n * UPN * 8 * XS, xs + n * UPN * 8 * ldx);
            return;
        }
#pragma unroll
        for (int n = 0; n < NWP; ++n)
            if (wvalid(n) && woff < nc * CB) cp_async16_s(buf + wdst + n * RPN * RW, rowp[wrow + n * RPN] + woff + c0 * CB);
#pragma unroll
        for (int n = 0; n < NXP; ++n)
            if (xu + n * UPN < nc) cp_async16_s(buf + xdst + 4 * n * UPN * 8 * XS, xs + n * UPN * 8 * ldx);
    };
    // this thread's decode tasks n = tid + n NTH (the same in every slab): row di, pieces PT dk .. PT dk +
    // PT - 1 of chunk du + n UT (the row, the pieces and so the scales' offset the same for every n: base
    // and step again); the scales' offset 32-bit (lanes_applies)
    constexpr int UT = NTH / (BM * TPC);
    static_assert(NTH % (BM * TPC) == 0 && (!EXPERT || (UT * (CB / 16)) % 8 == 0),
                  "decode tasks: each n the same row and piece, UT chunks further (experts: the piece's swizzle kept)");
    // (W^T's column di of a chain holds row di ^ lane_swap_a(chain): the task reads its piece h from row dr_h,
    // the same row for both pieces but in MXFP4, where piece 2 dk's chains are 0-3 and 2 dk + 1's 4-7; so the
    // swap costs the stores nothing, they stay at column di of every chain)
    const int di = tid % BM, dk = (tid / BM) % TPC, du = tid / (BM * TPC);  // pieces PT dk .. PT dk + PT - 1
    const int dr0 = di ^ lane_swap_a(WPT * PT * dk, BM / 2), dr1 = di ^ lane_swap_a(WPT * (PT * dk + 1), BM / 2);
    const int dsrc0 = dr0 * RW + 16 * ln_piece<EXPERT>(du * (CB / 16) + PT * dk, dr0);  // + n UT CB
    const int dsrc1 = dr1 * RW + 16 * ln_piece<EXPERT>(du * (CB / 16) + PT * dk + 1, dr1);
    // Piece h of a task: pieces 0 and 1 at dsrc0 and dsrc1; PT 4 (expert items: raw rows a power of two long,
    // the task's first piece a multiple of 4), piece h's row (dr0, or dr0 ^ BM / 2 where its chains' half
    // differs, lane_swap_a: (WPT h) & 4) and its swizzled place (ln_piece: q ^ (row & 7), the same row & 7)
    // make dsrc0 XOR a constant.
    static_assert(PT == 2 || (EXPERT && (RW & (RW - 1)) == 0), "four pieces a task: expert rows a power of two long");
    auto piece_src = [&](int h) {
        if constexpr (PT == 2) return h == 0 ? dsrc0 : dsrc1;
        else return dsrc0 ^ (((WPT * h) & 4 ? BM / 2 * RW : 0) | 16 * h);
    };
    const void* scale = a.scale;  // (experts: the item's)
    auto scale_at = [&](int dr, int q) {  // row dr's scales (MXFP4: of piece q of chunk 0)
        const int64_t ar = abs_row(row_base + dr);
        return static_cast<int>(FMT == W_FP8 ? (ar / 128) * ((C + 127) / 128) : (FMT == W_MXFP4 ? ar * (C / 32) + q : 0));
    };
    int dsc0 = scale_at(dr0, PT * dk), dsc1 = scale_at(dr1, PT * dk + 1);  // (FP8: one, the rows in one 128-row block)
    auto dvalid = [&](int n) { return TASKS % NTH == 0 || tid + n * NTH < TASKS; };
    // the decode tasks' multipliers for slab s (chunks past the last: 0, never used). FP8 scales are per
    // 128 columns, two chunks: slabs and UT even, so task n's is UT / 2 n past the slab's first
    static_assert(FMT != W_FP8 || (S % 2 == 0 && UT % 2 == 0), "FP8 scales: a slab's tasks UT / 2 scales apart");
    auto load_scales = [&](int s, float (&sc)[NT][2]) {
        const int c0 = s * S + du;  // (offsets in 32 bits, unsigned: one add to the tensor's address, not a 64-bit sum)
        const float* const fs = static_cast<const float*>(scale) + static_cast<uint32_t>(dsc0 + (c0 >> 1));
        const uint8_t* const es0 = static_cast<const uint8_t*>(scale) + static_cast<uint32_t>(dsc0 + 2 * c0);
        const uint8_t* const es1 = static_cast<const uint8_t*>(scale) + static_cast<uint32_t>(dsc1 + 2 * c0);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const bool in = c0 + n * UT < nch;
            sc[n][0] = sc[n][1] = 0.0f;
            if constexpr (FMT == W_FP8) {
                if (in) sc[n][0] = sc[n][1] = fp8_mult<DEC>(__ldg(fs + n * (UT / 2)));
            } else if constexpr (FMT == W_MXFP4) {
                if (in) {
                    const uint32_t e0 = __ldg(es0 + 2 * n * UT), e1 = __ldg(es1 + 2 * n * UT);
                    sc[n][0] = DEC == kDecInt ? e8m0_folded(e0) : e8m0(e0);
                    sc[n][1] = DEC == kDecInt ? e8m0_folded(e1) : e8m0(e1);
                }
            }
        }
    };
    // task n of a slab: lane l, raw stage rs, W^T buffer W (+ du 8 WS), fsel FP8's byte selector (bytes l, 8 + l)
    auto decode_task = [&](int l, const unsigned char* rs, float* W, uint32_t fsel, const float (&sc)[NT][2], int n) {
        float* const d = W + n * UT * 8 * WS;
        auto put = [&](int q, int m, float v) {  // chain WPT q + m
            const int ch = WPT * q + m;
            d[ch * WS + (di ^ ln_swz<EXPERT>(ch))] = v;
        };
        if constexpr (FMT == W_BF16) {  // piece q: chain q's eight weights
            const uint32_t h0 = *reinterpret_cast<const uint16_t*>(rs + dsrc0 + n * UT * CB + 2 * l);
            const uint32_t h1 = *reinterpret_cast<const uint16_t*>(rs + dsrc1 + n * UT * CB + 2 * l);
            put(2 * dk, 0, f32_from_bits(h0 << 16));
            put(2 * dk + 1, 0, f32_from_bits(h1 << 16));
        } else {
            // (PT 2: both pieces loaded first, as written before PT 4; the same loop otherwise moved the 128-register
            // kernels' allocation, the FP8 expert kernel 0 -> 56 bytes of stack)
            uint4 vs[PT];
            if constexpr (PT == 2) {
                vs[0] = *reinterpret_cast<const uint4*>(rs + dsrc0 + n * UT * CB);
                vs[1] = *reinterpret_cast<const uint4*>(rs + dsrc1 + n * UT * CB);
            } else {
#pragma unroll
                for (int h = 0; h < PT; ++h) vs[h] = *reinterpret_cast<const uint4*>(rs + piece_src(h) + n * UT * CB);
            }
#pragma unroll
            for (int h = 0; h < PT; ++h) {
                const uint4 v = PT == 2 ? (h ? vs[1] : vs[0]) : vs[h];
                const int q = PT * dk + h;
                const float scl = sc[n][h & 1];  // (FP8: the task's two equal multipliers)
                if constexpr (FMT == W_FP8) {  // chain 2q: byte l of the piece; 2q + 1: byte 8 + l
                    const uint32_t lo = (l & 4) ? v.y : v.x, hi = (l & 4) ? v.w : v.z;
                    const uint32_t pair = __byte_perm(lo, hi, fsel);
                    float w0, w1;
                    if constexpr (DEC == kDecInt) {
                        w0 = e4m3_int<0>(pair);
                        w1 = e4m3_int<1>(pair);
                    } else {
                        e4m3x2<DEC == kDecHw>(pair, w0, w1);
                    }
                    put(q, 0, fmul(w0, scl));
                    put(q, 1, fmul(w1, scl));
                } else {  // MXFP4: chain 4q + k is word k's nibble l
                    const uint32_t sh = 4u * static_cast<uint32_t>(l);
                    const uint32_t c0 = (v.x >> sh) & 15u, c1 = (v.y >> sh) & 15u, c2 = (v.z >> sh) & 15u, c3 = (v.w >> sh) & 15u;
                    if constexpr (DEC == kDecInt) {
                        float w0, w1, w2, w3;
                        e2m1_pair<0>(c0 | (c1 << 16), w0, w1);
                        e2m1_pair<0>(c2 | (c3 << 16), w2, w3);
                        put(q, 0, fmul(w0, scl));
                        put(q, 1, fmul(w1, scl));
                        put(q, 2, fmul(w2, scl));
                        put(q, 3, fmul(w3, scl));
                    } else {
                        put(q, 0, mxfp4_w(c0, scl));
                        put(q, 1, mxfp4_w(c1, scl));
                        put(q, 2, mxfp4_w(c2, scl));
                        put(q, 3, mxfp4_w(c3, scl));
                    }
                }
            }
        }
    };
    // slab s of pass p, lane ln_lane(p): raw stage -> W^T buffer wbuf (row u * 8 + chain, column i: at
    // i ^ ln_swz(chain), the value of row i ^ lane_swap_a(chain, BM / 2): dr0, dr1); a whole slab's tasks
    // without a test each (as its copies and its FMAs)
    auto decode = [&](int s, int p, int stage, int wbuf, const float (&sc)[NT][2]) {
        const int l = ln_lane(p), nc = chunks_of(s);
        const unsigned char* const rs = sm + stage * SB;
        float* const W = Wt + wbuf * (S * 8 * WS) + du * 8 * WS;
        const uint32_t fsel = static_cast<uint32_t>((l & 3) | (((l & 3) + 4) << 4));  // FP8: bytes l, 8 + l
        if (nc == S) {
#pragma unroll
            for (int n = 0; n < NT; ++n)
                if (dvalid(n)) decode_task(l, rs, W, fsel, sc, n);
        } else {
#pragma unroll
            for (int n = 0; n < NT; ++n)
                if (dvalid(n) && du + n * UT < nc) decode_task(l, rs, W, fsel, sc, n);
        }
    };
    // [row i][token j] of chain g: rows 4rg + i (i < 4), BM/2 + 4rg + i - 4; tokens 4tg + j (j < 4), BN/2 + 4tg
    // + j - 4 (TN 8), or four groups of four a quarter of BN apart (TN 16: lane_chunk_n)
    float acc[8][TN];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
    // one chunk u of the slab at W (the thread's A^T row) and X (its B^T row, the stage's): TN 16 reads a second
    // group of four columns BN / 4 past the first, placed by the same swizzle (an XOR: its own pointer)
    auto chunk = [&](const float* W, const float* X, const float* X1, int u) {
        lane_chunk_n<BM / 2, BN / 2, TN>(acc, W + u * 8 * WS, X + u * 8 * XS, X1 + u * 8 * XS);
    };
    auto x_row = [&](int stage, int col) {  // the thread's B^T place of column col in chunk 0 of the stage
        return reinterpret_cast<const float*>(sm + stage * SB + XOFF) + g * XS + (col ^ ln_swz<EXPERT>(g));
    };
    auto compute = [&](int s, int stage, int wbuf) {
        const float* W = Wt + wbuf * (S * 8 * WS) + g * WS + (4 * rg ^ ln_swz<EXPERT>(g));
        const float* X = x_row(stage, 4 * tg);
        const float* X1 = TN == 16 ? x_row(stage, 4 * tg + BN / 4) : X;
        auto one = [&](int u) { chunk(W, X, X1, u); };
        const int nc = chunks_of(s);
        if (nc == S) {  // a whole slab: no test per chunk
#pragma unroll
            for (int u = 0; u < S; ++u) one(u);
        } else {
#pragma unroll 1
            for (int u = 0; u < nc; ++u) one(u);
        }
    };
    // A whole slab's chunks with the next slab's decode tasks among them (that slab whole too: lane dl, raw
    // stage dstage, into the other W^T buffer), in one block of code, so that the tasks' chains of dependent
    // loads, conversions and stores wait beside the FMAs instead of after them. Dense FP8 launches only: those
    // went 36.3 -> 35.0 ms a 2048-token prefill, while the FP8 expert kernel, whose two tasks a slab pushed it
    // past the 128 registers (56 bytes of stack), went 52.8 -> 55.1 (docs/perf.md, "Session 34"); MXFP4's
    // and BF16's kernels spilled more with it (ptxas), unmeasured, so they keep the two blocks. With 16 tokens
    // a thread (up to 255 registers, no stack) every kernel whose slab's tasks spread over its chunks takes it
    // (JOIN): with the four-piece FP8 expert tasks, that kernel went 52.9 -> 51.1 ms ("Session 41").
    auto compute_decode = [&](int stage, int wbuf, int dl, int dstage, const float (&sc)[NT][2]) {
        const float* W = Wt + wbuf * (S * 8 * WS) + g * WS + (4 * rg ^ ln_swz<EXPERT>(g));
        const float* X = x_row(stage, 4 * tg);
        const float* X1 = TN == 16 ? x_row(stage, 4 * tg + BN / 4) : X;
        const unsigned char* const rs = sm + dstage * SB;
        float* const Wd = Wt + (wbuf ^ 1) * (S * 8 * WS) + du * 8 * WS;
        const uint32_t fsel = static_cast<uint32_t>((dl & 3) | (((dl & 3) + 4) << 4));
        // (the decode's setup is written here and in decode: one helper lambda for both made ptxas give the
        // MXFP4 expert kernel 40 bytes of stack for its 16, where it does not even take this block)
        constexpr int every = S / NT > 0 ? S / NT : 1;  // task n after chunk (n + 1) every - 1 (JOIN: S / NT >= 2)
#pragma unroll
        for (int u = 0; u < S; ++u) {
            chunk(W, X, X1, u);
            if (u % every == every - 1 && dvalid(u / every)) decode_task(dl, rs, Wd, fsel, sc, u / every);
        }
    };
    // lane pass p is over: fold its chains into Q[l] (2 rows x TN / 2 tokens of the thread's tile) and that
    // into the parked partials; after the last, write the outputs
    auto end_pass = [&](int p) {
        float Q[TN];
        if (!lane_pass_end(acc, g, p, park + tid, NTH, Q)) return;
        float* const Y = EXPERT && blockIdx.z != 0 ? a.Y2 : a.Y;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = row_base + lane_row(g, rg, BM / 2, i);
            if (r >= a.R) continue;
#pragma unroll
            for (int j = 0; j < TN / 2; ++j) {
                const int t = TN == 8 ? lane_col(g, tg, BN / 2, j) : lane_col16(g, tg, BN / 2, j);
                if (t < cnt) {
                    const int64_t yrow = EXPERT ? prow[t] : static_cast<int64_t>(start) + t;
                    const float y = Q[TN / 2 * i + j];
                    Y[yrow * a.ldy + r] = a.round ? bf16r(y) : y;
                }
            }
        }
    };
    // One barrier per slab (as the register-tiled kernel): an iteration finds its slab decoded and the
    // next copied; the barrier also ends every thread's use of the slab before (its stage, which the
    // slab ST - 1 ahead refills, and its W^T buffer, which the next slab takes). Slabs run on across lane
    // passes. Three cursors: the slab computed (cs, cp), the one issued (is, ip), each with its stage.
    auto next = [&](int& s, int& p) {
        if (++s == nst) {
            s = 0;
            ++p;
        }
    };
    auto next_stage = [](int& st) { st = st + 1 == ST ? 0 : st + 1; };
    // x offsets: from one slab to the next, and to a lane's first slab
    const int64_t xstep = static_cast<int64_t>(S) * 8 * ldx;
    // Head-blocked launches (dense; the block's rows lie in one head, lanes_applies): Xp holds the chunks
    // of every head's x (head h's from chunk h xhs / 64), and the block reads its head's.
    const bool heads = !EXPERT && a.rh < a.R;
    const int64_t nchx = EXPERT ? nch : lanes_x_chunks(a);  // chunks of a lane in Xp
    const int64_t xbase = heads ? static_cast<int64_t>(row_base / a.rh) * (a.xhs / 64) * 8 * ldx : 0;
    const int64_t xlane = nchx * 8 * ldx;
    auto issue_next = [&](int& s, int& p, int64_t& xo, int& st) {
        if (++s == nst) {
            s = 0;
            ++p;
            xo = xbase + ln_lane(p & 7) * xlane;
        } else {
            xo += xstep;
        }
        st = st + 1 == ST ? 0 : st + 1;
    };
    float sc[NT][2];
    // Expert items: the launch's units (item a.item0 + i of a.item_count, row block b: unit i rbs + b), unit
    // blockIdx.x, then every gridDim.x-th, by blocks that all stay resident (launch_lanes_bn: one an SM over the
    // launch's z halves). Every unit costs the same (an item's slots are computed whether filled or not), so
    // the blocks finish within a unit of each other: with a block per row block and item stride instead, ~8
    // waves of blocks walking 17-18 items each, the last wave left part of the SMs idle for a whole block.
    const int n_items = EXPERT ? (*a.n_items - a.item0 < a.item_count ? *a.n_items - a.item0 : a.item_count) : 1;
    const int rbs = EXPERT ? static_cast<int>((a.R + BM - 1) / BM) : 1;
    for (int unit = EXPERT ? static_cast<int>(blockIdx.x) : 0; unit < n_items * rbs;
         unit += EXPERT ? static_cast<int>(gridDim.x) : 1) {
        const int item = EXPERT ? unit / rbs : 0;
        if constexpr (EXPERT) {
            row_base = (unit - item * rbs) * BM;
            whole = row_base + BM <= a.R;
            dsc0 = scale_at(dr0, PT * dk);
            dsc1 = scale_at(dr1, PT * dk + 1);
        }
        const BlockWork bw = block_work<EXPERT>(a, a.item0 + item, static_cast<int>(blockIdx.y), BN);
        const void* data = bw.data;
        scale = bw.scale;
        start = bw.start;
        cnt = bw.cnt;
        xb = EXPERT ? a.X + static_cast<int64_t>(item) * BN * C : a.X + start;
        // the unit's output rows, loaded here and stored once the first slab has arrived (the load's latency
        // under the copies'), not one dependent load per output in the last pass's stores
        const int pr = EXPERT && tid < cnt ? a.pairs[start + tid] : 0;
        __syncthreads();  // the previous item is done with rowp, prow and every buffer
        if (tid < BM) rowp[tid] = static_cast<const unsigned char*>(data) + abs_row(row_base + tid) * rb;
        __syncthreads();
        int is = 0, ip = 0, ist = 0;
        int64_t ixo = xbase;  // lane 0, chunk 0
        for (int n = 0; n < ST - 1; ++n) {
            if (ip < 8) issue(is, ixo, ist);
            cp_async_commit();
            issue_next(is, ip, ixo, ist);
        }
        load_scales(0, sc);
        if (EXPERT && tid < BN) prow[tid] = pr;  // (read after the loop's barriers)
        cp_async_wait<ST - 2>();
        __syncthreads();
        decode(0, 0, 0, 0, sc);
        int cs = 0, cp = 0, cst = 0, wbuf = 0;
        int ds = 0, dp = 0, dst = 0;  // the slab decoded next (one ahead of cs, cp)
        next(ds, dp);
        next_stage(dst);
        load_scales(ds, sc);
        for (int qq = 0; qq < total; ++qq) {
            cp_async_wait<ST - 3>();
            __syncthreads();
            if (ip < 8) issue(is, ixo, ist);
            cp_async_commit();
            issue_next(is, ip, ixo, ist);
            if (JOIN && dp < 8 && chunks_of(cs) == S && chunks_of(ds) == S) {
                compute_decode(cst, wbuf, ln_lane(dp), dst, sc);
            } else {
                compute(cs, cst, wbuf);
                if (dp < 8) decode(ds, dp, dst, wbuf ^ 1, sc);
            }
            if (dp < 8) {
                next(ds, dp);
                next_stage(dst);
                load_scales(ds, sc);
            }
            if (cs == nst - 1) end_pass(cp);
            next(cs, cp);
            next_stage(cst);
            wbuf ^= 1;
        }
        cp_async_wait<0>();
    }
}

}  // namespace
}  // namespace glm::cuda
