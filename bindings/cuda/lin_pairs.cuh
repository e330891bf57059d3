// The few-pair expert kernel (k_linear_pairs: routed-expert items of up to eight pairs, FP8 and MXFP4).
// Part of weights.cu's translation unit (included there once, inside its anonymous namespace, so
// that every kernel keeps one definition and its name); not a header for other files.
#pragma once

namespace glm::cuda {
namespace {

// ---- the few-pair expert kernel -----------------------------------------------------------------
//
// Decode batches leave most routed experts one to four pairs (b32: ~1.5 a chosen expert, b128 ~3.6).
// The register-tiled kernel (lin_gemm.cuh) decodes each weight once into a transposed shared-memory
// tile that 8 or 16 tokens then read, which pays for itself from ~8 pairs; with one or two pairs the
// decode, its scalar transposed stores and the loads back are most of its instructions (a b32 step's
// experts ran at ~2.3 TB/s, a b128 step's at ~1.7). Here the raw rows arrive by cp.async as there, and
// each weight is decoded straight into the register of the one thread that multiplies it:
//
//   * a block: 64 rows x an item's pairs (up to 8); 512 threads, 16 warps;
//   * a thread owns chains 4q .. 4q + 3 (q = lane % 16) of two rows, i and i + 8 (i = a + 4 (lane / 16),
//     a = warp % 4 + 16 (warp / 4)): per chunk one 32-bit load of each row's four codes (a warp's two
//     half-warp rows lie 16 banks apart: rows four apart, 272-byte rows), the item's x rows read as
//     16-byte pieces (a quarter warp 128 contiguous bytes), 8 FMAs a pair: each the next step of its
//     chain in chunk order (cdot's P[g][l], k = 8g + l);
//   * the fold in registers: an output's 64 chains lie in the 16 lanes of one half warp, lane q holding
//     g = q / 2, l = 4 (q % 2) .. + 3, so cdot's accumulator tree (P[g] += P[g + w], w = 4, 2, 1) adds
//     lanes 8, 4, 2 apart, its lane tree's first step (w = 4) lanes 1 apart, and its last two steps (w = 2,
//     1) are adds within a lane: every addition the canonical fold's own (a butterfly over the outputs:
//     fold_level).
//
// MXFP4 (session 31): the thread's four columns are two bytes of a row, and its rows' E8M0 scales (one a
// 32-column block, [row][C / 32] bytes) arrive beside the codes: a slab's 16 scale bytes of a row are one
// 16-byte copy into the row's pad, so every slab is whole (pairs_applies: C a multiple of 512).
//
// An item computes its pairs rounded up to 1, 2, 3, 4, 6 or 8 (the slab loop specialised on the count;
// b128 leaves an expert ~3.6 pairs, so powers of two computed ~20 % more slots than pairs). A block's
// items follow each other without a drain: the next item's table is filled while the item multiplies,
// and its first slabs are requested during the item's last (the staging order, in the kernel).
constexpr int kPrThreads = 512;
constexpr int kPrRows = 64;   // rows per block
constexpr int kPrPairs = 8;   // pair slots per item
constexpr int kPrSlab = 8;    // chunks per slab (512 contiguous bytes of each row)
constexpr int kPrStages = 4;  // cp.async stages (three slabs in flight: 96 KB of weights an SM)
constexpr int kPrScaleBlocks = 256;  // 128-column scale blocks of a row at most (C <= 32768: pairs_applies)
template <int FMT>
constexpr int pr_wraw() {  // bytes per staged raw row (+16: rows four apart 16 banks apart; MXFP4: the slab's scales)
    return kPrSlab * chunk_bytes<FMT>() + 16;
}
constexpr int kPrXRow = kPrSlab * 64 + 4;  // floats per staged x row
template <int FMT>
constexpr int pr_stage_bytes() {
    return kPrRows * pr_wraw<FMT>() + kPrPairs * kPrXRow * 4;
}
template <int FMT>
constexpr int pr_smem_bytes() {
    return kPrStages * pr_stage_bytes<FMT>();
}

// Four FP8 codes (bytes 0..3 of v: four consecutive columns) times the chunk's multiplier m
// (fp8_mult of its scale), as decode_raw8 decodes them.
template <int DEC>
GLM_DEV void decode4_fp8(uint32_t v, float m, float (&w)[4]) {
    if constexpr (DEC == kDecInt) {
        w[0] = e4m3_int<0>(v);
        w[1] = e4m3_int<1>(v);
        w[2] = e4m3_int<2>(v);
        w[3] = e4m3_int<3>(v);
    } else {
        e4m3x2<DEC == kDecHw, 0>(v, w[0], w[1]);
        e4m3x2<DEC == kDecHw, 1>(v, w[2], w[3]);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) w[c] = fmul(w[c], m);
}
// Four MXFP4 codes (the low 16 bits of v: four consecutive columns, the first in the lowest nibble) times
// the block's multiplier m (e8m0 of its scale; e8m0_folded with kDecInt), as decode_raw8 decodes them.
template <int DEC>
GLM_DEV void decode4_mxfp4(uint32_t v, float m, float (&w)[4]) {
    if constexpr (DEC == kDecInt) {  // codes 0 and 1 to bits 0 and 4, 2 and 3 to bits 16 and 20 (e2m1_pair's L, L + 4)
        const uint32_t t = __byte_perm(v, 0u, 0x4140);
        e2m1_pair<0>(t, w[0], w[2]);
        e2m1_pair<1>(t, w[1], w[3]);
#pragma unroll
        for (int c = 0; c < 4; ++c) w[c] = fmul(w[c], m);
    } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) w[c] = mxfp4_w((v >> (4 * c)) & 15u, m);
    }
}

