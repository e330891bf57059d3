// mHC: the hyper-connection sites attn_hc.* and ffn_hc.*, all in double (docs/numerics.md, "mHC site").
//
//   v = the hc*D stream values of a token, stream-major; inv = 1/sqrt(cdot64(v, v)/(hc*D) + rms_norm_eps)
//   m_r = cdot64(fn_r, v) * inv                         for the (2+hc)*hc rows of fn
//   pre_i  = sigmoid64(m_i*s0 + base_i) + hc_eps
//   post_i = 2 * sigmoid64(m_{hc+i}*s1 + base_{hc+i})
//   comb   = row softmax(m*s2 + base) (exp64) + hc_eps, column-normalize, then (iters-1) x (rows, columns),
//            every normalization dividing by (csum64 + hc_eps)
//   collapsed[d]  = bf16(cdot64(pre, [X_0[d], ..., X_{hc-1}[d]]))
//   streams X'_j[d] = bf16(cdot64([post_j, C_0j, ..., C_{hc-1,j}], [u[d], X_0[d], ..., X_{hc-1}[d]]))
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "engine.hpp"
#include "exp64.hpp"
#include "formats.hpp"
#include "smalldot.hpp"

namespace glm::cpu {
namespace {

// One token's coefficients from its m row (the (2+hc)*hc projections, already times inv).
void coefficients(const Numerics& nm, const EngineConfig& c, const HcWeights& w, const double* m, double* pre,
                  double* post, double* comb) {
    const size_t hc = static_cast<size_t>(c.hc_mult);
    const double eps = c.hc_eps;
    for (size_t i = 0; i < hc; ++i) {
        pre[i] = sigmoid64(m[i] * w.scale[0] + w.base[i]) + eps;
        post[i] = 2.0 * sigmoid64(m[hc + i] * w.scale[1] + w.base[hc + i]);
    }
    std::vector<double> z(hc), e(hc), col(hc);
    for (size_t i = 0; i < hc; ++i) {
        for (size_t j = 0; j < hc; ++j) {
            const size_t r = 2 * hc + hc * i + j;
            z[j] = m[r] * w.scale[2] + w.base[r];
        }
        double zmax = z[0];
        for (size_t j = 1; j < hc; ++j) zmax = std::max(zmax, z[j]);
        for (size_t j = 0; j < hc; ++j) e[j] = exp64(z[j] - zmax);
        const double sum = nm.sum64(e.data(), hc);
        for (size_t j = 0; j < hc; ++j) comb[i * hc + j] = e[j] / sum + eps;
    }
    auto normalize_cols = [&] {
        for (size_t j = 0; j < hc; ++j) {
            for (size_t i = 0; i < hc; ++i) col[i] = comb[i * hc + j];
            const double sum = nm.sum64(col.data(), hc);
            for (size_t i = 0; i < hc; ++i) comb[i * hc + j] = comb[i * hc + j] / (sum + eps);
        }
    };
    auto normalize_rows = [&] {
        for (size_t i = 0; i < hc; ++i) {
            const double sum = nm.sum64(comb + i * hc, hc);
            for (size_t j = 0; j < hc; ++j) comb[i * hc + j] = comb[i * hc + j] / (sum + eps);
        }
    };
    normalize_cols();
    for (int64_t it = 0; it + 1 < c.hc_sinkhorn_iters; ++it) {
        normalize_rows();
        normalize_cols();
    }
}

}  // namespace

void hc_site(Step& s, int layer, bool ffn, const HcWeights& w, const float* X, double* pre, double* post,
             double* comb, float* collapsed) {
    const EngineConfig& c = s.c;
    const size_t T = s.T, hc = static_cast<size_t>(c.hc_mult), D = static_cast<size_t>(c.hidden_size);
    const size_t n = hc * D, R = static_cast<size_t>(c.hc_dim());
    const int S_PRE = ffn ? S_FFN_HC_PRE : S_ATTN_HC_PRE;

    // v (double, stream-major) and inv per token
    std::vector<double> v(T * n), inv(T), m(T * R);
    s.pool.parallel_for(T, 2 * n, [&](size_t a, size_t b) {
        for (size_t t = a; t < b; ++t) {
            double* vt = v.data() + t * n;
            const float* xt = X + t * n;
            for (size_t i = 0; i < n; ++i) vt[i] = static_cast<double>(xt[i]);
            inv[t] = 1.0 / std::sqrt(s.nm.dot64(vt, vt, n) / static_cast<double>(n) + c.rms_norm_eps);
        }
    });
    // m_r = cdot64(fn_r, v) * inv, one (token, row) pair per item
    s.pool.parallel_for(T * R, n, [&](size_t a, size_t b) {
        for (size_t k = a; k < b; ++k) {
            const size_t t = k / R, r = k % R;
            m[k] = s.nm.dot64(w.fn.data() + r * n, v.data() + t * n, n) * inv[t];
        }
    });
    for (size_t t = 0; t < T; ++t) {
        coefficients(s.nm, c, w, m.data() + t * R, pre + t * hc, post + t * hc, comb + t * hc * hc);
        s.emit64(layer, S_PRE, t, pre + t * hc, {static_cast<int64_t>(hc)});
        s.emit64(layer, S_PRE + 1, t, post + t * hc, {static_cast<int64_t>(hc)});
        s.emit64(layer, S_PRE + 2, t, comb + t * hc * hc, {static_cast<int64_t>(hc), static_cast<int64_t>(hc)});
    }
    // collapsed[t][d] = bf16(cdot64([X_0[d], ...], pre_t)); four channels at a time when hc <= 8
    const bool wide = !s.nm.seq_dot && hc <= 8;
    const size_t DB = wide ? D / 4 : 0;  // blocks of four channels, then the rest one by one
    const size_t per_t = DB + (D - 4 * DB);
    s.pool.parallel_for(T * per_t, 2 * hc * 4, [&](size_t a, size_t b) {
        double col[64];
        __m256d A[8], B[8];
        for (size_t k = a; k < b; ++k) {
            const size_t t = k / per_t, blk = k % per_t;
            const float* xt = X + t * n;
            if (blk < DB) {
                const size_t d = 4 * blk;
                for (size_t i = 0; i < hc; ++i) {
                    A[i] = _mm256_cvtps_pd(_mm_loadu_ps(xt + i * D + d));
                    B[i] = _mm256_set1_pd(pre[t * hc + i]);
                }
                alignas(32) float r[4];
                _mm_store_ps(r, _mm256_cvtpd_ps(cdot64_small4(A, B, hc)));
                for (size_t j = 0; j < 4; ++j) collapsed[t * D + d + j] = bf16_round(r[j]);
            } else {
                const size_t d = 4 * DB + (blk - DB);
                for (size_t i = 0; i < hc; ++i) col[i] = static_cast<double>(xt[i * D + d]);
                collapsed[t * D + d] = f32_from_bf16(bf16_bits_from_f64(s.nm.dot64(col, pre + t * hc, hc)));
            }
        }
    });
    for (size_t t = 0; t < T; ++t) s.emit(layer, S_PRE + 3, t, collapsed + t * D, {static_cast<int64_t>(D)});
}

void hc_expand(Step& s, int layer, bool ffn, float* X, const float* u, const double* post, const double* comb) {
    const EngineConfig& c = s.c;
    const size_t T = s.T, hc = static_cast<size_t>(c.hc_mult), D = static_cast<size_t>(c.hidden_size);
    // mix[t][j] = [post_j, C_0j, ..., C_{hc-1,j}]
    std::vector<double> mix(T * hc * (hc + 1));
    for (size_t t = 0; t < T; ++t)
        for (size_t j = 0; j < hc; ++j) {
            double* mj = mix.data() + (t * hc + j) * (hc + 1);
            mj[0] = post[t * hc + j];
            for (size_t i = 0; i < hc; ++i) mj[1 + i] = comb[t * hc * hc + i * hc + j];
        }
    // four channels at a time when hc + 1 <= 8 (every X_j[d] of a channel is read before any is written)
    const bool wide = !s.nm.seq_dot && hc + 1 <= 8;
    const size_t DB = wide ? D / 4 : 0;
    const size_t per_t = DB + (D - 4 * DB);
    s.pool.parallel_for(T * per_t, 2 * hc * (hc + 1) * 4, [&](size_t a, size_t b) {
        double row[65];
        __m256d A[8], B[8];
        for (size_t k = a; k < b; ++k) {
            const size_t t = k / per_t, blk = k % per_t;
            float* xt = X + t * hc * D;
            if (blk < DB) {
                const size_t d = 4 * blk;
                A[0] = _mm256_cvtps_pd(_mm_loadu_ps(u + t * D + d));
                for (size_t i = 0; i < hc; ++i) A[1 + i] = _mm256_cvtps_pd(_mm_loadu_ps(xt + i * D + d));
                for (size_t j = 0; j < hc; ++j) {
                    const double* mj = mix.data() + (t * hc + j) * (hc + 1);
                    for (size_t i = 0; i <= hc; ++i) B[i] = _mm256_set1_pd(mj[i]);
                    alignas(32) float r[4];
                    _mm_store_ps(r, _mm256_cvtpd_ps(cdot64_small4(A, B, hc + 1)));
                    for (size_t e = 0; e < 4; ++e) xt[j * D + d + e] = bf16_round(r[e]);
                }
            } else {
                const size_t d = 4 * DB + (blk - DB);
                row[0] = static_cast<double>(u[t * D + d]);
                for (size_t i = 0; i < hc; ++i) row[1 + i] = static_cast<double>(xt[i * D + d]);
                for (size_t j = 0; j < hc; ++j)
                    xt[j * D + d] = f32_from_bf16(bf16_bits_from_f64(
                        s.nm.dot64(row, mix.data() + (t * hc + j) * (hc + 1), hc + 1)));
            }
        }
    });
    const int st = ffn ? S_FFN_HC_STREAMS : S_ATTN_HC_STREAMS;
    for (size_t t = 0; t < T; ++t)
        s.emit(layer, st, t, X + t * hc * D, {static_cast<int64_t>(hc), static_cast<int64_t>(D)});
}

}  // namespace glm::cpu
