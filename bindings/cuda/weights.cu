// The linear layer on the device: weights decoded in registers inside the canonical dot
// (weights.cuh has the contract). Rows are independent and each is computed whole by one group of
// eight threads, so the grid shape changes no bit.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <tuple>
#include <type_traits>
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

int parse_release(const std::string& release) {
    if (release == "bf16") return W_BF16;
    if (release == "f32") return W_F32;
    if (release == "fp8") return W_FP8;
    if (release == "mxfp4") return W_MXFP4;
    throw std::invalid_argument("linear: release must be 'bf16', 'f32', 'fp8' or 'mxfp4', not '" + release + "'");
}

size_t Lin::bytes() const { return static_cast<size_t>(R * row_bytes(fmt, C) + scale_bytes(fmt, R, C)); }

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

// How E4M3 codes are decoded (LinArgs::dec): the software reference, the hardware e4m3x2 -> f16x2
// conversion, or integer bit placement for tensors without NaN codes (checked once at load): the code's
// magnitude bits placed at f32 bits 20-26 and its sign at bit 31 are the value times 2^-120 (normal
// and subnormal codes alike), so fl(fl(v * 2^120) * s) = fl(e4m3 * s) exactly: two multiplies instead of
// two conversions, which the conversion unit's throughput made the limit of FP8 decode.
enum Dec : int { kDecSw = 0, kDecHw = 1, kDecInt = 2 };

// Byte K of word, a non-NaN E4M3 code, times 2^-120: the byte moved to bits 24-31, then shifted right
// by four copying its sign, puts the sign on bits 27-31 and the magnitude on bits 20-26; the mask keeps
// bit 31 and bits 20-26 (two or three instructions, where separate sign and magnitude fields took four).
template <int K>
GLM_DEV float e4m3_int(uint32_t word) {
    const int32_t top = static_cast<int32_t>(K == 3 ? word : word << (24 - 8 * K));
    return f32_from_bits(static_cast<uint32_t>(top >> 4) & 0x87F00000u);
}
// Eight codes decoded: exact values, or with kDecInt the values times 2^-120 (scale_fp8 applies both).
template <int DEC>
GLM_DEV void e4m3_words(uint32_t lo, uint32_t hi, float (&w)[8]) {
    if constexpr (DEC == kDecInt) {
        w[0] = e4m3_int<0>(lo); w[1] = e4m3_int<1>(lo); w[2] = e4m3_int<2>(lo); w[3] = e4m3_int<3>(lo);
        w[4] = e4m3_int<0>(hi); w[5] = e4m3_int<1>(hi); w[6] = e4m3_int<2>(hi); w[7] = e4m3_int<3>(hi);
    } else {
        e4m3x8<DEC == kDecHw>(lo, hi, w);
    }
}

// w = fl32(e4m3 * s) from what e4m3_words gave. kDecInt: v = e4m3 * 2^-120 exactly and s2 = s * 2^120
// is exact (the tensor's scales are all below 2^8, checked at load: fp8_scales_foldable), so the real
// product v * s2 is e4m3 * s and fl(v * s2) is the one rounding the definition asks for: one multiply
// per weight (a branch per chunk on the scale instead cost the register kernel a third of its speed).
template <int DEC, int N>
GLM_DEV void scale_fp8(float (&w)[N], float s) {
    const float s2 = DEC == kDecInt ? fmul(s, 0x1p120f) : s;
#pragma unroll
    for (int l = 0; l < N; ++l) w[l] = fmul(w[l], s2);
}

// MXFP4 by placement (LinArgs::dec kDecInt, tensors whose E8M0 scales are all <= 240: checked at load,
// mxfp4_scales_foldable): codes l and l + 4 of a chunk's word (bits 4l and 4l + 16) placed as an f16
// pair, magnitude bits at 9-11 and sign at 15, are the E2M1 values times 2^-14 (normal and subnormal
// codes alike); f16 -> f32 is exact, and s2 = 2^(e-127) * 2^14 (f32 bits (e + 14) << 23, exact for e <=
// 240) makes fl(v * s2) the one rounding of e2m1 * 2^(e-127) the definition asks for, sign included
// (fl(-a s) = -fl(a s); code 8 gives -0 either way). Per pair of weights: four integer instructions and
// two conversions, where the software decode spends ~8 instructions per weight.
GLM_DEV void f16x2_f32(uint32_t h2, float& a, float& b) {
#if !defined(GLM_CUDA_EMU) && defined(__CUDA_ARCH__)
    asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}" : "=f"(a), "=f"(b) : "r"(h2));
#else
    auto one = [](uint32_t h) {  // the f16 values placed here: never infinite or NaN
        const uint32_t sign = (h & 0x8000u) << 16, ex = (h >> 10) & 31u, man = h & 0x3FFu;
        if (ex == 0) return f32_from_bits(f32_bits(static_cast<float>(man) * 0x1p-24f) | sign);
        return f32_from_bits(sign | ((ex + 112u) << 23) | (man << 13));
    };
    a = one(h2 & 0xFFFFu);
    b = one(h2 >> 16);
#endif
}
template <int L>
GLM_DEV void e2m1_pair(uint32_t v, float& a, float& b) {  // codes L and L + 4, times 2^-14
    const uint32_t x = L ? v >> (4 * L) : v;
    f16x2_f32(((x << 9) & 0x0E000E00u) | ((x << 12) & 0x80008000u), a, b);
}
GLM_DEV float e8m0_folded(uint32_t e) { return f32_from_bits((e + 14u) << 23); }  // 2^(e-127) * 2^14, e <= 240
// Eight MXFP4 weights of a chunk's word with the folded scale s2.
GLM_DEV void mxfp4_int8(uint32_t v, float s2, float (&w)[8]) {
    e2m1_pair<0>(v, w[0], w[4]);
    e2m1_pair<1>(v, w[1], w[5]);
    e2m1_pair<2>(v, w[2], w[6]);
    e2m1_pair<3>(v, w[3], w[7]);
#pragma unroll
    for (int l = 0; l < 8; ++l) w[l] = fmul(w[l], s2);
}

template <int FMT, int DEC>
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
        e4m3_words<DEC>(r.v.x, r.v.y, w);
        scale_fp8<DEC>(w, r.s);  // w = fl32(e4m3 * scale_inv[r/128][c/128])
    } else if constexpr (DEC == kDecInt) {
        mxfp4_int8(r.v, e8m0_folded(r.e), w);
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

// The x row of expert pair p: routed pair t*k + j reads token row t; the shared expert's pairs, which
// follow the T*k routed ones, read row p - p_split.
GLM_DEV int64_t pair_xrow(const LinArgs& a, int p) { return p < a.p_split ? p / a.xdiv : p - a.p_split; }

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
        const int item = tile;
        const int e = a.items[3 * item], start = a.items[3 * item + 1];
        const bool second = blockIdx.z != 0;
        cnt = a.items[3 * item + 2];
        data = (second ? a.dtab2 : a.dtab)[e];
        scale = (second ? a.stab2 : a.stab)[e];
        float* const Y = second ? a.Y2 : a.Y;
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
        const bool second = blockIdx.z != 0;
        data = (second ? a.dtab2 : a.dtab)[a.items[3 * item]];
        scale = (second ? a.stab2 : a.stab)[a.items[3 * item]];
        Y = second ? a.Y2 : a.Y;
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

// The cp.async pipeline of the staged kernels: stages 0 .. S-2 issued, then for each stage s in order:
// wait for it, the block's barrier (stage s is in for every thread's copies; stage s - 1, whose buffer
// the next issue refills, is read by all), issue stage s + S - 1, consume stage s. Every thread calls it.
template <int S, typename Issue, typename Consume>
GLM_DEV void cp_pipeline(int nst, Issue&& issue, Consume&& consume) {
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (s < nst) issue(s);
        cp_async_commit();
    }
    for (int s = 0; s < nst; ++s) {
        cp_async_wait<S - 2>();
        __syncthreads();
        if (s + S - 1 < nst) issue(s + S - 1);
        cp_async_commit();
        consume(s);
    }
}

// Bytes of one chunk (64 weights) of a row, and of one row.
template <int FMT>
constexpr int chunk_bytes() {
    return FMT == W_BF16 ? 128 : (FMT == W_F32 ? 256 : (FMT == W_FP8 ? 64 : 32));
}

