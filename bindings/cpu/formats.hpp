// Number formats of the canonical numerics (docs/contract.md §4.1): BF16 rounding, and exact decoding of the
// E4M3 (fn), E2M1 and E8M0 codes and of the FP8 / MXFP4 weight layouts.
//
// This is the fast engine's own implementation; it shares no code with the Python oracle (the scalar
// bit views and BF16 rounding it shares with the CUDA engine: bindings/numerics_dev.hpp).
#pragma once

#include <immintrin.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../numerics_dev.hpp"
#include "isa.hpp"

namespace glm::cpu {

// Bit views and the scalar BF16 rounding: bindings/numerics_dev.hpp, shared with the CUDA engine.
using num::f32_bits;
using num::f32_from_bits;
using num::f64_bits;
using num::f64_from_bits;

// ---- BF16 -------------------------------------------------------------------------------------

constexpr uint16_t kBf16CanonicalNaN = num::kBf16CanonicalNaN;

// Inline kernels under their instruction set's name (isa.hpp); tables and out-of-line functions outside.
inline namespace GLM_CPU_ISA {
// f32 -> bf16 bits: round to nearest, ties to even; every NaN -> 0x7FC0 (num::bf16_bits_of).
inline uint16_t bf16_bits(float x) { return static_cast<uint16_t>(num::bf16_bits_of(f32_bits(x))); }

// f64 -> f32 (RNE, the C++ conversion under the default rounding mode) -> bf16 (RNE).
inline uint16_t bf16_bits_from_f64(double x) { return bf16_bits(static_cast<float>(x)); }

inline float f32_from_bf16(uint16_t h) { return num::bf16_to_f32(h); }

// The value of bf16(x) as an f32.
inline float bf16_round(float x) { return f32_from_bf16(bf16_bits(x)); }

// Eight lanes at once: bf16_round of each lane (the bf16 bits in the high half of each lane, low
// half zero), bit-identical to bf16_round.
inline __m256 bf16_round8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}

}  // inline namespace GLM_CPU_ISA

// out[i] = bf16_bits(x[i]) (eight lanes at a time).
void bf16_bits_array(const float* x, uint16_t* out, size_t n);

// ---- 8-bit and 4-bit codes ----------------------------------------------------------------------

// Decode tables (exact f32 values). NaN codes decode to the quiet NaN 0x7FC00000 (sign dropped);
// the loader refuses NaN codes in weights and 0xFF scales anyway (docs/contract.md §4.1).
extern const std::array<float, 256> kE4M3;  // fn: bias 7, no inf, S.1111.111 = NaN, max 448
extern const std::array<float, 16> kE2M1;    // ±{0, .5, 1, 1.5, 2, 3, 4, 6}; code bit 3 is the sign
extern const std::array<float, 256> kE8M0;   // 2^(e-127); e = 0 -> 2^-127 (0x00400000); 0xFF -> NaN
// Row e (16 floats, 64-byte aligned): the bits fl32(m * kE8M0[e]) of the eight E2M1 magnitudes m (codes 0-7), then
// the same with the sign bit set (codes 8-15), as an f32 multiply and the sign OR'd on after it give them: each
// product is exact or overflows to inf, a NaN scale gives 0x7FC00000 (0xFFC00000 with the sign). A row's decode
// picks from it (no multiply a group). Made by integer arithmetic, so it does not depend on the FP environment
// at load time.
struct E2M1Scaled {
    alignas(64) uint32_t bits[256][16];
};
extern const E2M1Scaled kE2M1Scaled;

inline namespace GLM_CPU_ISA {
inline float decode_e4m3(uint8_t q) { return kE4M3[q]; }
inline float decode_e2m1(uint8_t q) { return kE2M1[q & 15u]; }
inline float decode_e8m0(uint8_t e) { return kE8M0[e]; }
inline const float* e2m1_scaled_row(uint8_t e) { return reinterpret_cast<const float*>(kE2M1Scaled.bits[e]); }

// Eight E4M3 codes (bytes 0..7 of b) -> their values times 2^-8, exactly, with the sign.
// Sign-extending each byte to 16 bits, shifting left by 7 and clearing bit 14 gives the FP16 bits
// S.0EEEE.MMM0000000, which are 2^(e-15)(1+m/8), or the FP16 subnormal m 2^-17 for e = 0: e4m3 * 2^-8
// in both cases. F16C's conversion to f32 is exact and its result is a normal f32 (no subnormal
// operand reaches the multiplies after it: they are slow on some CPUs). NaN codes (S.1111.111) come
// out as +-480 * 2^-8 and need e4m3_nan_mask_8.
inline __m256 e4m3_scaled_8(__m128i b) {
    const __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(b), 7);
    return _mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0xBF80))));
}
constexpr float kE4M3Unscale = 0x1p8f;  // e4m3 = e4m3_scaled_8 * 2^8, an exact multiply

// All-ones lanes where the code (bytes 0..7 of b) is a NaN code.
inline __m256 e4m3_nan_mask_8(__m128i b) {
    const __m256i mag = _mm256_and_si256(_mm256_cvtepu8_epi32(b), _mm256_set1_epi32(0x7F));
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
}

// Eight E4M3 codes (bytes 0..7 of b) -> exact f32, NaN codes -> 0x7FC00000.
inline __m256 decode_e4m3_8(__m128i b) {
    const __m256 v = _mm256_mul_ps(e4m3_scaled_8(b), _mm256_set1_ps(kE4M3Unscale));
    return _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), e4m3_nan_mask_8(b));
}

}  // inline namespace GLM_CPU_ISA

// True when any of the n codes is a NaN code (S.1111.111).
bool has_e4m3_nan(const uint8_t* q, size_t n);

inline namespace GLM_CPU_ISA {
// Eight E2M1 codes (in each 32-bit lane) -> fl32(e2m1 * s), by a permutation of `mags`, the eight magnitudes
// times the (non-negative) scale s (the first eight floats of e2m1_scaled_row), and the sign bit (code bit 3) moved
// to bit 31 after: fl32(-m * s) = -fl32(m * s). Only the low 4 bits of each lane are looked at.
inline __m256 decode_e2m1_8(__m256i code, __m256 mags) {
    const __m256 m = _mm256_permutevar8x32_ps(mags, code);  // uses the low 3 bits of each lane
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(code, 28), _mm256_set1_epi32(static_cast<int>(0x80000000u)));
    return _mm256_or_ps(m, _mm256_castsi256_ps(sign));
}

}  // inline namespace GLM_CPU_ISA

// ---- weight layouts -----------------------------------------------------------------------------

// FP8 block-128 weight: w[r][c] = fl32(e4m3(q[r][c]) * scale_inv[r/128][c/128]),
// scale_inv is [ceil(R/128), ceil(C/128)] row-major.
inline namespace GLM_CPU_ISA {
inline size_t fp8_scale_rows(size_t R) { return (R + 127) / 128; }
inline size_t fp8_scale_cols(size_t C) { return (C + 127) / 128; }
}  // inline namespace GLM_CPU_ISA

// Decode whole tensors (for tests and tools; the matvec kernels decode in registers instead).
void decode_fp8_weight(const uint8_t* q, const float* scale_inv, size_t R, size_t C, float* out);
// MXFP4: packed [R, C/2] (byte b of a row: column 2b in the low nibble, 2b+1 in the high nibble),
// scale [R, C/32] E8M0; w = fl32(e2m1 * 2^(e-127)). C % 32 == 0.
void decode_mxfp4_weight(const uint8_t* packed, const uint8_t* scale, size_t R, size_t C, float* out);

}  // namespace glm::cpu
