// The head (docs/numerics.md, Head; stages at layer index L): head.mean, final_norm, logits.
//   head.mean[d] = bf16(csum([X_0[d], ..., X_{hc-1}[d]]) / hc); final_norm = RMSNorm(norm.weight);
//   logits[v] = cdot(lm_head[v], final_norm) (f32; embed_tokens when tied).
#include <immintrin.h>

#include <vector>

#include "engine.hpp"
#include "formats.hpp"
#include "smalldot.hpp"

namespace glm::cpu {

void head_forward(Step& s, const float* X, const std::vector<size_t>& rows, float* logits) {
    const EngineConfig& c = s.c;
    const size_t n = rows.size(), hc = static_cast<size_t>(c.hc_mult), D = static_cast<size_t>(c.hidden_size);
    const size_t V = static_cast<size_t>(c.vocab_size);
    const int L = static_cast<int>(c.num_hidden_layers);
    if (n == 0) return;
    std::vector<float> mean(n * D), normed(n * D);
    const float fhc = static_cast<float>(hc);
    const bool wide = !s.nm.seq_dot && hc <= 8;  // eight channels at a time (smalldot.hpp)
    s.pool.parallel_for(n * D, hc, [&](size_t a, size_t b) {
        float col[64];
        __m256 A[8], B[8];
        for (size_t j = 0; j < 8; ++j) B[j] = _mm256_set1_ps(1.0f);
        for (size_t i = a; i < b;) {
            const size_t r = i / D, d = i % D;
            const float* xt = X + rows[r] * hc * D;
            if (wide && d + 8 <= D && i + 8 <= b) {
                for (size_t j = 0; j < hc; ++j) A[j] = _mm256_loadu_ps(xt + j * D + d);
                _mm256_storeu_ps(mean.data() + i,
                                 bf16_round8(_mm256_div_ps(cdot_small8(A, B, hc), _mm256_set1_ps(fhc))));
                i += 8;
            } else {
                for (size_t j = 0; j < hc; ++j) col[j] = xt[j * D + d];
                mean[i] = bf16_round(s.nm.sum(col, hc) / fhc);
                i += 1;
            }
        }
    });
    for (size_t r = 0; r < n; ++r) s.emit(L, S_HEAD_MEAN, rows[r], mean.data() + r * D, {static_cast<int64_t>(D)});
    rms_norm_rows(s, mean.data(), n, D, s.E.final_norm.data(), static_cast<float>(c.rms_norm_eps), normed.data());
    for (size_t r = 0; r < n; ++r) s.emit(L, S_FINAL_NORM, rows[r], normed.data() + r * D, {static_cast<int64_t>(D)});
    s.linear(s.E.lm_head, normed.data(), D, logits, V, false, n);
    for (size_t r = 0; r < n; ++r) s.emit(L, S_LOGITS, rows[r], logits + r * V, {static_cast<int64_t>(V)});
}

}  // namespace glm::cpu
