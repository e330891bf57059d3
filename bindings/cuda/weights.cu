// The linear layer on the device: weights decoded in registers inside the canonical dot
// (weights.cuh has the contract). Rows are independent and each is computed whole by one group of
// eight threads, so the grid shape changes no bit.
#include <algorithm>

#include "weights.cuh"

namespace glm::cuda {

const char* wfmt_name(int f) {
    switch (f) {
        case W_BF16: return "bf16";
        case W_F32: return "f32";
        case W_FP8: return "fp8";
        case W_MXFP4: return "mxfp4";
    }
    return "?";
}

size_t Lin::bytes() const {
    const size_t r = static_cast<size_t>(R), c = static_cast<size_t>(C);
    switch (fmt) {
        case W_BF16: return r * c * 2;
        case W_F32: return r * c * 4;
        case W_FP8: return r * c + ((r + 127) / 128) * ((c + 127) / 128) * 4;
        case W_MXFP4: return r * (c / 2) + r * (c / 32);
    }
    return 0;
}

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

// Eight consecutive weights of absolute row ar at column col (col % 8 == 0, col + 8 <= C), decoded,
// element by element (rows whose length breaks the vector alignment).
template <int FMT>
GLM_DEV void load_w8_scalar(const void* __restrict__ data, const void* __restrict__ scale, int64_t ar, int64_t col,
                            int64_t C, float (&w)[8]) {
#pragma unroll
    for (int l = 0; l < 8; ++l) w[l] = decode_elem(FMT, data, scale, ar, col + l, C);
}

// The raw bytes of one chunk of eight weights (vector loads) and their decoding.
template <int FMT>
struct Raw;
template <>
struct Raw<W_BF16> {
    uint4 v;
};
template <>
struct Raw<W_F32> {
    float4 a, b;
};
template <>
struct Raw<W_FP8> {
    uint2 v;
    float s;
};
template <>
struct Raw<W_MXFP4> {
    uint32_t v;
    uint32_t e;
};

template <int FMT>
GLM_DEV Raw<FMT> load_raw(const void* __restrict__ data, const void* __restrict__ scale, int64_t ar, int64_t col,
                          int64_t C) {
    Raw<FMT> r;
    if constexpr (FMT == W_BF16) {
        r.v = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(data) + ar * C + col));
    } else if constexpr (FMT == W_F32) {
        const float* p = static_cast<const float*>(data) + ar * C + col;
        r.a = __ldg(reinterpret_cast<const float4*>(p));
        r.b = __ldg(reinterpret_cast<const float4*>(p + 4));
    } else if constexpr (FMT == W_FP8) {
        r.v = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(data) + ar * C + col));
        r.s = __ldg(static_cast<const float*>(scale) + (ar / 128) * ((C + 127) / 128) + col / 128);
    } else {
        r.v = __ldg(reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(data) + ar * (C / 2) + col / 2));
        r.e = __ldg(static_cast<const uint8_t*>(scale) + ar * (C / 32) + col / 32);
    }
    return r;
}

template <int FMT, bool HW8>
GLM_DEV void decode_raw(const Raw<FMT>& r, float (&w)[8]) {
    if constexpr (FMT == W_BF16) {
        const uint32_t u[4] = {r.v.x, r.v.y, r.v.z, r.v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            w[2 * k] = f32_from_bits(u[k] << 16);
            w[2 * k + 1] = f32_from_bits(u[k] & 0xFFFF0000u);
        }
    } else if constexpr (FMT == W_F32) {
        w[0] = r.a.x; w[1] = r.a.y; w[2] = r.a.z; w[3] = r.a.w;
        w[4] = r.b.x; w[5] = r.b.y; w[6] = r.b.z; w[7] = r.b.w;
    } else if constexpr (FMT == W_FP8) {
        e4m3x8<HW8>(r.v.x, r.v.y, w);
        // w = fl32(e4m3 * scale_inv[r/128][c/128]): one f32 multiply
#pragma unroll
        for (int l = 0; l < 8; ++l) w[l] = fmul(w[l], r.s);
    } else {
        const float s = e8m0(r.e);
#pragma unroll
        for (int l = 0; l < 8; ++l) w[l] = mxfp4_w((r.v >> (4 * l)) & 15u, s);
    }
}

