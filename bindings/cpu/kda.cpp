// KDA: Kimi delta attention (docs/numerics.md, KDA). Stages kda.q_proj|k_proj|v_proj, kda.q|k|v,
// kda.g, kda.beta, kda.state, kda.o, kda.gate, kda.o_norm, kda.out.
//
// Per token: projections -> causal depthwise conv (cdot over the K taps, +0 before position 0) + SiLU
// -> per-head l2 norms -> the delta rule on the f32 state -> gated RMSNorm -> o_proj. Prefill runs
// the same per-token recurrence as decode. The state S[h][i][j] is stored transposed (column j
// contiguous) so pred_j = cdot(k, S[:, j]) and o_j = cdot(q, S[:, j]) read contiguous memory.
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "engine.hpp"
#include "formats.hpp"
#include "smalldot.hpp"

namespace glm::cpu {

void kda_forward(Step& s, int layer, const KdaWeights& w, const float* x, float* out) {
    const EngineConfig& c = s.c;
    const Numerics& nm = s.nm;
    const size_t T = s.T, D = static_cast<size_t>(c.hidden_size);
    const size_t H = static_cast<size_t>(c.linear_num_heads), d = static_cast<size_t>(c.linear_head_dim);
    const size_t P = H * d, K = static_cast<size_t>(c.linear_conv_kernel_dim);
    const float eps = static_cast<float>(c.rms_norm_eps);

    // kda.q_proj, kda.k_proj, kda.v_proj: qkv [T][3P] (q | k | v)
    std::vector<float> qkv(T * 3 * P);
    s.linear(w.q_proj, x, D, qkv.data(), 3 * P, true);
    s.linear(w.k_proj, x, D, qkv.data() + P, 3 * P, true);
    s.linear(w.v_proj, x, D, qkv.data() + 2 * P, 3 * P, true);
    s.emit_rows(layer, S_KDA_Q_PROJ, qkv.data(), P, 3 * P, {static_cast<int64_t>(P)});
    s.emit_rows(layer, S_KDA_K_PROJ, qkv.data() + P, P, 3 * P, {static_cast<int64_t>(P)});
    s.emit_rows(layer, S_KDA_V_PROJ, qkv.data() + 2 * P, P, 3 * P, {static_cast<int64_t>(P)});

    // kda.q, kda.k, kda.v: conv over the window [x_{t-K+1}, ..., x_t] of each channel, then bf16(silu).
    // hist (per segment): the K-1 cached pre-conv rows, then the segment's rows.
    const size_t C3 = 3 * P;
    std::vector<std::vector<float>> hist(s.segs.size());
    for (size_t gi = 0; gi < s.segs.size(); ++gi) {
        const Segment& g = s.segs[gi];
        std::vector<float>& h = hist[gi];
        h.resize((K - 1 + g.n) * C3);
        std::memcpy(h.data(), g.seq->kda[layer].conv_tail.data(), (K - 1) * C3 * sizeof(float));
        std::memcpy(h.data() + (K - 1) * C3, qkv.data() + g.t0 * C3, g.n * C3 * sizeof(float));
    }
    std::vector<float> act(T * C3);
    const bool wide = !nm.seq_dot && K <= 8;  // eight channels at a time (smalldot.hpp)
    const size_t nb = wide ? C3 / 8 : 0, per_t = nb + (C3 - 8 * nb);
    s.pool.parallel_for(T * per_t, 8 * K + 40, [&](size_t a, size_t b) {
        std::vector<float> win(K);
        __m256 A[8], B[8];
        for (size_t item = a; item < b; ++item) {
            const size_t t = item / per_t, blk = item % per_t;
            const size_t gi = s.seg_of[t];
            const float* h = hist[gi].data() + (t - s.segs[gi].t0) * C3;  // row t-K+1 of the window
            if (blk < nb) {
                const size_t ch = 8 * blk;
                for (size_t j = 0; j < K; ++j) {
                    A[j] = _mm256_loadu_ps(w.conv_t.data() + j * C3 + ch);
                    B[j] = _mm256_loadu_ps(h + j * C3 + ch);
                }
                _mm256_storeu_ps(act.data() + t * C3 + ch, bf16_round8(nm.silu8(cdot_small8(A, B, K))));
            } else {
                const size_t ch = 8 * nb + (blk - nb);
                for (size_t j = 0; j < K; ++j) win[j] = h[j * C3 + ch];
                act[t * C3 + ch] = bf16_round(nm.silu(nm.dot(w.conv.data() + ch * K, win.data(), K)));
            }
        }
    });
    // the conv cache keeps the last K-1 pre-conv rows
    for (size_t gi = 0; gi < s.segs.size(); ++gi) {
        const Segment& g = s.segs[gi];
        std::memcpy(g.seq->kda[layer].conv_tail.data(), hist[gi].data() + g.n * C3, (K - 1) * C3 * sizeof(float));
    }
    s.emit_rows(layer, S_KDA_Q, act.data(), P, 3 * P, {static_cast<int64_t>(P)});
    s.emit_rows(layer, S_KDA_K, act.data() + P, P, 3 * P, {static_cast<int64_t>(P)});
    s.emit_rows(layer, S_KDA_V, act.data() + 2 * P, P, 3 * P, {static_cast<int64_t>(P)});

    // kda.g = lb * sigmoid(expf(A_log[h]) * (f + dt_bias)), f = lin(f_b, lin(f_a, x))
    std::vector<float> fa(T * d), g(T * P), beta(T * H);
    s.linear(w.f_a, x, D, fa.data(), d, true);
    s.linear(w.f_b, fa.data(), d, g.data(), P, true);
    const float lb = static_cast<float>(c.linear_lower_bound);
    for (size_t t = 0; t < T; ++t)
        for (size_t ch = 0; ch < P; ++ch) {
            float& v = g[t * P + ch];
            v = lb * nm.sigmoid(w.decay_rate[ch / d] * (v + w.dt_bias[ch]));
        }
    s.emit_rows(layer, S_KDA_G, g.data(), P, P, {static_cast<int64_t>(P)});
    // kda.beta = sigmoid(lin(b_proj, x)), kept f32
    s.linear(w.b_proj, x, D, beta.data(), H, true);
    for (float& b : beta) b = nm.sigmoid(b);
    s.emit_rows(layer, S_KDA_BETA, beta.data(), H, H, {static_cast<int64_t>(H)});

    // the recurrence: one task per (segment, head), tokens in position order
    std::vector<float> o(T * P);
    const bool cap_state = [&] {
        for (size_t t = 0; t < T; ++t)
            if (s.wants_row(layer, S_KDA_STATE, t)) return true;
        return false;
    }();
    std::vector<float> states(cap_state ? T * H * d * d : 0);
    const float qscale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    const size_t nseg = s.segs.size();
    s.pool.parallel_for(nseg * H, 4 * d * d * T / (nseg ? nseg : 1), [&](size_t a, size_t b) {
        std::vector<float> qs(d), kn(d), eg(d);
        for (size_t item = a; item < b; ++item) {
            const Segment& sg = s.segs[item / H];
            const size_t h = item % H;
            float* St = sg.seq->kda[layer].S.data() + h * d * d;  // St[j*d + i] = S[i][j]
            for (size_t i = 0; i < sg.n; ++i) {
                const size_t t = sg.t0 + i;
                const float* q = act.data() + t * 3 * P + h * d;
                const float* k = act.data() + t * 3 * P + P + h * d;
                const float* v = act.data() + t * 3 * P + 2 * P + h * d;
                const float nq = std::sqrt(nm.dot(q, q, d) + 1e-6f);
                const float nk = std::sqrt(nm.dot(k, k, d) + 1e-6f);
                for (size_t e = 0; e < d; ++e) {
                    qs[e] = (q[e] / nq) * qscale;
                    kn[e] = k[e] / nk;
                    eg[e] = nm.exp(g[t * P + h * d + e]);
                }
                const float bt = beta[t * H + h];
                for (size_t j = 0; j < d; ++j) {
                    float* col = St + j * d;
                    // S[i][j] *= expf(g_i)
                    size_t e = 0;
                    for (; e + 8 <= d; e += 8)
                        _mm256_storeu_ps(col + e, _mm256_mul_ps(_mm256_loadu_ps(col + e), _mm256_loadu_ps(eg.data() + e)));
                    for (; e < d; ++e) col[e] = col[e] * eg[e];
                    // pred_j = cdot(k, S[:, j]); u_j = (v_j - pred_j) * beta; S[i][j] = fma(k_i, u_j, S[i][j])
                    const float u = (v[j] - nm.dot(kn.data(), col, d)) * bt;
                    const __m256 uv = _mm256_set1_ps(u);
                    e = 0;
                    for (; e + 8 <= d; e += 8)
                        _mm256_storeu_ps(col + e, _mm256_fmadd_ps(_mm256_loadu_ps(kn.data() + e), uv, _mm256_loadu_ps(col + e)));
                    for (; e < d; ++e) col[e] = std::fma(kn[e], u, col[e]);
                }
                // kda.o: o_j = cdot(q, S[:, j]) after the update
                for (size_t j = 0; j < d; ++j) o[t * P + h * d + j] = nm.dot(qs.data(), St + j * d, d);
                // kda.state (as the oracle: the token's state is handed on after o is computed, so an
                // injected state element shows from the next token on). Element h*d*d + i*d + j is
                // S[i][j] = St[j*d + i].
                const int64_t el = s.inject_element(layer, S_KDA_STATE, t);
                if (el >= 0 && static_cast<size_t>(el) / (d * d) == h) {
                    const size_t r = static_cast<size_t>(el) % (d * d);
                    s.inject_f32(layer, S_KDA_STATE, t, St + (r % d) * d + r / d, static_cast<size_t>(el), 1);
                }
                if (cap_state && s.wants_row(layer, S_KDA_STATE, t)) {
                    float* dst = states.data() + (t * H + h) * d * d;
                    for (size_t ii = 0; ii < d; ++ii)
                        for (size_t j = 0; j < d; ++j) dst[ii * d + j] = St[j * d + ii];
                }
            }
        }
    });
    if (cap_state)
        for (size_t t = 0; t < T; ++t)
            if (s.wants_row(layer, S_KDA_STATE, t))
                s.capture(layer, S_KDA_STATE, t, states.data() + t * H * d * d, 4,
                          {static_cast<int64_t>(H), static_cast<int64_t>(d), static_cast<int64_t>(d)});
    s.emit_rows(layer, S_KDA_O, o.data(), P, P, {static_cast<int64_t>(P)});

    // kda.gate = lin(g_b, lin(g_a, x))
    std::vector<float> ga(T * d), gate(T * P);
    s.linear(w.g_a, x, D, ga.data(), d, true);
    s.linear(w.g_b, ga.data(), d, gate.data(), P, true);
    s.emit_rows(layer, S_KDA_GATE, gate.data(), P, P, {static_cast<int64_t>(P)});

    // kda.o_norm per head: inv = 1/sqrtf(cdot(o,o)/d + eps), y = bf16(((o*inv)*w)*sigmoid(gate))
    std::vector<float> y(T * P);
    s.pool.parallel_for(T * H, 8 * d, [&](size_t a, size_t b) {
        for (size_t item = a; item < b; ++item) {
            const size_t t = item / H, h = item % H;
            const float* oh = o.data() + t * P + h * d;
            const float inv = 1.0f / std::sqrt(nm.dot(oh, oh, d) / static_cast<float>(d) + eps);
            for (size_t e = 0; e < d; ++e)
                y[t * P + h * d + e] =
                    bf16_round(((oh[e] * inv) * w.o_norm[e]) * nm.sigmoid(gate[t * P + h * d + e]));
        }
    });
    s.emit_rows(layer, S_KDA_O_NORM, y.data(), P, P, {static_cast<int64_t>(P)});

    // kda.out = lin(o_proj, o_norm)
    s.linear(w.o_proj, y.data(), P, out, D, true);
    s.emit_rows(layer, S_KDA_OUT, out, D, D, {static_cast<int64_t>(D)});
}

}  // namespace glm::cpu
