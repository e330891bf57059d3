// Release-format weight views: exact row decoding and the in-register matvec (H2's kernels).
#include "weights.hpp"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cdot.hpp"
#include "formats.hpp"
#include "matvec.hpp"

namespace glm::cpu {

const char* wfmt_name(WFmt f) {
    switch (f) {
        case WFmt::BF16: return "bf16";
        case WFmt::F32: return "f32";
        case WFmt::FP8: return "fp8";
        case WFmt::MXFP4: return "mxfp4";
    }
    return "?";
}

size_t Lin::bytes() const {
    switch (fmt) {
        case WFmt::BF16: return R * C * 2;
        case WFmt::F32: return R * C * 4;
        case WFmt::FP8: return R * C + ((R + 127) / 128) * ((C + 127) / 128) * 4;
        case WFmt::MXFP4: return R * (C / 2) + R * (C / 32);
    }
    return 0;
}

void Lin::decode_row(size_t r, float* out) const {
    const size_t a = row0 + r;
    switch (fmt) {
        case WFmt::BF16: {
            const uint16_t* p = static_cast<const uint16_t*>(data) + a * C;
            size_t c = 0;
            for (; c + 8 <= C; c += 8) {
                const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c));
                _mm256_storeu_ps(out + c, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
            }
            for (; c < C; ++c) out[c] = f32_from_bf16(p[c]);
            return;
        }
        case WFmt::F32:
            std::memcpy(out, static_cast<const float*>(data) + a * C, C * sizeof(float));
            return;
        case WFmt::FP8: {
            const uint8_t* q = static_cast<const uint8_t*>(data) + a * C;
            const float* srow = static_cast<const float*>(scale) + (a / 128) * fp8_scale_cols(C);
            size_t c = 0;
            if (fp8_nan_free) {
                // (code & 0x7F) << 20 read as f32 is |e4m3| * 2^-120 exactly (normal or subnormal);
                // with the block's scale folded as s * 2^120 (exact while it stays finite),
                // fl32(|e4m3| 2^-120 * s 2^120) is the one rounding of the exact product |e4m3| * s;
                // the code's sign flips it after (rounding is symmetric; xor, so a negative scale works).
                // Blocks whose folded scale would not be exact take the plain path.
                const __m256i magmask = _mm256_set1_epi32(0x07F00000), signmask = _mm256_set1_epi32(static_cast<int>(0x80000000u));
                for (size_t blk = 0; blk * 128 < C; ++blk) {
                    const float sf = srow[blk] * 0x1p120f;
                    const size_t end = std::min(C, (blk + 1) * 128);
                    if (!(std::fabs(sf) <= 3.0e38f) || (srow[blk] != 0.0f && std::fabs(srow[blk]) < 0x1p-126f)) {
                        for (; c < end; ++c) out[c] = decode_e4m3(q[c]) * srow[blk];
                        continue;
                    }
                    const __m256 vs = _mm256_set1_ps(sf);
                    for (; c + 8 <= end; c += 8) {
                        uint64_t v;
                        std::memcpy(&v, q + c, 8);
                        const __m256i code = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(v)));
                        const __m256 mag = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(code, 20), magmask));
                        const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(code, 24), signmask);
                        _mm256_storeu_ps(out + c, _mm256_xor_ps(_mm256_mul_ps(mag, vs), _mm256_castsi256_ps(sign)));
                    }
                    for (; c < end; ++c) out[c] = decode_e4m3(q[c]) * srow[blk];
                }
                return;
            }
            for (; c + 8 <= C; c += 8) {
                uint64_t v;
                std::memcpy(&v, q + c, 8);
                const __m128i codes = _mm_cvtsi64_si128(static_cast<long long>(v));
                // one f32 multiply: fl32(e4m3 * scale_inv[r/128][c/128]); c..c+7 share one block
                _mm256_storeu_ps(out + c, _mm256_mul_ps(decode_e4m3_8(codes), _mm256_set1_ps(srow[c / 128])));
            }
            for (; c < C; ++c) out[c] = decode_e4m3(q[c]) * srow[c / 128];
            return;
        }
        case WFmt::MXFP4: {
            const uint8_t* p = static_cast<const uint8_t*>(data) + a * (C / 2);
            const uint8_t* sc = static_cast<const uint8_t*>(scale) + a * (C / 32);
            const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            for (size_t g = 0; g < C / 32; ++g) {  // C % 32 == 0
                // fl32(m * s) for the eight magnitudes m of the group's scale s (e2m1_scaled_row), picked by
                // nibble; the sign after (fl32(-m s) = -fl32(m s)) -- the same values as fl32(e2m1 * s)
                const __m256 table = _mm256_load_ps(e2m1_scaled_row(sc[g]));
                for (size_t k = 0; k < 4; ++k) {
                    const size_t c = 32 * g + 8 * k;
                    uint32_t v;
                    std::memcpy(&v, p + c / 2, 4);
                    const __m256i nib = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(v)), shifts);
                    _mm256_storeu_ps(out + c, decode_e2m1_8(nib, table));
                }
            }
            return;
        }
    }
}

void Lin::matvec(size_t r0, size_t r1, const float* x, float* y) const { matmul(r0, r1, x, C, 1, y, 0, false); }

void Lin::matmul(size_t r0, size_t r1, const float* X, size_t ldx, size_t T, float* Y, size_t ldy, bool round) const {
    if (r1 <= r0 || T == 0) return;
    if (T > detail::kPackTokens) {  // (the kernels pack x per call: its copy a thread keeps stays bounded)
        for (size_t t0 = 0; t0 < T; t0 += detail::kPackTokens)
            matmul(r0, r1, X + t0 * ldx, ldx, std::min(detail::kPackTokens, T - t0), Y + t0 * ldy, ldy, round);
        return;
    }
    const size_t a0 = row0 + r0, a1 = row0 + r1;
    const LinKernels& k = kernels ? *kernels : lin_kernels();
    switch (fmt) {
        case WFmt::BF16:
            k.rows_bf16(static_cast<const uint16_t*>(data), C, a0, a1, X, ldx, T, Y, ldy, round);
            return;
        case WFmt::F32:
            k.rows_f32(static_cast<const float*>(data), C, a0, a1, X, ldx, T, Y, ldy, round);
            return;
        case WFmt::FP8:
            k.rows_fp8(static_cast<const uint8_t*>(data), static_cast<const float*>(scale), C, a0, a1, X, ldx, T, Y, ldy,
                     round, fp8_nan_free);
            return;
        case WFmt::MXFP4:
            k.rows_mxfp4(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(scale), C, a0, a1, X, ldx, T, Y,
                       ldy, round);
            return;
    }
}

}  // namespace glm::cpu
