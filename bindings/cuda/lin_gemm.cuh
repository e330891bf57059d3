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
// results are folded by the canonical trees once at the end. A thread owns ONE chain k of 8 rows x 8
// tokens (SGEMM's register tile): per chunk it loads its chain's column of 8 rows and of 8 tokens by
// two 16-byte loads each and makes 64 FMAs, each the next step of its own chain in chunk order. Warp w
// holds chains 4w .. 4w + 3 (g = w / 2, lanes l = 4 (w % 2) .. + 3), its lanes c * 8 + tile: chain
// 4w + c of the tile-th 8 x 8 block of the block's BM rows x BN tokens (BM = 64 / TNG, BN = 8 TNG).
//
// Per slab of S chunks: the block's weight rows (raw bytes) and its tokens' x rows (f32) arrive by
// cp.async (gm_stages: up to two slabs in flight); one slab ahead of its use every weight is decoded
// ONCE (decode_smem, as every kernel decodes it) and every x value moved, into column-major slabs
// (column, then rows or tokens), which the 8 x 8 tiles read (two buffers each: one barrier per slab).
//
// The fold (after the last chunk): P[g] += P[g + w] for w = 4, 2, 1 across warps through shared memory
// (warps of g in [w, 2w) write, those of g < w add), then the lane tree: l += l + 4 (warp 1 into warp 0),
// l += l + 2 and l += l + 1 by shuffles within warp 0 (lanes 16 and 8 apart).
constexpr int kGmThreads = 512;
template <int TNG>
constexpr int gm_rows() {  // rows per block
    return 8 * (8 / TNG);
}
template <int TNG>
constexpr int gm_tokens() {  // tokens (or pairs) per block
    return 8 * TNG;
}
template <int FMT, int TNG, int S>
struct GmLayout {
    static constexpr int BM = gm_rows<TNG>(), BN = gm_tokens<TNG>(), CB = chunk_bytes<FMT>();
    static constexpr int WRAW = S * CB + 16;  // raw bytes of a weight row in a stage (padded: decode reads)
    static constexpr int RF = S * 64 + 8;     // floats of a raw x row in a stage
    static constexpr int LDW = BM + 4, LDX = BN + 4;  // floats of a decoded column (weights, x)
    static constexpr int STAGE = BM * WRAW + BN * RF * 4;
    static constexpr int DEC = 2 * S * 64 * (LDW + LDX) * 4;  // the two decoded slabs of both
    static constexpr int pipe(int st) { return st * STAGE + DEC; }
};
constexpr int kGmSmemMax = 227 * 1024;
template <int FMT, int TNG>
constexpr int gm_slab() {  // chunks per slab: 4 where three stages fit, else 2, else 1
    return GmLayout<FMT, TNG, 4>::pipe(3) <= kGmSmemMax ? 4 : (GmLayout<FMT, TNG, 2>::pipe(3) <= kGmSmemMax ? 2 : 1);
}
template <int FMT, int TNG>
constexpr int gm_stages() {
    return GmLayout<FMT, TNG, gm_slab<FMT, TNG>()>::pipe(4) <= kGmSmemMax ? 4 : 3;
}
template <int FMT, int TNG>
constexpr int gm_smem_bytes() {
    const int pipe = GmLayout<FMT, TNG, gm_slab<FMT, TNG>()>::pipe(gm_stages<FMT, TNG>());
    const int fold = 8 * 64 * 32 * 4;  // [slot 0..7][element][lane]
    return pipe > fold ? pipe : fold;
}

