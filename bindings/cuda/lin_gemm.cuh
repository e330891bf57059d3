// The register-tiled several-token kernel (k_linear_gemm).
// Part of weights.cu's translation unit (included there once, inside its anonymous namespace, so
// that every kernel keeps one definition and its name); not a header for other files.
#pragma once

namespace glm::cuda {
namespace {

// ---- the register-tiled kernel ------------------------------------------------------------------
//
// Y[t][r] = cdot(W[r], X[t]) for a tile of rows x tokens (or an expert work item's pairs). Each output
// is 64 FMA chains P[g][l] (chain k = 8g + l takes the columns 64c + k, c in order); chains, rows and
// tokens are independent, so this is 64 small GEMMs of depth C/64 side by side, one per chain, whose
// results are folded by the canonical trees once at the end. A thread owns 4 consecutive chains
// (q = 2g + h: chains 8g + 4h .. + 3) of 4 rows x 4 tokens (kGmTG = 4; 8 x 2 for expert items of eight
// pairs): 64 accumulators fed per chunk by 4 + 4 vector loads from shared memory (16 FMAs per loaded
// float4, every one a step of its own chain in chunk order). Warp w holds g = w % 8 (both halves h) of
// a 16-row set: within a warp the 4 x 16-byte words of a load are 8 distinct ones (one wavefront).
//
// Per slab of S chunks (gm_slab): the block's weight rows (raw bytes) and its tokens' x rows (f32)
// arrive by cp.async (gm_stages: up to two slabs in flight); each weight of a slab is decoded ONCE
// into an f32 slab in shared memory (every token of the tile reads that one value), exactly as the
// other kernels decode it in registers (decode_smem), one slab ahead of its use (two decoded buffers,
// one barrier per slab); the x rows are read where they were copied. Rows of both are padded by 8
// floats so that the 4 rows or tokens of a load fall on distinct banks.
//
// The fold (after the last chunk): P[g] += P[g + w] for w = 4, 2, 1 across the warps through shared
// memory (the warps of g in [w, 2w) write, those of g < w add), then in the g = 0 warps the lane tree:
// lanes l and l + 4 sit in threads h = 0 and h = 1 (a shuffle), l + 2 and l + 1 in registers.
constexpr int kGmThreads = 512;
constexpr int kGmPad = 8;  // floats of padding per staged row
template <int TG>
constexpr int gm_rows() {  // rows per block: two sets of 4 * (16 / TG)
    return 2 * 4 * (16 / TG);
}
template <int TG>
constexpr int gm_tokens() {  // tokens (or pairs) per block
    return 4 * TG;
}
// Chunks per slab and cp.async stages (slabs in flight: stages - 2 while one is decoded and one used):
// as many as fit beside the two decoded slabs in 227 KB.
template <int FMT, int TG>
constexpr int gm_slab() {
    return TG == 2 && (FMT == W_BF16 || FMT == W_F32) ? 2 : 4;
}
template <int FMT, int TG>
constexpr int gm_rowf() {  // floats per staged x row and per decoded weight row
    return gm_slab<FMT, TG>() * 64 + kGmPad;
}
template <int FMT, int TG>
constexpr int gm_stage_bytes() {  // raw weight bytes, then x
    return gm_rows<TG>() * gm_slab<FMT, TG>() * chunk_bytes<FMT>() + gm_tokens<TG>() * gm_rowf<FMT, TG>() * 4;
}
template <int FMT, int TG>
constexpr int gm_fw_bytes() {  // the two decoded slabs
    return 2 * gm_rows<TG>() * gm_rowf<FMT, TG>() * 4;
}
template <int FMT, int TG>
constexpr int gm_stages() {
    return gm_fw_bytes<FMT, TG>() + 4 * gm_stage_bytes<FMT, TG>() <= 227 * 1024 ? 4 : 3;
}
template <int FMT, int TG>
constexpr int gm_smem_bytes() {
    const int pipe = gm_stages<FMT, TG>() * gm_stage_bytes<FMT, TG>() + gm_fw_bytes<FMT, TG>();
    const int fold = 2 * 4 * 64 * 32 * 4;  // [set][slot 0..3][element][lane]
    return pipe > fold ? pipe : fold;
}

template <int FMT, bool EXPERT, int DEC, int TG>
__global__ void __launch_bounds__(kGmThreads, 1) k_linear_gemm(LinArgs a) {
    pdl_enter();
    GLM_DYN_SMEM(unsigned char, sm);
    constexpr int CB = chunk_bytes<FMT>(), RG = 16 / TG, BM = gm_rows<TG>(), BN = gm_tokens<TG>();
    constexpr int S = gm_slab<FMT, TG>(), ST = gm_stages<FMT, TG>(), RF = gm_rowf<FMT, TG>();
    constexpr int WRAW = S * CB;                      // raw bytes of one row in a slab
    constexpr int SBYTES = gm_stage_bytes<FMT, TG>();
    constexpr int GROUPS = BM * S * 8;                // groups of eight weights to decode per slab
    constexpr int NG = (GROUPS + kGmThreads - 1) / kGmThreads;
    static_assert(GROUPS % kGmThreads == 0, "every thread decodes the same number of groups");
    static_assert(gm_smem_bytes<FMT, TG>() <= 227 * 1024, "shared memory");
    __shared__ const unsigned char* rowp[BM];
    __shared__ const float* xrow[BN];
    float* const Fw = reinterpret_cast<float*>(sm + ST * SBYTES);  // two decoded slabs
    const int64_t C = a.C;
    const int nchunks = static_cast<int>(C / 64);
    const int nst = (nchunks + S - 1) / S;
    const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
    const int set = warp >> 3, g = warp & 7, h = lane >> 4, rg = (lane & 15) / TG, tg = (lane & 15) % TG;
    const int q4 = 4 * (2 * g + h);  // the first of this thread's four chains (8g + 4h)
    const int my_r0 = set * (BM / 2) + rg;  // rows my_r0 + RG i, tokens tg + TG j of the tile
    const int row_base = static_cast<int>(blockIdx.x) * BM;
    const int64_t rb = row_bytes(FMT, C);
    auto abs_row = [&](int r) {  // rows past R read the last row (computed, never stored)
        r = r < a.R ? r : a.R - 1;
        return a.row0 + static_cast<int64_t>(r / a.rh) * a.hstride + a.woff + (r % a.rh);
    };
    // this thread's decode groups (the same in every slab): group tid + k * threads is row gi / (8S),
    // chunk (gi / 8) % S of the slab, lanes 8 (gi % 8) .. + 7; their scales' offsets (32-bit: gemm_applies)
    int dscale[NG];
#pragma unroll
    for (int k = 0; k < NG; ++k) {
        const int gi = tid + k * kGmThreads;
        const int64_t ar = abs_row(row_base + gi / (S * 8));
        dscale[k] = static_cast<int>(FMT == W_FP8 ? (ar / 128) * ((C + 127) / 128) : (FMT == W_MXFP4 ? ar * (C / 32) : 0));
    }
    const int n_items = EXPERT ? *a.n_items : 1;
    for (int item = EXPERT ? static_cast<int>(blockIdx.y) : 0; item < n_items;
         item += EXPERT ? static_cast<int>(gridDim.y) : 1) {
        const void* data = a.data;
        const void* scale = a.scale;
        int cnt, start = 0;
        if constexpr (EXPERT) {
            const ExpertItem it = expert_item(a, item);
            data = it.data;
            scale = it.scale;
            start = it.start;
            cnt = it.cnt;
        } else {
            start = static_cast<int>(blockIdx.y) * BN;
            cnt = a.T - start < BN ? a.T - start : BN;
        }
        __syncthreads();  // the previous item's fold is read before rowp, xrow and the buffers change
        if (tid < BM) rowp[tid] = static_cast<const unsigned char*>(data) + abs_row(row_base + tid) * rb;
        if (tid < BN) {  // slots past cnt compute the last token again (not stored)
            const int j = tid < cnt ? tid : cnt - 1;
            int64_t xr;
            if constexpr (EXPERT) xr = pair_xrow(a, a.pairs[start + j]);
            else xr = static_cast<int64_t>(start) + j;
            // (head-blocked: the block's rows lie in one head, gemm_applies; its x is that head's)
            xrow[tid] = a.X + xr * a.ldx + (EXPERT ? 0 : static_cast<int64_t>(row_base / a.rh) * a.xhs);
        }
        __syncthreads();
        // This thread's 16-byte pieces of a whole slab (the same in every slab but for the column offset):
        // weight piece p (< BM * PPR) is row p / PPR, bytes 16 (p % PPR); x piece p is token p / (16 S),
        // floats 4 (p % (16 S)). Destinations are 32-bit shared addresses within a stage. A last slab of
        // fewer chunks takes the general loop.
        constexpr int PPR = S * CB / 16, NWP = (BM * PPR + kGmThreads - 1) / kGmThreads;
        constexpr int NXP = (BN * S * 16 + kGmThreads - 1) / kGmThreads;
        constexpr bool kWAll = BM * PPR % kGmThreads == 0, kXAll = BN * S * 16 % kGmThreads == 0;
        const unsigned char* wsrc[NWP];
        int wdst[NWP];
#pragma unroll
        for (int k = 0; k < NWP; ++k) {
            const int p = tid + k * kGmThreads, i = p / PPR < BM ? p / PPR : BM - 1;
            wsrc[k] = rowp[i] + 16 * (p % PPR);
            wdst[k] = kWAll || p < BM * PPR ? i * WRAW + 16 * (p % PPR) : -1;
        }
        const float* xsrc[NXP];
        int xdst[NXP];
#pragma unroll
        for (int k = 0; k < NXP; ++k) {
            const int p = tid + k * kGmThreads, j = p / (16 * S) < BN ? p / (16 * S) : BN - 1;
            xsrc[k] = xrow[j] + 4 * (p % (16 * S));
            xdst[k] = kXAll || p < BN * S * 16 ? BM * WRAW + 4 * (j * RF + 4 * (p % (16 * S))) : -1;
        }
        const uint32_t sm_s = smem_u32(sm);
        auto chunks_of = [&](int s) { return nchunks - s * S < S ? nchunks - s * S : S; };  // chunks of slab s
        // slab s's copies; FULL: it has S chunks (no test)
        auto issue = [&](int s, bool full) {
            const int c0 = s * S;
            const int nc = full ? S : chunks_of(s);
            const uint32_t buf = sm_s + static_cast<uint32_t>((s % ST) * SBYTES);
            if (full || nc == S) {
#pragma unroll
                for (int k = 0; k < NWP; ++k)
                    if (kWAll || wdst[k] >= 0) cp_async16_s(buf + wdst[k], wsrc[k] + static_cast<int64_t>(c0) * CB);
#pragma unroll
                for (int k = 0; k < NXP; ++k)
                    if (kXAll || xdst[k] >= 0) cp_async16_s(buf + xdst[k], xsrc[k] + 64 * static_cast<int64_t>(c0));
                return;
            }
            const int ppr = nc * CB / 16;
            for (int p = tid; p < BM * ppr; p += kGmThreads) {
                const int i = p / ppr, k = p - i * ppr;
                cp_async16_s(buf + i * WRAW + 16 * k, rowp[i] + static_cast<int64_t>(c0) * CB + 16 * k);
            }
            for (int p = tid; p < BN * nc * 16; p += kGmThreads) {
                const int j = p / (nc * 16), k = p - j * (nc * 16);
                cp_async16_s(buf + BM * WRAW + 4 * (j * RF + 4 * k), xrow[j] + 64 * static_cast<int64_t>(c0) + 4 * k);
            }
        };
        // the multipliers of slab s's groups (decode_raw8; loaded a slab ahead of their decode; chunks past
        // the last read the last chunk's, never used; FULL: none is)
        auto load_scales = [&](int s, float (&sc)[NG], bool full) {
#pragma unroll
            for (int k = 0; k < NG; ++k) {
                const int gi = tid + k * kGmThreads;
                int ch = s * S + (gi / 8) % S;  // the group's chunk
                if (!full) ch = ch < nchunks ? ch : nchunks - 1;
                sc[k] = 0.0f;
                // (32-bit offsets: gemm_applies; the group's 8 columns share a scale)
                if constexpr (FMT == W_FP8) {
                    sc[k] = fp8_mult<DEC>(__ldg(static_cast<const float*>(scale) + (dscale[k] + (ch >> 1))));
                } else if constexpr (FMT == W_MXFP4) {
                    const uint32_t e = __ldg(static_cast<const uint8_t*>(scale) + (dscale[k] + 2 * ch + (gi % 8) / 4));
                    sc[k] = DEC == kDecInt ? e8m0_folded(e) : e8m0(e);
                }
            }
        };
        // raw slab s -> decoded slab s & 1 (each weight once, as the other kernels decode it); FULL: every
        // chunk of the slab is there (no test)
        auto decode = [&](int s, const float (&sc)[NG], bool full) {
            const int nc = full ? S : chunks_of(s);
            const unsigned char* buf = sm + (s % ST) * SBYTES;
            float* F = Fw + (s & 1) * (BM * RF);
#pragma unroll
            for (int k = 0; k < NG; ++k) {
                const int gi = tid + k * kGmThreads;
                const int i = gi / (S * 8), u = (gi / 8) % S, g8 = gi % 8;
                if (full || u < nc) {
                    // Threads g8 = 4..7 store their second four weights first: each 16-byte store of a
                    // quarter warp then takes eight distinct four-bank groups (in order, g8 and g8 + 4 shared
                    // banks: ncu counted 34 M bank conflicts in 16 M stores, q|k|v FP8 T = 512)
                    const int hf = (g8 >> 2) & 1;
                    float w[8];
                    const unsigned char* p = buf + i * WRAW + u * CB + g8 * (CB / 8);
                    constexpr bool kRaw8 = FMT == W_BF16 || FMT == W_FP8 || FMT == W_MXFP4;
                    if constexpr (kRaw8) decode_raw8<FMT, DEC>(swap_halves8<FMT>(load_raw8<FMT>(p), hf), sc[k], w);
                    else decode_smem<FMT, DEC, 8>(p, sc[k], w);  // (F32: not swapped, h4 below is 0)
                    const int h4 = kRaw8 ? 4 * hf : 0;
                    float* d = F + i * RF + 64 * u + 8 * g8;
                    *reinterpret_cast<float4*>(d + h4) = make_float4(w[0], w[1], w[2], w[3]);
                    *reinterpret_cast<float4*>(d + 4 - h4) = make_float4(w[4], w[5], w[6], w[7]);
                }
            }
        };
        float acc[4][4][4];  // [row i][token j][chain m]
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int m = 0; m < 4; ++m) acc[i][j][m] = 0.0f;
        auto chunk = [&](const float* xs, const float* F, int u) {
            const int off = 64 * u + q4;
            float4 xv[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) xv[j] = *reinterpret_cast<const float4*>(xs + (tg + TG * j) * RF + off);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float4 wv = *reinterpret_cast<const float4*>(F + (my_r0 + RG * i) * RF + off);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc[i][j][0] = ffma(wv.x, xv[j].x, acc[i][j][0]);
                    acc[i][j][1] = ffma(wv.y, xv[j].y, acc[i][j][1]);
                    acc[i][j][2] = ffma(wv.z, xv[j].z, acc[i][j][2]);
                    acc[i][j][3] = ffma(wv.w, xv[j].w, acc[i][j][3]);
                }
            }
        };
        auto slab_x = [&](int s) { return reinterpret_cast<const float*>(sm + (s % ST) * SBYTES + BM * WRAW); };
        auto slab_w = [&](int s) { return static_cast<const float*>(Fw + (s & 1) * (BM * RF)); };
        // One barrier per slab. Iteration s: slab s + 1 is in (cp.async) and slab s decoded (the
        // iteration before); the barrier also ends every thread's use of slab s - 1 (its stage, which
        // slab s + ST - 1 then refills, and its decoded buffer, which slab s + 1 then takes); then
        // compute slab s, whose x is read in its stage, and decode slab s + 1.
        float sc[NG];
        for (int s = 0; s < ST - 1; ++s) {
            if (s < nst) issue(s, false);
            cp_async_commit();
        }
        load_scales(0, sc, false);
        cp_async_wait<ST - 2>();
        __syncthreads();
        decode(0, sc, false);
        load_scales(1, sc, false);
        // FP8 and MXFP4 tiles of 16 (kSteady): while slab s, the slab it decodes (s + 1) and the one it
        // refills (s + ST - 1) are whole, the iteration is one branch-free block (copies, the slab's
        // chunks unrolled, the next slab's decode; 447 instructions for 256 FMAs where the general loop
        // took 522: ptxas, FP8 dense). BF16 spilled when its slab was unrolled and ran 25 % slower (its
        // steady block measured +0-2 %, within the noise of a decode step: not taken), 8-pair expert
        // tiles 15 % (bench_gemm, H200): those take the general loop, as do the last slabs.
        constexpr bool kSteady = (FMT == W_FP8 || FMT == W_MXFP4) && TG == 4;
        const int nfull = nchunks / S;
        int s = 0;
        if constexpr (kSteady) {
            for (; s + ST - 1 < nfull; ++s) {
                cp_async_wait<ST - 3>();
                __syncthreads();
                issue(s + ST - 1, true);
                cp_async_commit();
                const float* xs = slab_x(s);
                const float* F = slab_w(s);
#pragma unroll
                for (int u = 0; u < S; ++u) chunk(xs, F, u);
                decode(s + 1, sc, true);
                load_scales(s + 2, sc, true);  // (s + 2 < s + ST - 1: whole)
            }
        }
        for (; s < nst; ++s) {
            cp_async_wait<ST - 3>();
            __syncthreads();
            if (s + ST - 1 < nst) issue(s + ST - 1, false);
            cp_async_commit();
            if (s + 1 < nst) {
                decode(s + 1, sc, false);
                load_scales(s + 2, sc, false);
            }
            const int nc = chunks_of(s);
            const float* xs = slab_x(s);
            const float* F = slab_w(s);
            if (kSteady && nc == S) {
#pragma unroll
                for (int u = 0; u < S; ++u) chunk(xs, F, u);
            } else {
#pragma unroll 1
                for (int u = 0; u < nc; ++u) chunk(xs, F, u);
            }
        }
        cp_async_wait<0>();
        // the accumulator tree across the warps of a set: P[g] += P[g + w] for w = 4, 2, 1
        float* const red = reinterpret_cast<float*>(sm) + set * (4 * 64 * 32);
#pragma unroll
        for (int w = 4; w >= 1; w >>= 1) {
            __syncthreads();  // (w = 4: every warp is done with the last slab)
            if (g >= w && g < 2 * w) {
#pragma unroll
                for (int e = 0; e < 64; ++e) red[((g - w) * 64 + e) * 32 + lane] = acc[e >> 4][(e >> 2) & 3][e & 3];
            }
            __syncthreads();
            if (g < w) {
#pragma unroll
                for (int e = 0; e < 64; ++e)
                    acc[e >> 4][(e >> 2) & 3][e & 3] = add(acc[e >> 4][(e >> 2) & 3][e & 3], red[(g * 64 + e) * 32 + lane]);
            }
        }
        // the lane tree of P[0] in the warps g = 0 (a warp-uniform branch): l += l + 4 (thread h = 1 to h = 0),
        // then l + 2, l + 1
        float* const Y = EXPERT && blockIdx.z != 0 ? a.Y2 : a.Y;
        if (g == 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = row_base + my_r0 + RG * i;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    float (&p)[4] = acc[i][j];
#pragma unroll
                    for (int m = 0; m < 4; ++m) {
                        const float o = __shfl_down_sync(kFull, p[m], 16);
                        p[m] = add(p[m], o);  // (meaningful on h = 0)
                    }
                    p[0] = add(p[0], p[2]);
                    p[1] = add(p[1], p[3]);
                    p[0] = add(p[0], p[1]);
                    const int slot = tg + TG * j;
                    if (h == 0 && r < a.R && slot < cnt) {
                        int64_t yrow;
                        if constexpr (EXPERT) yrow = a.pairs[start + slot];
                        else yrow = static_cast<int64_t>(start) + slot;
                        Y[yrow * a.ldy + r] = a.round ? bf16r(p[0]) : p[0];
                    }
                }
            }
        }
    }
}

}  // namespace
}  // namespace glm::cuda
