#include "formats.hpp"

#include <limits>

namespace glm::cpu {
namespace {

constexpr float pow2f(int e) {  // exact 2^e for e in [-149, 127], by exact halvings/doublings
    float r = 1.0f;
    for (; e > 0; --e) r *= 2.0f;
    for (; e < 0; ++e) r *= 0.5f;
    return r;
}

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();  // 0x7FC00000 on x86-64

constexpr std::array<float, 256> make_e4m3() {
    std::array<float, 256> t{};
    for (int q = 0; q < 256; ++q) {
        const int e = (q >> 3) & 15, m = q & 7;
        float v = 0.0f;
        if ((q & 0x7F) == 0x7F)
            v = kNaN;
        else if (e == 0)
            v = static_cast<float>(m) * pow2f(-9);  // subnormal: m/8 * 2^-6
        else
            v = static_cast<float>(8 + m) * pow2f(e - 7 - 3);
        t[q] = (q & 0x80) && v == v ? -v : v;
    }
    return t;
}

constexpr std::array<float, 16> make_e2m1() {
    constexpr float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    std::array<float, 16> t{};
    for (int q = 0; q < 16; ++q) t[q] = (q & 8) ? -mags[q & 7] : mags[q & 7];
    return t;
}

constexpr std::array<float, 256> make_e8m0() {
    std::array<float, 256> t{};
    for (int e = 0; e < 255; ++e) t[e] = pow2f(e - 127);
    t[255] = kNaN;
    return t;
}

// bits of fl32(m 2^(e-127)) for E2M1 magnitude code q (0-7), as the f32 multiply rounds it: m = f 2^k with f 1 or
// 1.5, so the product f 2^x (x = e - 127 + k >= -128) is normal, subnormal (exact: a multiple of 2^-149) or past
// the largest finite (inf); a NaN scale propagates (x86: the NaN operand, 0x7FC00000)
constexpr uint32_t e2m1_times_e8m0_bits(int q, int e) {
    if (e == 255) return 0x7FC00000u;
    if (q == 0) return 0u;
    constexpr int k[8] = {0, -1, 0, 0, 1, 1, 2, 2};  // 0.5 = 2^-1, 1, 1.5, 2, 3 = 1.5 2^1, 4, 6 = 1.5 2^2
    const bool f15 = q == 3 || q == 5 || q == 7;
    const int x = e - 127 + k[q];
    if (x > 127) return 0x7F800000u;
    if (x >= -126) return static_cast<uint32_t>(x + 127) << 23 | (f15 ? 0x400000u : 0u);
    return (f15 ? 3u : 2u) << (x + 148);  // f 2^(x + 149) units of 2^-149
}

constexpr E2M1Scaled make_e2m1_scaled() {
    E2M1Scaled t{};
    for (int e = 0; e < 256; ++e)
        for (int q = 0; q < 8; ++q) {
            t.bits[e][q] = e2m1_times_e8m0_bits(q, e);
            t.bits[e][q + 8] = t.bits[e][q] | 0x80000000u;
        }
    return t;
}

}  // namespace

const E2M1Scaled kE2M1Scaled = make_e2m1_scaled();

const std::array<float, 256> kE4M3 = make_e4m3();
const std::array<float, 16> kE2M1 = make_e2m1();
const std::array<float, 256> kE8M0 = make_e8m0();

void bf16_bits_array(const float* x, uint16_t* out, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i v = _mm256_srli_epi32(_mm256_castps_si256(bf16_round8(_mm256_loadu_ps(x + i))), 16);
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);  // qwords 0, 2
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(p));
    }
    for (; i < n; ++i) out[i] = bf16_bits(x[i]);
}

bool has_e4m3_nan(const uint8_t* q, size_t n) {
    size_t i = 0;
    __m256i any = _mm256_setzero_si256();
    const __m256i top = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi8(-1);
    for (; i + 32 <= n; i += 32) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i));
        any = _mm256_or_si256(any, _mm256_cmpeq_epi8(_mm256_or_si256(v, top), ones));
    }
    bool found = !_mm256_testz_si256(any, any);
    for (; i < n; ++i) found |= (q[i] & 0x7F) == 0x7F;
    return found;
}

void decode_fp8_weight(const uint8_t* q, const float* scale_inv, size_t R, size_t C, float* out) {
    const size_t sc = fp8_scale_cols(C);
    for (size_t r = 0; r < R; ++r) {
        const float* srow = scale_inv + (r / 128) * sc;
        for (size_t c = 0; c < C; ++c) out[r * C + c] = kE4M3[q[r * C + c]] * srow[c / 128];
    }
}

void decode_mxfp4_weight(const uint8_t* packed, const uint8_t* scale, size_t R, size_t C, float* out) {
    for (size_t r = 0; r < R; ++r) {
        const uint8_t* prow = packed + r * (C / 2);
        const uint8_t* srow = scale + r * (C / 32);
        for (size_t c = 0; c < C; ++c) {
            const uint8_t nib = (c & 1) ? (prow[c / 2] >> 4) : (prow[c / 2] & 15u);
            out[r * C + c] = kE2M1[nib] * kE8M0[srow[c / 32]];
        }
    }
}

}  // namespace glm::cpu