template <int FMT, bool EXPERT, int DEC, int TNG>
__global__ void __launch_bounds__(kGmThreads, 1) k_linear_gemm(LinArgs a) {
    pdl_enter();
    GLM_DYN_SMEM(unsigned char, sm);
    constexpr int S = gm_slab<FMT, TNG>(), ST = gm_stages<FMT, TNG>();
    using L = GmLayout<FMT, TNG, S>;
    constexpr int CB = L::CB, BM = L::BM, BN = L::BN, WRAW = L::WRAW, RF = L::RF, LDW = L::LDW, LDX = L::LDX;
    constexpr int GROUPS = BM * S * 8;  // groups of eight weights to decode per slab
    constexpr int NG = (GROUPS + kGmThreads - 1) / kGmThreads;
    constexpr int XQ = BN * S * 16;     // x pieces of four floats per slab
    constexpr int NXQ = (XQ + kGmThreads - 1) / kGmThreads;
    static_assert(gm_smem_bytes<FMT, TNG>() <= kGmSmemMax, "shared memory");
    __shared__ const unsigned char* rowp[BM];
    __shared__ const float* xrow[BN];
    float* const Fw = reinterpret_cast<float*>(sm + ST * L::STAGE);  // [2][S * 64][LDW]
    float* const Fx = Fw + 2 * S * 64 * LDW;                          // [2][S * 64][LDX]
    const int64_t C = a.C;
    const int nchunks = static_cast<int>(C / 64);
    const int nst = (nchunks + S - 1) / S;
    const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
    const int k = 4 * warp + (lane >> 3);  // this thread's chain
    const int rt = (lane & 7) / TNG, tt = (lane & 7) % TNG;  // its rows 8 rt .. + 7, tokens 8 tt .. + 7
    const int row_base = static_cast<int>(blockIdx.x) * BM;
    const int64_t rb = row_bytes(FMT, C);
    auto abs_row = [&](int r) {  // rows past R read the last row (computed, never stored)
        r = r < a.R ? r : a.R - 1;
        return a.row0 + static_cast<int64_t>(r / a.rh) * a.hstride + a.woff + (r % a.rh);
    };
    // this thread's decode groups (the same in every slab): group tid + n * threads is row gi % BM (a
    // warp's lanes: consecutive rows of one column), chunk gi / (8 BM) of the slab, lanes 8 ((gi / BM) % 8)
    // .. + 7; their scales' offsets (32-bit: gemm_applies bounds them)
    int dscale[NG];
#pragma unroll
    for (int n = 0; n < NG; ++n) {
        const int gi = tid + n * kGmThreads;
        const int64_t ar = abs_row(row_base + gi % BM);
        dscale[n] = static_cast<int>(FMT == W_FP8 ? (ar / 128) * ((C + 127) / 128) : (FMT == W_MXFP4 ? ar * (C / 32) : 0));
    }
    const int n_items = EXPERT ? *a.n_items : 1;
    for (int item = EXPERT ? static_cast<int>(blockIdx.y) : 0; item < n_items;
         item += EXPERT ? static_cast<int>(gridDim.y) : 1) {
        const void* data = a.data;
        const void* scale = a.scale;
        int cnt, start = 0;
        if constexpr (EXPERT) {
            const bool second = blockIdx.z != 0;
            data = (second ? a.dtab2 : a.dtab)[a.items[3 * item]];
            scale = (second ? a.stab2 : a.stab)[a.items[3 * item]];
            start = a.items[3 * item + 1];
            cnt = a.items[3 * item + 2];
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
            xrow[tid] = a.X + xr * a.ldx;
        }
        __syncthreads();
        // This thread's 16-byte pieces of a whole slab (the same in every slab but for the column offset):
        // weight piece p (< BM * PPR) is row p / PPR, bytes 16 (p % PPR); x piece p is token p / (16 S),
        // floats 4 (p % (16 S)). A last slab of fewer chunks takes the general loop.
        constexpr int PPR = S * CB / 16, NWP = (BM * PPR + kGmThreads - 1) / kGmThreads;
        constexpr int NXP = (BN * S * 16 + kGmThreads - 1) / kGmThreads;
        const unsigned char* wsrc[NWP];
        int wdst[NWP];
#pragma unroll
        for (int n = 0; n < NWP; ++n) {
            const int p = tid + n * kGmThreads, i = p / PPR < BM ? p / PPR : BM - 1;
            wsrc[n] = rowp[i] + 16 * (p % PPR);
            wdst[n] = p < BM * PPR ? i * WRAW + 16 * (p % PPR) : -1;
        }
        const float* xsrc[NXP];
        int xdst[NXP];
#pragma unroll
        for (int n = 0; n < NXP; ++n) {
            const int p = tid + n * kGmThreads, j = p / (16 * S) < BN ? p / (16 * S) : BN - 1;
            xsrc[n] = xrow[j] + 4 * (p % (16 * S));
            xdst[n] = p < BN * S * 16 ? BM * WRAW + 4 * (j * RF + 4 * (p % (16 * S))) : -1;
        }
        auto issue = [&](int s) {
            const int c0 = s * S;
            const int nc = nchunks - c0 < S ? nchunks - c0 : S;
            unsigned char* buf = sm + (s % ST) * L::STAGE;
            if (nc == S) {
#pragma unroll
                for (int n = 0; n < NWP; ++n)
                    if (wdst[n] >= 0) cp_async16(buf + wdst[n], wsrc[n] + static_cast<int64_t>(c0) * CB);
#pragma unroll
                for (int n = 0; n < NXP; ++n)
                    if (xdst[n] >= 0) cp_async16(buf + xdst[n], xsrc[n] + 64 * static_cast<int64_t>(c0));
                return;
            }
            float* xs = reinterpret_cast<float*>(buf + BM * WRAW);
            const int ppr = nc * CB / 16;
            for (int p = tid; p < BM * ppr; p += kGmThreads) {
                const int i = p / ppr, q = p - i * ppr;
                cp_async16(buf + i * WRAW + 16 * q, rowp[i] + static_cast<int64_t>(c0) * CB + 16 * q);
            }
            for (int p = tid; p < BN * nc * 16; p += kGmThreads) {
                const int j = p / (nc * 16), q = p - j * (nc * 16);
                cp_async16(xs + j * RF + 4 * q, xrow[j] + 64 * static_cast<int64_t>(c0) + 4 * q);
            }
        };
        // the scales of slab s's groups (loaded a slab ahead of their decode)
        auto load_scales = [&](int s, float (&sc)[NG]) {
#pragma unroll
            for (int n = 0; n < NG; ++n) {
                const int gi = tid + n * kGmThreads, u = gi / (8 * BM);
                const int64_t col = 64 * static_cast<int64_t>(s * S + u) + 8 * ((gi / BM) % 8);
                sc[n] = 0.0f;
                if (gi < GROUPS && s < nst && s * S + u < nchunks) {
                    if constexpr (FMT == W_FP8) {
                        sc[n] = __ldg(static_cast<const float*>(scale) + dscale[n] + col / 128);
                    } else if constexpr (FMT == W_MXFP4) {
                        const uint32_t e = __ldg(static_cast<const uint8_t*>(scale) + dscale[n] + col / 32);
                        sc[n] = DEC == kDecInt ? e8m0_folded(e) : e8m0(e);
                    }
                }
            }
        };
        // stage of slab s -> its decoded weights and its x, column-major, in buffers s & 1
        auto convert = [&](int s, const float (&sc)[NG]) {
            const int nc = nchunks - s * S < S ? nchunks - s * S : S;
            const unsigned char* buf = sm + (s % ST) * L::STAGE;
            float* fw = Fw + (s & 1) * (S * 64 * LDW);
            float* fx = Fx + (s & 1) * (S * 64 * LDX);
#pragma unroll
            for (int n = 0; n < NG; ++n) {
                const int gi = tid + n * kGmThreads;
                const int i = gi % BM, u = gi / (8 * BM), g8 = (gi / BM) % 8;
                if (gi < GROUPS && u < nc) {
                    float w[8];
                    decode_smem<FMT, DEC, 8>(buf + i * WRAW + u * CB + g8 * (CB / 8), sc[n], w);
#pragma unroll
                    for (int l = 0; l < 8; ++l) fw[(64 * u + 8 * g8 + l) * LDW + i] = w[l];
                }
            }
            const float* xs = reinterpret_cast<const float*>(buf + BM * WRAW);
#pragma unroll
            for (int n = 0; n < NXQ; ++n) {
                const int q = tid + n * kGmThreads, j = q % BN, c4 = q / BN;  // token j, columns 4 c4 .. + 3
                if (q < XQ && c4 < 16 * nc) {
                    const float4 v = *reinterpret_cast<const float4*>(xs + j * RF + 4 * c4);
                    fx[(4 * c4 + 0) * LDX + j] = v.x;
                    fx[(4 * c4 + 1) * LDX + j] = v.y;
                    fx[(4 * c4 + 2) * LDX + j] = v.z;
                    fx[(4 * c4 + 3) * LDX + j] = v.w;
                }
            }
        };
        float acc[8][8];  // [row i][token j] of chain k
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
        auto chunk = [&](const float* fw, const float* fx, int u) {
            const float* pw = fw + (64 * u + k) * LDW + 8 * rt;
            const float* px = fx + (64 * u + k) * LDX + 8 * tt;
            const float4 w0 = *reinterpret_cast<const float4*>(pw), w1 = *reinterpret_cast<const float4*>(pw + 4);
            const float4 x0 = *reinterpret_cast<const float4*>(px), x1 = *reinterpret_cast<const float4*>(px + 4);
            const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
            const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = ffma(w[i], x[j], acc[i][j]);
        };
        // One barrier per slab. Iteration s: slab s + 1 is in (cp.async) and slab s converted (the
        // iteration before); the barrier also ends every thread's use of slab s - 1 (its stage, which
        // slab s + ST - 1 then refills, and its converted buffers, which slab s + 1 then takes).
        float sc[NG];
        for (int s = 0; s < ST - 1; ++s) {
            if (s < nst) issue(s);
            cp_async_commit();
        }
        load_scales(0, sc);
        cp_async_wait<ST - 2>();
        __syncthreads();
        convert(0, sc);
        load_scales(1, sc);
        for (int s = 0; s < nst; ++s) {
            cp_async_wait<ST - 3>();
            __syncthreads();
            if (s + ST - 1 < nst) issue(s + ST - 1);
            cp_async_commit();
            if (s + 1 < nst) {
                convert(s + 1, sc);
                load_scales(s + 2, sc);
            }
            const int nc = nchunks - s * S < S ? nchunks - s * S : S;
            const float* fw = Fw + (s & 1) * (S * 64 * LDW);
            const float* fx = Fx + (s & 1) * (S * 64 * LDX);
#pragma unroll 1
            for (int u = 0; u < nc; ++u) chunk(fw, fx, u);
        }
        cp_async_wait<0>();
        // the accumulator tree across the warps: P[g] += P[g + w] (warps 2g + h and 2 (g + w) + h)
        float* const red = reinterpret_cast<float*>(sm);
        const int g = warp >> 1;
#pragma unroll
        for (int w = 4; w >= 1; w >>= 1) {
            __syncthreads();  // (w = 4: every warp is done with the last slab)
            if (g >= w && g < 2 * w) {
#pragma unroll
                for (int e = 0; e < 64; ++e) red[((warp - 2 * w) * 64 + e) * 32 + lane] = acc[e >> 3][e & 7];
            }
            __syncthreads();
            if (g < w) {
#pragma unroll
                for (int e = 0; e < 64; ++e) acc[e >> 3][e & 7] = add(acc[e >> 3][e & 7], red[(warp * 64 + e) * 32 + lane]);
            }
        }
        // the lane tree: l += l + 4 (warp 1 into warp 0), then within warp 0 l += l + 2, l += l + 1
        __syncthreads();
        if (warp == 1) {
#pragma unroll
            for (int e = 0; e < 64; ++e) red[e * 32 + lane] = acc[e >> 3][e & 7];
        }
        __syncthreads();
        if (warp == 0) {
            float* const Y = EXPERT && blockIdx.z != 0 ? a.Y2 : a.Y;
#pragma unroll
            for (int e = 0; e < 64; ++e) {
                float p = add(acc[e >> 3][e & 7], red[e * 32 + lane]);
                p = add(p, __shfl_down_sync(kFull, p, 16));
                p = add(p, __shfl_down_sync(kFull, p, 8));
                const int r = row_base + 8 * rt + (e >> 3), slot = 8 * tt + (e & 7);
                if (lane < 8 && r < a.R && slot < cnt) {
                    int64_t yrow;
                    if constexpr (EXPERT) yrow = a.pairs[start + slot];
                    else yrow = static_cast<int64_t>(start) + slot;
                    Y[yrow * a.ldy + r] = a.round ? bf16r(p) : p;
                }
            }
        }
    }
}

}  // namespace
}  // namespace glm::cuda
