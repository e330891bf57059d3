// Number formats on the device (docs/contract.md §4.1): BF16 rounding and the exact decoding of E4M3 (fn),
// E2M1 and E8M0 codes, eight at a time as the dot kernels read them. The CUDA engine's own code (it
// shares none with the oracle; with the CPU engine only the scalar BF16 rounding, numerics_dev.hpp).
#pragma once

#include "compat.cuh"

namespace glm::cuda {

// ---- BF16 ----------------------------------------------------------------------------------------

// The value of bf16(x) (round to nearest even, every NaN -> 0x7FC0) held in an f32.
GLM_DEV float bf16r(float x) { return f32_from_bits(num::bf16_bits_of(f32_bits(x)) << 16); }
// From a double: first to f32 (RNE), then to BF16 (RNE).
GLM_DEV float bf16r64(double x) { return bf16r(__double2float_rn(x)); }
using num::bf16_to_f32;

// ---- E8M0 and E2M1 --------------------------------------------------------------------------------

// 2^(e-127); e = 0 -> 2^-127 (a subnormal f32), 0xFF -> NaN.
GLM_DEV float e8m0(uint32_t e) {
    return e == 0 ? f32_from_bits(0x00400000u) : (e == 255 ? f32_from_bits(0x7FC00000u) : f32_from_bits(e << 23));
}

// |E2M1| for the 3 magnitude bits m: {0, .5, 1, 1.5, 2, 3, 4, 6}, built from two byte permutations
// (high byte 00 3F 3F 3F 40 40 40 40, next byte 00 00 80 C0 00 40 80 C0).
GLM_DEV float e2m1_mag(uint32_t m) {
    const uint32_t hi = __byte_perm(0x3F3F3F00u, 0x40404040u, m);
    const uint32_t lo = __byte_perm(0xC0800000u, 0xC0804000u, m);
    return f32_from_bits(((hi & 0xFFu) << 24) | ((lo & 0xFFu) << 16));
}

// fl32(e2m1(code) * s) for s >= 0 (an E8M0 scale): the magnitude times s, one rounding, then the sign
// (fl32(-m s) = -fl32(m s); code 8 gives -0).
GLM_DEV float mxfp4_w(uint32_t code, float s) {
    return f32_from_bits(f32_bits(fmul(e2m1_mag(code & 7u), s)) | ((code & 8u) << 28));
}

// ---- E4M3 (fn: bias 7, no infinities, S.1111.111 = NaN, max 448) ---------------------------------

// Software decode of one code, exact: normal codes by bit placement, subnormals m * 2^-9.
GLM_DEV float e4m3_sw(uint32_t q) {
    const uint32_t e = (q >> 3) & 15u, m = q & 7u;
    float v;
    if ((q & 0x7Fu) == 0x7Fu)
        return f32_from_bits(0x7FC00000u);
    if (e == 0)
        v = fmul(static_cast<float>(m), 0x1p-9f);
    else
        v = f32_from_bits(((e + 120u) << 23) | (m << 20));
    return (q & 0x80u) ? -v : v;
}

// Eight codes (bytes of lo then hi, column order) -> exact f32 values.
// Device: the sm_89+ conversion e4m3x2 -> f16x2 (exact: every E4M3 value is an FP16 value) and
// f16 -> f32 (exact). The software path is the reference (and the emulation's path); the engine
// checks the two agree on all 65,536 code pairs at start and falls back to software if not.
// The conversion of the code pair in half HALF of word (selected by the instruction's operand: no shift).
template <int HALF>
GLM_DEV uint32_t e4m3x2_f16x2(uint32_t word) {
    uint32_t h2 = 0;
#if !defined(GLM_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if constexpr (HALF == 0)
        asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;}" : "=r"(h2) : "r"(word));
    else
        asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, h;}" : "=r"(h2) : "r"(word));
#else
    (void)word;
#endif
    return h2;
}
template <bool HW>
GLM_DEV void e4m3x8(uint32_t lo, uint32_t hi, float (&w)[8]) {
#if !defined(GLM_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    constexpr bool kHw = HW;
#else
    constexpr bool kHw = false;
#endif
    if constexpr (kHw) {
#if !defined(GLM_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        const uint32_t words[2] = {lo, hi};
#pragma unroll
        for (int k = 0; k < 2; ++k) {
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                const uint32_t h2 = p == 0 ? e4m3x2_f16x2<0>(words[k]) : e4m3x2_f16x2<1>(words[k]);
                float a, b;
                asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}"
                    : "=f"(a), "=f"(b)
                    : "r"(h2));
                w[4 * k + 2 * p] = a;
                w[4 * k + 2 * p + 1] = b;
            }
        }
#endif
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[i] = e4m3_sw((lo >> (8 * i)) & 0xFFu);
            w[4 + i] = e4m3_sw((hi >> (8 * i)) & 0xFFu);
        }
    }
}

}  // namespace glm::cuda
