#include "greedy.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include "../numerics_dev.hpp"
#include "cdot.hpp"
#include "expf.hpp"

namespace glm::cpu {

int32_t argmax(const float* x, size_t n) {
    int best = -1;
    float bv = 0.0f;
    for (size_t j = 0; j < n; ++j)
        if (num::argmax_better(x[j], static_cast<int>(j), bv, best)) {
            bv = x[j];
            best = static_cast<int>(j);
        }
    return best;
}

float argmax_logprob(const float* x, size_t n, int32_t t) {
    for (size_t i = 0; i < n; ++i)
        if (!std::isfinite(x[i])) return std::numeric_limits<float>::quiet_NaN();
    const float m = x[t];
    std::vector<float> d(n), e(n);
    for (size_t i = 0; i < n; ++i) d[i] = x[i] - m;
    expf_array(d.data(), e.data(), n);
    return num::logprob_from(d[static_cast<size_t>(t)], csum(e.data(), n));
}

}  // namespace glm::cpu