// One step of the few-pair kernel's fold (k_linear_pairs): the lane holds N outputs (v's slots 0 .. N - 1,
// four values each), its partner is lane ^ d. N even: the lower lane (hi false) keeps slots 0 .. N/2 - 1, the
// upper the rest (moved to 0 .. N/2 - 1: first, the output in slot 0, moves with them), each adding its
// partner's values of them; N odd: both add all (the same sums: addition commutes bit for bit), and only
// the lower lane stores them (mine).
constexpr int fold_halves(int n) { return n % 2 == 0 ? n / 2 : n; }
template <int N, int O>
GLM_DEV void fold_level(float (&v)[O][4], int d, bool hi, int& first, bool& mine) {
    if constexpr (N % 2 == 0) {
        constexpr int H = N / 2;
#pragma unroll
        for (int i = 0; i < H; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const float send = hi ? v[i][c] : v[i + H][c];
                const float keep = hi ? v[i + H][c] : v[i][c];
                v[i][c] = add(keep, __shfl_xor_sync(kFull, send, d));
            }
        if (hi) first += H;
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) v[i][c] = add(v[i][c], __shfl_xor_sync(kFull, v[i][c], d));
        mine = mine && !hi;
    }
}

template <int FMT, int DEC>
__global__ void __launch_bounds__(kPrThreads, 1) k_linear_pairs(LinArgs a) {
    pdl_enter();
    static_assert(FMT == W_FP8 || FMT == W_MXFP4, "FP8 or MXFP4 experts");
    GLM_DYN_SMEM(unsigned char, sm);
    constexpr int CB = chunk_bytes<FMT>(), WRAW = pr_wraw<FMT>(), SB = pr_stage_bytes<FMT>();
    constexpr int S = kPrSlab, ST = kPrStages, BM = kPrRows, BN = kPrPairs;
    constexpr int PPR = S * CB / 16;                            // 16-byte pieces of a raw row per slab
    constexpr int NWP = BM * PPR / kPrThreads;                  // weight pieces a thread copies per slab
    constexpr int XPR = S * 64 / 4;                             // pieces of an x row per slab
    constexpr int NXP = BN * XPR / kPrThreads;                 // x pieces a thread copies per slab
    static_assert(BM * PPR % kPrThreads == 0 && BN * XPR % kPrThreads == 0, "whole copies");
    static_assert((ST & (ST - 1)) == 0, "stages a power of two (a slab's stage by a mask)");
    // The item tables, two: the item being multiplied reads one while the next item's are filled into the
    // other (at its first slab), so that its first slabs can be requested during this one's last (below).
    // Per table: its rows, its pairs' x rows, its chunk multipliers (fp8_mult of its rows' scales, one a
    // 128-column block; read from global memory a slab ahead, they left each slab's first chunk waiting on
    // a load: ncu at 128 tokens, 13 % of the stalls long-scoreboard), its first pair and count.
    __shared__ const unsigned char* rowp[2][BM];
    __shared__ const float* xrow[2][BN];
    __shared__ float mult[2][FMT == W_FP8 ? kPrScaleBlocks : 1];
    __shared__ const uint8_t* sclp[2][FMT == W_MXFP4 ? BM : 1];  // MXFP4: the rows' scales
    __shared__ int first_cnt[2][2];
    (void)mult;  // (read in the slab loop, a generic lambda, which GCC's set-but-unused warning misses)
    (void)sclp;
    const int64_t C = a.C;
    const int nchunks = static_cast<int>(C / 64);
    const int nst = (nchunks + S - 1) / S;
    const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
    const int q = lane & 15;                                    // chains 4q .. 4q + 3
    const int r0 = (warp & 3) + 16 * (warp >> 2) + 4 * (lane >> 4), r1 = r0 + 8;
    const int row_base = static_cast<int>(blockIdx.x) * BM;
    const int64_t rb = row_bytes(FMT, C);
    auto abs_row = [&](int r) {  // rows past R read the last row (computed, never stored)
        return a.row0 + static_cast<int64_t>(r < a.R ? r : a.R - 1);
    };
    // FP8: the block's rows lie in one 128-row scale block (pairs_applies: row0 % 64 == 0)
    const int64_t srow = (abs_row(row_base) / 128) * ((C + 127) / 128);
    (void)srow;
    const int n_items = *a.n_items;
    const int stride = static_cast<int>(gridDim.y);
    int item = static_cast<int>(blockIdx.y);
    if (item >= n_items) return;
    // item it's table into tb (no barrier: the caller orders it before its readers and after the table's
    // last readers)
    auto fill = [&](int it, int tb) {
        const ExpertItem e = expert_item(a, it);
        if constexpr (FMT == W_FP8) {
            for (int b = tid; b < (nchunks + 1) / 2; b += kPrThreads)
                mult[tb][b] = fp8_mult<DEC>(__ldg(static_cast<const float*>(e.scale) + srow + b));
        } else {
            if (tid < BM) sclp[tb][tid] = static_cast<const uint8_t*>(e.scale) + abs_row(row_base + tid) * (C / 32);
        }
        if (tid < BM) rowp[tb][tid] = static_cast<const unsigned char*>(e.data) + abs_row(row_base + tid) * rb;
        if (tid < BN) xrow[tb][tid] = a.X + pair_xrow(a, a.pairs[e.start + (tid < e.cnt ? tid : e.cnt - 1)]) * a.ldx;
        if (tid == 0) first_cnt[tb][0] = e.start, first_cnt[tb][1] = e.cnt;
    };
    // this thread's pieces of table tb's item: weight piece p = tid + n * threads (row p / PPR, bytes 16 (p %
    // PPR)); x piece p likewise (pair slot p / XPR, floats 4 (p % XPR)), copied for the item's pairs only
    const unsigned char* wsrc[NWP];
    int wdst[NWP];
    const uint8_t* ssrc = nullptr;  // MXFP4, threads < BM: row tid's scales (a slab's 16 bytes into its pad)
    (void)ssrc;
    const float* xsrc[NXP];
    int xdst[NXP];
    bool xlive[NXP];
    auto set_copies = [&](int tb) {
        const int n_live = first_cnt[tb][1];
#pragma unroll
        for (int n = 0; n < NWP; ++n) {
            const int p = tid + n * kPrThreads;
            wsrc[n] = rowp[tb][p / PPR] + 16 * (p % PPR);
            wdst[n] = (p / PPR) * WRAW + 16 * (p % PPR);
        }
#pragma unroll
        for (int n = 0; n < NXP; ++n) {
            const int p = tid + n * kPrThreads, j = p / XPR;
            xsrc[n] = xrow[tb][j] + 4 * (p % XPR);
            xdst[n] = BM * WRAW + 4 * (j * kPrXRow + 4 * (p % XPR));
            xlive[n] = j < n_live;
        }
        if constexpr (FMT == W_MXFP4) {
            if (tid < BM) ssrc = sclp[tb][tid];
        }
    };
    const uint32_t sm_s = smem_u32(sm);
    auto issue = [&](int s, int stage) {  // slab s of the copies' item into stage (a last slab of fewer chunks: only its own pieces)
        const int c0 = s * S, nc = nchunks - c0 < S ? nchunks - c0 : S;
        const uint32_t buf = sm_s + static_cast<uint32_t>(stage * SB);
#pragma unroll
        for (int n = 0; n < NWP; ++n) {
            const int p = tid + n * kPrThreads;
            if (nc == S || p % PPR < nc * CB / 16) cp_async16_s(buf + wdst[n], wsrc[n] + static_cast<int64_t>(c0) * CB);
        }
#pragma unroll
        for (int n = 0; n < NXP; ++n) {
            const int p = tid + n * kPrThreads;
            if (xlive[n] && (nc == S || p % XPR < nc * 16)) cp_async16_s(buf + xdst[n], xsrc[n] + 64 * static_cast<int64_t>(c0));
        }
        if constexpr (FMT == W_MXFP4) {  // (whole slabs: 2 S scale bytes)
            if (tid < BM) cp_async16_s(buf + static_cast<uint32_t>(tid * WRAW + S * CB), ssrc + 2 * c0);
        }
    };
    // Slabs are staged in the order the block multiplies them, across its items: slab s of an item whose
    // first slab is the block's slab number g0 takes stage (g0 + s) % ST (base = g0 % ST). Where an item
    // has ST slabs or more (chain), its last ST - 1 slabs request the next item's first ST - 1, so the
    // weights in flight do not drain at each item's end; the next item's table, filled at the item's
    // first slab, is read for them from its second (a barrier apart). Else each item's first slabs are
    // requested at its start, after a barrier.
    const bool chain = nst >= ST;
    int tb = 0, base = 0;
    bool ahead = false;  // the item's first ST - 1 slabs already requested (by the item before)
    fill(item, 0);
    float acc[2][4][BN];  // [row r0, r1][chain 4q + c][pair slot]
    auto slabs = [&](auto np_, bool has_next, int next) {
        constexpr int NP = decltype(np_)::value;
        for (int s = 0; s < nst; ++s) {
            cp_async_wait<ST - 2>();
            __syncthreads();  // slab s landed for every thread's copies; slab s - 1's stage is free
            const int stage = (base + s) & (ST - 1);
            if (s + ST - 1 < nst) {
                issue(s + ST - 1, (stage + ST - 1) & (ST - 1));
            } else if (chain && has_next) {
                if (s + ST - 1 == nst) set_copies(tb ^ 1);  // (s >= 1: the fill at slab 0 is a barrier behind)
                issue(s + ST - 1 - nst, (stage + ST - 1) & (ST - 1));
            }
            cp_async_commit();
            if (s == 0 && has_next) fill(next, tb ^ 1);  // (the previous item's readers of that table are done)
            const unsigned char* buf = sm + stage * SB;
            const float* xs = reinterpret_cast<const float*>(buf + BM * WRAW);
            const float* const m_item = mult[tb];
            (void)m_item;
            const int nc = nchunks - s * S < S ? nchunks - s * S : S;
            auto chunk = [&](int u) {
                float w0[4], w1[4];
                if constexpr (FMT == W_FP8) {
                    const uint32_t v0 = *reinterpret_cast<const uint32_t*>(buf + r0 * WRAW + u * CB + 4 * q);
                    const uint32_t v1 = *reinterpret_cast<const uint32_t*>(buf + r1 * WRAW + u * CB + 4 * q);
                    const float m = m_item[(s * S + u) >> 1];
                    decode4_fp8<DEC>(v0, m, w0);
                    decode4_fp8<DEC>(v1, m, w1);
                } else {  // columns 4q .. 4q + 3: bytes 2q, 2q + 1 of the chunk; scale 2u + q / 8 of the slab's
                    const uint32_t v0 = *reinterpret_cast<const uint16_t*>(buf + r0 * WRAW + u * CB + 2 * q);
                    const uint32_t v1 = *reinterpret_cast<const uint16_t*>(buf + r1 * WRAW + u * CB + 2 * q);
                    const uint32_t e0 = buf[r0 * WRAW + S * CB + 2 * u + (q >> 3)];
                    const uint32_t e1 = buf[r1 * WRAW + S * CB + 2 * u + (q >> 3)];
                    decode4_mxfp4<DEC>(v0, DEC == kDecInt ? e8m0_folded(e0) : e8m0(e0), w0);
                    decode4_mxfp4<DEC>(v1, DEC == kDecInt ? e8m0_folded(e1) : e8m0(e1), w1);
                }
#pragma unroll
                for (int j = 0; j < NP; ++j) {
                    const float4 x = *reinterpret_cast<const float4*>(xs + j * kPrXRow + 64 * u + 4 * q);
                    const float xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        acc[0][c][j] = ffma(w0[c], xv[c], acc[0][c][j]);
                        acc[1][c][j] = ffma(w1[c], xv[c], acc[1][c][j]);
                    }
                }
            };
            if (nc == S) {
#pragma unroll
                for (int u = 0; u < S; ++u) chunk(u);
            } else {
#pragma unroll 1
                for (int u = 0; u < nc; ++u) chunk(u);
            }
        }
    };
    // The fold, in registers: an output's 64 chains lie in the 16 lanes of a half warp (above), and every
    // step of cdot's trees adds the values of two lanes (q, q ^ d: d = 8, 4, 2 the accumulator tree's w = 4,
    // 2, 1; d = 1 the lane tree's w = 4) element by element. As a butterfly (fold_level): where the lane's
    // outputs split evenly, each lane of a pair keeps half of them and takes its partner's values of that
    // half (one shuffle an element, the elements halving each step), else both take all (the same sums,
    // one lane stores them). Then the lane tree's last two steps within the lane. (A shuffle tree for each
    // output, lanes q < d adding, was 11 % of the kernel's instructions at 128 tokens.)
    auto fold = [&](auto np_, int fstart, int fcnt) {
        constexpr int NP = decltype(np_)::value, O = 2 * NP;  // output o: row r0 / r1 (o / NP), slot o % NP
        float v[O][4];
#pragma unroll
        for (int o = 0; o < O; ++o)
#pragma unroll
            for (int c = 0; c < 4; ++c) v[o][c] = acc[o / NP][c][o % NP];
        int first = 0;     // the output in this lane's slot 0
        bool mine = true;  // whether this lane stores its outputs
        constexpr int N1 = fold_halves(O), N2 = fold_halves(N1), N3 = fold_halves(N2), N4 = fold_halves(N3);
        fold_level<O>(v, 8, (q & 8) != 0, first, mine);
        fold_level<N1>(v, 4, (q & 4) != 0, first, mine);
        fold_level<N2>(v, 2, (q & 2) != 0, first, mine);
        fold_level<N3>(v, 1, (q & 1) != 0, first, mine);
        float* const Y = blockIdx.z != 0 ? a.Y2 : a.Y;
#pragma unroll
        for (int i = 0; i < N4; ++i) {
            const int o = first + i, r = o >= NP, j = o - r * NP;
            const float y = add(add(v[i][0], v[i][2]), add(v[i][1], v[i][3]));
            const int row = row_base + (r ? r1 : r0);
            if (mine && j < fcnt && row < a.R) Y[static_cast<int64_t>(a.pairs[fstart + j]) * a.ldy + row] = a.round ? bf16r(y) : y;
        }
    };
    for (;;) {
        if (!ahead) {
            __syncthreads();  // the item's table filled; every thread done with the stages
            set_copies(tb);
            for (int j = 0; j < ST - 1; ++j) {
                if (j < nst) issue(j, (base + j) & (ST - 1));
                cp_async_commit();
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c)
#pragma unroll
                for (int j = 0; j < BN; ++j) acc[r][c][j] = 0.0f;
        const int fstart = first_cnt[tb][0], fcnt = first_cnt[tb][1];
        const int next = item + stride;
        const bool has_next = next < n_items;
        with_slots8(fcnt, [&](auto np_) {
            slabs(np_, has_next, next);
            fold(np_, fstart, fcnt);
        });
        if (!has_next) break;
        item = next;
        tb ^= 1;
        base = (base + nst) & (ST - 1);
        ahead = chain;
    }
    cp_async_wait<0>();
}

}  // namespace
}  // namespace glm::cuda
