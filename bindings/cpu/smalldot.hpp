// cdot / cdot64 of n <= 8 elements, for many independent columns at once (4 doubles or 8 floats per
// register). Used where the model reduces over a handful of values for every channel: the mHC
// collapse and stream mix (hc or hc+1 values per channel, double), the head's mean over streams, the
// MoE combination over the k selected experts and KDA's causal conv over the K taps (f32).
//
// For n <= 8 the definition of cdot (docs/contract.md §4.2; H2's cdot/cdot64 in cdot.hpp) reduces to a closed
// form: only accumulator P[0] receives elements, P[0][l] = fma(a_l, b_l, +0) for l < n and +0 for
// l >= n; the accumulator fold adds the all-(+0) accumulators P[4], P[2], P[1] to it, which changes
// nothing but a -0 (an fma whose product underflows to -0) into +0: p_l = fma(a_l, b_l, +0) + 0.
// The lane fold then gives ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)). These kernels evaluate
// exactly that, with the same operations; tests/test_fast_cpu.py checks them bit for bit against
// cdot / cdot64 (signed zeros, underflows, subnormals, infinities and NaNs included).
#pragma once

#include <immintrin.h>

#include <cstddef>

namespace glm::cpu {

// Column j (j < 4) of the result: cdot64 over l < n of (A[l][j], B[l][j]), where A[l], B[l] are
// registers holding the l-th element of four columns.
inline __m256d cdot64_small4(const __m256d* A, const __m256d* B, size_t n) {
    const __m256d z = _mm256_setzero_pd();
    __m256d p[8];
    for (size_t l = 0; l < 8; ++l) p[l] = l < n ? _mm256_add_pd(_mm256_fmadd_pd(A[l], B[l], z), z) : z;
    const __m256d q0 = _mm256_add_pd(p[0], p[4]), q1 = _mm256_add_pd(p[1], p[5]);
    const __m256d q2 = _mm256_add_pd(p[2], p[6]), q3 = _mm256_add_pd(p[3], p[7]);
    return _mm256_add_pd(_mm256_add_pd(q0, q2), _mm256_add_pd(q1, q3));
}

// The same in f32 for eight columns.
inline __m256 cdot_small8(const __m256* A, const __m256* B, size_t n) {
    const __m256 z = _mm256_setzero_ps();
    __m256 p[8];
    for (size_t l = 0; l < 8; ++l) p[l] = l < n ? _mm256_add_ps(_mm256_fmadd_ps(A[l], B[l], z), z) : z;
    const __m256 q0 = _mm256_add_ps(p[0], p[4]), q1 = _mm256_add_ps(p[1], p[5]);
    const __m256 q2 = _mm256_add_ps(p[2], p[6]), q3 = _mm256_add_ps(p[3], p[7]);
    return _mm256_add_ps(_mm256_add_ps(q0, q2), _mm256_add_ps(q1, q3));
}

// One reduction of n <= 8 elements (scalar): the same closed form. (x + 0.0 is not folded away by
// the compiler without -fno-signed-zeros: it is the -0 -> +0 of the accumulator fold.)
inline double cdot64_small(const double* a, const double* b, size_t n) {
    double p[8];
    for (size_t l = 0; l < 8; ++l) p[l] = l < n ? __builtin_fma(a[l], b[l], 0.0) + 0.0 : 0.0;
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

inline float cdot_small(const float* a, const float* b, size_t n) {
    float p[8];
    for (size_t l = 0; l < 8; ++l) p[l] = l < n ? __builtin_fmaf(a[l], b[l], 0.0f) + 0.0f : 0.0f;
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

inline double csum64_small(const double* x, size_t n) {
    double p[8];
    for (size_t l = 0; l < 8; ++l) p[l] = l < n ? x[l] + 0.0 : 0.0;  // fma(x, 1, +0) = x + 0, exactly
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

inline float csum_small(const float* x, size_t n) {
    float p[8];
    for (size_t l = 0; l < 8; ++l) p[l] = l < n ? x[l] + 0.0f : 0.0f;
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

}  // namespace glm::cpu
