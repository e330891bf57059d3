// Hardware floating-point state and build probes (docs/contract.md §4.6): the engine refuses to run with FTZ/DAZ
// set, and the tests check that the build did not contract, flush or turn divisions into multiplies.
#pragma once

#include <cstddef>

namespace glm::cpu {

// True when MXCSR (of the calling thread) has flush-to-zero (bit 15) or denormals-are-zero (bit 6) set.
bool ftz_daz_enabled();

// a*b + c for a = b = 1 + 2^-12, c = -(1 + 2^-11), from volatile inputs: 0 when the compiler keeps the
// multiply and the add separate (as required), 2^-24 when it contracts them into an FMA.
float contract_probe();

// y[i] = x[i] / d, a loop-invariant divisor (what -freciprocal-math would turn into x[i] * (1/d)).
void div_probe(const float* x, float d, float* y, size_t n);

}  // namespace glm::cpu