// The eight x values of one token row at col.
GLM_DEV void load_x8(const float* __restrict__ x, int64_t col, bool vec, float (&v)[8]) {
    if (vec) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(x + col));
        const float4 b = __ldg(reinterpret_cast<const float4*>(x + col + 4));
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int l = 0; l < 8; ++l) v[l] = x[col + l];
    }
}

// One block's work: rows [blockIdx.x * RPB, +RPB) for the token tile `tile` (or expert work item).
template <int FMT, int TT, bool EXPERT, bool HW8, bool DEEP>
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
        const int item = tile;
        const int e = a.items[3 * item], start = a.items[3 * item + 1];
        cnt = a.items[3 * item + 2];
        data = a.dtab[e];
        scale = a.stab[e];
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            const int p = a.pairs[start + (j < cnt ? j : cnt - 1)];
            xr[j] = a.X + static_cast<int64_t>(p / a.xdiv) * a.ldx;
            yr[j] = a.Y + static_cast<int64_t>(p) * a.ldy;
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
                decode_raw<FMT, HW8>(raw[u], w);
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
                    decode_raw<FMT, HW8>(raw[u], w);
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
template <int FMT, int TT, bool EXPERT, bool HW8, bool DEEP>
__global__ void __launch_bounds__(rows_per_block<TT>() * 8) k_linear(LinArgs a) {
    if constexpr (EXPERT) {
        const int n = *a.n_items;
        for (int item = static_cast<int>(blockIdx.y); item < n; item += static_cast<int>(gridDim.y))
            linear_block<FMT, TT, EXPERT, HW8, false>(a, item);
    } else {
        linear_block<FMT, TT, EXPERT, HW8, DEEP>(a, static_cast<int>(blockIdx.y));
    }
}

// Streaming multiprocessors of the current device (once).
int sm_count() {
    static int n = [] {
        int dev = 0;
        cudaDeviceProp p;
        if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&p, dev) != cudaSuccess) return 132;
        return p.multiProcessorCount > 0 ? p.multiProcessorCount : 132;
    }();
    return n;
}

// dot="sequential": one thread per (row, token), decoded element by element, s = s + w*x.
template <bool EXPERT>
__global__ void k_linear_seq(LinArgs a, int tile) {
    const int r = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if (r >= a.R) return;
    const void* data = a.data;
    const void* scale = a.scale;
    int cnt, base = 0;
    if constexpr (EXPERT) {
        const int item = static_cast<int>(blockIdx.y);
        if (item >= *a.n_items) return;  // (the sequential path caps no grid: a demonstration mode)
        data = a.dtab[a.items[3 * item]];
        scale = a.stab[a.items[3 * item]];
        base = a.items[3 * item + 1];
        cnt = a.items[3 * item + 2];
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
            x = a.X + static_cast<int64_t>(p / a.xdiv) * a.ldx;
            y = a.Y + static_cast<int64_t>(p) * a.ldy;
        } else {
            x = a.X + static_cast<int64_t>(base + j) * a.ldx;
            y = a.Y + static_cast<int64_t>(base + j) * a.ldy;
        }
        x += static_cast<int64_t>(head) * a.xhs;
        float s = 0.0f;
        for (int64_t i = 0; i < a.C; ++i) s = fadd(s, fmul(decode_elem(a.fmt, data, scale, ar, i, a.C), x[i]));
        y[r] = a.round ? bf16r(s) : s;
    }
}

template <int FMT, int TT, bool EXPERT>
void launch_fmt(const LinArgs& a, dim3 grid, bool hw8) {
    constexpr int threads = rows_per_block<TT>() * 8;
    grid.x = static_cast<unsigned>((a.R + rows_per_block<TT>() - 1) / rows_per_block<TT>());
    const int64_t nb = static_cast<int64_t>(grid.x) * grid.y, nsm = sm_count();
    constexpr bool can_deep = TT == 1 && !EXPERT;
    const bool deep = can_deep && (nb <= 2 * nsm || nb > 16 * nsm);
    if (FMT == W_FP8 && hw8) {
        auto k = deep ? k_linear<FMT, TT, EXPERT, true, can_deep> : k_linear<FMT, TT, EXPERT, true, false>;
        GLM_LAUNCH(k, grid, threads, 0, a);
    } else {
        auto k = deep ? k_linear<FMT, TT, EXPERT, false, can_deep> : k_linear<FMT, TT, EXPERT, false, false>;
        GLM_LAUNCH(k, grid, threads, 0, a);
    }
}

