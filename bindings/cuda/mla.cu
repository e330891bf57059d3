// MLA: multi-head latent attention in the absorbed form, NoPE (docs/numerics.md, MLA). Stages
// mla.q_lat, mla.q, mla.c, mla.q_abs, mla.selected, mla.scores, mla.probs, mla.o_lat, mla.o, mla.out.
//
// The cache on the GPU holds only the normalized latent c (kv_lora_rank values) per position. Each
// head folds W_UK into its query (q_abs_h[k] = bf16(cdot over i < d_n of q_h[i] W_UK_h[i][k])) and
// applies W_UV after the weighted sum over the selected positions. Scores: a warp per (head,
// position). o_lat: a thread per (head, k) with its 64 partial sums in registers when every row
// attends <= 128 positions, else groups of eight threads for a tile of HT heads at once (one read of a
// latent column serves HT heads). Each (head, element) has its own canonical cdot in every mapping.
#include "engine.cuh"
#include "lanes_core.cuh"

namespace glm::cuda {
namespace {

constexpr int HT = 8;  // heads per tile

// Append rows [T][n] (row stride lds) into each row's segment cache at its position.
// which: 0 = c (MLA latent), 1 = k (indexer keys), 2 = gate (indexer gates).
__global__ void k_append(const float* __restrict__ src, int64_t lds, int T, int n, const SegDev* __restrict__ segs,
                         const int* __restrict__ seg_of, const int* __restrict__ pos, int which) {
    pdl_enter();
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<int64_t>(T) * n) return;
    const int t = static_cast<int>(idx / n), k = static_cast<int>(idx % n);
    const SegDev& sg = segs[seg_of[t]];
    float* base = which == 0 ? sg.c : (which == 1 ? sg.k : sg.gate);
    base[static_cast<int64_t>(pos[t]) * n + k] = src[static_cast<int64_t>(t) * lds + k];
}

// mla.scores[t][h][j] = cdot(q_abs[t][h], c[sel_j]) * scale. A warp per (t, head, JW positions): lane
// L = 8g + l (g < 4) owns the partial sums P[g][l] (elements 64c + L) and P[g+4][l] (elements
// 64c + 32 + L), coalesced; the tree: P[g] += P[g+4] in the thread, then P[g] += P[g+2], P[g] += P[g+1]
// and the lane tree 4/2/1 by shuffles down 16, 8, 4, 2, 1: the canonical cdot. Block: eight heads.
// Sequential mode: lane 0 sums left to right.
template <int JW>
__global__ void __launch_bounds__(256) k_mla_scores(const float* __restrict__ q_abs, int nh, int r,
                                                    const int* __restrict__ sel, const int64_t* __restrict__ sel_off,
                                                    const int* __restrict__ sel_n, const SegDev* __restrict__ segs,
                                                    const int* __restrict__ seg_of, float scale, float* scores, Nm nm) {
    pdl_enter();
    const int lane = static_cast<int>(threadIdx.x & 31u);
    const int t = static_cast<int>(blockIdx.y);
    const int h = static_cast<int>(blockIdx.z) * 8 + static_cast<int>(threadIdx.x >> 5);
    const int j0 = static_cast<int>(blockIdx.x) * JW;
    const int ns = sel_n[t];
    if (h >= nh || j0 >= ns) return;  // uniform over the warp
    const int* st = sel + sel_off[t];
    const float* cache = segs[seg_of[t]].c;
    const float* qa = q_abs + (static_cast<int64_t>(t) * nh + h) * r;
    float* out = scores + sel_off[t] * nh + static_cast<int64_t>(h) * ns;
    const float* crow[JW];
#pragma unroll
    for (int jj = 0; jj < JW; ++jj) crow[jj] = cache + static_cast<int64_t>(st[j0 + jj < ns ? j0 + jj : j0]) * r;
    if (!nm.seq) {
        float p0[JW], p1[JW];
#pragma unroll
        for (int jj = 0; jj < JW; ++jj) p0[jj] = p1[jj] = 0.0f;
#pragma unroll 4
        for (int base = 0; base < r; base += 64) {
            const int i0 = base + lane, i1 = base + 32 + lane;
            if (i0 < r) {
                const float qv = qa[i0];
#pragma unroll
                for (int jj = 0; jj < JW; ++jj) p0[jj] = ffma(qv, crow[jj][i0], p0[jj]);
            }
            if (i1 < r) {
                const float qv = qa[i1];
#pragma unroll
                for (int jj = 0; jj < JW; ++jj) p1[jj] = ffma(qv, crow[jj][i1], p1[jj]);
            }
        }
#pragma unroll
        for (int jj = 0; jj < JW; ++jj) {
            float v = fadd(p0[jj], p1[jj]);
#pragma unroll
            for (int o = 16; o >= 1; o >>= 1) {
                const float x = __shfl_down_sync(kFull, v, o);
                if (lane < o) v = fadd(v, x);
            }
            if (lane == 0 && j0 + jj < ns) out[j0 + jj] = fmul(v, scale);
        }
    } else if (lane == 0) {
        for (int jj = 0; jj < JW; ++jj) {
            if (j0 + jj >= ns) break;
            float v = 0.0f;
            for (int i = 0; i < r; ++i) v = fadd(v, fmul(qa[i], crow[jj][i]));
            out[j0 + jj] = fmul(v, scale);
        }
    }
}

// mla.scores for prefill-sized steps (the same values as k_mla_scores): a block per (row t, 64 of its
// selected positions, 32 heads), the heads' q_abs rows and the positions' latent rows whole in shared
// memory (r <= 512: 192 KB; k-major, so one element index of 32 heads or 64 positions is contiguous),
// each thread 2 heads x 4 positions, each dot made whole by cdot_tree_walk (partial k: the fma chain
// over the chunks 64c + k; elements past r are zeros, which leave every partial as it is). The latent
// rows of a row's selection are read once per 32 heads instead of once per head, from shared memory.
// C: the chunks of r (r <= 64 C), known when compiled: every leaf's chain unrolled (ncu at a 2048-token
// prefill with C at run time: FFMA 31 % of the instructions, the rest the chunk loop's addresses,
// branches and moves).
constexpr int kAttnHeads = 32, kAttnPos = 64, kAttnThreads = 256;
template <int C>
__global__ void __launch_bounds__(kAttnThreads) k_mla_scores_tiled(const float* __restrict__ q_abs, int nh, int r,
                                                                   const int* __restrict__ sel,
                                                                   const int64_t* __restrict__ sel_off,
                                                                   const int* __restrict__ sel_n,
                                                                   const SegDev* __restrict__ segs,
                                                                   const int* __restrict__ seg_of, float scale,
                                                                   float* scores) {
    pdl_enter();
    GLM_DYN_SMEM(float, sm);
    const int t = static_cast<int>(blockIdx.y);
    const int j0 = static_cast<int>(blockIdx.x) * kAttnPos, h0 = static_cast<int>(blockIdx.z) * kAttnHeads;
    const int ns = sel_n[t];
    if (j0 >= ns) return;  // uniform over the block
    constexpr int R = 64 * C;
    float* Qs = sm;                          // [R][32]
    float* Cs = sm + R * kAttnHeads;         // [R][64]
    const int tid = static_cast<int>(threadIdx.x);
    const int* st = sel + sel_off[t];
    const float* cache = segs[seg_of[t]].c;
    const int r4 = r / 4;
    for (int i = tid; i < kAttnHeads * (R / 4); i += kAttnThreads) {  // lanes over heads: conflict-free stores
        const int h = i % kAttnHeads, k4 = i / kAttnHeads;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (k4 < r4 && h0 + h < nh)
            v = *reinterpret_cast<const float4*>(q_abs + (static_cast<int64_t>(t) * nh + h0 + h) * r + 4 * k4);
        store_kmajor4(Qs + 4 * k4 * kAttnHeads + h, v, kAttnHeads);
    }
    for (int i = tid; i < kAttnPos * (R / 4); i += kAttnThreads) {  // lanes over positions
        const int p = i % kAttnPos, k4 = i / kAttnPos;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (k4 < r4 && j0 + p < ns)
            v = *reinterpret_cast<const float4*>(cache + static_cast<int64_t>(st[j0 + p]) * r + 4 * k4);
        store_kmajor4(Cs + 4 * k4 * kAttnPos + p, v, kAttnPos);
    }
    __syncthreads();
    const int th = tid >> 4, tp = tid & 15;  // heads 2 th.., positions 4 tp..
    float dots[2][4];
    cdot_tree_walk<2, 4>(dots, [&](int k, float (&v)[2][4]) {
        leaf_chain<C, 2, 4>(v, C, [&](int c) { return Qs + (64 * c + k) * kAttnHeads + 2 * th; },
                         [&](int c) { return Cs + (64 * c + k) * kAttnPos + 4 * tp; });
    });
    float* out = scores + sel_off[t] * nh;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int pp = 0; pp < 4; ++pp) {
            const int h = h0 + 2 * th + hh, j = j0 + 4 * tp + pp;
            if (h < nh && j < ns) out[static_cast<int64_t>(h) * ns + j] = fmul(dots[hh][pp], scale);
        }
}

