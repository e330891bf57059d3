// The staged one-token kernel (k_linear_st: rows copied into shared memory by cp.async stages).
// Part of weights.cu's translation unit (included there once, inside its anonymous namespace, so
// that every kernel keeps one definition and its name); not a header for other files.
#pragma once

namespace glm::cuda {
namespace {

// ---- the staged one-token kernel ----------------------------------------------------------------
//
// Decode at batch 1 streams many mid-size matrices (2k-16k rows) and a few skinny ones (64-512 rows of
// 4k-16k columns). With weights loaded into registers by the eight threads that own a row, a matrix
// of R rows has only R/4 warps, each waiting on its own few loads (the profile: 0.9-1.7 TB/s on the
// mid-size ones, ~17 us for a 1 MB skinny one). Here every thread of a 256-thread block copies the
// block's rows into shared memory (cp.async, 16 bytes each, kStStages - 1 stages in flight), and the
// row's partial sums are then computed from shared memory: P[g][l] is still one FMA chain over the
// chunks in order, but the 64 chains of a row may be spread over 8, 16 or 32 threads (LPT = 8, 4 or 2
// lanes of one accumulator g per thread), and the fold runs the same 4/2/1 trees by shuffles. Only
// where the bytes wait and which thread owns a chain change; no operation does.
constexpr int kStThreads = 256;
constexpr int kStStages = 4;
constexpr int kStStageBytes = 12288;  // weight bytes of one stage over the block's rows (default)

// Rows [blockIdx.x * rpb, +rpb) for one token row (or one expert work item of one pair), C % 64 == 0,
// rows 16-byte aligned; `cps` chunks per stage. XS: x of the stage's columns also staged (one x per
// block: no head-blocked views).
template <int FMT, bool EXPERT, int DEC, int LPT, bool XS>
__global__ void __launch_bounds__(kStThreads) k_linear_st(LinArgs a, int rpb, int cps) {
    pdl_enter();
    GLM_DYN_SMEM(unsigned char, sm);
    constexpr int TPR = 64 / LPT;
    constexpr int MAXR = kStThreads / 8;
    __shared__ const unsigned char* rowp[MAXR];
    __shared__ int64_t rowar[MAXR];
    __shared__ const float* xrow;
    constexpr int CB = chunk_bytes<FMT>();
    const int64_t C = a.C;
    const int nchunks = static_cast<int>(C / 64);
    const int nst = (nchunks + cps - 1) / cps;
    const int sbp = cps * CB + CB;  // padded row stride of a stage: consecutive rows on other banks
    const int wbytes = rpb * sbp;
    const int sbytes = wbytes + (XS ? cps * 256 : 0);
    const int tid = static_cast<int>(threadIdx.x);
    const int row_base = static_cast<int>(blockIdx.x) * rpb;
    const int64_t rb = row_bytes(FMT, C);
    const int my_row = tid / TPR, j = tid % TPR, g = j / (8 / LPT), h = j % (8 / LPT);
    const bool comp = my_row < rpb && row_base + my_row < a.R;
    const bool folds = (tid & ~31) < rpb * TPR;  // warps holding compute threads fold (full-mask shuffles)

    const int n_items = EXPERT ? *a.n_items : 1;
    for (int item = EXPERT ? static_cast<int>(blockIdx.y) : 0; item < n_items;
         item += EXPERT ? static_cast<int>(gridDim.y) : 1) {
        const void* data = a.data;
        const void* scale = a.scale;
        const float* xr;
        float* yr;
        if constexpr (EXPERT) {
            const int e = a.items[3 * item], p = a.pairs[a.items[3 * item + 1]];
            const bool second = blockIdx.z != 0;
            data = (second ? a.dtab2 : a.dtab)[e];
            scale = (second ? a.stab2 : a.stab)[e];
            xr = a.X + pair_xrow(a, p) * a.ldx;
            yr = (second ? a.Y2 : a.Y) + static_cast<int64_t>(p) * a.ldy;
        } else {
            xr = a.X;
            yr = a.Y;
        }
        __syncthreads();  // the previous item's last stage is read before these buffers are refilled
        if (tid < rpb) {
            const int r = row_base + tid;
            const int rr = r < a.R ? r : a.R - 1;
            const int64_t ar = a.row0 + static_cast<int64_t>(rr / a.rh) * a.hstride + a.woff + (rr % a.rh);
            rowar[tid] = ar;
            rowp[tid] = r < a.R ? static_cast<const unsigned char*>(data) + ar * rb : nullptr;
        }
        if (tid == 0) xrow = xr;
        __syncthreads();
        auto issue = [&](int s) {
            const int c0 = s * cps;
            const int nc = nchunks - c0 < cps ? nchunks - c0 : cps;
            const int ppr = nc * CB / 16;  // 16-byte pieces per row in this stage
            unsigned char* buf = sm + static_cast<int64_t>(s % kStStages) * sbytes;
            for (int q = tid; q < rpb * ppr; q += kStThreads) {
                const int i = q / ppr, k = q - i * ppr;
                const unsigned char* src = rowp[i];
                if (src) cp_async16(buf + i * sbp + 16 * k, src + static_cast<int64_t>(c0) * CB + 16 * k);
            }
            if constexpr (XS) {
                const unsigned char* xs = reinterpret_cast<const unsigned char*>(xrow + 64 * static_cast<int64_t>(c0));
                for (int q = tid; q < nc * 16; q += kStThreads) cp_async16(buf + wbytes + 16 * q, xs + 16 * q);
            }
        };
        const int64_t ar = rowar[my_row < rpb ? my_row : 0];
        const float* x = xr + static_cast<int64_t>(comp ? (row_base + my_row) / a.rh : 0) * a.xhs;
        float acc[LPT];
#pragma unroll
        for (int l = 0; l < LPT; ++l) acc[l] = 0.0f;
        cp_pipeline<kStStages>(nst, issue, [&](int s) {
            if (comp) {
                const int c0 = s * cps;
                const int nc = nchunks - c0 < cps ? nchunks - c0 : cps;
                const unsigned char* buf = sm + static_cast<int64_t>(s % kStStages) * sbytes;
                const unsigned char* row = buf + my_row * sbp;
                const float* xsm = reinterpret_cast<const float*>(buf + wbytes);
#pragma unroll 4
                for (int u = 0; u < nc; ++u) {
                    const int off = 8 * g + LPT * h;  // first element of this thread in the chunk
                    const int64_t col = 64 * static_cast<int64_t>(c0 + u) + off;
                    float sc = 0.0f;
                    if constexpr (FMT == W_FP8)
                        sc = __ldg(static_cast<const float*>(scale) + (ar / 128) * ((C + 127) / 128) + col / 128);
                    else if constexpr (FMT == W_MXFP4)
                        sc = e8m0(__ldg(static_cast<const uint8_t*>(scale) + ar * (C / 32) + col / 32));
                    float w[LPT], xv[LPT];
                    decode_smem<FMT, DEC, LPT>(row + u * CB + (off * CB) / 64, sc, w);
                    const float* xp = XS ? xsm + 64 * u + off : x + col;
                    if constexpr (LPT >= 4) {  // 16-byte aligned: off is a multiple of 4
#pragma unroll
                        for (int k = 0; k < LPT; k += 4) {
                            const float4 v = XS ? *reinterpret_cast<const float4*>(xp + k)
                                                : __ldg(reinterpret_cast<const float4*>(xp + k));
                            xv[k] = v.x;
                            xv[k + 1] = v.y;
                            xv[k + 2] = v.z;
                            xv[k + 3] = v.w;
                        }
                    } else {
                        const float2 v = XS ? *reinterpret_cast<const float2*>(xp) : __ldg(reinterpret_cast<const float2*>(xp));
                        xv[0] = v.x;
                        xv[1] = v.y;
                    }
#pragma unroll
                    for (int l = 0; l < LPT; ++l) acc[l] = ffma(w[l], xv[l], acc[l]);
                }
            }
        });
        if (folds) {
            const float y = fold_lanes<LPT>(acc, g, h);
            if (comp && j == 0) yr[row_base + my_row] = a.round ? bf16r(y) : y;
        }
    }
}

}  // namespace
}  // namespace glm::cuda