// Two E4M3 codes (low byte first) -> exact f32 values, by the path e4m3x8 takes.
template <bool HW>
GLM_DEV void e4m3x2(uint32_t pair, float& a, float& b) {
#if !defined(GLM_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if constexpr (HW) {
        uint32_t h2;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<unsigned short>(pair)));
        asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}"
            : "=f"(a), "=f"(b)
            : "r"(h2));
        return;
    }
#endif
    a = e4m3_sw(pair & 0xFFu);
    b = e4m3_sw((pair >> 8) & 0xFFu);
}

// LPT consecutive weights of a row from shared memory (p: their first byte), decoded exactly as
// decode_raw does for eight: BF16 bits, F32, E4M3 * scale (one f32 multiply), E2M1 * E8M0 scale.
template <int FMT, int DEC, int LPT>
GLM_DEV void decode_smem(const unsigned char* p, float s, float (&w)[LPT]) {
    if constexpr (FMT == W_BF16) {
        uint32_t u[LPT / 2];
        if constexpr (LPT == 8) {
            const uint4 v = *reinterpret_cast<const uint4*>(p);
            u[0] = v.x; u[1] = v.y; u[2] = v.z; u[3] = v.w;
        } else if constexpr (LPT == 4) {
            const uint2 v = *reinterpret_cast<const uint2*>(p);
            u[0] = v.x; u[1] = v.y;
        } else {
            u[0] = *reinterpret_cast<const uint32_t*>(p);
        }
#pragma unroll
        for (int k = 0; k < LPT / 2; ++k) {
            w[2 * k] = f32_from_bits(u[k] << 16);
            w[2 * k + 1] = f32_from_bits(u[k] & 0xFFFF0000u);
        }
    } else if constexpr (FMT == W_F32) {
#pragma unroll
        for (int k = 0; k < LPT; k += 2) {
            const float2 v = *reinterpret_cast<const float2*>(p + 4 * k);
            w[k] = v.x;
            w[k + 1] = v.y;
        }
    } else if constexpr (FMT == W_FP8) {
        if constexpr (LPT == 8) {
            const uint2 v = *reinterpret_cast<const uint2*>(p);
            float t[8];
            e4m3_words<DEC>(v.x, v.y, t);
#pragma unroll
            for (int l = 0; l < 8; ++l) w[l] = t[l];
        } else if constexpr (DEC == kDecInt) {
            const uint32_t v = LPT == 4 ? *reinterpret_cast<const uint32_t*>(p) : *reinterpret_cast<const uint16_t*>(p);
            w[0] = e4m3_int<0>(v);
            w[1] = e4m3_int<1>(v);
            if constexpr (LPT == 4) {
                w[2] = e4m3_int<2>(v);
                w[3] = e4m3_int<3>(v);
            }
        } else if constexpr (LPT == 4) {
            const uint32_t v = *reinterpret_cast<const uint32_t*>(p);
            e4m3x2<DEC == kDecHw>(v & 0xFFFFu, w[0], w[1]);
            e4m3x2<DEC == kDecHw>(v >> 16, w[2], w[3]);
        } else {
            const uint32_t v = *reinterpret_cast<const uint16_t*>(p);
            e4m3x2<DEC == kDecHw>(v, w[0], w[1]);
        }
        scale_fp8<DEC>(w, s);
    } else if constexpr (LPT == 8 && DEC == kDecInt) {  // s: the folded scale (e8m0_folded)
        mxfp4_int8(*reinterpret_cast<const uint32_t*>(p), s, w);
    } else {
        uint32_t v;
        if constexpr (LPT == 8) v = *reinterpret_cast<const uint32_t*>(p);
        else if constexpr (LPT == 4) v = *reinterpret_cast<const uint16_t*>(p);
        else v = *p;
#pragma unroll
        for (int l = 0; l < LPT; ++l) w[l] = mxfp4_w((v >> (4 * l)) & 15u, s);
    }
}

// The canonical fold when thread (g, h) of a row holds lanes [h*LPT, (h+1)*LPT) of accumulator g
// (TPR = 64/LPT threads per row, aligned in the warp): P[g] += P[g+w] for w = 4, 2, 1 (lane-wise),
// then P[0][l] += P[0][l+w] for w = 4, 2, 1. The result is in thread (0, 0) of the row. Every lane
// of the warp calls it.
template <int LPT>
GLM_DEV float fold_lanes(float (&acc)[LPT], int g, int h) {
    constexpr int SUB = 8 / LPT;  // threads per accumulator
    constexpr int TPR = 8 * SUB;
#pragma unroll
    for (int w = 4; w >= 1; w >>= 1) {
#pragma unroll
        for (int k = 0; k < LPT; ++k) {
            const float o = __shfl_down_sync(kFull, acc[k], w * SUB, TPR);
            if (g < w) acc[k] = add(acc[k], o);
        }
    }
#pragma unroll
    for (int w = 4; w >= 1; w >>= 1) {
        if (w >= LPT) {
#pragma unroll
            for (int k = 0; k < LPT; ++k) {
                const float o = __shfl_down_sync(kFull, acc[k], w / LPT, TPR);
                if (h * LPT + k < w) acc[k] = add(acc[k], o);
            }
        } else {
#pragma unroll
            for (int k = 0; k < LPT; ++k)
                if (k < w) acc[k] = add(acc[k], acc[k + w]);
        }
    }
    return acc[0];
}

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
            cnt = a.T - item * TT < TT ? a.T - item * TT : TT;
        }
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
            else xr = static_cast<int64_t>(item) * TT + j;
            xrow[tid] = a.X + xr * a.ldx;
        }
        __syncthreads();
        auto issue = [&](int s) {
            const int c0 = s * CPS;
            const int nc = nchunks - c0 < CPS ? nchunks - c0 : CPS;
            unsigned char* buf = sm + (s % kMtStages) * SBYTES;
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
                    else yrow = static_cast<int64_t>(item) * TT + j;
                    Y[yrow * a.ldy + r] = a.round ? bf16r(y) : y;
                }
            }
        }
    }
}

// ---- the streaming one-token kernel -------------------------------------------------------------
//
// One token row (or expert items of one pair) streamed by warps that live for the whole launch. The
// launch's rows are cut into units of four consecutive rows of one matrix (of one expert item and
// table); warp w of the grid takes units w, w + (warps in the grid), ..., so the warps sweep the
// weights as one front. Each warp streams its units' rows into its own ring of sm_slots buffers by
// bulk asynchronous copies (one per row and stage of 1 KB, completing on the buffer's memory barrier),
// issued by its lane 0 as soon as the buffer is free, across unit boundaries: the weights keep
// arriving while a unit is folded and written, and no warp waits on another. (A block-wide stage of 32
// rows, refilled by one warp after a block barrier, ran at 1-2.5 TB/s on the H200: the rows' copies
// leave one warp one at a time.) x is read through L1 as by the register kernel. Each row is computed
// as by the register kernel: thread g of the row's eight owns P[g][0..7] (chunks in order, one FMA
// each), then group_fold. Only where the bytes wait changes.
constexpr int kSmThreads = 256;
constexpr int kSmWarps = kSmThreads / 32;
template <int MINB>
constexpr int sm_slots() {  // buffers per warp: 6 (one block per SM), 3 (two) or 2 (three)
    return MINB == 1 ? 6 : (MINB == 2 ? 3 : 2);
}
template <int FMT>
constexpr int sm_cps() {  // chunks per stage: 1 KB of each row
    return 1024 / chunk_bytes<FMT>();
}
template <int FMT>
constexpr int sm_pitch() {  // a buffer's row stride: consecutive rows on other banks
    return 1024 + (chunk_bytes<FMT>() < 64 ? chunk_bytes<FMT>() : 64);
}
template <int FMT, int MINB>
constexpr int sm_block_bytes() {
    return kSmWarps * sm_slots<MINB>() * 4 * sm_pitch<FMT>();
}

