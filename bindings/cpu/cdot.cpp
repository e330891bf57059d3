#include "cdot.hpp"

#include <cmath>

namespace glm::cpu {

float cdot(const float* a, const float* b, size_t n) { return detail::cdot_kernel(detail::F32Row{a}, b, n); }

float csum(const float* x, size_t n) { return detail::cdot_kernel(detail::OnesRow{}, x, n); }

// cdot64: the same association in double. Accumulator g is P[g][0..3] in lo[g], P[g][4..7] in hi[g].
double cdot64(const double* a, const double* b, size_t n) {
    __m256d lo[8], hi[8];
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) lo[g] = hi[g] = _mm256_setzero_pd();
    const size_t nfull = n / 64;
    for (size_t c = 0; c < nfull; ++c) {
        const double* pa = a + 64 * c;
        const double* pb = b + 64 * c;
#pragma GCC unroll 8
        for (int g = 0; g < 8; ++g) {
            lo[g] = _mm256_fmadd_pd(_mm256_loadu_pd(pa + 8 * g), _mm256_loadu_pd(pb + 8 * g), lo[g]);
            hi[g] = _mm256_fmadd_pd(_mm256_loadu_pd(pa + 8 * g + 4), _mm256_loadu_pd(pb + 8 * g + 4), hi[g]);
        }
    }
    // tail: each remaining element goes to its own P[g][l], in index order (one element per lane)
    alignas(32) double P[8][8];
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
        _mm256_store_pd(P[g], lo[g]);
        _mm256_store_pd(P[g] + 4, hi[g]);
    }
    for (size_t i = 64 * nfull; i < n; ++i) {
        const size_t g = (i / 8) % 8, l = i % 8;
        P[g][l] = std::fma(a[i], b[i], P[g][l]);
    }
    for (int w = 4; w >= 1; w >>= 1)
        for (int g = 0; g < w; ++g)
            for (int l = 0; l < 8; ++l) P[g][l] += P[g + w][l];
    for (int w = 4; w >= 1; w >>= 1)
        for (int l = 0; l < w; ++l) P[0][l] += P[0][l + w];
    return P[0][0];
}

}  // namespace glm::cpu
