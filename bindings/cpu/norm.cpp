// RMSNorm (attn_norm, ffn_norm, mla.q_lat, mla.c, final_norm) and the indexer's LayerNorm
// (indexer.k); KDA's gated norm (kda.o_norm) is in kda.cpp. As docs/numerics.md:
//   RMSNorm:   ss = cdot(x, x), inv = 1/sqrtf(ss/n + eps), y = bf16(bf16(x*inv) * w)
//   LayerNorm: mu = csum(x)/n, xc = x - mu, inv = 1/sqrtf(cdot(xc, xc)/n + eps), y = bf16((xc*inv)*w + b)
#include <cmath>
#include <vector>

#include "engine.hpp"
#include "formats.hpp"

namespace glm::cpu {

void rms_norm_row(const Numerics& nm, const float* x, size_t n, const float* w, float eps, float* y) {
    const float ss = nm.dot(x, x, n);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (size_t i = 0; i < n; ++i) y[i] = bf16_round(bf16_round(x[i] * inv) * w[i]);
}

void rms_norm_rows(Step& s, const float* X, size_t rows, size_t n, const float* w, float eps, float* Y) {
    s.pool.parallel_for(rows, 4 * n, [&](size_t a, size_t b) {
        for (size_t t = a; t < b; ++t) rms_norm_row(s.nm, X + t * n, n, w, eps, Y + t * n);
    });
}

void layer_norm_row(const Numerics& nm, const float* x, size_t n, const float* w, const float* b, float eps,
                    float* y) {
    const float fn = static_cast<float>(n);
    const float mu = nm.sum(x, n) / fn;
    std::vector<float> xc(n);
    for (size_t i = 0; i < n; ++i) xc[i] = x[i] - mu;
    const float var = nm.dot(xc.data(), xc.data(), n) / fn;
    const float inv = 1.0f / std::sqrt(var + eps);
    for (size_t i = 0; i < n; ++i) y[i] = bf16_round((xc[i] * inv) * w[i] + b[i]);
}

}  // namespace glm::cpu