// The memory barrier of a stage and the bulk copies that complete on it (sm_90). The emulation copies
// at issue and keeps the barrier's phase, pending arrival and byte count in its eight bytes.
#if defined(GLM_CUDA_EMU)
struct EmuBar {
    int32_t tx;
    uint16_t pending;
    uint8_t count, phase;
};
GLM_DEV void emu_bar_complete(EmuBar* b) {
    if (b->pending == 0 && b->tx == 0) {
        b->phase ^= 1u;
        b->pending = b->count;
    }
}
#else
GLM_DEV unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
#endif
GLM_DEV void mbar_init(uint64_t* bar, unsigned count) {
#if defined(GLM_CUDA_EMU)
    *reinterpret_cast<EmuBar*>(bar) = EmuBar{0, static_cast<uint16_t>(count), static_cast<uint8_t>(count), 0};
#else
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}
GLM_DEV void mbar_init_fence() {
#if !defined(GLM_CUDA_EMU)
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// One arrival that also announces `bytes` to come by bulk copies.
GLM_DEV void mbar_arrive_expect(uint64_t* bar, unsigned bytes) {
#if defined(GLM_CUDA_EMU)
    EmuBar* b = reinterpret_cast<EmuBar*>(bar);
    b->tx += static_cast<int32_t>(bytes);
    --b->pending;
    emu_bar_complete(b);
#else
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}
// bytes (a multiple of 16; both addresses 16-byte aligned) from global to shared memory.
GLM_DEV void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
#if defined(GLM_CUDA_EMU)
    std::memcpy(dst, src, bytes);
    EmuBar* b = reinterpret_cast<EmuBar*>(bar);
    b->tx -= static_cast<int32_t>(bytes);
    emu_bar_complete(b);
#else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
#endif
}
// Until the barrier's phase of parity `parity` has completed.
GLM_DEV void mbar_wait(uint64_t* bar, unsigned parity) {
#if defined(GLM_CUDA_EMU)
    while (reinterpret_cast<volatile EmuBar*>(bar)->phase == parity) glm_emu::spin();
#else
    asm volatile(
        "{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT;\n}\n" ::"r"(
            smem_addr(bar)),
        "r"(parity)
        : "memory");
#endif
}

// Unit u of the launch (four rows): which matrix, rows, x and y. Units run over (item, table, row
// group), row groups fastest.
struct SmUnit {
    const unsigned char* data;
    const void* scale;
    const float* x;  // dense: add the row's head offset
    float* y;
    int r0;  // first output row
};
template <bool EXPERT>
GLM_DEV SmUnit sm_unit(const LinArgs& a, int u, int nrg) {
    SmUnit s;
    s.r0 = (u % nrg) * 4;
    if constexpr (EXPERT) {
        const int nz = a.dtab2 ? 2 : 1;
        const int item = u / nrg / nz, z = (u / nrg) % nz;
        const int e = a.items[3 * item], p = a.pairs[a.items[3 * item + 1]];
        s.data = static_cast<const unsigned char*>((z ? a.dtab2 : a.dtab)[e]);
        s.scale = (z ? a.stab2 : a.stab)[e];
        s.x = a.X + pair_xrow(a, p) * a.ldx;
        s.y = (z ? a.Y2 : a.Y) + static_cast<int64_t>(p) * a.ldy;
    } else {
        s.data = static_cast<const unsigned char*>(a.data);
        s.scale = a.scale;
        s.x = a.X;
        s.y = a.Y;
    }
    return s;
}
GLM_DEV int64_t weight_row(const LinArgs& a, int r) {
    return a.row0 + static_cast<int64_t>(r / a.rh) * a.hstride + a.woff + (r % a.rh);
}

// MINB: blocks per SM the launch keeps resident (1, 2 or 3), so the registers fit that many.
template <int FMT, bool EXPERT, int DEC, int MINB>
__global__ void __launch_bounds__(kSmThreads, MINB) k_linear_stream(LinArgs a) {
    pdl_enter();
    GLM_DYN_SMEM(unsigned char, sm);
    constexpr int CB = chunk_bytes<FMT>(), CPS = sm_cps<FMT>(), PITCH = sm_pitch<FMT>(), S = sm_slots<MINB>();
    __shared__ uint64_t bars[kSmWarps][S];
    const int64_t C = a.C;
    const int64_t rbytes = row_bytes(FMT, C);
    const int nchunks = static_cast<int>(C / 64);
    const int nst = (nchunks + CPS - 1) / CPS;
    const int nrg = (a.R + 3) / 4;
    const int nunits = EXPERT ? *a.n_items * (a.dtab2 ? 2 : 1) * nrg : nrg;
    const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31, i = lane >> 3, g = lane & 7;
    const int gw = static_cast<int>(blockIdx.x) * kSmWarps + warp, GW = static_cast<int>(gridDim.x) * kSmWarps;
    const int K = gw < nunits ? (nunits - gw + GW - 1) / GW * nst : 0;  // this warp's stages, in order
    unsigned char* wsm = sm + warp * S * 4 * PITCH;
    uint64_t* wb = bars[warp];
    if (lane == 0)
        for (int s = 0; s < S; ++s) mbar_init(&wb[s], 1);
    mbar_init_fence();
    __syncthreads();

    // The issue cursor: the next stage to request (its index, column stage, unit and buffer). The whole
    // warp runs it; lane 0 announces the bytes, lane r copies row r of the unit (1 KB or less).
    int ik = 0, is = 0, iu = gw, islot = 0, irows = 0;
    const unsigned char* isrc = nullptr;
    auto issue_next = [&] {
        if (is == 0) {
            const SmUnit un = sm_unit<EXPERT>(a, iu, nrg);
            irows = a.R - un.r0 < 4 ? a.R - un.r0 : 4;
            isrc = un.data + weight_row(a, un.r0 + (lane < irows ? lane : 0)) * rbytes;
        }
        const int c0 = is * CPS, nc = nchunks - c0 < CPS ? nchunks - c0 : CPS;
        uint64_t* bar = &wb[islot];
        if (lane == 0) mbar_arrive_expect(bar, static_cast<unsigned>(irows * nc * CB));
        __syncwarp();
        if (lane < irows)
            bulk_copy(wsm + (islot * 4 + lane) * PITCH, isrc + static_cast<int64_t>(c0) * CB, static_cast<unsigned>(nc * CB), bar);
        ++ik;
        if (++is == nst) {
            is = 0;
            iu += GW;
        }
        if (++islot == S) islot = 0;
    };
    while (ik < S && ik < K) issue_next();

    float acc[8];
    zero8(acc);
    SmUnit un{};
    const float* xr = nullptr;
    int64_t srow = 0;  // this row's scale row (FP8: its 128-row block's; MXFP4: its own)
    bool live = false;
    int s = 0, u = gw, slot = 0;
    unsigned phase = 0;
    for (int k = 0; k < K; ++k) {
        if (s == 0) {
            un = sm_unit<EXPERT>(a, u, nrg);
            const int r = un.r0 + i;
            live = r < a.R;
            const int rr = live ? r : a.R - 1;
            const int64_t ar = weight_row(a, rr);
            srow = FMT == W_FP8 ? (ar / 128) * ((C + 127) / 128) : (FMT == W_MXFP4 ? ar * (C / 32) : 0);
            xr = un.x + (EXPERT ? 0 : static_cast<int64_t>(rr / a.rh) * a.xhs) + 8 * g;
        }
        const int c0 = s * CPS, nc = nchunks - c0 < CPS ? nchunks - c0 : CPS;
        const unsigned char* row = wsm + (slot * 4 + i) * PITCH + g * (CB / 8);
        const float* xs = xr + 64 * static_cast<int64_t>(c0);
        mbar_wait(&wb[slot], phase);
        if (live) {
            // chunk c with its scale (FP8: already times 2^120 for the integer decode, as scale_fp8 does)
            auto chunk = [&](int c, float sc) {
                float w[8];
                if constexpr (FMT == W_FP8) {
                    const uint2 v = *reinterpret_cast<const uint2*>(row + c * CB);
                    e4m3_words<DEC>(v.x, v.y, w);
#pragma unroll
                    for (int l = 0; l < 8; ++l) w[l] = fmul(w[l], sc);  // w = fl32(e4m3 * scale_inv)
                } else {
                    decode_smem<FMT, DEC, 8>(row + c * CB, sc, w);
                }
                const float4 x0 = __ldg(reinterpret_cast<const float4*>(xs + 64 * c));
                const float4 x1 = __ldg(reinterpret_cast<const float4*>(xs + 64 * c + 4));
                acc[0] = ffma(w[0], x0.x, acc[0]);
                acc[1] = ffma(w[1], x0.y, acc[1]);
                acc[2] = ffma(w[2], x0.z, acc[2]);
                acc[3] = ffma(w[3], x0.w, acc[3]);
                acc[4] = ffma(w[4], x1.x, acc[4]);
                acc[5] = ffma(w[5], x1.y, acc[5]);
                acc[6] = ffma(w[6], x1.z, acc[6]);
                acc[7] = ffma(w[7], x1.w, acc[7]);
            };
            auto scale_of = [&](int c) {  // chunk c's scale (FP8: one per two chunks, 128 columns)
                if constexpr (FMT == W_FP8) {
                    const float sv = __ldg(static_cast<const float*>(un.scale) + srow + (c0 + c) / 2);
                    return DEC == kDecInt ? fmul(sv, 0x1p120f) : sv;
                } else if constexpr (FMT == W_MXFP4) {
                    const uint32_t e = __ldg(static_cast<const uint8_t*>(un.scale) + srow + 2 * (c0 + c) + g / 4);
                    return DEC == kDecInt ? e8m0_folded(e) : e8m0(e);
                } else {
                    return 0.0f;
                }
            };
            if (nc == CPS) {
                if constexpr (FMT == W_FP8) {
#pragma unroll
                    for (int c = 0; c < CPS; c += 2) {
                        const float sc = scale_of(c);
                        chunk(c, sc);
                        chunk(c + 1, sc);
                    }
                } else {
#pragma unroll
                    for (int c = 0; c < CPS; ++c) chunk(c, scale_of(c));
                }
            } else {
                for (int c = 0; c < nc; ++c) chunk(c, scale_of(c));
            }
        }
        __syncwarp();  // every lane is done with buffer `slot`: refill it
        if (ik < K) issue_next();
        if (s == nst - 1) {
            const float y = group_fold(acc);
            if (live && g == 0) un.y[un.r0 + i] = a.round ? bf16r(y) : y;
            zero8(acc);
        }
        if (++s == nst) {
            s = 0;
            u += GW;
        }
        if (++slot == S) {
            slot = 0;
            phase ^= 1u;
        }
    }
}

