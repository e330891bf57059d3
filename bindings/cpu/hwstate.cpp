#include "hwstate.hpp"

#include <xmmintrin.h>

namespace glm::cpu {

bool ftz_daz_enabled() { return (_mm_getcsr() & 0x8040u) != 0; }

float contract_probe() {
    volatile float va = 1.0f + 0x1p-12f, vc = -(1.0f + 0x1p-11f);
    const float a = va, b = va, c = vc;
    return a * b + c;
}

void div_probe(const float* x, float d, float* y, size_t n) {
    for (size_t i = 0; i < n; ++i) y[i] = x[i] / d;
}

}  // namespace glm::cpu
