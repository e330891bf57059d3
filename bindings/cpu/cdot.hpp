// The one reduction primitive (SPEC 4.2).
//
// cdot(a, b) over n f32 elements: 64 partial sums P[g][l] (g, l in 0..7) start at +0; element
// i = 64c + 8g + l is added as P[g][l] = fma(a[i], b[i], P[g][l]), chunks c in increasing order,
// elements past n skipped. Then the accumulators fold P[g] += P[g+w] for w = 4, 2, 1 (lane-wise),
// then the lanes of P[0] fold P[0][l] += P[0][l+w] for w = 4, 2, 1. The result is P[0][0].
//
// Here accumulator g is one __m256 holding P[g][0..7]. A partial last group of eight is computed
// on zero-padded operands and then *blended* into the accumulator only on the live lanes: a
// masked-off lane must keep its value (fma(0, 0, -0) would turn a -0 partial sum into +0).
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace glm::cpu {

float cdot(const float* a, const float* b, size_t n);
double cdot64(const double* a, const double* b, size_t n);
float csum(const float* x, size_t n);  // = cdot(x, ones)

namespace detail {

// Lane mask with the first k (0..8) lanes set.
inline __m256i lane_mask(size_t k) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)), idx);
}

inline float fold8(__m256 acc[8]) {
    for (int w = 4; w >= 1; w >>= 1)
        for (int g = 0; g < w; ++g) acc[g] = _mm256_add_ps(acc[g], acc[g + w]);
    // lanes of P[0]: w = 4, then 2, then 1
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[0]), _mm256_extractf128_ps(acc[0], 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));      // l < 2: P[l] += P[l+2]
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));  // l = 0: P[0] += P[1]
    return _mm_cvtss_f32(v);
}

// The cdot kernel for any row source. A Row provides
//   __m256 load8(size_t base, size_t g)   -- elements base+8g .. base+8g+7 (all < n), as f32
//   __m256 load_partial(size_t base, size_t g, size_t k) -- elements base+8g .. +k-1 (k in 1..7),
//                                            anything finite elsewhere (those lanes are discarded)
// where base is a multiple of 64 (so a Row can share work between the groups of one chunk, e.g.
// a scale per 32 or 128 columns), and x is an f32 vector of length n (the b operand).
template <class Row>
inline float cdot_kernel(const Row& row, const float* x, size_t n) {
    __m256 acc[8];
    for (int g = 0; g < 8; ++g) acc[g] = _mm256_setzero_ps();
    const size_t nfull = n / 64;
    for (size_t c = 0; c < nfull; ++c) {
        const size_t base = 64 * c;
        for (size_t g = 0; g < 8; ++g)
            acc[g] = _mm256_fmadd_ps(row.load8(base, g), _mm256_loadu_ps(x + base + 8 * g), acc[g]);
    }
    const size_t base = 64 * nfull;
    const size_t rem = n - base;
    const size_t gfull = rem / 8;
    for (size_t g = 0; g < gfull; ++g)
        acc[g] = _mm256_fmadd_ps(row.load8(base, g), _mm256_loadu_ps(x + base + 8 * g), acc[g]);
    const size_t k = rem % 8;
    if (k) {
        const __m256i m = lane_mask(k);
        const __m256 xv = _mm256_maskload_ps(x + base + 8 * gfull, m);
        const __m256 t = _mm256_fmadd_ps(row.load_partial(base, gfull, k), xv, acc[gfull]);
        acc[gfull] = _mm256_blendv_ps(acc[gfull], t, _mm256_castsi256_ps(m));
    }
    return fold8(acc);
}

struct F32Row {
    const float* p;
    __m256 load8(size_t base, size_t g) const { return _mm256_loadu_ps(p + base + 8 * g); }
    __m256 load_partial(size_t base, size_t g, size_t k) const {
        return _mm256_maskload_ps(p + base + 8 * g, lane_mask(k));
    }
};

struct OnesRow {
    __m256 load8(size_t, size_t) const { return _mm256_set1_ps(1.0f); }
    __m256 load_partial(size_t, size_t, size_t) const { return _mm256_set1_ps(1.0f); }
};

}  // namespace detail
}  // namespace glm::cpu
