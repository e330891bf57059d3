// The canonical single-precision exponential (docs/contract.md §4.3): glibc's expf (>= 2.28, from Arm's optimized
// routines) with its five FMAs explicit, N = 32 table entries, special cases only for |x| >= 88.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "../numerics_dev.hpp"

namespace glm::cpu {

// T[i] = bits(2^(i/32) correctly rounded to double) - (i << 47) (bindings/numerics_dev.hpp).
using num::kExpfTable;

float expf(float x);  // num::expf, the definition both engines share

// Eight lanes at once; bit-identical to expf on every input (checked exhaustively by the tests).
__m256 expf8(__m256 x);

// y[i] = expf(x[i]) (the 8-wide path for whole groups of eight, the scalar one for the rest).
void expf_array(const float* x, float* y, size_t n);

// Compare an implementation against the host libm ::expf on every bit pattern in [lo, hi)
// (hi <= 2^32), split over `threads` std::threads (0 = hardware concurrency). Returns the number
// of inputs whose result bits differ, and the smallest such input's bits in *first (2^32 if none).
uint64_t expf_check_range(uint64_t lo, uint64_t hi, uint64_t* first, unsigned threads = 0);
uint64_t expf8_check_range(uint64_t lo, uint64_t hi, uint64_t* first, unsigned threads = 0);

}  // namespace glm::cpu
