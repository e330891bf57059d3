// The greedy choice over one row of logits and its log-probability: the heads "argmax" and
// "argmax_logprob" of a step (want_head 2 and 3) and fast._core.argmax_logprob.
#pragma once

#include <cstddef>
#include <cstdint>

namespace glm::cpu {

// np.argmax's rule (num::argmax_better): the first NaN, else the lowest index of the maximum.
int32_t argmax(const float* x, size_t n);

// oracle.sampling.log_softmax(x)[t] bit for bit, for t = argmax(x, n): d = x - x[t] (x[t] is the
// oracle's max, the first maximum), s = csum(expf(d)), num::logprob_from(d[t], s). NaN when x holds a
// NaN or an infinity (rows the oracle refuses with SamplingError).
float argmax_logprob(const float* x, size_t n, int32_t t);

}  // namespace glm::cpu
