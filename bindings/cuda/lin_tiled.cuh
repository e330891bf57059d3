// The tiled multi-token kernel (k_linear_mt).
// Part of weights.cu's translation unit (included there once, inside its anonymous namespace, so
// that every kernel keeps one definition and its name); not a header for other files.
#pragma once

namespace glm::cuda {
namespace {

// ---- the tiled multi-token kernel ---------------------------------------------------------------
//
// Several token rows (or an expert work item of several pairs) against one matrix. The register kernel
// gives each row's eight threads all TT tokens: every weight it decodes meets TT x values, but every x
// value it loads meets one weight, so at TT = 8 it issues a shared-memory load per FMA and ran at ~2.4
// TFMA/s on the H200 (lm_head at batch 32: 8.5 ms). Here a warp owns kMtRpt rows and each thread
// holds LPT = 2 lanes of one accumulator g of every (row, token) pair of the tile: per chunk it decodes
// RPT*2 weights and loads TT*2 x values for RPT*TT*2 FMAs. The block's weight rows and the tile's x rows
// are staged through shared memory (cp.async, kMtStages - 1 stages in flight). Each P[g][l] is still one
// FMA chain over the chunks in order and the fold is fold_lanes' 4/2/1 trees: the same operations as
// the register kernel, on other threads.
constexpr int kMtThreads = 256;
constexpr int kMtRpt = 4;                                // rows per warp (and per thread)
constexpr int kMtLpt = 2;                                // lanes of one accumulator per thread
constexpr int kMtRows = (kMtThreads / 32) * kMtRpt;      // 32 rows per block
constexpr int kMtStages = 3;
template <int FMT>
constexpr int mt_cps() {  // chunks per stage: 8 KB of weights over the block's rows
    return 8192 / (kMtRows * chunk_bytes<FMT>()) > 0 ? 8192 / (kMtRows * chunk_bytes<FMT>()) : 1;
}
template <int FMT, int TT>
constexpr int mt_stage_bytes() {
    return kMtRows * mt_cps<FMT>() * chunk_bytes<FMT>() + TT * mt_cps<FMT>() * 256;
}

template <int FMT, bool EXPERT, int DEC, int TT>
__global__ void __launch_bounds__(kMtThreads) k_linear_mt(LinArgs a) {
    pdl_enter();
    GLM_DYN_SMEM(unsigned char, sm);
    constexpr int CB = chunk_bytes<FMT>(), LPT = kMtLpt, RPT = kMtRpt, CPS = mt_cps<FMT>();
    constexpr int WROW = CPS * CB, WBYTES = kMtRows * WROW, SBYTES = mt_stage_bytes<FMT, TT>();
    __shared__ const unsigned char* rowp[kMtRows];
    __shared__ const float* xrow[TT];
    const int64_t C = a.C;
    const int nchunks = static_cast<int>(C / 64);
    const int nst = (nchunks + CPS - 1) / CPS;
    const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, h = lane & 3, off = 8 * g + LPT * h;  // fold_lanes<2>'s thread (g, h)
    const int row_base = static_cast<int>(blockIdx.x) * kMtRows;
    const int64_t rb = row_bytes(FMT, C);
    // the scale rows of this thread's RPT rows (rows past R read the last row's; nothing is stored)
    int64_t srow[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int r = row_base + warp * RPT + i < a.R ? row_base + warp * RPT + i : a.R - 1;
        const int64_t ar = a.row0 + static_cast<int64_t>(r / a.rh) * a.hstride + a.woff + (r % a.rh);
        srow[i] = FMT == W_FP8 ? (ar / 128) * ((C + 127) / 128) : (FMT == W_MXFP4 ? ar * (C / 32) : 0);
    }
    const int n_items = EXPERT ? *a.n_items : (a.T + TT - 1) / TT;
    for (int item = static_cast<int>(blockIdx.y); item < n_items; item += static_cast<int>(gridDim.y)) {
        const BlockWork bw = block_work<EXPERT>(a, item, item, TT);
        const void* data = bw.data;
        const void* scale = bw.scale;
        const int start = bw.start, cnt = bw.cnt;
        __syncthreads();  // the previous item's last stage is read before rowp, xrow and the buffers change
        if (tid < kMtRows) {
            const int r = row_base + tid;
            const int64_t ar = a.row0 + static_cast<int64_t>(r / a.rh) * a.hstride + a.woff + (r % a.rh);
            rowp[tid] = r < a.R ? static_cast<const unsigned char*>(data) + ar * rb : nullptr;
        }
        if (tid < TT) {  // slots past cnt compute the last pair's token again (not stored)
            const int j = tid < cnt ? tid : cnt - 1;
            int64_t xr;
            if constexpr (EXPERT) xr = pair_xrow(a, a.pairs[start + j]);
            else xr = static_cast<int64_t>(start) + j;
            xrow[tid] = a.X + xr * a.ldx;
        }
        __syncthreads();
        auto issue = [&](int s) {
            const int c0 = s * CPS;
            const int nc = nchunks - c0 < CPS ? nchunks - c0 : CPS;
            unsigned char* buf = sm + (s % kMtStages) * SBYTES;
            if (nc == CPS) {
                // a whole stage: piece counts known at compile time (the general loop's divisions by a
                // runtime count and its bounds took a fifth of the kernel's instructions: ncu, FP8 experts
                // at 128 tokens)
                constexpr int PPR = CPS * CB / 16, NW = kMtRows * PPR, NX = TT * CPS * 16;
#pragma unroll
                for (int q = tid; q < NW; q += kMtThreads) {
                    const int i = q / PPR, k = q % PPR;
                    if (rowp[i]) cp_async16(buf + i * WROW + 16 * k, rowp[i] + static_cast<int64_t>(c0) * CB + 16 * k);
                }
#pragma unroll
                for (int q = tid; q < NX; q += kMtThreads) {
                    const int j = q / (CPS * 16), k = q % (CPS * 16);
                    cp_async16(buf + WBYTES + j * CPS * 256 + 16 * k, xrow[j] + 64 * static_cast<int64_t>(c0) + 4 * k);
                }
                return;
            }
            const int ppr = nc * CB / 16;  // 16-byte pieces per row in this stage
            for (int q = tid; q < kMtRows * ppr; q += kMtThreads) {
                const int i = q / ppr, k = q - i * ppr;
                if (rowp[i]) cp_async16(buf + i * WROW + 16 * k, rowp[i] + static_cast<int64_t>(c0) * CB + 16 * k);
            }
            for (int q = tid; q < TT * nc * 16; q += kMtThreads) {
                const int j = q / (nc * 16), k = q - j * (nc * 16);
                cp_async16(buf + WBYTES + j * CPS * 256 + 16 * k, xrow[j] + 64 * static_cast<int64_t>(c0) + 4 * k);
            }
        };
        float acc[RPT][TT][LPT];
#pragma unroll
        for (int i = 0; i < RPT; ++i)
#pragma unroll
            for (int j = 0; j < TT; ++j)
#pragma unroll
                for (int l = 0; l < LPT; ++l) acc[i][j][l] = 0.0f;
        cp_pipeline<kMtStages>(nst, issue, [&](int s) {
            const int c0 = s * CPS;
            const int nc = nchunks - c0 < CPS ? nchunks - c0 : CPS;
            const unsigned char* buf = sm + (s % kMtStages) * SBYTES;
            for (int u = 0; u < nc; ++u) {
                const int64_t col = 64 * static_cast<int64_t>(c0 + u) + off;
                float w[RPT][LPT];
#pragma unroll
                for (int i = 0; i < RPT; ++i) {
                    float sc = 0.0f;
                    if constexpr (FMT == W_FP8) sc = __ldg(static_cast<const float*>(scale) + srow[i] + col / 128);
                    else if constexpr (FMT == W_MXFP4) sc = e8m0(__ldg(static_cast<const uint8_t*>(scale) + srow[i] + col / 32));
                    decode_smem<FMT, DEC, LPT>(buf + (warp * RPT + i) * WROW + u * CB + (off * CB) / 64, sc, w[i]);
                }
#pragma unroll
                for (int j = 0; j < TT; ++j) {
                    const float2 xv = *reinterpret_cast<const float2*>(buf + WBYTES + j * CPS * 256 + 4 * (64 * u + off));
#pragma unroll
                    for (int i = 0; i < RPT; ++i) {
                        acc[i][j][0] = ffma(w[i][0], xv.x, acc[i][j][0]);
                        acc[i][j][1] = ffma(w[i][1], xv.y, acc[i][j][1]);
                    }
                }
            }
        });
        float* const Y = EXPERT && blockIdx.z != 0 ? a.Y2 : a.Y;
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int r = row_base + warp * RPT + i;
#pragma unroll
            for (int j = 0; j < TT; ++j) {
                const float y = fold_lanes<LPT>(acc[i][j], g, h);
                if (lane == 0 && r < a.R && j < cnt) {
                    int64_t yrow;
                    if constexpr (EXPERT) yrow = a.pairs[start + j];
                    else yrow = static_cast<int64_t>(start) + j;
                    Y[yrow * a.ldy + r] = a.round ? bf16r(y) : y;
                }
            }
        }
    }
}

}  // namespace
}  // namespace glm::cuda