// mla.scores and mla.o_lat for a prefill of one sequence whose rows all see every position before them (the
// indexer's dense selection: row t's j-th position is j), the same values as k_mla_scores and k_mla_olat,
// as lane-pass products (lanes_core.cuh). A block: row t, 64 heads x 64 columns (scores: positions j0 ..;
// o_lat: latent columns k0 ..), 512 threads (a thread chain g of 8 heads x 8 columns), the row's chunks in
// slabs of S, four stages, slabs running on across lane passes; each lane's chains folded by shuffles, the
// lanes as they arrive. A, the heads' side, comes re-laid so that a lane's (chunk, chain) values of 64 heads
// are 16-byte copies: scores q_abs (x_lanes: token t nh + h), o_lat the probabilities (k_probs_lanes). B:
// scores the latent rows re-laid likewise (x_lanes: token = position), r = 64 S, one slab a lane; o_lat the
// latent rows themselves (B^T's row of (chunk u, chain g) is position 64u + 8g + l's 64 columns of the
// block, zeros past the row's positions: fma(0, 0, P) = P), slabs of 8. Where this replaced
// k_mla_scores_tiled (256 threads holding 2048 dots' operands whole, 192 KB: one block an SM) and
// k_mla_olat_tiled, a 2048-token prefill of the slice took 6.5 + 6.7 ms for their 12.5 + 10.9; with each
// thread's copies set once and slabs of 8 for o_lat (session 34), 6.6 + 5.3.
constexpr int kSlThreads = 512, kSlStages = 4, kSlPad = 72;  // 64 + 8: a half warp's 16-byte loads cover 32 banks once
constexpr int kOlSlab = 8;  // o_lat's chunks a slab (4 until session 34: 5.54 -> 5.27 ms at 2048 tokens with 8)
template <int S>
constexpr size_t sl_smem_bytes() {  // the stages (heads' and columns' rows (chunk, chain) of S chunks), the parked partials
    return static_cast<size_t>(kSlStages * 2 * S * 8 * kSlPad + 3 * 8 * kSlThreads) * 4;
}
struct AttnLanes {
    const float* xa;  // A re-laid: [l][chunk][g][lda], heads' token t nh + h
    int64_t lda;
    int nca;          // A's chunks a lane
    const float* xb;  // scores: B re-laid ([l][S][g][ldb], token = position); o_lat: the latent rows (r floats apart,
                      // r a multiple of 64: a block's 64 columns lie in the row)
    int64_t ldb;
    int nh, r;
    const int64_t* sel_off;
    const int* sel_n;
    float scale;
    float* out;       // scores [sel_off[t] nh + h ns + j]; o_lat [t nh + h][r]
};
template <bool SCORES, int S>
__global__ void __launch_bounds__(kSlThreads, 1) k_mla_attn_lanes(AttnLanes a) {
    pdl_enter();
    GLM_DYN_SMEM(float, sm);
    const int x0 = static_cast<int>(blockIdx.x) * 64, t = static_cast<int>(blockIdx.y), h0 = static_cast<int>(blockIdx.z) * 64;
    const int ns = a.sel_n[t];
    if (SCORES && x0 >= ns) return;  // (uniform) positions this row does not see
    const int nc = SCORES ? S : (ns + 63) / 64, nst = (nc + S - 1) / S, total = 8 * nst;
    constexpr int SF = 2 * S * 8 * kSlPad, HALF = S * 8 * kSlPad;
    float* const park = sm + kSlStages * SF;
    const int tid = static_cast<int>(threadIdx.x);
    const LaneSeat seat = lane_seat(tid, 4);
    const uint32_t sm_s = smem_u32(sm);
    const int64_t q0 = static_cast<int64_t>(t) * a.nh + h0;
    // A slab (pass p, lane l = ln_lane(p), chunks S sl ..) is its chunks' rows (u, g) of lane l, 64 heads then
    // 64 columns, in 16-byte pieces (piece i: row i / 16, floats 4 (i % 16) ..). This thread's pieces i = tid +
    // n kSlThreads lie at the same places in every slab (row 32 n further each): their offsets are set once,
    // and a slab adds its base (a division and ~50 instructions of address arithmetic a piece per slab before:
    // o_lat's slab of 256 FMAs took ~470 instructions).
    constexpr int NPIECE = S * 8 * 16, NP = (NPIECE + kSlThreads - 1) / kSlThreads, RPN = kSlThreads / 16;
    const int prow = tid >> 4, pc4 = 4 * (tid & 15), pu = prow >> 3, pg = prow & 7;
    const uint32_t da0 = static_cast<uint32_t>((prow * kSlPad + (pc4 ^ lane_swap_a(pg, 32))) * 4);
    const uint32_t db0 = static_cast<uint32_t>((HALF + prow * kSlPad + (pc4 ^ lane_swap_b(pg, 32))) * 4);
    // (32-bit: 32 rows of a re-laid operand, T nh or a row's positions rounded up (the launch checks), and
    // 256 latent rows of at most 512)
    const int aoff = prow * static_cast<int>(a.lda) + pc4;  // row (u, g) of the slab: u 8 + g = prow
    const int boff = SCORES ? prow * static_cast<int>(a.ldb) + pc4 : (64 * pu + 8 * pg) * a.r + pc4;
    auto issue = [&](int p, int sl, int stage) {
        const int l = ln_lane(p), c0 = sl * S;
        const uint32_t buf = sm_s + static_cast<uint32_t>(stage * SF * 4);
        const int64_t lc = static_cast<int64_t>(l) * a.nca + c0;
        const float* const xa = a.xa + lc * 8 * a.lda + q0 + aoff;
        // scores: B re-laid as A; o_lat: position 64 c + 8 g + l's row of the latent cache
        const float* const xb = SCORES ? a.xb + lc * 8 * a.ldb + x0 + boff
                                       : a.xb + static_cast<int64_t>(64 * c0 + l) * a.r + x0 + boff;
#pragma unroll
        for (int n = 0; n < NP; ++n) {
            if (NPIECE % kSlThreads != 0 && tid + n * kSlThreads >= NPIECE) continue;
            if (c0 + pu + n * (RPN / 8) >= nc) continue;  // (past the row's chunks: never computed)
            const uint32_t dn = static_cast<uint32_t>(n * RPN * kSlPad * 4);
            cp_async16_s(buf + da0 + dn, xa + static_cast<int64_t>(n) * RPN * a.lda);
            if constexpr (SCORES) {
                cp_async16_s(buf + db0 + dn, xb + static_cast<int64_t>(n) * RPN * a.ldb);
            } else {
                const int pos = 64 * (c0 + pu + n * (RPN / 8)) + 8 * pg + l;
                if (pos < ns) cp_async16_s(buf + db0 + dn, xb + static_cast<int64_t>(n) * (RPN / 8) * 64 * a.r);
                else store_zero16_s(buf + db0 + dn);
            }
        }
    };
    // slabs by cursors (pass, slab of the pass, stage): the slab issued next and the slab computed
    auto advance = [&](int& p, int& sl, int& stage) {
        if (++sl == nst) sl = 0, ++p;
        stage = stage + 1 == kSlStages ? 0 : stage + 1;
    };
    int ip = 0, isl = 0, ist = 0;
    for (int q = 0; q < kSlStages - 1; ++q) {
        if (q < total) issue(ip, isl, ist);
        cp_async_commit();
        advance(ip, isl, ist);
    }
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
    float Q[8];
    int cp = 0, csl = 0, cst = 0;
    for (int q = 0; q < total; ++q) {
        cp_async_wait<kSlStages - 2>();
        __syncthreads();  // slab q arrived; every thread is done with slab q - 1's stage, which q + 3 refills
        if (ip < 8) issue(ip, isl, ist);
        cp_async_commit();
        advance(ip, isl, ist);
        const int nu = nc - csl * S < S ? nc - csl * S : S;
        const float* A = sm + cst * SF + seat.g * kSlPad + 4 * seat.rg;
        const float* B = A + HALF + 4 * (seat.tg - seat.rg);
        if (nu == S) {
#pragma unroll
            for (int u = 0; u < S; ++u) lane_chunk<32, 32>(acc, A + u * 8 * kSlPad, B + u * 8 * kSlPad);
        } else {
#pragma unroll 1
            for (int u = 0; u < nu; ++u) lane_chunk<32, 32>(acc, A + u * 8 * kSlPad, B + u * 8 * kSlPad);
        }
        if (csl == nst - 1) lane_pass_end(acc, seat.g, cp, park + tid, kSlThreads, Q);
        advance(cp, csl, cst);
    }
    cp_async_wait<0>();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int h = h0 + lane_row(seat.g, seat.rg, 32, i);
        if (h >= a.nh) continue;
        float* const out = SCORES ? a.out + a.sel_off[t] * a.nh + static_cast<int64_t>(h) * ns
                                  : a.out + (static_cast<int64_t>(t) * a.nh + h) * a.r;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int x = x0 + lane_col(seat.g, seat.tg, 32, j);
            if (x < (SCORES ? ns : a.r)) out[x] = SCORES ? fmul(Q[4 * i + j], a.scale) : bf16r(Q[4 * i + j]);
        }
    }
}

