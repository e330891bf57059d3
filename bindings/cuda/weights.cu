// The linear layer on the device: weights decoded in registers inside the canonical dot
// (weights.cuh has the contract). Rows are independent and each is computed whole by one group of
// eight threads, so the grid shape changes no bit.
#include <algorithm>
#include <cstring>

#include <string>
#include <vector>

#include "engine_api.hpp"
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

// ---- the staged one-token kernel ----------------------------------------------------------------
//
// Decode at batch 1 streams many mid-size matrices (2k-16k rows) and a few skinny ones (64-512 rows of
// 4k-16k columns). With weights loaded into registers by the eight threads that own a row, a matrix
// of R rows has only R/4 warps, each waiting on its own few loads: the profile showed 0.9-1.7 TB/s on
// the mid-size ones and ~17 us for a 1 MB skinny one. Here every thread of a 256-thread block copies
// the block's rows into shared memory (cp.async, 16 bytes each, kStStages - 1 stages in flight), and
// the eight threads of each row then run exactly the canonical dot of linear_block from shared memory:
// the same chunks, in the same order, into the same accumulators. Only where the bytes wait changes.
constexpr int kStThreads = 256;
constexpr int kStStages = 4;
constexpr int kStStageBytes = 12288;  // weight bytes of one stage over the block's rows
constexpr int kStMaxRows = 32;

GLM_DEV void cp_async16(void* smem, const void* gmem) {
#if defined(GLM_CUDA_EMU)
    std::memcpy(smem, gmem, 16);
#else
    const unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gmem) : "memory");