// The staged kernel takes one token row (or expert items of one pair each), whole chunks, 16-byte
// aligned rows (and x rows), and matrices of at most 16 waves of 16-row blocks (lm_head streams at
// 85-90 % of the copy bandwidth through the register kernel already). The bound is per matrix, not per
// launch: a batch-1 expert launch holds k routed items and the shared expert's (k = 8: 9 items of
// 4096-row down matrices, past 16 waves together), the case the staged kernel was measured fastest on.
// What both shared-memory kernels (staged, tiled) need to copy rows by 16-byte pieces: whole chunks,
// 16-byte aligned weight rows and x rows.
bool rows_copyable(const LinArgs& a, bool expert) {
    const int64_t rb = row_bytes(a.fmt, a.C);
    if (a.C % 64 != 0 || a.C == 0 || rb % 16 != 0) return false;
    // expert weights are separate allocations of the arena (256-byte aligned); a dense view is checked here
    if (!expert && reinterpret_cast<uintptr_t>(a.data) % 16 != 0) return false;
    return reinterpret_cast<uintptr_t>(a.X) % 16 == 0 && a.ldx % 4 == 0;
}

bool staged_applies(const LinArgs& a, bool expert) {
    if (!rows_copyable(a, expert) || a.xhs % 4 != 0) return false;
    if (expert ? a.tile_pairs != 1 : a.T != 1) return false;
    return (a.R + 15) / 16 <= 16 * static_cast<int64_t>(sm_count());
}

// f(std::integral_constant<int, DEC>{}) for the launch's decode path: FP8 has three kernels (software,
// hardware conversion, integer placement), MXFP4 two where MXFP4_INT (software, placement), every other
// format and kernel the software one (whose values every path equals).
template <int FMT, bool MXFP4_INT, class F>
void with_dec(int dec, F&& f) {
    if constexpr (FMT == W_FP8) {
        if (dec == kDecInt) f(std::integral_constant<int, kDecInt>{});
        else if (dec == kDecHw) f(std::integral_constant<int, kDecHw>{});
        else f(std::integral_constant<int, kDecSw>{});
    } else if constexpr (FMT == W_MXFP4 && MXFP4_INT) {
        if (dec == kDecInt) f(std::integral_constant<int, kDecInt>{});
        else f(std::integral_constant<int, kDecSw>{});
    } else {
        f(std::integral_constant<int, kDecSw>{});
    }
}

// Raise a kernel's dynamic shared memory limit to `bytes`, once per kernel.
template <class K>
void allow_smem(K kernel, size_t bytes) {
    static std::map<const void*, size_t> done;
    const void* key = reinterpret_cast<const void*>(kernel);
    if (done.count(key) && done[key] >= bytes) return;
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
          "smem attribute");
    done[key] = bytes;
}

template <int FMT, bool EXPERT, int LPT, bool XS, int DEC>
void launch_st_dec(const LinArgs& a, dim3 grid, int rpb, int cps, size_t smem) {
    auto k = k_linear_st<FMT, EXPERT, DEC, LPT, XS>;
    allow_smem(k, 200 * 1024);
    GLM_LAUNCH(k, grid, kStThreads, smem, a, rpb, cps);
}
template <int FMT, bool EXPERT, int LPT, bool XS>
void launch_st(const LinArgs& a, dim3 grid, int rpb, int cps, size_t smem) {
    with_dec<FMT, false>(a.dec, [&](auto dec) { launch_st_dec<FMT, EXPERT, LPT, XS, decltype(dec)::value>(a, grid, rpb, cps, smem); });
}

// The staged kernel with variant c (fields 0 / -1: the defaults); false when it does not apply.
template <int FMT, bool EXPERT>
bool launch_staged(const LinArgs& a, dim3 g, const StChoice& c) {
    constexpr int CB = chunk_bytes<FMT>();
    if (!staged_applies(a, EXPERT)) return false;
    const int64_t nsm = sm_count();
    const bool heads = a.rh < a.R && a.xhs != 0;
    const int lpt = c.lpt > 0 ? c.lpt : 8;
    const bool xs = !heads && (c.xs >= 0 ? c.xs == 1 : true);
    const int maxr = kStThreads / (64 / lpt);
    int rpb = c.rpb ? std::min(c.rpb, maxr) : std::min(16, maxr);
    if (!c.rpb)
        while (rpb > 1 && (a.R + rpb - 1) / rpb * static_cast<int64_t>(g.y) * g.z < 2 * nsm) rpb /= 2;
    const int nchunks = static_cast<int>(a.C / 64);
    int cps = c.cps ? c.cps : std::max(1, kStStageBytes / (rpb * CB));
    cps = std::min(cps, nchunks);
    const size_t smem = static_cast<size_t>(kStStages) * (rpb * (cps * CB + CB) + (xs ? cps * 256 : 0));
    if (smem > 200 * 1024) return false;
    const dim3 grid(static_cast<unsigned>((a.R + rpb - 1) / rpb), g.y, g.z);
    if (lpt == 8) {
        if (xs) launch_st<FMT, EXPERT, 8, true>(a, grid, rpb, cps, smem);
        else launch_st<FMT, EXPERT, 8, false>(a, grid, rpb, cps, smem);
    } else if (lpt == 4) {
        if (xs) launch_st<FMT, EXPERT, 4, true>(a, grid, rpb, cps, smem);
        else launch_st<FMT, EXPERT, 4, false>(a, grid, rpb, cps, smem);
    } else {
        if (xs) launch_st<FMT, EXPERT, 2, true>(a, grid, rpb, cps, smem);
        else launch_st<FMT, EXPERT, 2, false>(a, grid, rpb, cps, smem);
    }
    return true;
}

// The tiled kernel takes token rows (or expert items) of one x row each (no head-blocked x) whose rows
// can be copied. Several tokens or pairs take it always; one token (TT = 1) where the one-token tuning
// measured it fastest, or when forced.
bool tiled_applies(const LinArgs& a, bool expert) {
    return rows_copyable(a, expert) && !(a.rh < a.R && a.xhs != 0);
}

