// The register kernel (k_linear: eight threads per row, weights loaded straight into registers, one
// to eight token rows per block) and the sequential reference kernel (dot='sequential').
// Part of weights.cu's translation unit (included there once, inside its anonymous namespace, so
// that every kernel keeps one definition and its name); not a header for other files.
#pragma once

namespace glm::cuda {
namespace {

// Rows per block: 16 (128 threads) for one token row, so that a matrix spreads over every SM;
// 32 (256 threads) when the block serves several token rows.
template <int TT>
constexpr int rows_per_block() {
    return TT == 1 ? 16 : 32;
}
// Chunks whose weight loads are issued together before any is used (bytes in flight per thread).
// One token: DEEP batches (32 FP8/MXFP4 chunks, 16 BF16) when the matrix fills at most two waves of
// blocks or very many (lm_head), else 16 / 8: the deep batch's registers cost occupancy, and a
// matrix of 4 to 8 waves' worth of blocks then spills into one more wave (measured: KDA q/k/v slower).
// Routed experts keep 16 / 8 (their grid is items x rows; 32 spills there).
template <int FMT, int TT, bool DEEP>
constexpr int batch_chunks() {
    return TT == 1 ? ((FMT == W_MXFP4 || FMT == W_FP8) ? (DEEP ? 32 : 16) : (FMT == W_BF16 ? (DEEP ? 16 : 8) : 8))
                   : (TT == 4 ? 4 : 2);
}

// One block's work: rows [blockIdx.x * RPB, +RPB) for the token tile `tile` (or expert work item).
template <int FMT, int TT, bool EXPERT, int DEC, bool DEEP>
GLM_DEV void linear_block(const LinArgs& a, int tile) {
    constexpr int RPB = rows_per_block<TT>();
    constexpr int U = batch_chunks<FMT, TT, DEEP>();
    const int g = lane8();
    const int grp = static_cast<int>(blockIdx.x) * RPB + static_cast<int>(threadIdx.x >> 3);
    const bool live = grp < a.R;
    const int r = live ? grp : a.R - 1;
    const void* data = a.data;
    const void* scale = a.scale;
    int cnt;
    const float* xr[TT];
    float* yr[TT];
    if constexpr (EXPERT) {
        const ExpertItem it = expert_item(a, tile);
        const int start = it.start;
        cnt = it.cnt;
        data = it.data;
        scale = it.scale;
        float* const Y = it.second ? a.Y2 : a.Y;
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            const int p = a.pairs[start + (j < cnt ? j : cnt - 1)];
            xr[j] = a.X + pair_xrow(a, p) * a.ldx;
            yr[j] = Y + static_cast<int64_t>(p) * a.ldy;
        }
    } else {
        const int t0 = tile * TT;
        cnt = a.T - t0 < TT ? a.T - t0 : TT;
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            const int t = t0 + (j < cnt ? j : cnt - 1);
            xr[j] = a.X + static_cast<int64_t>(t) * a.ldx;
            yr[j] = a.Y + static_cast<int64_t>(t) * a.ldy;
        }
    }
    const int head = r / a.rh;
    const int64_t ar = a.row0 + static_cast<int64_t>(head) * a.hstride + a.woff + (r % a.rh);
    bool xvec = true;
#pragma unroll
    for (int j = 0; j < TT; ++j) {
        xr[j] += static_cast<int64_t>(head) * a.xhs;
        xvec = xvec && (reinterpret_cast<uintptr_t>(xr[j]) % 16 == 0);
    }
    const int64_t C = a.C;
    const bool wvec = FMT == W_MXFP4 || (FMT == W_F32 ? C % 4 == 0 : C % 8 == 0);

