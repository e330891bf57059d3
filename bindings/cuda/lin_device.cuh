// The linear kernels' device parts: weight decoding from the release formats (eight weights of a
// chunk from global memory, LPT from shared memory), the lane fold, and the asynchronous copies
// (cp.async groups; bulk copies completing on a memory barrier).
// Part of weights.cu's translation unit (included there once, inside its anonymous namespace, so
// that every kernel keeps one definition and its name); not a header for other files.
#pragma once

namespace glm::cuda {
namespace {

// An expert work item (moe.cu's items: [matrix, first pair, pairs]) as a kernel takes it: the matrix's
// weights and scales, from the second tables in the blocks of blockIdx.z == 1 (gate|up's up half).
struct ExpertItem {
    const void* data;
    const void* scale;
    int start, cnt;
    bool second;
};
GLM_DEV ExpertItem expert_item(const LinArgs& a, int item) {
    const bool second = blockIdx.z != 0;
    const int e = a.items[3 * item];
    return {(second ? a.dtab2 : a.dtab)[e], (second ? a.stab2 : a.stab)[e], a.items[3 * item + 1],
            a.items[3 * item + 2], second};
}
// f(integral_constant<int, m>) for m the least of 1, 2, 3, 4, 6, 8 that is >= n (n <= 8): the few-pair
// kernel's and the register-tiled items of 8's slot counts (code unrolled for a block-uniform count): fewer
// wasted slots than powers of two, in six variants.
template <class F>
GLM_DEV void with_slots8(int n, F&& f) {
    if (n <= 2) {
        if (n <= 1) f(std::integral_constant<int, 1>{});
        else f(std::integral_constant<int, 2>{});
    } else if (n <= 4) {
        if (n <= 3) f(std::integral_constant<int, 3>{});
        else f(std::integral_constant<int, 4>{});
    } else if (n <= 6) {
        f(std::integral_constant<int, 6>{});
    } else {
        f(std::integral_constant<int, 8>{});
    }
}
// What a several-token block works on: expert item `item` (its matrix and pairs), or, dense, the launch's
// matrix and tokens [tile * n, + tile) of a.T.
struct BlockWork {
    const void* data;
    const void* scale;
    int start, cnt;
};
template <bool EXPERT>
GLM_DEV BlockWork block_work(const LinArgs& a, int item, int n, int tile) {
    if constexpr (EXPERT) {
        const ExpertItem it = expert_item(a, item);
        return {it.data, it.scale, it.start, it.cnt};
    } else {
        const int start = n * tile;
        return {a.data, a.scale, start, a.T - start < tile ? a.T - start : tile};
    }
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
template <int DEC>
GLM_DEV float fp8_mult(float s) {  // what the decoded codes are multiplied by
    return DEC == kDecInt ? fmul(s, 0x1p120f) : s;
}
template <int DEC, int N>
GLM_DEV void scale_fp8(float (&w)[N], float s) {
    const float s2 = fp8_mult<DEC>(s);
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
// The weight row of output row r (head-blocked: row0 + (r / rh) hstride + woff + r % rh; LinArgs).
GLM_DEV int64_t weight_row(const LinArgs& a, int r) {
    return a.row0 + static_cast<int64_t>(r / a.rh) * a.hstride + a.woff + (r % a.rh);
}

// Bytes of one chunk (64 weights) of a row, and of one row.
template <int FMT>
constexpr int chunk_bytes() {
    return FMT == W_BF16 ? 128 : (FMT == W_F32 ? 256 : (FMT == W_FP8 ? 64 : 32));
}

// Two E4M3 codes, bytes 2 HALF and 2 HALF + 1 of word (low byte first) -> exact f32 values, by the path
// e4m3x8 takes. The conversion reads the word's half itself (a shift to the low half first cost an
// instruction a code pair: 4 % of the few-pair kernel's at 128 tokens).
template <bool HW, int HALF = 0>
GLM_DEV void e4m3x2(uint32_t word, float& a, float& b) {
    static_assert(HALF == 0 || HALF == 1, "a word's low or high half");
#if !defined(GLM_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if constexpr (HW) {
        const uint32_t h2 = e4m3x2_f16x2<HALF>(word);
        asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}"
            : "=f"(a), "=f"(b)
            : "r"(h2));
        return;
    }
#endif
    a = e4m3_sw((word >> (16 * HALF)) & 0xFFu);
    b = e4m3_sw((word >> (16 * HALF + 8)) & 0xFFu);
}

// The raw bytes of LPT (4 or 2) consecutive FP8 or BF16 weights, and their decoding: what a thread of
// the wide register kernel loads per chunk, and what decode_smem reads for fewer than eight lanes.
template <int FMT, int LPT>
using WideWord = std::conditional_t<FMT == W_BF16 && LPT == 4, uint2, uint32_t>;

template <int FMT, int LPT>
GLM_DEV WideWord<FMT, LPT> wide_load(const void* __restrict__ data, int64_t ar, int64_t C, int64_t col) {
    if constexpr (FMT == W_BF16) {
        const uint16_t* p = static_cast<const uint16_t*>(data) + ar * C + col;
        if constexpr (LPT == 4) return __ldg(reinterpret_cast<const uint2*>(p));
        else return __ldg(reinterpret_cast<const uint32_t*>(p));
    } else {  // W_FP8
        const uint8_t* p = static_cast<const uint8_t*>(data) + ar * C + col;
        if constexpr (LPT == 4) return __ldg(reinterpret_cast<const uint32_t*>(p));
        else return static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(p)));
    }
}