template <int FMT, bool EXPERT, int TT, int DEC>
void launch_mt_dec(const LinArgs& a, dim3 grid) {
    auto k = k_linear_mt<FMT, EXPERT, DEC, TT>;
    constexpr size_t smem = static_cast<size_t>(kMtStages) * mt_stage_bytes<FMT, TT>();
    allow_smem(k, smem);
    grid.x = static_cast<unsigned>((a.R + kMtRows - 1) / kMtRows);
    GLM_LAUNCH(k, grid, kMtThreads, smem, a);
}
template <int FMT, bool EXPERT, int TT>
void launch_mt(const LinArgs& a, dim3 grid) {
    with_dec<FMT, false>(a.dec, [&](auto dec) { launch_mt_dec<FMT, EXPERT, TT, decltype(dec)::value>(a, grid); });
}

// The streaming kernel: one token row (or expert items of one pair) whose rows can be copied.
bool stream_applies(const LinArgs& a, bool expert) {
    return rows_copyable(a, expert) && a.xhs % 4 == 0 && (expert ? a.tile_pairs == 1 : a.T == 1);
}

template <int FMT, bool EXPERT, int DEC, int MINB>
void launch_sm_dec(const LinArgs& a, dim3 g) {
    auto k = k_linear_stream<FMT, EXPERT, DEC, MINB>;
    constexpr size_t smem = static_cast<size_t>(sm_block_bytes<FMT, MINB>());
    allow_smem(k, smem);
    // every unit's block resident at once: at most MINB blocks per SM (expert launches: as many units
    // as the largest work list could hold; blocks past the device's count of units exit at once)
    const int64_t units = (a.R + 3) / 4 * (EXPERT ? static_cast<int64_t>(a.max_items) * g.z : 1);
    const unsigned blocks =
        static_cast<unsigned>(std::min<int64_t>((units + kSmWarps - 1) / kSmWarps, static_cast<int64_t>(MINB) * sm_count()));
    GLM_LAUNCH(k, blocks, kSmThreads, smem, a);
}
template <int FMT, bool EXPERT, int MINB>
void launch_sm(const LinArgs& a, dim3 g) {
    with_dec<FMT, true>(a.dec, [&](auto dec) { launch_sm_dec<FMT, EXPERT, decltype(dec)::value, MINB>(a, g); });
}

// minb 5 or 6 (one token): the variant bounded to that many 128-thread blocks per SM (<= 102 or 85
// registers; ptxas: the FP8 expert kernel then spills 32 or 128 bytes)
template <int FMT, int TT, bool EXPERT, int DEC>
void launch_reg(const LinArgs& a, dim3 grid, int minb) {
    constexpr int threads = rows_per_block<TT>() * 8;
    grid.x = static_cast<unsigned>((a.R + rows_per_block<TT>() - 1) / rows_per_block<TT>());
    const int64_t nb = static_cast<int64_t>(grid.x) * grid.y, nsm = sm_count();
    constexpr bool can_deep = TT == 1 && !EXPERT;
    const bool deep = can_deep && (nb <= 2 * nsm || nb > 16 * nsm);
    auto k = deep ? k_linear<FMT, TT, EXPERT, DEC, can_deep> : k_linear<FMT, TT, EXPERT, DEC, false>;
    if constexpr (TT == 1) {
        if (minb == 5) k = k_linear<FMT, 1, EXPERT, DEC, false, 5>;
        if (minb == 6) k = k_linear<FMT, 1, EXPERT, DEC, false, 6>;
    }
    GLM_LAUNCH(k, grid, threads, 0, a);
}

// minb (one token): the register-bounded variants (tuning candidates)
// (MXFP4 with several tokens: the software decode)
template <int FMT, int TT, bool EXPERT>
void launch_register(const LinArgs& a, dim3 grid, int minb = 1) {
    with_dec<FMT, TT == 1>(a.dec, [&](auto dec) { launch_reg<FMT, TT, EXPERT, decltype(dec)::value>(a, grid, minb); });
}

// ---- the one-token kernel choice, measured -----------------------------------------------------
//
// Every variant (the register kernel, the staged kernel with 8/4/2 lanes per thread, x staged or not)
// computes the same bits, so which is fastest for a shape is a question for the device, not for the
// numerics: the first one-token launch of each shape (format, rows, columns, head blocking, expert
// items, decode path) times the candidates on the real operands, each after evicting L2 (decode streams
// every weight from HBM), and keeps the fastest. The candidates all write the same Y, so the call's
// result is unchanged. Off under the CPU emulation (GLM_CUDA_TUNE=0 also turns it off): there the
// staged kernel with 8 lanes is used wherever it applies, the register kernel elsewhere.
struct TuneKey {
    int fmt, R, rh, dec;
    int64_t C;
    bool expert;
    unsigned gy, gz;  // gz 2: gate and up in one launch, twice the blocks of one matrix
    bool operator<(const TuneKey& o) const {
        return std::tie(fmt, R, rh, dec, C, expert, gy, gz) <
               std::tie(o.fmt, o.R, o.rh, o.dec, o.C, o.expert, o.gy, o.gz);
    }
};
struct TuneResult {
    StChoice choice;  // lpt == -1: the register kernel
    std::vector<std::pair<std::string, float>> us;
};
std::map<TuneKey, TuneResult>& tuned() {
    static std::map<TuneKey, TuneResult> m;
    return m;
}
bool tuning_on() {
#if defined(GLM_CUDA_EMU)
    return false;
#else
    static const bool on = !env_is("GLM_CUDA_TUNE", "0");
    return on;
#endif
}
std::string choice_name(const StChoice& c) {
    if (c.dec >= 0) {
        StChoice d = c;
        d.dec = -1;
        return choice_name(d) + (c.dec == kDecHw ? "/hw" : (c.dec == kDecInt ? "/int" : "/sw"));
    }
    if (c.lpt == kTiledChoice) return "tiled";
    if (c.lpt == kRegOccChoice) return "register:occ" + std::to_string(c.rpb);
    if (c.lpt == kStreamChoice) return "stream:" + std::to_string(c.rpb);
    if (c.lpt < 0) return "register";
    return "staged:" + std::to_string(c.lpt) + ":" + std::to_string(c.xs) +
           (c.rpb ? ":" + std::to_string(c.rpb) + ":" + std::to_string(c.cps) : "");
}

void flush_l2() {
    static void* buf = nullptr;
    constexpr size_t n = size_t{96} << 20;  // larger than the H100/H200 L2 (50 MB)
    if (!buf) check(cudaMalloc(&buf, n), "cudaMalloc (L2 flush)");
    check(cudaMemsetAsync(buf, 0, n, 0), "L2 flush");
}

// The fastest one-token kernel for a's shape: timed over the candidates on the first call (which
// leaves their common result in Y), looked up after.
// One token with kernel choice c (register, register bounded to c.rpb blocks per SM, tiled, or a staged
// variant); false when c does not apply to a's shape.
template <int FMT, bool EXPERT>
bool launch_one_token(const LinArgs& a, dim3 grid, const StChoice& c) {
    if (c.dec >= 0 && c.dec != a.dec) {  // every decode path gives the same values: the tuning times them
        LinArgs b = a;
        b.dec = c.dec;
        StChoice d = c;
        d.dec = -1;
        return launch_one_token<FMT, EXPERT>(b, grid, d);
    }
    if (c.lpt == kTiledChoice) {
        if (!tiled_applies(a, EXPERT)) return false;
        launch_mt<FMT, EXPERT, 1>(a, grid);
        return true;
    }
    if (c.lpt == kStreamChoice) {
        if (!stream_applies(a, EXPERT)) return false;
        if (c.rpb == 1) launch_sm<FMT, EXPERT, 1>(a, grid);
        else if (c.rpb == 2) launch_sm<FMT, EXPERT, 2>(a, grid);
        else launch_sm<FMT, EXPERT, 3>(a, grid);
        return true;
    }
    if (c.lpt < 0) {
        launch_register<FMT, 1, EXPERT>(a, grid, c.lpt == kRegOccChoice ? c.rpb : 1);
        return true;
    }
    return launch_staged<FMT, EXPERT>(a, grid, c);
}