    float acc[TT][8];
#pragma unroll
    for (int j = 0; j < TT; ++j) zero8(acc[j]);
    auto fma_chunk = [&](const float (&w)[8], int64_t col) {
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            float x[8];
            load_x8(xr[j], col, xvec, x);
#pragma unroll
            for (int l = 0; l < 8; ++l) acc[j][l] = ffma(w[l], x[l], acc[j][l]);
        }
    };

    const int64_t nfull = C / 64;
    int64_t c = 0;
    if (wvec) {
        // U chunks' loads in flight before the first is decoded; chunks still in increasing order
        for (; c + U <= nfull; c += U) {
            Raw<FMT> raw[U];
#pragma unroll
            for (int u = 0; u < U; ++u) raw[u] = load_raw<FMT>(data, scale, ar, 64 * (c + u) + 8 * g, C);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float w[8];
                decode_raw<FMT, DEC>(raw[u], w);
                fma_chunk(w, 64 * (c + u) + 8 * g);
            }
        }
        // the remaining (< U) chunks in predicated batches of up to 8, so short rows also batch their loads
        constexpr int V = U < 8 ? U : 8;
        for (; c < nfull; c += V) {
            Raw<FMT> raw[V];
#pragma unroll
            for (int u = 0; u < V; ++u)
                if (c + u < nfull) raw[u] = load_raw<FMT>(data, scale, ar, 64 * (c + u) + 8 * g, C);
#pragma unroll
            for (int u = 0; u < V; ++u) {
                if (c + u < nfull) {
                    float w[8];
                    decode_raw<FMT, DEC>(raw[u], w);
                    fma_chunk(w, 64 * (c + u) + 8 * g);
                }
            }
        }
    } else {
        for (; c < nfull; ++c) {
            float w[8];
            load_w8_scalar<FMT>(data, scale, ar, 64 * c + 8 * g, C, w);
            fma_chunk(w, 64 * c + 8 * g);
        }
    }
    // the last, partial chunk: element by element, only those < C
    const int64_t col = 64 * nfull + 8 * g;
    if (col < C) {
#pragma unroll
        for (int l = 0; l < 8; ++l) {
            if (col + l < C) {
                const float wv = decode_elem(FMT, data, scale, ar, col + l, C);
#pragma unroll
                for (int j = 0; j < TT; ++j) acc[j][l] = ffma(wv, xr[j][col + l], acc[j][l]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < TT; ++j) {
        const float y = group_fold(acc[j]);
        if (live && g == 0 && j < cnt) yr[j][r] = a.round ? bf16r(y) : y;
    }
}

// Expert work items beyond gridDim.y are taken in turn (the grid's y extent is capped at 65535).
// MINB > 1 (one token, a tuning candidate): the compiler must fit MINB blocks per SM in registers.
// Written out, MINB = 1 lets nvcc take up to 255 registers (the one-token FP8 kernels 177-255), which
// ran the dense FP8 matrices 25-35 % faster than the ~80 registers it chose with no min-blocks bound
// (H200, session 4, run 6); the routed-expert kernel (ncu before: 128 registers, 23 % occupancy, 1.5
// TB/s, its warps waiting on loads) is fastest at 5 or 6 blocks per SM.
template <int FMT, int TT, bool EXPERT, int DEC, bool DEEP, int MINB = 1>
__global__ void __launch_bounds__(rows_per_block<TT>() * 8, MINB) k_linear(LinArgs a) {
    pdl_enter();
    if constexpr (EXPERT) {
        const int n = *a.n_items;
        for (int item = static_cast<int>(blockIdx.y); item < n; item += static_cast<int>(gridDim.y))
            linear_block<FMT, TT, EXPERT, DEC, false>(a, item);
    } else {
        linear_block<FMT, TT, EXPERT, DEC, DEEP>(a, static_cast<int>(blockIdx.y));
    }
}

// ---- the wide register kernel (one token, dense): 64 / LPT threads per row --------------------
//
// Thread (g, h) of a row holds lanes [h*LPT, (h+1)*LPT) of accumulator g (fold_lanes' layout): chunk c's
// weights 64c + 8g + LPT*h .. + LPT - 1, in increasing chunk order as every kernel. Short wide matrices
// (4096 output rows over K = 8192 or 16384: the attention output projections) give the eight-thread
// kernel ~8 warps per SM, each running a long serial stream of decode instructions; two or four times
// the threads per row split that stream, with as many bytes in flight per SM. 128 threads per block.
template <int LPT>
GLM_DEV void wide_load_x(const float* __restrict__ x, float (&v)[LPT]) {
    if constexpr (LPT == 4) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(x));
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    } else {
        const float2 a = __ldg(reinterpret_cast<const float2*>(x));
        v[0] = a.x; v[1] = a.y;
    }
}