#endif
}
GLM_DEV void cp_async_commit() {
#if !defined(GLM_CUDA_EMU)
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
GLM_DEV void cp_async_wait() {
#if !defined(GLM_CUDA_EMU)
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Bytes of one chunk (64 weights) of a row, and of one row.
template <int FMT>
constexpr int chunk_bytes() {
    return FMT == W_BF16 ? 128 : (FMT == W_F32 ? 256 : (FMT == W_FP8 ? 64 : 32));
}
__host__ __device__ inline int64_t row_bytes(int fmt, int64_t C) {
    return fmt == W_BF16 ? 2 * C : (fmt == W_F32 ? 4 * C : (fmt == W_FP8 ? C : C / 2));
}

// The raw bytes of chunk `u` of thread g's eight weights, from a row's bytes in shared memory.
template <int FMT>
GLM_DEV Raw<FMT> smem_raw(const unsigned char* row, int u, int g, const void* __restrict__ scale, int64_t ar,
                          int64_t col, int64_t C) {
    Raw<FMT> r;
    const unsigned char* p = row + u * chunk_bytes<FMT>() + g * (chunk_bytes<FMT>() / 8);
    if constexpr (FMT == W_BF16) {
        r.v = *reinterpret_cast<const uint4*>(p);
    } else if constexpr (FMT == W_F32) {
        r.a = *reinterpret_cast<const float4*>(p);
        r.b = *reinterpret_cast<const float4*>(p + 16);
    } else if constexpr (FMT == W_FP8) {
        r.v = *reinterpret_cast<const uint2*>(p);
        r.s = __ldg(static_cast<const float*>(scale) + (ar / 128) * ((C + 127) / 128) + col / 128);
    } else {
        r.v = *reinterpret_cast<const uint32_t*>(p);
        r.e = __ldg(static_cast<const uint8_t*>(scale) + ar * (C / 32) + col / 32);
    }
    return r;
}

// Rows [blockIdx.x * rpb, +rpb) for one token row (or one expert work item of one pair), C % 64 == 0,
// rows 16-byte aligned; `cps` chunks per stage.
template <int FMT, bool EXPERT, bool HW8>
__global__ void __launch_bounds__(kStThreads) k_linear_st(LinArgs a, int rpb, int cps) {
    GLM_DYN_SMEM(unsigned char, sm);
    __shared__ const unsigned char* rowp[kStMaxRows];
    __shared__ int64_t rowar[kStMaxRows];
    constexpr int CB = chunk_bytes<FMT>();
    const int64_t C = a.C;
    const int nchunks = static_cast<int>(C / 64);
    const int nst = (nchunks + cps - 1) / cps;
    const int sbp = cps * CB + CB;  // padded row stride of a stage: consecutive rows on other banks
    const int tid = static_cast<int>(threadIdx.x);
    const int row_base = static_cast<int>(blockIdx.x) * rpb;
    const int64_t rb = row_bytes(FMT, C);
    const int my_row = tid >> 3, g = tid & 7;
    const bool comp = my_row < rpb && row_base + my_row < a.R;
    const bool folds = (tid & ~31) < rpb * 8;  // the warps that hold compute threads fold (full-mask shuffles)

    const int n_items = EXPERT ? *a.n_items : 1;
    for (int item = EXPERT ? static_cast<int>(blockIdx.y) : 0; item < n_items;
         item += EXPERT ? static_cast<int>(gridDim.y) : 1) {
        const void* data = a.data;
        const void* scale = a.scale;
        const float* xr;
        float* yr;
        if constexpr (EXPERT) {
            const int e = a.items[3 * item], p = a.pairs[a.items[3 * item + 1]];
            data = a.dtab[e];
            scale = a.stab[e];
            xr = a.X + static_cast<int64_t>(p / a.xdiv) * a.ldx;
            yr = a.Y + static_cast<int64_t>(p) * a.ldy;
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
        __syncthreads();
        auto issue = [&](int s) {
            const int c0 = s * cps;
            const int nc = nchunks - c0 < cps ? nchunks - c0 : cps;
            const int ppr = nc * CB / 16;  // 16-byte pieces per row in this stage
            unsigned char* buf = sm + static_cast<int64_t>(s % kStStages) * rpb * sbp;
            for (int q = tid; q < rpb * ppr; q += kStThreads) {
                const int i = q / ppr, k = q - i * ppr;
                const unsigned char* src = rowp[i];
                if (src) cp_async16(buf + i * sbp + 16 * k, src + static_cast<int64_t>(c0) * CB + 16 * k);
            }
        };
        const int64_t ar = rowar[my_row < rpb ? my_row : 0];
        const float* x = xr + static_cast<int64_t>(comp ? (row_base + my_row) / a.rh : 0) * a.xhs;
        const bool xvec = reinterpret_cast<uintptr_t>(x) % 16 == 0;
        float acc[8];
        zero8(acc);
#pragma unroll
        for (int s = 0; s < kStStages - 1; ++s) {
            if (s < nst) issue(s);
            cp_async_commit();
        }
        for (int s = 0; s < nst; ++s) {
            cp_async_wait<kStStages - 2>();
            __syncthreads();  // stage s is in for every thread's copies; stage s - 1 is read by all
            if (s + kStStages - 1 < nst) issue(s + kStStages - 1);
            cp_async_commit();
            if (comp) {
                const int c0 = s * cps;
                const int nc = nchunks - c0 < cps ? nchunks - c0 : cps;
                const unsigned char* row = sm + static_cast<int64_t>(s % kStStages) * rpb * sbp + my_row * sbp;
#pragma unroll 4
                for (int u = 0; u < nc; ++u) {
                    const int64_t col = 64 * static_cast<int64_t>(c0 + u) + 8 * g;
                    const Raw<FMT> raw = smem_raw<FMT>(row, u, g, scale, ar, col, C);
                    float w[8], xv[8];
                    decode_raw<FMT, HW8>(raw, w);
                    load_x8(x, col, xvec, xv);
#pragma unroll
                    for (int l = 0; l < 8; ++l) acc[l] = ffma(w[l], xv[l], acc[l]);
                }
            }
        }
        if (folds) {
            const float y = group_fold(acc);
            if (comp && g == 0) yr[row_base + my_row] = a.round ? bf16r(y) : y;
        }
    }
}

// The staged kernel takes one token row (or expert items of one pair each), whole chunks, 16-byte
// aligned rows, and matrices of at most 16 waves of 16-row blocks (lm_head streams at 85-90 % of the
// copy bandwidth through the register kernel already).
bool staged_applies(const LinArgs& a, unsigned gy, bool expert) {
    const int64_t rb = row_bytes(a.fmt, a.C);
    if (a.C % 64 != 0 || a.C == 0 || rb % 16 != 0) return false;
    // expert weights are separate allocations of the arena (256-byte aligned); a dense view is checked here
    if (!expert && reinterpret_cast<uintptr_t>(a.data) % 16 != 0) return false;
    if (expert ? a.tile_pairs != 1 : a.T != 1) return false;
    const int64_t b16 = (a.R + 15) / 16 * static_cast<int64_t>(gy);
    return b16 <= 16 * static_cast<int64_t>(sm_count());
}

template <int FMT, bool EXPERT>
bool launch_staged(const LinArgs& a, unsigned gy, bool hw8) {
    constexpr int CB = chunk_bytes<FMT>();
    if (!staged_applies(a, gy, EXPERT)) return false;
    const int64_t nsm = sm_count();
    int rpb = 16;
    while (rpb > 1 && (a.R + rpb - 1) / rpb * static_cast<int64_t>(gy) < 2 * nsm) rpb /= 2;
    const int nchunks = static_cast<int>(a.C / 64);
    int cps = std::max(1, kStStageBytes / (rpb * CB));
    cps = std::min(cps, nchunks);
    const size_t smem = static_cast<size_t>(kStStages) * rpb * (cps * CB + CB);
    dim3 grid(static_cast<unsigned>((a.R + rpb - 1) / rpb), gy);
    auto k = hw8 ? k_linear_st<FMT, EXPERT, true> : k_linear_st<FMT, EXPERT, false>;
    static bool attr_set[2] = {false, false};
    if (!attr_set[hw8 ? 1 : 0]) {
        check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024), "smem attribute");
        attr_set[hw8 ? 1 : 0] = true;
    }
    GLM_LAUNCH(k, grid, kStThreads, smem, a, rpb, cps);
    return true;
}

template <int FMT, int TT, bool EXPERT>
void launch_fmt(const LinArgs& a, dim3 grid, bool hw8) {
    if constexpr (TT == 1) {
        if (!a.no_staged && launch_staged<FMT, EXPERT>(a, grid.y, hw8)) return;
    }
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
    a.tile_pairs = tile;
    run(a, true, tile, nm, hw8);
}

// ---- test entry point --------------------------------------------------------------------------

std::vector<float> linear_device(const std::string& release, const void* data, size_t data_bytes, const void* scale,
                                 size_t scale_bytes, int64_t R, int64_t C, const float* X, int T, bool round,
                                 const std::string& kernel, bool expert) {
    int fmt;
    if (release == "bf16") fmt = W_BF16;
    else if (release == "f32") fmt = W_F32;
    else if (release == "fp8") fmt = W_FP8;
    else if (release == "mxfp4") fmt = W_MXFP4;
    else throw std::invalid_argument("linear: release must be 'bf16', 'f32', 'fp8' or 'mxfp4', not '" + release + "'");
    if (kernel != "auto" && kernel != "staged" && kernel != "register")
        throw std::invalid_argument("linear: kernel must be 'auto', 'staged' or 'register', not '" + kernel + "'");
    if (R <= 0 || C <= 0 || T <= 0) throw std::invalid_argument("linear: R, C and T must be positive");
    if (expert && T > 65535) throw std::invalid_argument("linear: at most 65535 pairs");
    auto dalloc = [](size_t n) {
        void* p = nullptr;
        check(cudaMalloc(&p, n ? n : 16), "cudaMalloc");
        return p;
    };
    struct Free {
        std::vector<void*> p;
        ~Free() {
            for (void* q : p) cudaFree(q);
        }
    } guard;
    auto alloc = [&](size_t n) {
        guard.p.push_back(dalloc(n));
        return guard.p.back();
    };
    void* dd = alloc(data_bytes);
    void* ds = alloc(scale_bytes);
    void* dx = alloc(static_cast<size_t>(T) * C * 4);
    void* dy = alloc(static_cast<size_t>(T) * R * 4);
    void* dtab = alloc(2 * sizeof(void*));
    void* ditems = alloc(static_cast<size_t>(T) * 4 * 4 + 4);
    check(cudaMemcpy(dd, data, data_bytes, cudaMemcpyHostToDevice), "linear: weights");
    if (scale_bytes) check(cudaMemcpy(ds, scale, scale_bytes, cudaMemcpyHostToDevice), "linear: scales");
    check(cudaMemcpy(dx, X, static_cast<size_t>(T) * C * 4, cudaMemcpyHostToDevice), "linear: X");
    LinArgs a;
    a.fmt = fmt;
    a.C = C;
    a.R = static_cast<int>(R);
    a.rh = a.R;
    a.X = static_cast<const float*>(dx);
    a.ldx = C;
    a.Y = static_cast<float*>(dy);
    a.ldy = R;
    a.T = T;
    a.round = round;
    a.no_staged = kernel == "register";
    if (expert) {
        // one expert (the matrix), each token row its own work item of one pair
        const void* tab[2] = {dd, ds};
        check(cudaMemcpy(dtab, tab, sizeof(tab), cudaMemcpyHostToDevice), "linear: table");
        std::vector<int> it(static_cast<size_t>(T) * 4 + 1);
        for (int t = 0; t < T; ++t) {
            it[3 * static_cast<size_t>(t)] = 0;
            it[3 * static_cast<size_t>(t) + 1] = t;
            it[3 * static_cast<size_t>(t) + 2] = 1;
            it[3 * static_cast<size_t>(T) + 1 + static_cast<size_t>(t)] = t;
        }
        it[3 * static_cast<size_t>(T)] = T;
        check(cudaMemcpy(ditems, it.data(), it.size() * 4, cudaMemcpyHostToDevice), "linear: items");
        const int* di = static_cast<const int*>(ditems);
        a.dtab = static_cast<const void* const*>(dtab);
        a.stab = static_cast<const void* const*>(dtab) + 1;
        a.items = di;
        a.n_items = di + 3 * T;
        a.pairs = di + 3 * T + 1;
        a.max_items = T;
        a.tile_pairs = 1;
        if (kernel == "staged" && !staged_applies(a, static_cast<unsigned>(std::min(T, 65535)), true))
            throw std::invalid_argument("linear: the staged kernel does not apply to this shape");
        run(a, true, 1, Nm{}, true);
    } else {
        a.data = dd;
        a.scale = ds;
        if (kernel == "staged" && !staged_applies(a, 1, false))
            throw std::invalid_argument("linear: the staged kernel does not apply to this shape");
        run(a, false, tile_for(T), Nm{}, true);
    }
    std::vector<float> y(static_cast<size_t>(T) * R);
    check(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost), "linear: Y");
    check(cudaDeviceSynchronize(), "linear");
    return y;
}

}  // namespace glm::cuda