// mla.probs per (t, h), one warp: m = max (NaN semantics of a left-to-right std::max: a NaN first
// score wins, later NaNs are ignored), e = expf(s - m), p = bf16(e / csum(e)).
// The max of a row over the warp: each lane takes its values in order (softmax_take), then softmax_max's
// shuffles; a NaN first score, or a row of NaNs, gives sc[0].
struct SoftmaxMax {
    float mx = -INFINITY;
    bool any = false;
};
GLM_DEV void softmax_take(SoftmaxMax& m, float v) {
    if (!is_nan(v) && (!m.any || v > m.mx)) m.mx = v;
    m.any = m.any || !is_nan(v);
}
GLM_DEV float softmax_max(SoftmaxMax m, const float* sc, bool live) {
    for (int o = 16; o >= 1; o >>= 1) {
        const float om = __shfl_xor_sync(kFull, m.mx, o);
        const int oa = __shfl_xor_sync(kFull, m.any ? 1 : 0, o);
        if (oa && (!m.any || om > m.mx)) m.mx = om;
        m.any = m.any || oa;
    }
    return live && (is_nan(sc[0]) || !m.any) ? sc[0] : m.mx;
}
GLM_DEV int softmax_row_lane(int ns, int lane) { return ns > lane ? (ns - lane + 31) / 32 : 0; }  // lane's values

// Any numerics (dot="sequential" included) and any row length: the row's e written, summed from memory,
// then divided in place. sums (tests: mla_softmax_device), when not null: each row's csum(e) at [t nh + h].
__global__ void k_mla_softmax(const float* __restrict__ scores, int T, int nh, const int64_t* __restrict__ sel_off,
                              const int* __restrict__ sel_n, float* probs, Nm nm, float* sums) {
    pdl_enter();
    const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = static_cast<int>(threadIdx.x & 31);
    const bool live = warp < T * nh;
    const int item = live ? warp : 0;
    const int t = item / nh, h = item % nh;
    const int ns = sel_n[t];
    const float* sc = scores + sel_off[t] * nh + static_cast<int64_t>(h) * ns;
    float* p = probs + sel_off[t] * nh + static_cast<int64_t>(h) * ns;
    SoftmaxMax part;
    if (live)
        for (int jj = lane; jj < ns; jj += 32) softmax_take(part, sc[jj]);
    const float mx = softmax_max(part, sc, live);
    if (live)
        for (int jj = lane; jj < ns; jj += 32) p[jj] = nm.exp(fsub(sc[jj], mx));
    __syncwarp();
    const float sum = __shfl_sync(kFull,
                                  group_dot<float>((live && lane < 8) ? ns : 0, nm.seq,
                                                   [&](int i, float& a, float& b) {
                                                       a = p[i];
                                                       b = 1.0f;
                                                   }),
                                  0);
    __syncwarp();
    if (sums && live && lane == 0) sums[warp] = sum;
    if (live)
        for (int jj = lane; jj < ns; jj += 32) p[jj] = bf16r(fdiv(p[jj], sum));
}

