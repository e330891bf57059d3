// The canonical double exponential `exp64` (docs/numerics.md; used by mHC only).
//
// This is glibc's double exp (>= 2.28, from Arm's optimized routines: N = 128 table entries,
// a degree-5 polynomial) with the fused multiply-adds that glibc's FMA build performs written out:
//   kd  = fma(InvLn2N, x, Shift);  ki = bits(kd);  kd -= Shift
//   r   = fma(kd, NegLn2loN, fma(kd, NegLn2hiN, x))
//   tail = asdouble(T[2 (ki % N)]),  sbits = T[2 (ki % N) + 1] + (ki << 45)
//   r2  = r * r
//   tmp = fma(r2 * r2, fma(r, C5, C4), fma(r2, fma(r, C3, C2), tail + r))
//   y   = fma(scale, tmp, scale)             (scale = asdouble(sbits))
// with glibc's special cases (|x| < 2^-54: 1 + x; |x| >= 512: over/underflow, inf, NaN, and the
// scaled path `specialcase`: for k > 0 it fuses, 2^1009 * fma(scale, tmp, scale); for k < 0 glibc's
// build forms st = scale * tmp once and adds it unfused, y = scale + st, lo = (scale - y) + st).
// Checked equal to the host glibc 2.36 exp on 21 million inputs (subnormal results included).
// Written independently of the oracle's Numba port (oracle.numerics); the tests compare the two
// bit for bit on a large sample.
#pragma once

#include <cstdint>

namespace glm::cpu {

extern const uint64_t kExp64Table[256];  // tab[2k] = bits(tail_k), tab[2k+1] = bits(H_k) - (k << 45)

double exp64(double x);
inline double sigmoid64(double x) { return 1.0 / (1.0 + exp64(-x)); }

}  // namespace glm::cpu
