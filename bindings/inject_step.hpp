// The fault injection's step (`inject=L,P,STAGE,ELEM,ULPS`): move one value by ULPS in value order.
// Shared by the CPU engine, the CUDA kernels and the CUDA emulation; oracle/inject.py defines the same
// rule (its docstring is the specification) and the tests compare the three bit for bit.
//
// A float pattern of `width` bits (16: BF16, 32: f32, 64: f64) maps to an ordered integer: +x to its
// magnitude bits, -x to minus them, so -0 and +0 are the one point 0 and consecutive finite values are
// consecutive integers. ULPS is added there and the sum clamped to the finite range [-max, +max]; an
// infinity pushed further out stays where it is, one moved inwards enters the finite range. The step
// never makes an infinity or a NaN out of a finite value; a NaN stays the same NaN. int32 values add
// ULPS as integers, saturating at the int32 limits.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define GLM_INJECT_HD __host__ __device__
#else
#define GLM_INJECT_HD
#endif

namespace glm {

// bits: the pattern in the low `width` bits (16, 32 or 64) -> the moved pattern.
GLM_INJECT_HD inline uint64_t inject_step_bits(uint64_t bits, int width, int64_t ulps) {
    const int mant = width == 16 ? 7 : width == 32 ? 23 : 52;
    const uint64_t sign = uint64_t{1} << (width - 1);
    const uint64_t inf = (sign - 1) >> mant << mant;  // exponent all ones, mantissa zero
    const uint64_t mag = bits & (sign - 1);
    if (mag > inf) return bits;  // NaN
    const int64_t maxf = static_cast<int64_t>(inf - 1);
    const int64_t o = (bits & sign) ? -static_cast<int64_t>(mag) : static_cast<int64_t>(mag);
    const int64_t lo = o < -maxf ? o : -maxf, hi = o > maxf ? o : maxf;
    int64_t r;
    // distances and sums in unsigned arithmetic: |hi - lo| can exceed INT64_MAX for f64
    if (ulps >= 0)
        r = static_cast<uint64_t>(ulps) >= static_cast<uint64_t>(hi) - static_cast<uint64_t>(o)
                ? hi
                : static_cast<int64_t>(static_cast<uint64_t>(o) + static_cast<uint64_t>(ulps));
    else
        r = uint64_t{0} - static_cast<uint64_t>(ulps) >= static_cast<uint64_t>(o) - static_cast<uint64_t>(lo)
                ? lo
                : static_cast<int64_t>(static_cast<uint64_t>(o) + static_cast<uint64_t>(ulps));
    return r >= 0 ? static_cast<uint64_t>(r) : (sign | (uint64_t{0} - static_cast<uint64_t>(r)));
}

GLM_INJECT_HD inline uint32_t inject_step_f32(uint32_t bits, int64_t ulps) {
    return static_cast<uint32_t>(inject_step_bits(bits, 32, ulps));
}

// A BF16 stage's value held as f32 bits: moved on its 16-bit pattern, the low half comes back zero.
GLM_INJECT_HD inline uint32_t inject_step_bf16(uint32_t f32bits, int64_t ulps) {
    return static_cast<uint32_t>(inject_step_bits(f32bits >> 16, 16, ulps)) << 16;
}

GLM_INJECT_HD inline uint64_t inject_step_f64(uint64_t bits, int64_t ulps) { return inject_step_bits(bits, 64, ulps); }

GLM_INJECT_HD inline int32_t inject_step_i32(int32_t v, int64_t ulps) {
    const int64_t top = 2147483647, bottom = -top - 1;
    if (ulps >= 0) return ulps >= top - v ? static_cast<int32_t>(top) : static_cast<int32_t>(v + ulps);
    return ulps <= bottom - v ? static_cast<int32_t>(bottom) : static_cast<int32_t>(v + ulps);
}

}  // namespace glm