constexpr int kWideThreads = 128;
template <int FMT, int DEC, int LPT>
__global__ void __launch_bounds__(kWideThreads, 1) k_linear_wide(LinArgs a) {
    pdl_enter();
    constexpr int SUB = 8 / LPT, TPR = 8 * SUB, RPB = kWideThreads / TPR;
    constexpr int U = FMT == W_BF16 ? 16 : 32;  // chunks whose loads are in flight together
    const int tid = static_cast<int>(threadIdx.x), q = tid % TPR, g = q / SUB, h = q % SUB;
    const int grp = static_cast<int>(blockIdx.x) * RPB + tid / TPR;
    const bool live = grp < a.R;
    const int r = live ? grp : a.R - 1;
    const int head = r / a.rh;
    const int64_t ar = a.row0 + static_cast<int64_t>(head) * a.hstride + a.woff + (r % a.rh);
    const int64_t C = a.C, nch = C / 64;
    const float* xr = a.X + static_cast<int64_t>(head) * a.xhs + 8 * g + LPT * h;
    const int64_t col0 = 8 * g + LPT * h;
    const float* srow = FMT == W_FP8 ? static_cast<const float*>(a.scale) + (ar / 128) * ((C + 127) / 128) : nullptr;
    float acc[LPT];
#pragma unroll
    for (int l = 0; l < LPT; ++l) acc[l] = 0.0f;
    auto step = [&](const WideWord<FMT, LPT>& raw, float sc, int64_t c) {
        float w[LPT], x[LPT];
        wide_decode<FMT, DEC, LPT>(raw, sc, w);
        wide_load_x<LPT>(xr + 64 * c, x);
#pragma unroll
        for (int l = 0; l < LPT; ++l) acc[l] = ffma(w[l], x[l], acc[l]);
    };
    int64_t c = 0;
    for (; c + U <= nch; c += U) {
        WideWord<FMT, LPT> raw[U];
        float sc[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            raw[u] = wide_load<FMT, LPT>(a.data, ar, C, 64 * (c + u) + col0);
            sc[u] = FMT == W_FP8 ? __ldg(srow + (c + u) / 2) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) step(raw[u], sc[u], c + u);
    }
    for (; c < nch; c += 8) {  // the rest in predicated batches of eight
        WideWord<FMT, LPT> raw[8];
        float sc[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            if (c + u < nch) {
                raw[u] = wide_load<FMT, LPT>(a.data, ar, C, 64 * (c + u) + col0);
                sc[u] = FMT == W_FP8 ? __ldg(srow + (c + u) / 2) : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u)
            if (c + u < nch) step(raw[u], sc[u], c + u);
    }
    const float y = fold_lanes<LPT>(acc, g, h);
    if (live && q == 0) a.Y[r] = a.round ? bf16r(y) : y;
}

// dot="sequential": one thread per (row, token), decoded element by element, s = s + w*x.
template <bool EXPERT>
__global__ void k_linear_seq(LinArgs a, int tile) {
    pdl_enter();
    const int r = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if (r >= a.R) return;
    const void* data = a.data;
    const void* scale = a.scale;
    float* Y = a.Y;
    int cnt, base = 0;
    if constexpr (EXPERT) {
        const int item = static_cast<int>(blockIdx.y);
        if (item >= *a.n_items) return;  // (the sequential path caps no grid: a demonstration mode)
        const ExpertItem it = expert_item(a, item);
        data = it.data;
        scale = it.scale;
        Y = it.second ? a.Y2 : a.Y;
        base = it.start;
        cnt = it.cnt;
    } else {
        base = static_cast<int>(blockIdx.y) * tile;
        cnt = a.T - base < tile ? a.T - base : tile;
    }
    const int head = r / a.rh;
    const int64_t ar = a.row0 + static_cast<int64_t>(head) * a.hstride + a.woff + (r % a.rh);
    for (int j = 0; j < cnt; ++j) {
        const float* x;
        float* y;
        if constexpr (EXPERT) {
            const int p = a.pairs[base + j];
            x = a.X + pair_xrow(a, p) * a.ldx;
            y = Y + static_cast<int64_t>(p) * a.ldy;
        } else {
            x = a.X + static_cast<int64_t>(base + j) * a.ldx;
            y = Y + static_cast<int64_t>(base + j) * a.ldy;
        }
        x += static_cast<int64_t>(head) * a.xhs;
        float s = 0.0f;
        for (int64_t i = 0; i < a.C; ++i) s = fadd(s, fmul(decode_elem(a.fmt, data, scale, ar, i, a.C), x[i]));
        y[r] = a.round ? bf16r(s) : s;
    }
}

}  // namespace
}  // namespace glm::cuda