template <int TT, bool EXPERT>
void launch_tt(const LinArgs& a, dim3 grid, bool hw8) {
    switch (a.fmt) {
        case W_BF16: launch_fmt<W_BF16, TT, EXPERT>(a, grid, hw8); break;
        case W_F32: launch_fmt<W_F32, TT, EXPERT>(a, grid, hw8); break;
        case W_FP8: launch_fmt<W_FP8, TT, EXPERT>(a, grid, hw8); break;
        case W_MXFP4: launch_fmt<W_MXFP4, TT, EXPERT>(a, grid, hw8); break;
        default: throw std::logic_error("linear: unknown weight format");
    }
}

void run(LinArgs a, bool expert, int tile, const Nm& nm, bool hw8) {
    if (a.R <= 0) return;
    if (!expert && a.T <= 0) return;
    if (nm.seq) {
        const int ty = expert ? a.max_items : (a.T + tile - 1) / tile;
        if (ty > 65535) throw std::invalid_argument("dot='sequential': at most 65535 expert work items per step");
        dim3 grid((a.R + 127) / 128, ty);
        if (expert) {
            auto k = k_linear_seq<true>;
            GLM_LAUNCH(k, grid, 128, 0, a, tile);
        } else {
            auto k = k_linear_seq<false>;
            GLM_LAUNCH(k, grid, 128, 0, a, tile);
        }
        check_launch("linear (sequential)");
        return;
    }
    const int TT = tile;
    const unsigned gx = 1;  // set per instantiation (rows per block)
    const unsigned gy = static_cast<unsigned>(expert ? std::min(a.max_items, 65535) : (a.T + TT - 1) / TT);
    if (gy == 0) return;
    dim3 grid(gx, gy);
    if (expert) {
        if (TT == 1) launch_tt<1, true>(a, grid, hw8);
        else if (TT == 4) launch_tt<4, true>(a, grid, hw8);
        else launch_tt<8, true>(a, grid, hw8);
    } else {
        if (TT == 1) launch_tt<1, false>(a, grid, hw8);
        else if (TT == 4) launch_tt<4, false>(a, grid, hw8);
        else launch_tt<8, false>(a, grid, hw8);
    }
    check_launch("linear");
}

int tile_for(int T) { return T <= 1 ? 1 : (T <= 4 ? 4 : 8); }

}  // namespace

void linear(const Lin& W, const float* X, int64_t ldx, float* Y, int64_t ldy, int T, bool round, const Nm& nm,
            bool hw8) {
    linear_heads(W, static_cast<int>(W.R), static_cast<int>(W.R), 0, 0, X, ldx, 0, Y, ldy, T, round, nm, hw8);
}

void linear_heads(const Lin& W, int R, int rh, int64_t hstride, int64_t woff, const float* X, int64_t ldx,
                  int64_t xhs, float* Y, int64_t ldy, int T, bool round, const Nm& nm, bool hw8) {
    LinArgs a;
    a.fmt = W.fmt;
    a.C = W.C;
    a.data = W.data;
    a.scale = W.scale;
    a.row0 = W.row0;
    a.R = R;
    a.rh = rh > 0 ? rh : 1;
    a.hstride = hstride;
    a.woff = woff;
    a.X = X;
    a.ldx = ldx;
    a.xhs = xhs;
    a.Y = Y;
    a.ldy = ldy;
    a.T = T;
    a.round = round;
    run(a, false, tile_for(T), nm, hw8);
}

void linear_experts(const ExpertTable& W, const int* items, const int* n_items, int max_items, const int* pairs,
                    const float* X, int64_t ldx, int xdiv, float* Y, int64_t ldy, int tile, const Nm& nm, bool hw8) {
    LinArgs a;
    a.fmt = W.fmt;
    a.C = W.C;
    a.R = static_cast<int>(W.R);
    a.rh = a.R;
    a.X = X;
    a.ldx = ldx;
    a.Y = Y;
    a.ldy = ldy;
    a.round = true;
    a.dtab = W.data;
    a.stab = W.scale;
    a.items = items;
    a.n_items = n_items;
    a.max_items = max_items;
    a.pairs = pairs;
    a.xdiv = xdiv;
    run(a, true, tile, nm, hw8);
}

}  // namespace glm::cuda
