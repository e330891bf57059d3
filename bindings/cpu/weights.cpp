// Release-format weight views: exact row decoding and the in-register matvec (H2's kernels).
#include "weights.hpp"

#include <immintrin.h>

#include <algorithm>
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
            for (size_t c = 0; c < C; c += 8) {  // C % 32 == 0
                uint32_t v;
                std::memcpy(&v, p + c / 2, 4);
                const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(v)), shifts),
                                                     _mm256_set1_epi32(15));
                _mm256_storeu_ps(out + c, _mm256_mul_ps(decode_e2m1_8(nib), _mm256_set1_ps(decode_e8m0(sc[c / 32]))));
            }
            return;
        }
    }
}

void Lin::matvec(size_t r0, size_t r1, const float* x, float* y) const {
    if (r1 <= r0) return;
    const size_t a0 = row0 + r0, n = r1 - r0;
    switch (fmt) {
        case WFmt::BF16:
            matvec_bf16(static_cast<const uint16_t*>(data) + a0 * C, n, C, x, y, 1);
            return;
        case WFmt::F32: {
            const float* W = static_cast<const float*>(data);
            for (size_t i = 0; i < n; ++i) y[i] = cdot(W + (a0 + i) * C, x, C);
            return;
        }
        case WFmt::FP8: {
            // H2's kernel indexes scale rows by (row / 128) relative to the pointer it is given:
            // split at absolute 128-row block boundaries and hand it each block's scale row.
            const size_t sc = fp8_scale_cols(C);
            size_t a = a0;
            const size_t end = a0 + n;
            while (a < end) {
                const size_t b = std::min(end, (a / 128 + 1) * 128);
                matvec_fp8(static_cast<const uint8_t*>(data) + a * C, static_cast<const float*>(scale) + (a / 128) * sc,
                           b - a, C, x, y + (a - a0), 1);
                a = b;
            }
            return;
        }
        case WFmt::MXFP4:
            matvec_mxfp4(static_cast<const uint8_t*>(data) + a0 * (C / 2),
                         static_cast<const uint8_t*>(scale) + a0 * (C / 32), n, C, x, y, 1);
            return;
    }
}

}  // namespace glm::cpu