// The canonical sum (not dot="sequential") where the warp's lanes hold the partial sums themselves: lane q's
// values are positions 32 m + q, i.e. chunk m / 2's element q (m even) or q + 32 (m odd), the partials
// P[q] and P[q + 32] of cdot, each in position order, then warp_fold64. Rows of up to 32 K positions keep
// their values in registers (one read, one write); K = 0: any length, the scores read three times and e
// computed twice (the same bits both times).
template <int K>
__global__ void k_mla_softmax_rows(const float* __restrict__ scores, int T, int nh, const int64_t* __restrict__ sel_off,
                                   const int* __restrict__ sel_n, float* probs, Nm nm, float* sums) {
    pdl_enter();
    const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = static_cast<int>(threadIdx.x & 31);
    if (warp >= T * nh) return;  // (whole warps: blockDim a multiple of 32)
    const int t = warp / nh, h = warp % nh;
    const int ns = sel_n[t], nl = softmax_row_lane(ns, lane);
    const float* sc = scores + sel_off[t] * nh + static_cast<int64_t>(h) * ns;
    float* p = probs + sel_off[t] * nh + static_cast<int64_t>(h) * ns;
    // (K > 0: the lane's values in groups of G, a group's work free of branches, so that its G exponentials
    // overlap; past the row a value is NaN to the max, which ignores it, and its e is +0 to the sum, where
    // fma(+0, 1, P) = P for every P the sum can hold: it starts at +0 and adds e >= 0)
    constexpr int G = K > 0 && K < 8 ? K : 8;
    auto groups = [&](auto&& f) {  // f(m) for the lane's m < K, a group at a time while the row reaches it
#pragma unroll
        for (int g0 = 0; g0 < K; g0 += G) {
            if (32 * g0 >= ns) break;  // (the warp's whole row is behind it)
#pragma unroll
            for (int m = g0; m < g0 + G; ++m) f(m);
        }
    };
    float v[K > 0 ? K : 1];
    SoftmaxMax part;
    if constexpr (K > 0) {
        groups([&](int m) {
            v[m] = m < nl ? sc[lane + 32 * m] : NAN;
            softmax_take(part, v[m]);
        });
    } else {
#pragma unroll 8
        for (int m = 0; m < nl; ++m) softmax_take(part, sc[lane + 32 * m]);
    }
    const float mx = softmax_max(part, sc, true);
    float a0 = 0.0f, a1 = 0.0f;  // P[lane], P[lane + 32]
    auto add_e = [&](int m, float e) {
        if (m & 1) a1 = fma_(e, 1.0f, a1);
        else a0 = fma_(e, 1.0f, a0);
    };
    if constexpr (K > 0) {
        groups([&](int m) {
            v[m] = m < nl ? nm.exp(fsub(v[m], mx)) : 0.0f;
            add_e(m, v[m]);
        });
    } else {
#pragma unroll 8
        for (int m = 0; m < nl; ++m) add_e(m, nm.exp(fsub(sc[lane + 32 * m], mx)));
    }
    const float sum = __shfl_sync(kFull, warp_fold64(a0, a1), 0);
    if (sums && lane == 0) sums[warp] = sum;
    if constexpr (K > 0) {
        groups([&](int m) {
            const float q = bf16r(fdiv(v[m], sum));
            if (m < nl) p[lane + 32 * m] = q;
        });
    } else {
#pragma unroll 8
        for (int m = 0; m < nl; ++m) p[lane + 32 * m] = bf16r(fdiv(nm.exp(fsub(sc[lane + 32 * m], mx)), sum));
    }
}

using SoftmaxKernel = decltype(&k_mla_softmax);
// A step's softmax kernel by its longest row: the lanes' registers up to 2048 positions, streamed beyond;
// dot="sequential" (not cdot's order) the general kernel. `name` forces one (mla_softmax_device: "general",
// "rows4", "rows16", "rows64", "stream"; "auto" the rule).
SoftmaxKernel softmax_kernel(int max_ns, bool seq, const std::string& name = "auto") {
    if (name == "general" || (name == "auto" && seq)) return k_mla_softmax;
    if (seq) throw std::invalid_argument("mla_softmax: dot=\"sequential\" takes the general kernel only, not " + name);
    const int k = name == "auto"     ? (max_ns <= 128 ? 4 : (max_ns <= 512 ? 16 : (max_ns <= 2048 ? 64 : 0)))
                  : name == "rows4"  ? 4
                  : name == "rows16" ? 16
                  : name == "rows64" ? 64
                  : name == "stream" ? 0
                                     : -1;
    if (k < 0)
        throw std::invalid_argument("mla_softmax: kernel must be auto, general, rows4, rows16, rows64 or stream, got " +
                                    name);
    if (k > 0 && max_ns > 32 * k)
        throw std::invalid_argument("mla_softmax: kernel " + name + " holds rows of up to " + std::to_string(32 * k) +
                                    " positions, got " + std::to_string(max_ns));
    return k == 4 ? k_mla_softmax_rows<4>
                  : (k == 16 ? k_mla_softmax_rows<16> : (k == 64 ? k_mla_softmax_rows<64> : k_mla_softmax_rows<0>));
}

// The probabilities of one sequence's dense prefill as k_mla_attn_lanes's o_lat reads them: Xp[((l ncp + c) 8 + g)
// ldp + t nh + h] = p[t][h][64c + 8g + l] (0 past the row's positions), for the chunks c a row's positions
// reach. A block per (chunk c, row t, 32 heads): the heads' 64 values through a padded tile, written as 32
// consecutive heads per (lane, chain).
__global__ void __launch_bounds__(256) k_probs_lanes(const float* __restrict__ probs, int nh, int ncp,
                                                     const int64_t* __restrict__ sel_off,
                                                     const int* __restrict__ sel_n, int64_t ldp, float* __restrict__ xp) {
    pdl_enter();
    __shared__ float tile[32][65];
    const int c = static_cast<int>(blockIdx.x), t = static_cast<int>(blockIdx.y), h0 = static_cast<int>(blockIdx.z) * 32;
    const int ns = sel_n[t], tid = static_cast<int>(threadIdx.x);
    if (64 * c >= ns) return;  // (uniform) never read: the row's positions end before this chunk
    const float* pr = probs + sel_off[t] * nh;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        const int i = tid + 256 * n, hh = i >> 6, j = i & 63, pos = 64 * c + j;
        tile[hh][j] = h0 + hh < nh && pos < ns ? pr[static_cast<int64_t>(h0 + hh) * ns + pos] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        const int i = tid + 256 * n, hh = i & 31, lg = i >> 5, l = lg >> 3, g = lg & 7;
        if (h0 + hh < nh)
            xp[((static_cast<int64_t>(l) * ncp + c) * 8 + g) * ldp + static_cast<int64_t>(t) * nh + h0 + hh] = tile[hh][8 * g + l];
    }
}