// LPT weights from their raw word, exactly as decode_raw decodes eight (s: the FP8 block scale).
template <int FMT, int DEC, int LPT>
GLM_DEV void wide_decode(const WideWord<FMT, LPT>& v, float s, float (&w)[LPT]) {
    if constexpr (FMT == W_BF16) {
        uint32_t u[LPT / 2];
        if constexpr (LPT == 4) {
            u[0] = v.x;
            u[1] = v.y;
        } else {
            u[0] = v;
        }
#pragma unroll
        for (int k = 0; k < LPT / 2; ++k) {
            w[2 * k] = f32_from_bits(u[k] << 16);
            w[2 * k + 1] = f32_from_bits(u[k] & 0xFFFF0000u);
        }
    } else {
        if constexpr (DEC == kDecInt) {
            w[0] = e4m3_int<0>(v);
            w[1] = e4m3_int<1>(v);
            if constexpr (LPT == 4) {
                w[2] = e4m3_int<2>(v);
                w[3] = e4m3_int<3>(v);
            }
        } else {
            e4m3x2<DEC == kDecHw, 0>(v, w[0], w[1]);
            if constexpr (LPT == 4) e4m3x2<DEC == kDecHw, 1>(v, w[2], w[3]);
        }
        scale_fp8<DEC>(w, s);
    }
}

// Eight BF16, FP8 or MXFP4 weights of a chunk in two steps, the raw word's load from shared memory and its
// decoding (decode_smem's eight-lane path; the register-tiled kernel decodes two words of one 16-byte load).
template <int FMT>
using Raw8 = std::conditional_t<FMT == W_BF16, uint4, std::conditional_t<FMT == W_FP8, uint2, uint32_t>>;
template <int FMT>
GLM_DEV Raw8<FMT> load_raw8(const unsigned char* p) {
    static_assert(FMT == W_BF16 || FMT == W_FP8 || FMT == W_MXFP4, "BF16, FP8 or MXFP4");
    return *reinterpret_cast<const Raw8<FMT>*>(p);
}
// m: the chunk's multiplier (FP8: fp8_mult of its scale; MXFP4: its E8M0 scale, e8m0_folded with kDecInt)
template <int FMT, int DEC>
GLM_DEV void decode_raw8(const Raw8<FMT>& v, float m, float (&w)[8]) {
    if constexpr (FMT == W_BF16) {  // (m unused)
        const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            w[2 * k] = f32_from_bits(u[k] << 16);
            w[2 * k + 1] = f32_from_bits(u[k] & 0xFFFF0000u);
        }
    } else if constexpr (FMT == W_FP8) {
        e4m3_words<DEC>(v.x, v.y, w);
#pragma unroll
        for (int l = 0; l < 8; ++l) w[l] = fmul(w[l], m);
    } else if constexpr (DEC == kDecInt) {
        mxfp4_int8(v, m, w);
    } else {
#pragma unroll
        for (int l = 0; l < 8; ++l) w[l] = mxfp4_w((v >> (4 * l)) & 15u, m);
    }
}

// LPT consecutive weights of a row from shared memory (p: their first byte), decoded exactly as
// decode_raw does for eight: BF16 bits, F32, E4M3 * scale (one f32 multiply), E2M1 * E8M0 scale.
template <int FMT, int DEC, int LPT>
GLM_DEV void decode_smem(const unsigned char* p, float s, float (&w)[LPT]) {
    if constexpr ((FMT == W_BF16 || FMT == W_FP8) && LPT < 8) {
        WideWord<FMT, LPT> v;
        if constexpr (FMT == W_BF16 && LPT == 4) v = *reinterpret_cast<const uint2*>(p);
        else if constexpr (FMT == W_BF16 || LPT == 4) v = *reinterpret_cast<const uint32_t*>(p);
        else v = *reinterpret_cast<const uint16_t*>(p);
        wide_decode<FMT, DEC, LPT>(v, s, w);
    } else if constexpr (FMT == W_F32) {
#pragma unroll
        for (int k = 0; k < LPT; k += 2) {
            const float2 v = *reinterpret_cast<const float2*>(p + 4 * k);
            w[k] = v.x;
            w[k + 1] = v.y;
        }
    } else if constexpr (LPT == 8) {  // BF16, FP8, MXFP4
        decode_raw8<FMT, DEC>(load_raw8<FMT>(p), FMT == W_FP8 ? fp8_mult<DEC>(s) : s, w);
    } else {  // MXFP4, fewer than eight
        uint32_t v;
        if constexpr (LPT == 4) v = *reinterpret_cast<const uint16_t*>(p);
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

}  // namespace
}  // namespace glm::cuda