template <int FMT, bool EXPERT>
StChoice tuned_choice(const LinArgs& a, dim3 grid) {
    const TuneKey key{a.fmt, a.R, a.rh < a.R ? a.rh : 0, a.dec, a.C, EXPERT, grid.y, grid.z};
    auto it = tuned().find(key);
    if (it != tuned().end()) return it->second.choice;
    const bool heads = a.rh < a.R && a.xhs != 0;
    std::vector<StChoice> cands(1);
    cands[0].lpt = -1;  // the register kernel
    for (int lpt : {8, 4, 2}) {
        if (!staged_applies(a, EXPERT)) break;
        StChoice c;
        c.lpt = lpt;
        c.xs = heads ? 0 : 1;
        cands.push_back(c);
    }
    if (tiled_applies(a, EXPERT)) {
        StChoice c;
        c.lpt = kTiledChoice;
        cands.push_back(c);
    }
    for (int minb : {5, 6}) {
        StChoice c;
        c.lpt = kRegOccChoice;
        c.rpb = minb;
        cands.push_back(c);
    }
    if (stream_applies(a, EXPERT)) {
        for (int bps : {1, 2, 3}) {
            StChoice c;
            c.lpt = kStreamChoice;
            c.rpb = bps;
            cands.push_back(c);
        }
    }
    if (a.dec == kDecInt) {  // the same kernels with the hardware E4M3 conversion (MXFP4: the software decode)
        const size_t n = cands.size();
        for (size_t j = 0; j < n; ++j) {
            StChoice c = cands[j];
            c.dec = FMT == W_FP8 ? kDecHw : kDecSw;
            cands.push_back(c);
        }
    }
    TuneResult res;
    cudaEvent_t e0, e1;
    check(cudaEventCreate(&e0), "event");
    check(cudaEventCreate(&e1), "event");
    float best = 1e30f;
    for (const StChoice& c : cands) {
        float t_min = 1e30f;
        for (int rep = 0; rep < 2; ++rep) {
            flush_l2();
            check(cudaEventRecord(e0, 0), "event");
            launch_one_token<FMT, EXPERT>(a, grid, c);
            check(cudaEventRecord(e1, 0), "event");
            check(cudaEventSynchronize(e1), "tuning");
            float ms = 0;
            check(cudaEventElapsedTime(&ms, e0, e1), "event");
            t_min = std::min(t_min, ms);
        }
        res.us.emplace_back(choice_name(c), 1e3f * t_min);
        if (t_min < best) {
            best = t_min;
            res.choice = c;
        }
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return tuned().emplace(key, res).first->second.choice;
}

template <int FMT, int TT, bool EXPERT>
void launch_fmt(const LinArgs& a, dim3 grid) {
    if constexpr (TT == 1) {
        StChoice c = a.st;  // a variant forced by a test or benchmark, else the engine's choice:
        if (c.lpt == 0) {   // the measured one where a shared-memory kernel applies, the register kernel elsewhere
            if (a.no_staged || !(staged_applies(a, EXPERT) || stream_applies(a, EXPERT))) c.lpt = -1;
            else if (tuning_on()) c = tuned_choice<FMT, EXPERT>(a, grid);
            else if (!staged_applies(a, EXPERT)) c.lpt = -1;
        }
        if (launch_one_token<FMT, EXPERT>(a, grid, c)) return;
    } else {
        if (!a.no_staged && tiled_applies(a, EXPERT)) {
            launch_mt<FMT, EXPERT, TT>(a, grid);
            return;
        }
    }
    launch_register<FMT, TT, EXPERT>(a, grid);
}

template <int TT, bool EXPERT>
void launch_tt(const LinArgs& a, dim3 grid) {
    switch (a.fmt) {
        case W_BF16: launch_fmt<W_BF16, TT, EXPERT>(a, grid); break;
        case W_F32: launch_fmt<W_F32, TT, EXPERT>(a, grid); break;
        case W_FP8: launch_fmt<W_FP8, TT, EXPERT>(a, grid); break;
        case W_MXFP4: launch_fmt<W_MXFP4, TT, EXPERT>(a, grid); break;
        default: throw std::logic_error("linear: unknown weight format");
    }
}

void run(LinArgs a, bool expert, int tile, const Nm& nm) {
    if (a.R <= 0) return;
    if (!expert && a.T <= 0) return;
    if (nm.seq) {
        const int ty = expert ? a.max_items : (a.T + tile - 1) / tile;
        if (ty > 65535) throw std::invalid_argument("dot='sequential': at most 65535 expert work items per step");
        dim3 grid((a.R + 127) / 128, ty, expert && a.dtab2 ? 2 : 1);
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
    dim3 grid(gx, gy, expert && a.dtab2 ? 2 : 1);
    if (expert) {
        if (TT == 1) launch_tt<1, true>(a, grid);
        else if (TT == 4) launch_tt<4, true>(a, grid);
        else launch_tt<8, true>(a, grid);
    } else {
        if (TT == 1) launch_tt<1, false>(a, grid);
        else if (TT == 4) launch_tt<4, false>(a, grid);
        else launch_tt<8, false>(a, grid);
    }
    check_launch("linear");
}

int tile_for(int T) { return T <= 1 ? 1 : (T <= 4 ? 4 : 8); }

int dec_for(int fmt, bool int_decode, bool hw8) {
    if (fmt == W_MXFP4) return int_decode ? kDecInt : kDecSw;
    if (fmt != W_FP8) return kDecSw;
    return int_decode ? kDecInt : (hw8 ? kDecHw : kDecSw);
}

__global__ void k_e4m3_nan_scan(const uint8_t* p, size_t n, int* found) {
    pdl_enter();
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        if ((p[i] & 0x7Fu) == 0x7Fu) *found = 1;
}

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
    a.dec = dec_for(W.fmt, W.int_decode, hw8);
    run(a, false, tile_for(T), nm);
}

namespace {
LinArgs expert_args(const ExpertTable& W, const int* items, const int* n_items, int max_items, const int* pairs,
                    const float* X, int64_t ldx, int xdiv, int p_split, float* Y, int64_t ldy, int tile) {
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
    a.p_split = p_split;
    a.tile_pairs = tile;
    return a;
}
}  // namespace

void linear_experts(const ExpertTable& W, const int* items, const int* n_items, int max_items, const int* pairs,
                    const float* X, int64_t ldx, int xdiv, int p_split, float* Y, int64_t ldy, int tile,
                    const Nm& nm, bool hw8) {
    LinArgs a = expert_args(W, items, n_items, max_items, pairs, X, ldx, xdiv, p_split, Y, ldy, tile);
    a.dec = dec_for(W.fmt, W.int_decode, hw8);
    run(a, true, tile, nm);
}

void linear_experts2(const ExpertTable& W, const ExpertTable& W2, const int* items, const int* n_items, int max_items,
                     const int* pairs, const float* X, int64_t ldx, int xdiv, int p_split, float* Y, float* Y2,
                     int64_t ldy, int tile, const Nm& nm, bool hw8) {
    if (W2.fmt != W.fmt || W2.R != W.R || W2.C != W.C) {  // one launch needs one kernel for both tables
        linear_experts(W, items, n_items, max_items, pairs, X, ldx, xdiv, p_split, Y, ldy, tile, nm, hw8);
        linear_experts(W2, items, n_items, max_items, pairs, X, ldx, xdiv, p_split, Y2, ldy, tile, nm, hw8);
        return;
    }
    LinArgs a = expert_args(W, items, n_items, max_items, pairs, X, ldx, xdiv, p_split, Y, ldy, tile);
    a.dtab2 = W2.data;
    a.stab2 = W2.scale;
    a.Y2 = Y2;
    // one decode path for both (the template's): every path decodes exactly, the integer one only NaN-free codes
    a.dec = dec_for(W.fmt, W.int_decode && W2.int_decode, hw8);
    run(a, true, tile, nm);
}

std::vector<TunedShape> tuned_shapes() {
    std::vector<TunedShape> out;
    for (const auto& kv : tuned()) {
        TunedShape t;
        t.fmt = wfmt_name(kv.first.fmt);
        t.R = kv.first.R;
        t.C = kv.first.C;
        t.expert_items = kv.first.expert ? static_cast<int>(kv.first.gy) : 0;
        t.tables = std::max(1, static_cast<int>(kv.first.gz));
        t.heads = kv.first.rh != 0;
        t.decode = kv.first.dec == kDecInt ? "int" : (kv.first.dec == kDecHw ? "hw" : "sw");
        t.choice = choice_name(kv.second.choice);
        t.us = kv.second.us;
        out.push_back(t);
    }
    return out;
}

bool fp8_scales_foldable(const float* scale, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        const float s2 = scale[i] * 0x1p120f;  // (exact or overflowing: a power-of-two multiply)
        if (!(s2 - s2 == 0.0f)) return false;  // inf or NaN
    }
    return true;
}