// mla.o_lat for short selections (ns <= kOlatShort): a thread per (t, h, k) holds the 64 partial sums
// P[g][l] in registers (fully unrolled, so no local memory): element j to P[j % 64] by FMA, chunks in
// order, then the 4/2/1 trees: the canonical cdot (cdot_serial's operations). NP < 64 (only when every
// row has ns <= NP, one chunk): P[NP..64) never receive an element and stay the constant +0, so they
// take no registers; the trees still add them (the same operations). Sequential mode: left to right.
constexpr int kOlatShort = 128;
template <int NP>
__global__ void __launch_bounds__(256) k_mla_olat_short(const float* __restrict__ probs, int nh, int r,
                                                        const int* __restrict__ sel,
                                                        const int64_t* __restrict__ sel_off,
                                                        const int* __restrict__ sel_n, const SegDev* __restrict__ segs,
                                                        const int* __restrict__ seg_of, float* o_lat, Nm nm) {
    pdl_enter();
    const int k = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    const int h = static_cast<int>(blockIdx.y), t = static_cast<int>(blockIdx.z);
    if (k >= r) return;
    const int ns = sel_n[t];
    const int* st = sel + sel_off[t];
    const float* cache = segs[seg_of[t]].c + k;
    const float* pr = probs + sel_off[t] * nh + static_cast<int64_t>(h) * ns;
    float v;
    if (!nm.seq) {
        float P[64];
#pragma unroll
        for (int q = 0; q < 64; ++q) P[q] = 0.0f;
        for (int base = 0; base < ns; base += 64) {
#pragma unroll
            for (int q = 0; q < NP; ++q) {
                const int i = base + q;
                if (i < ns) P[q] = ffma(pr[i], cache[static_cast<int64_t>(st[i]) * r], P[q]);
            }
        }
        // P[g] += P[g+w] for w = 4, 2, 1 (g < w), then P[0][l] += P[0][l+w] for w = 4, 2, 1 (l < w)
#pragma unroll
        for (int q = 0; q < 32; ++q) P[q] = fadd(P[q], P[q + 32]);
#pragma unroll
        for (int q = 0; q < 16; ++q) P[q] = fadd(P[q], P[q + 16]);
#pragma unroll
        for (int q = 0; q < 8; ++q) P[q] = fadd(P[q], P[q + 8]);
#pragma unroll
        for (int q = 0; q < 4; ++q) P[q] = fadd(P[q], P[q + 4]);
#pragma unroll
        for (int q = 0; q < 2; ++q) P[q] = fadd(P[q], P[q + 2]);
        v = fadd(P[0], P[1]);
    } else {
        v = 0.0f;
        for (int i = 0; i < ns; ++i) v = fadd(v, fmul(pr[i], cache[static_cast<int64_t>(st[i]) * r]));
    }
    o_lat[(static_cast<int64_t>(t) * nh + h) * r + k] = bf16r(v);
}

// mla.o_lat for prefill-sized steps (the same values as k_mla_olat): a block per (row t, 64 latent
// columns, 32 heads), each thread 2 heads x 4 columns, each dot (over the row's ns selected positions)
// made whole by cdot_tree_walk: partial m is the fma chain over the positions 64c + m. The walk takes
// its leaves eight at a time (j = 8s .. 8s + 7: partials m = bitrev6(j), the positions 64c + m of every
// chunk c, at most 8 x NC of them), so shared memory holds those positions' probabilities for 32 heads
// and their latent rows' 64 columns: 8 NC x 96 floats. Positions past ns are zeros (fma(0, 0, P) = P).
constexpr int kOlatHeads = 32, kOlatCols = 64, kOlatThreads = 256;
__global__ void __launch_bounds__(kOlatThreads) k_mla_olat_tiled(const float* __restrict__ probs, int nh, int r,
                                                                 const int* __restrict__ sel,
                                                                 const int64_t* __restrict__ sel_off,
                                                                 const int* __restrict__ sel_n,
                                                                 const SegDev* __restrict__ segs,
                                                                 const int* __restrict__ seg_of, float* o_lat) {
    pdl_enter();
    GLM_DYN_SMEM(float, sm);
    const int t = static_cast<int>(blockIdx.y);
    const int k0 = static_cast<int>(blockIdx.x) * kOlatCols, h0 = static_cast<int>(blockIdx.z) * kOlatHeads;
    const int ns = sel_n[t], nc = (ns + 63) / 64, slots = 8 * nc;
    float* Ps = sm;                          // [slots][32]: slot q = 8c + i <-> position 64c + bitrev6(8s + i)
    float* Cs = sm + slots * kOlatHeads;     // [slots][64]
    const int tid = static_cast<int>(threadIdx.x);
    const int* st = sel + sel_off[t];
    const float* cache = segs[seg_of[t]].c;
    const float* pr = probs + sel_off[t] * nh;
    const int th = tid >> 4, tc = tid & 15;  // heads 2 th.., columns 4 tc..
    float dots[2][4];
    cdot_tree_walk<2, 4>(dots, [&](int m, float (&v)[2][4]) {
        const int j = bitrev6(m);  // (bitrev6 is its own inverse)
        if ((j & 7) == 0) {        // a new stage: the eight partials' positions into shared memory
            const int sg = j >> 3;
            __syncthreads();       // (the previous stage's readers are done)
            for (int i = tid; i < slots * (kOlatCols / 4); i += kOlatThreads) {  // latent columns, float4
                const int q = i / (kOlatCols / 4), c4 = i % (kOlatCols / 4);
                const int pos = 64 * (q >> 3) + bitrev6(8 * sg + (q & 7)), col = k0 + 4 * c4;
                float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
                if (pos < ns && col < r) x = *reinterpret_cast<const float4*>(cache + static_cast<int64_t>(st[pos]) * r + col);
                *reinterpret_cast<float4*>(Cs + q * kOlatCols + 4 * c4) = x;
            }
            for (int i = tid; i < slots * kOlatHeads; i += kOlatThreads) {  // probabilities
                const int q = i / kOlatHeads, h = i % kOlatHeads;
                const int pos = 64 * (q >> 3) + bitrev6(8 * sg + (q & 7));
                Ps[q * kOlatHeads + h] = pos < ns && h0 + h < nh ? pr[static_cast<int64_t>(h0 + h) * ns + pos] : 0.0f;
            }
            __syncthreads();
        }
        const int i = j & 7;
        leaf_chain<0, 2, 4>(v, nc, [&](int c) { return Ps + (8 * c + i) * kOlatHeads + 2 * th; },
                         [&](int c) { return Cs + (8 * c + i) * kOlatCols + 4 * tc; });
    });
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) {
            const int h = h0 + 2 * th + hh, k = k0 + 4 * tc + cc;
            if (h < nh && k < r) o_lat[(static_cast<int64_t>(t) * nh + h) * r + k] = bf16r(dots[hh][cc]);
        }
}

