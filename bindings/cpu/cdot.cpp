#include "cdot.hpp"

#include <cmath>
#include <cstring>
#include <vector>

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

const float* packed_tokens(const float* X, size_t ldx, size_t T, size_t n, size_t most, size_t width, bool pair_lanes) {
    const size_t nb = detail::token_blocks(T, most), nch = (n + 63) / 64, G = 64 / width;
    struct alignas(64) Group {  // (aligned: the passes' x loads never split a line)
        float v[16];
    };
    thread_local std::vector<Group> buf;
    if (buf.size() < 4 * T * nch) buf.resize(4 * T * nch);
    float* const Xp = buf.data()->v;
    size_t t0 = 0;
    for (size_t b = 0; b < nb; ++b) {
        const size_t nt = detail::block_tokens(T, nb, b, t0);
        float* const blk = Xp + 64 * t0 * nch;
        for (size_t t = 0; t < nt; ++t) {
            const float* const x = X + (t0 + t) * ldx;
            for (size_t c = 0; c < nch; ++c)
                for (size_t j = 0; j < G; ++j) {
                    float* const d = blk + ((G * c + j) * nt + t) * width;
                    const size_t i = 64 * c + width * j, k = i < n ? std::min<size_t>(width, n - i) : 0;
                    if (k == width) {
                        std::memcpy(d, x + i, width * sizeof(float));
                    } else {
                        std::memset(d, 0, width * sizeof(float));
                        if (k) std::memcpy(d, x + i, k * sizeof(float));
                    }
                    if (pair_lanes) {  // lane 2q: element q, lane 2q + 1: element 8 + q
                        float v[16];
                        std::memcpy(v, d, sizeof v);
                        for (size_t q = 0; q < 8; ++q) {
                            d[2 * q] = v[q];
                            d[2 * q + 1] = v[8 + q];
                        }
                    }
                }
        }
        t0 += nt;
    }
    return Xp;
}

}  // namespace glm::cpu