bool mxfp4_scales_foldable(const uint8_t* scale, size_t n) {
    for (size_t i = 0; i < n; ++i)
        if (scale[i] > 240) return false;
    return true;
}

bool e4m3_nan_free_device(const void* data, size_t n) {
    if (n == 0) return true;
    void* dv = nullptr;
    check(cudaMalloc(&dv, sizeof(int)), "cudaMalloc");
    int* d = static_cast<int*>(dv);
    int found = 0;
    check(cudaMemcpy(d, &found, sizeof(int), cudaMemcpyHostToDevice), "nan scan");
    auto k = k_e4m3_nan_scan;
    GLM_LAUNCH(k, 1024, 256, 0, static_cast<const uint8_t*>(data), n, d);
    check_launch("nan scan");
    const cudaError_t e = cudaMemcpy(&found, d, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(d);
    check(e, "nan scan");
    return found == 0;
}

// ---- test and benchmark entry points ------------------------------------------------------------

namespace {

// kernel: "auto" | "register" | "register:occ5|6" | "stream:1|2|3" | "tiled" | "tiled:1" | "staged" | "staged:LPT:XS[:RPB:CPS]" -> (no_staged,
// forced choice); "tiled" gives expert work items of tile_for(T) pairs, "tiled:1" of one pair.
StChoice parse_kernel(const std::string& kernel, bool& no_staged, bool& require_staged) {
    StChoice c;
    no_staged = kernel == "register";
    require_staged = kernel.rfind("staged", 0) == 0;
    if (kernel == "tiled" || kernel == "tiled:1") c.lpt = kTiledChoice;
    if (kernel == "register:occ5" || kernel == "register:occ6") {
        c.lpt = kRegOccChoice;
        c.rpb = kernel.back() - '0';
    }
    if (kernel == "stream:1" || kernel == "stream:2" || kernel == "stream:3") {
        c.lpt = kStreamChoice;
        c.rpb = kernel.back() - '0';
    }
    if (kernel == "auto" || kernel == "register" || c.lpt == kRegOccChoice || c.lpt == kStreamChoice ||
        kernel == "tiled" || kernel == "tiled:1" || kernel == "staged")
        return c;
    int v[4] = {0, -1, 0, 0};
    int n = 0;
    if (require_staged && kernel.size() > 7 && kernel[6] == ':') {
        size_t pos = 7;
        while (n < 4 && pos <= kernel.size()) {
            const size_t e = kernel.find(':', pos);
            const std::string f = kernel.substr(pos, e == std::string::npos ? std::string::npos : e - pos);
            if (f.empty() || f.find_first_not_of("0123456789") != std::string::npos) break;
            v[n++] = std::stoi(f);
            if (e == std::string::npos) {
                pos = kernel.size() + 1;
                break;
            }
            pos = e + 1;
        }
        if (pos == kernel.size() + 1 && (n == 2 || n == 4) && (v[0] == 8 || v[0] == 4 || v[0] == 2) &&
            (v[1] == 0 || v[1] == 1) && v[2] >= 0 && v[2] <= 32 && v[3] >= 0) {
            c.lpt = v[0];
            c.xs = v[1];
            c.rpb = v[2];
            c.cps = v[3];
            return c;
        }
    }
    throw std::invalid_argument("linear: kernel must be 'auto', 'register', 'register:occ5', 'register:occ6', "
                                "'stream:1', 'stream:2', 'stream:3', 'tiled', "
                                "'tiled:1', 'staged' or "
                                "'staged:LPT:XS[:RPB:CPS]' "
                                "(LPT 8, 4 or 2; XS 0 or 1), not '" + kernel + "'");
}

void parse_decode(const std::string& d) {
    if (d != "auto" && d != "sw" && d != "hw" && d != "int")
        throw std::invalid_argument("linear: decode must be 'auto', 'sw', 'hw' or 'int', not '" + d + "'");
}
// FP8 decode path: auto = the engine's choice (integer placement for NaN-free weights whose scales
// are below 2^8, else hardware); 'int' on other weights is refused. MXFP4: 'int' (placement, scales
// <= 240) or 'sw'; auto takes 'int' where it applies.
int dec_of(const std::string& d, int fmt, bool int_decode) {
    if (fmt == W_MXFP4) {
        if (d == "int" && !int_decode) throw std::invalid_argument("linear: decode 'int' needs MXFP4 scales of at most 240");
        return d == "auto" || d == "int" ? (int_decode ? kDecInt : kDecSw) : kDecSw;
    }
    if (fmt != W_FP8) return kDecSw;
    if (d == "sw") return kDecSw;
    if (d == "hw") return kDecHw;
    if (d == "int" && !int_decode)
        throw std::invalid_argument("linear: decode 'int' needs weights without NaN codes and scales below 2^8");
    return int_decode ? kDecInt : kDecHw;
}

// Y[t][r] over all R rows of one matrix (no head blocking), x rows ldx apart, y rows R apart.
LinArgs whole_matrix_args(int fmt, int64_t R, int64_t C, const void* X, int64_t ldx, void* Y, int T, bool round,
                          bool no_staged) {
    LinArgs a;
    a.fmt = fmt;
    a.C = C;
    a.R = static_cast<int>(R);
    a.rh = a.R;
    a.X = static_cast<const float*>(X);
    a.ldx = ldx;
    a.Y = static_cast<float*>(Y);
    a.ldy = R;
    a.T = T;
    a.round = round;
    a.no_staged = no_staged;
    return a;
}

struct DevBufs {
    std::vector<void*> p;
    void* alloc(size_t n) {
        void* q = nullptr;
        check(cudaMalloc(&q, n ? n : 16), "cudaMalloc");
        p.push_back(q);
        return q;
    }
    ~DevBufs() {
        for (void* q : p) cudaFree(q);
    }
};

// Work items of `tile` consecutive pairs (the last may hold fewer), item i on expert i % n_experts:
// [3T] items (the unused ones zero), then n_items, then [T] pairs (pair t is token row t).
std::vector<int> expert_items(int T, int n_experts, int tile = 1) {
    std::vector<int> it(static_cast<size_t>(T) * 4 + 1);
    int n = 0;
    for (int t = 0; t < T; t += tile, ++n) {
        it[3 * static_cast<size_t>(n)] = n % n_experts;
        it[3 * static_cast<size_t>(n) + 1] = t;
        it[3 * static_cast<size_t>(n) + 2] = T - t < tile ? T - t : tile;
    }
    for (int t = 0; t < T; ++t) it[3 * static_cast<size_t>(T) + 1 + static_cast<size_t>(t)] = t;
    it[3 * static_cast<size_t>(T)] = n;
    return it;
}

void set_expert_args(LinArgs& a, const void* tables, const void* items, int T, int n_experts, int tile = 1) {
    const int* di = static_cast<const int*>(items);
    a.dtab = static_cast<const void* const*>(tables);
    a.stab = static_cast<const void* const*>(tables) + n_experts;
    a.items = di;
    a.n_items = di + 3 * T;
    a.pairs = di + 3 * T + 1;
    a.max_items = (T + tile - 1) / tile;
    a.tile_pairs = tile;
}

__global__ void k_fill_bytes(unsigned char* p, size_t n, uint32_t seed, int fmt) {
    pdl_enter();
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        unsigned char b = static_cast<unsigned char>(h);
        if (fmt == W_FP8 && (b & 0x7F) == 0x7F) b = 0x7E;
        if (fmt == W_BF16 && (i & 1)) b = static_cast<unsigned char>(0x3C + (b & 1));  // |w| in [2^-7, 2^-5)
        if (fmt == W_F32 && (i & 3) == 3) b = 0x3C;
        p[i] = b;
    }
}
void fill(void* p, size_t n, uint32_t seed, int fmt) {
    auto k = k_fill_bytes;
    GLM_LAUNCH(k, 1024, 256, 0, static_cast<unsigned char*>(p), n, seed, fmt);
    check_launch("fill");
}
}  // namespace