// mla.o_lat[t][h][k] = bf16(cdot over rank j of (p_h[j], c[sel_j][k])). Group per (t, k, head tile).
__global__ void __launch_bounds__(256) k_mla_olat(const float* __restrict__ probs, int nh, int r,
                                                  const int* __restrict__ sel, const int64_t* __restrict__ sel_off,
                                                  const int* __restrict__ sel_n, const SegDev* __restrict__ segs,
                                                  const int* __restrict__ seg_of, float* o_lat, Nm nm) {
    pdl_enter();
    const int g = lane8();
    const int t = static_cast<int>(blockIdx.y);
    const int kk = static_cast<int>(blockIdx.x) * 32 + static_cast<int>(threadIdx.x >> 3);
    const int h0 = static_cast<int>(blockIdx.z) * HT;
    const bool live = kk < r;
    const int k = live ? kk : 0;
    const int ns = sel_n[t];
    const int* st = sel + sel_off[t];
    const float* cache = segs[seg_of[t]].c;
    const float* pr = probs + sel_off[t] * nh;
    float* out = o_lat + static_cast<int64_t>(t) * nh * r;
    if (!nm.seq) {
        float acc[HT][8];
#pragma unroll
        for (int hh = 0; hh < HT; ++hh) zero8(acc[hh]);
        const int n = live ? ns : 0;
        for (int base = 8 * g; base < n; base += 64) {
#pragma unroll
            for (int l = 0; l < 8; ++l) {
                const int i = base + l;
                if (i < n) {
                    const float cv = cache[static_cast<int64_t>(st[i]) * r + k];
#pragma unroll
                    for (int hh = 0; hh < HT; ++hh)
                        if (h0 + hh < nh) acc[hh][l] = ffma(pr[static_cast<int64_t>(h0 + hh) * ns + i], cv, acc[hh][l]);
                }
            }
        }
#pragma unroll
        for (int hh = 0; hh < HT; ++hh) {
            const float v = group_fold(acc[hh]);
            if (live && g == 0 && h0 + hh < nh) out[static_cast<int64_t>(h0 + hh) * r + k] = bf16r(v);
        }
    } else {
        for (int hh = 0; hh < HT; ++hh) {
            const int h = h0 + hh < nh ? h0 + hh : nh - 1;
            const float v = group_dot<float>(live ? ns : 0, true, [&](int i, float& a, float& b) {
                a = pr[static_cast<int64_t>(h) * ns + i];
                b = cache[static_cast<int64_t>(st[i]) * r + k];
            });
            if (live && g == 0 && h0 + hh < nh) out[static_cast<int64_t>(h) * r + k] = bf16r(v);
        }
    }
}

}  // namespace

void append_rows(Step& s, int layer, const float* src, int64_t lds, int n, int which) {
    const int T = s.T;
    auto k = k_append;
    GLM_LAUNCH(k, blocks(static_cast<int64_t>(T) * n, 256), 256, 0, src, lds, T, n, s.seg_table(layer), s.d_seg,
               s.d_pos, which);
    check_launch("append");
}

