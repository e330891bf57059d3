// The canonical double exponential `exp64` (docs/numerics.md; used by mHC only).
//
// glibc's double exp (>= 2.28, from Arm's optimized routines: N = 128 table entries, a degree-5
// polynomial) with the fused multiply-adds that glibc's FMA build performs written out; the definition
// (and the algorithm's description) is bindings/numerics_dev.hpp's num::exp64, shared with the CUDA
// engine. Checked equal to the host glibc 2.36 exp on 21 million inputs (subnormal results included).
// Written independently of the oracle's Numba port (oracle.numerics); the tests compare the two bit
// for bit on a large sample.
#pragma once

#include <cstdint>

#include "../numerics_dev.hpp"

namespace glm::cpu {

using num::kExp64Table;  // tab[2k] = bits(tail_k), tab[2k+1] = bits(H_k) - (k << 45)

double exp64(double x);  // num::exp64, the definition both engines share
inline double sigmoid64(double x) { return num::sigmoid64(x); }

}  // namespace glm::cpu