std::vector<float> linear_device(const std::string& release, const void* data, size_t data_bytes, const void* scale,
                                 size_t scale_bytes, int64_t R, int64_t C, const float* X, int T, bool round,
                                 const std::string& kernel, bool expert, const std::string& decode) {
    const int fmt = parse_release(release);
    parse_decode(decode);
    bool no_staged = false, require_staged = false;
    const StChoice choice = parse_kernel(kernel, no_staged, require_staged);
    if (R <= 0 || C <= 0 || T <= 0) throw std::invalid_argument("linear: R, C and T must be positive");
    if (expert && T > 65535) throw std::invalid_argument("linear: at most 65535 pairs");
    DevBufs B;
    void* dd = B.alloc(data_bytes);
    void* ds = B.alloc(scale_bytes);
    void* dx = B.alloc(static_cast<size_t>(T) * C * 4);
    void* dy = B.alloc(static_cast<size_t>(T) * R * 4);
    void* dtab = B.alloc(2 * sizeof(void*));
    void* ditems = B.alloc(static_cast<size_t>(T) * 4 * 4 + 4);
    check(cudaMemcpy(dd, data, data_bytes, cudaMemcpyHostToDevice), "linear: weights");
    if (scale_bytes) check(cudaMemcpy(ds, scale, scale_bytes, cudaMemcpyHostToDevice), "linear: scales");
    check(cudaMemcpy(dx, X, static_cast<size_t>(T) * C * 4, cudaMemcpyHostToDevice), "linear: X");
    const bool tiled = kernel.rfind("tiled", 0) == 0;  // the tiled kernel
    LinArgs a = whole_matrix_args(fmt, R, C, dx, C, dy, T, round, no_staged);
    a.dec = dec_of(decode, fmt,
                   fmt == W_FP8 ? e4m3_nan_free_device(dd, data_bytes) &&
                                      fp8_scales_foldable(static_cast<const float*>(scale), scale_bytes / 4)
                                : fmt == W_MXFP4 && mxfp4_scales_foldable(static_cast<const uint8_t*>(scale), scale_bytes));
    a.st = choice;
    if (expert) {
        // one expert (the matrix), each token row its own work item of one pair
        const void* tab[2] = {dd, ds};
        check(cudaMemcpy(dtab, tab, sizeof(tab), cudaMemcpyHostToDevice), "linear: table");
        const int tile = kernel == "tiled" ? tile_for(T) : 1;
        const std::vector<int> it = expert_items(T, 1, tile);
        check(cudaMemcpy(ditems, it.data(), it.size() * 4, cudaMemcpyHostToDevice), "linear: items");
        set_expert_args(a, dtab, ditems, T, 1, tile);
        if (require_staged && !staged_applies(a, true))
            throw std::invalid_argument("linear: the staged kernel does not apply to this shape");
        if (tiled && !tiled_applies(a, true))
            throw std::invalid_argument("linear: the tiled kernel does not apply to this shape");
        if (choice.lpt == kStreamChoice && !stream_applies(a, true))
            throw std::invalid_argument("linear: the stream kernel does not apply to this shape");
        run(a, true, tile, Nm{});
    } else {
        a.data = dd;
        a.scale = ds;
        if (require_staged && !staged_applies(a, false))
            throw std::invalid_argument("linear: the staged kernel does not apply to this shape");
        if (tiled && !tiled_applies(a, false))
            throw std::invalid_argument("linear: the tiled kernel does not apply to this shape");
        if (choice.lpt == kStreamChoice && !stream_applies(a, false))
            throw std::invalid_argument("linear: the stream kernel does not apply to this shape");
        run(a, false, tile_for(T), Nm{});
    }
    std::vector<float> y(static_cast<size_t>(T) * R);
    check(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost), "linear: Y");
    check(cudaDeviceSynchronize(), "linear");
    return y;
}

double linear_bench_device(const std::string& release, int64_t R, int64_t C, int experts, const std::string& kernel,
                           int reps, const std::string& decode) {
    const int fmt = parse_release(release);
    parse_decode(decode);
    bool no_staged = false, require_staged = false;
    const StChoice choice = parse_kernel(kernel, no_staged, require_staged);
    if (R <= 0 || C <= 0 || C % 64 != 0 || experts < 0 || experts > 64 || reps < 1)
        throw std::invalid_argument("linear_bench: R > 0, C a positive multiple of 64, 0 <= experts <= 64, reps >= 1");
    const int nmat = std::max(1, experts);
    const size_t wbytes = static_cast<size_t>(R) * static_cast<size_t>(row_bytes(fmt, C));
    const size_t sbytes = fmt == W_FP8 ? static_cast<size_t>((R + 127) / 128) * ((C + 127) / 128) * 4
                                       : (fmt == W_MXFP4 ? static_cast<size_t>(R) * (C / 32) : 0);
    DevBufs B;
    std::vector<const void*> tab(2 * static_cast<size_t>(nmat));
    for (int e = 0; e < nmat; ++e) {
        void* w = B.alloc(wbytes);
        fill(w, wbytes, 17u + static_cast<uint32_t>(e), fmt);
        void* sc = B.alloc(sbytes);
        if (sbytes) fill(sc, sbytes, 1000u + static_cast<uint32_t>(e), W_F32);  // FP8: ~2^-7 scales; E8M0 codes
        tab[static_cast<size_t>(e)] = w;
        tab[static_cast<size_t>(nmat + e)] = sc;
    }
    void* dx = B.alloc(static_cast<size_t>(C) * 4);
    fill(dx, static_cast<size_t>(C) * 4, 5u, W_F32);
    const int T = std::max(1, experts);
    void* dy = B.alloc(static_cast<size_t>(T) * R * 4);
    LinArgs a = whole_matrix_args(fmt, R, C, dx, 0, dy, 1, true, no_staged);  // ldx 0: every pair reads one x
    a.dec = dec_of(decode, fmt, true);  // the fill makes no NaN codes
    a.st = choice;
    void* dtab = nullptr;
    if (experts > 0) {
        dtab = B.alloc(tab.size() * sizeof(void*));
        check(cudaMemcpy(dtab, tab.data(), tab.size() * sizeof(void*), cudaMemcpyHostToDevice), "bench: table");
        const std::vector<int> it = expert_items(T, nmat);
        void* ditems = B.alloc(it.size() * 4);
        check(cudaMemcpy(ditems, it.data(), it.size() * 4, cudaMemcpyHostToDevice), "bench: items");
        set_expert_args(a, dtab, ditems, T, nmat);
        if (require_staged && !staged_applies(a, true))
            throw std::invalid_argument("linear_bench: the staged kernel does not apply to this shape");
    } else {
        a.data = tab[0];
        a.scale = tab[1];
        if (require_staged && !staged_applies(a, false))
            throw std::invalid_argument("linear_bench: the staged kernel does not apply to this shape");
    }
    auto once = [&] {
        if (experts > 0) run(a, true, 1, Nm{});
        else run(a, false, 1, Nm{});
    };
    for (int i = 0; i < 3; ++i) once();
    check(cudaDeviceSynchronize(), "bench warm-up");
    cudaEvent_t e0, e1;
    check(cudaEventCreate(&e0), "event");
    check(cudaEventCreate(&e1), "event");
    std::vector<float> ms;
    for (int i = 0; i < reps; ++i) {
        flush_l2();  // decode streams every weight from HBM: no rep may find it in L2
        check(cudaEventRecord(e0, 0), "event");
        once();
        check(cudaEventRecord(e1, 0), "event");
        check(cudaEventSynchronize(e1), "bench");
        float t = 0;
        check(cudaEventElapsedTime(&t, e0, e1), "event");
        ms.push_back(t);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    std::sort(ms.begin(), ms.end());
    return 1e3 * static_cast<double>(ms[ms.size() / 2]);
}

}  // namespace glm::cuda