void mla_forward(Step& s, int layer, const MlaW& w, const float* x, float* out) {
    const Config& c = s.c;
    const Nm nm = s.nm;
    const int T = s.T, D = static_cast<int>(c.hidden_size);
    const int nh = static_cast<int>(c.num_attention_heads), dn = static_cast<int>(c.qk_nope_head_dim);
    const int dv = static_cast<int>(c.v_head_dim), r = static_cast<int>(c.kv_lora_rank);
    const int rq = static_cast<int>(c.q_lora_rank), kva = r + static_cast<int>(c.qk_rope_head_dim);
    const float eps = static_cast<float>(c.rms_norm_eps);
    const float scale =
        static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim)));
    s.mark("mla.proj");
    // mla.q_lat = RMSNorm(lin(q_a, x))
    float* qa = s.scratch.d<float>(static_cast<size_t>(T) * rq);
    float* q_lat = s.scratch.d<float>(static_cast<size_t>(T) * rq);
    linear(w.q_a, x, D, qa, rq, T, true, nm, s.hw8);
    rms_norm_rows(s, qa, rq, T, rq, w.q_a_norm, eps, q_lat, rq);
    s.emit(layer, S_MLA_Q_LAT, q_lat, rq, {rq});
    // mla.q = lin(q_b, q_lat)
    float* q = s.scratch.d<float>(static_cast<size_t>(T) * nh * dn);
    linear(w.q_b, q_lat, rq, q, static_cast<int64_t>(nh) * dn, T, true, nm, s.hw8);
    s.emit(layer, S_MLA_Q, q, static_cast<int64_t>(nh) * dn, {static_cast<int64_t>(nh) * dn});
    // mla.c = RMSNorm(lin(kv_a, x)[:r]) -> appended to the latent cache
    float* kv = s.scratch.d<float>(static_cast<size_t>(T) * kva);
    float* lat = s.scratch.d<float>(static_cast<size_t>(T) * r);
    linear(w.kv_a, x, D, kv, kva, T, true, nm, s.hw8);
    rms_norm_rows(s, kv, kva, T, r, w.kv_a_norm, eps, lat, r);
    s.emit(layer, S_MLA_C, lat, r, {r});
    append_rows(s, layer, lat, r, r, 0);
    // mla.q_abs[t][h][k] = bf16(cdot(W_UK_h^T[k], q_h))
    float* q_abs = s.scratch.d<float>(static_cast<size_t>(T) * nh * r);
    linear_heads(w.w_uk_t, nh * r, r, r, 0, q, static_cast<int64_t>(nh) * dn, dn, q_abs, static_cast<int64_t>(nh) * r, T,
                 true, nm, s.hw8);
    s.emit(layer, S_MLA_Q_ABS, q_abs, static_cast<int64_t>(nh) * r, {nh, r});

    // the selection: this layer's indexer, or the previous full layer's (shared layers)
    s.mark("mla.indexer");
    if (w.has_indexer) indexer_select(s, layer, w, x, q_lat);
    if (!s.have_sel) throw std::logic_error("MLA layer without a selection (shared layer with no full layer before it)");
    s.mark("mla.attention");
    {
        std::vector<std::vector<int64_t>> shapes(static_cast<size_t>(T));
        for (int t = 0; t < T; ++t) shapes[static_cast<size_t>(t)] = {s.sel_n[static_cast<size_t>(t)]};
        s.emit_var(layer, S_MLA_SELECTED, s.d_sel, s.sel_off, shapes);
        for (int t = 0; t < T; ++t) {
            if (s.inject_element(layer, S_MLA_SELECTED, t) < 0) continue;  // an injected position must exist
            const int len = static_cast<int>(s.segs[static_cast<size_t>(s.seg_of[static_cast<size_t>(t)])].pos0 +
                                             s.segs[static_cast<size_t>(s.seg_of[static_cast<size_t>(t)])].n);
            std::vector<int> row(static_cast<size_t>(s.sel_n[static_cast<size_t>(t)]));
            check(cudaMemcpy(row.data(), s.d_sel + s.sel_off[static_cast<size_t>(t)], row.size() * sizeof(int),
                             cudaMemcpyDeviceToHost),
                  "selection read-back");
            for (int tau : row)
                if (tau < 0 || tau >= len)
                    throw std::invalid_argument("inject: mla.selected now holds position " + std::to_string(tau) +
                                                ", outside the cache [0, " + std::to_string(len) + ")");
        }
    }
    int max_ns = 1;
    for (int64_t n : s.sel_n) max_ns = std::max(max_ns, static_cast<int>(n));
    float* scores = s.scratch.d<float>(static_cast<size_t>(s.sel_total) * nh);
    float* probs = s.scratch.d<float>(static_cast<size_t>(s.sel_total) * nh);
    SegDev* segs = s.seg_table(layer);
    const unsigned ntile = static_cast<unsigned>((nh + HT - 1) / HT);
    // one sequence's prefill over a dense selection (row t's j-th position is j): mla.scores and mla.o_lat
    // as lane-pass products (k_mla_attn_lanes)
    // (k_mla_attn_lanes keeps its pieces' offsets in 32 bits: 32 rows of the re-laid q_abs, T nh + 96 floats
    // apart, and of the re-laid latent rows; larger steps take the tiled kernels)
    const bool offsets32 = (static_cast<int64_t>(T) * nh + 96) * 32 < (int64_t{1} << 31) &&
                           (static_cast<int64_t>(max_ns) + 64) * 32 < (int64_t{1} << 31);
    const bool lanes = launch_options().attn_tiled && !nm.seq && T >= 64 && r % 64 == 0 && r <= 512 && nh % 4 == 0 &&
                       s.sel_dense && !s.injects(layer, S_MLA_SELECTED) && s.segs.size() == 1 && offsets32;
    const float* cache_c = lanes ? s.segs[0].seq->mla[static_cast<size_t>(layer)].c.as<float>() : nullptr;
    const int64_t ldq = (static_cast<int64_t>(T) * nh + 64 + 31) / 32 * 32;  // (a last head tile reads 64 rows on)
    {
        // one sequence's prefill over a dense selection: the lane-pass product (x_lanes re-lays q_abs and
        // the latent rows its rows see); other prefill-sized steps: the tiled kernel (unless attn_tiled is
        // off); else positions per warp: one while the grid is small (latency), four once it is large (q_abs reuse)
        if (lanes) {
            static const decltype(&k_mla_attn_lanes<true, 1>) kByChunks[] = {
                k_mla_attn_lanes<true, 1>, k_mla_attn_lanes<true, 2>, k_mla_attn_lanes<true, 3>, k_mla_attn_lanes<true, 4>,
                k_mla_attn_lanes<true, 5>, k_mla_attn_lanes<true, 6>, k_mla_attn_lanes<true, 7>, k_mla_attn_lanes<true, 8>};
            static const size_t kSmem[] = {sl_smem_bytes<1>(), sl_smem_bytes<2>(), sl_smem_bytes<3>(), sl_smem_bytes<4>(),
                                           sl_smem_bytes<5>(), sl_smem_bytes<6>(), sl_smem_bytes<7>(), sl_smem_bytes<8>()};
            const int nch = r / 64;
            const int64_t ldc = (static_cast<int64_t>(max_ns) + 63) / 64 * 64;
            float* xq = s.scratch.d<float>(static_cast<size_t>(ldq) * r);
            float* xc = s.scratch.d<float>(static_cast<size_t>(ldc) * r);
            x_lanes(q_abs, r, T * nh, nch, ldq, xq);
            x_lanes(cache_c, r, max_ns, nch, ldc, xc);
            auto k = kByChunks[nch - 1];
            allow_smem(k, kSmem[nch - 1]);
            const AttnLanes al{xq, ldq, nch, xc, ldc, nh, r, s.d_sel_off, s.d_sel_n, scale, scores};
            GLM_LAUNCH(k, dim3(static_cast<unsigned>(ldc / 64), T, static_cast<unsigned>((nh + 63) / 64)), kSlThreads,
                       kSmem[nch - 1], al);
        } else if (launch_options().attn_tiled && !nm.seq && T >= 16 && r % 4 == 0 && r <= 512) {
            static const decltype(&k_mla_scores_tiled<1>) kByChunks[] = {
                k_mla_scores_tiled<1>, k_mla_scores_tiled<2>, k_mla_scores_tiled<3>, k_mla_scores_tiled<4>,
                k_mla_scores_tiled<5>, k_mla_scores_tiled<6>, k_mla_scores_tiled<7>, k_mla_scores_tiled<8>};
            auto k = kByChunks[(r + 63) / 64 - 1];
            const size_t smem = static_cast<size_t>((r + 63) / 64) * 64 * (kAttnHeads + kAttnPos) * 4;
            allow_smem(k, smem);
            GLM_LAUNCH(k, dim3(blocks(max_ns, kAttnPos), T, static_cast<unsigned>((nh + kAttnHeads - 1) / kAttnHeads)),
                       kAttnThreads, smem, q_abs, nh, r, s.d_sel, s.d_sel_off, s.d_sel_n, segs, s.d_seg, scale, scores);
        } else if (static_cast<int64_t>(max_ns) * T * ntile <= 8192) {
            auto k = k_mla_scores<1>;
            GLM_LAUNCH(k, dim3(max_ns, T, ntile), 256, 0, q_abs, nh, r, s.d_sel, s.d_sel_off, s.d_sel_n, segs, s.d_seg,
                       scale, scores, nm);
        } else {
            auto k = k_mla_scores<4>;
            GLM_LAUNCH(k, dim3(blocks(max_ns, 4), T, ntile), 256, 0, q_abs, nh, r, s.d_sel, s.d_sel_off, s.d_sel_n,
                       segs, s.d_seg, scale, scores, nm);
        }
        check_launch("mla_scores");
    }
    std::vector<int64_t> off(static_cast<size_t>(T));
    std::vector<std::vector<int64_t>> shapes(static_cast<size_t>(T));
    for (int t = 0; t < T; ++t) {
        off[static_cast<size_t>(t)] = s.sel_off[static_cast<size_t>(t)] * nh;
        shapes[static_cast<size_t>(t)] = {nh, s.sel_n[static_cast<size_t>(t)]};
    }
    s.emit_var(layer, S_MLA_SCORES, scores, off, shapes);
    {
        auto k = softmax_kernel(max_ns, nm.seq);
        GLM_LAUNCH(k, blocks(static_cast<int64_t>(T) * nh * 32, 256), 256, 0, scores, T, nh, s.d_sel_off, s.d_sel_n,
                   probs, nm, static_cast<float*>(nullptr));
        check_launch("mla_softmax");
    }
    s.emit_var(layer, S_MLA_PROBS, probs, off, shapes);
    float* o_lat = s.scratch.d<float>(static_cast<size_t>(T) * nh * r);
    {
        const size_t olat_smem = static_cast<size_t>(8 * ((max_ns + 63) / 64)) * (kOlatHeads + kOlatCols) * 4;
        if (lanes) {
            const int ncp = (max_ns + 63) / 64;
            float* xp = s.scratch.d<float>(static_cast<size_t>(ldq) * ncp * 64);
            auto kp = k_probs_lanes;
            GLM_LAUNCH(kp, dim3(static_cast<unsigned>(ncp), T, static_cast<unsigned>((nh + 31) / 32)), 256, 0, probs, nh,
                       ncp, s.d_sel_off, s.d_sel_n, ldq, xp);
            check_launch("mla_probs_lanes");
            auto k = k_mla_attn_lanes<false, kOlSlab>;
            allow_smem(k, sl_smem_bytes<kOlSlab>());
            const AttnLanes al{xp, ldq, ncp, cache_c, r, nh, r, s.d_sel_off, s.d_sel_n, 1.0f, o_lat};
            GLM_LAUNCH(k, dim3(static_cast<unsigned>((r + 63) / 64), T, static_cast<unsigned>((nh + 63) / 64)), kSlThreads,
                       sl_smem_bytes<kOlSlab>(), al);
        } else if (launch_options().attn_tiled && !nm.seq && T >= 16 && r % 4 == 0 && olat_smem <= 200 * 1024) {
            // prefill-sized steps: the tiled kernel (unless attn_tiled is off), short selections included
            auto k = k_mla_olat_tiled;
            allow_smem(k, olat_smem);
            GLM_LAUNCH(k, dim3(blocks(r, kOlatCols), T, static_cast<unsigned>((nh + kOlatHeads - 1) / kOlatHeads)),
                       kOlatThreads, olat_smem, probs, nh, r, s.d_sel, s.d_sel_off, s.d_sel_n, segs, s.d_seg, o_lat);
        } else if (max_ns <= kOlatShort) {
            auto k = max_ns <= 32 ? k_mla_olat_short<32> : k_mla_olat_short<64>;
            const int thr = r >= 256 ? 256 : (r + 31) / 32 * 32;
            GLM_LAUNCH(k, dim3(blocks(r, thr), nh, T), thr, 0, probs, nh, r, s.d_sel, s.d_sel_off, s.d_sel_n, segs,
                       s.d_seg, o_lat, nm);
        } else {
            auto k = k_mla_olat;
            GLM_LAUNCH(k, dim3(blocks(r, 32), T, ntile), 256, 0, probs, nh, r, s.d_sel, s.d_sel_off, s.d_sel_n, segs,
                       s.d_seg, o_lat, nm);
        }
        check_launch("mla_olat");
    }
    s.emit(layer, S_MLA_O_LAT, o_lat, static_cast<int64_t>(nh) * r, {nh, r});

    s.mark("mla.out");
    // mla.o: o_h = lin(W_UV_h, o_lat_h), W_UV_h = rows h(d_n+d_v) + d_n + [0, d_v) of kv_b_proj
    float* o = s.scratch.d<float>(static_cast<size_t>(T) * nh * dv);
    linear_heads(w.kv_b, nh * dv, dv, dn + dv, dn, o_lat, static_cast<int64_t>(nh) * r, r, o,
                 static_cast<int64_t>(nh) * dv, T, true, nm, s.hw8);
    s.emit(layer, S_MLA_O, o, static_cast<int64_t>(nh) * dv, {static_cast<int64_t>(nh) * dv});
    // mla.out = lin(o_proj, o)
    linear(w.o_proj, o, static_cast<int64_t>(nh) * dv, out, D, T, true, nm, s.hw8);
    s.emit(layer, S_MLA_OUT, out, D, {D});
}

