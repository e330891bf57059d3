// Matrix-vector kernels that decode the weights in registers inside the dot (no decoded matrix is
// ever materialized). Row r of the result is bit-identical to cdot(decoded W[r], x).
// Rows are independent, so they may be split over threads without changing any bit.
#pragma once

#include <cstddef>
#include <cstdint>

namespace glm::cpu {

// threads: 0 = pick from the problem size and the hardware; 1 = run on the calling thread.
// W: [R, C] bf16 bits; x: [C]; y: [R].
void matvec_bf16(const uint16_t* W, size_t R, size_t C, const float* x, float* y, unsigned threads = 0);
// q: [R, C] E4M3 codes; scale_inv: [ceil(R/128), ceil(C/128)].
void matvec_fp8(const uint8_t* q, const float* scale_inv, size_t R, size_t C, const float* x, float* y,
                unsigned threads = 0);
// packed: [R, C/2] E2M1 nibbles (column 2b low, 2b+1 high); scale: [R, C/32] E8M0; C % 32 == 0.
void matvec_mxfp4(const uint8_t* packed, const uint8_t* scale, size_t R, size_t C, const float* x, float* y,
                  unsigned threads = 0);

}  // namespace glm::cpu