MlaSoftmax mla_softmax_device(const float* scores, const std::vector<int>& lens, int nh, const std::string& kernel) {
    const int T = static_cast<int>(lens.size());
    if (T < 1 || nh < 1) throw std::invalid_argument("mla_softmax: at least one row of lengths and one head");
    std::vector<int64_t> off(static_cast<size_t>(T));
    int64_t total = 0;
    int max_ns = 1;
    for (int t = 0; t < T; ++t) {
        if (lens[t] < 1) throw std::invalid_argument("mla_softmax: lens must be >= 1, got " + std::to_string(lens[t]));
        off[t] = total;
        total += lens[t];
        max_ns = std::max(max_ns, lens[t]);
    }
    const auto k = softmax_kernel(max_ns, false, kernel);
    const size_t bytes = static_cast<size_t>(total) * nh * 4;
    DBuf ds(bytes), dp(bytes), doff(static_cast<size_t>(T) * 8), dn(static_cast<size_t>(T) * 4),
        dsum(static_cast<size_t>(T) * nh * 4);
    check(cudaMemcpy(ds.p, scores, bytes, cudaMemcpyHostToDevice), "mla_softmax");
    check(cudaMemcpy(doff.p, off.data(), static_cast<size_t>(T) * 8, cudaMemcpyHostToDevice), "mla_softmax");
    check(cudaMemcpy(dn.p, lens.data(), static_cast<size_t>(T) * 4, cudaMemcpyHostToDevice), "mla_softmax");
    GLM_LAUNCH(k, blocks(static_cast<int64_t>(T) * nh * 32, 256), 256, 0, ds.as<float>(), T, nh, doff.as<int64_t>(),
               dn.as<int>(), dp.as<float>(), Nm{}, dsum.as<float>());
    check_launch("mla_softmax");
    MlaSoftmax out;
    out.probs.resize(static_cast<size_t>(total) * nh);
    out.sums.resize(static_cast<size_t>(T) * nh);
    check(cudaMemcpy(out.probs.data(), dp.p, bytes, cudaMemcpyDeviceToHost), "mla_softmax");
    check(cudaMemcpy(out.sums.data(), dsum.p, out.sums.size() * 4, cudaMemcpyDeviceToHost), "mla_softmax");
    return out;
}

}  // namespace glm::cuda
