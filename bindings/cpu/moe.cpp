// Feed-forward (docs/numerics.md, FFN): the clamped SwiGLU (dense layers: mlp.gate, mlp.up, mlp.out;
// shared and routed experts) and the MoE (moe.logits, moe.selected, moe.weights, moe.experts,
// moe.routed, moe.shared, moe.out).
//
//   SwiGLU: g, u = lin(gate, x), lin(up, x); g' = min(g, L), u' = clamp(u, -L, L);
//           h = bf16(silu(g') * u'); y = lin(down, h)
//   router: logits = cdot(W_gate[e], x) (f32), s = sigmoid(logits), choice = s + bias; group-limited
//           top-k by choice (ties to the lower index), selected sorted by expert index;
//           w = s_sel [/ (csum(s_sel) + 1e-20f)] * routed_scaling_factor
//   routed[d] = bf16(cdot over j of (w_j, y_j[d])); out = bf16(routed + shared)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "engine.hpp"
#include "formats.hpp"
#include "smalldot.hpp"

namespace glm::cpu {

void swiglu(Step& s, const Lin& gate, const Lin& up, const Lin& down, const float* x, size_t ldx, size_t rows,
            float* y, int cap_layer) {
    const size_t I = gate.R, D = down.R;
    const float L = static_cast<float>(s.c.swiglu_limit);
    std::vector<float> g(rows * I), u(rows * I);
    s.linear(gate, x, ldx, g.data(), I, true, rows);
    s.linear(up, x, ldx, u.data(), I, true, rows);
    if (cap_layer >= 0) {  // the dense MLP's stages (the experts' are not stages)
        s.emit_rows(cap_layer, S_MLP_GATE, g.data(), I, I, {static_cast<int64_t>(I)});
        s.emit_rows(cap_layer, S_MLP_UP, u.data(), I, I, {static_cast<int64_t>(I)});
    }
    s.pool.parallel_for(rows * I, 16, [&](size_t a, size_t b) {
        for (size_t i = a; i < b; ++i) {
            const float gv = g[i] > L ? L : g[i];
            const float uv = u[i] > L ? L : (u[i] < -L ? -L : u[i]);
            g[i] = bf16_round(s.nm.silu(gv) * uv);
        }
    });
    s.linear(down, g.data(), I, y, D, true, rows);
}

namespace {

// The router's choice for one row: expert ids, ascending.
std::vector<int32_t> top_experts(const EngineConfig& c, const float* choice) {
    const size_t E = static_cast<size_t>(c.n_routed_experts), k = static_cast<size_t>(c.num_experts_per_tok);
    const size_t G = static_cast<size_t>(c.n_group);
    auto better = [&](size_t a, size_t b) {  // by choice, ties to the lower index
        const float ca = std::isnan(choice[a]) ? -INFINITY : choice[a];
        const float cb = std::isnan(choice[b]) ? -INFINITY : choice[b];
        return ca > cb || (ca == cb && a < b);
    };
    std::vector<size_t> cand;
    if (G > 1) {
        const size_t per = E / G;
        std::vector<float> gscore(G);
        for (size_t gi = 0; gi < G; ++gi) {
            std::vector<size_t> m(per);
            std::iota(m.begin(), m.end(), gi * per);
            std::partial_sort(m.begin(), m.begin() + 2, m.end(), better);
            gscore[gi] = choice[m[0]] + choice[m[1]];  // larger + smaller
        }
        std::vector<size_t> groups(G);
        std::iota(groups.begin(), groups.end(), size_t{0});
        std::stable_sort(groups.begin(), groups.end(), [&](size_t a, size_t b) {
            const float ga = std::isnan(gscore[a]) ? -INFINITY : gscore[a];
            const float gb = std::isnan(gscore[b]) ? -INFINITY : gscore[b];
            return ga > gb;
        });
        groups.resize(static_cast<size_t>(c.topk_group));
        std::sort(groups.begin(), groups.end());
        for (size_t gi : groups)
            for (size_t e = gi * per; e < (gi + 1) * per; ++e) cand.push_back(e);
    } else {
        cand.resize(E);
        std::iota(cand.begin(), cand.end(), size_t{0});
    }
    std::partial_sort(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(k), cand.end(), better);
    std::vector<int32_t> sel(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(k));
    std::sort(sel.begin(), sel.end());
    return sel;
}

}  // namespace

void moe_forward(Step& s, int layer, const FfnWeights& w, const float* x, float* out) {
    const EngineConfig& c = s.c;
    const Numerics& nm = s.nm;
    const size_t T = s.T, D = static_cast<size_t>(c.hidden_size), E = static_cast<size_t>(c.n_routed_experts);
    const size_t k = static_cast<size_t>(c.num_experts_per_tok);

    // moe.logits (f32, no rounding)
    std::vector<float> logits(T * E);
    s.linear(w.router, x, D, logits.data(), E, false);
    s.emit_rows(layer, S_MOE_LOGITS, logits.data(), E, E, {static_cast<int64_t>(E)});
    // moe.selected, moe.weights
    std::vector<int32_t> sel(T * k);
    std::vector<float> wts(T * k);
    std::vector<float> scores(T * E);
    for (size_t t = 0; t < T; ++t) {
        std::vector<float> choice(E);
        float* sc = scores.data() + t * E;
        for (size_t e = 0; e < E; ++e) {
            sc[e] = nm.sigmoid(logits[t * E + e]);
            choice[e] = sc[e] + w.bias[e];
        }
        const std::vector<int32_t> st = top_experts(c, choice.data());
        std::copy(st.begin(), st.end(), sel.begin() + static_cast<std::ptrdiff_t>(t * k));
        s.emit_i32(layer, S_MOE_SELECTED, t, sel.data() + t * k, {static_cast<int64_t>(k)});
        for (size_t j = 0; j < k; ++j)
            if (sel[t * k + j] < 0 || sel[t * k + j] >= static_cast<int32_t>(E))  // only an injection can do this
                throw std::invalid_argument("inject: moe.selected now holds expert " + std::to_string(sel[t * k + j]) +
                                            ", outside [0, " + std::to_string(E) + ")");
    }
    for (size_t t = 0; t < T; ++t) {
        const float* sc = scores.data() + t * E;
        float* wt = wts.data() + t * k;
        for (size_t j = 0; j < k; ++j) wt[j] = sc[static_cast<size_t>(sel[t * k + j])];
        if (c.norm_topk_prob) {
            const float den = nm.sum(wt, k) + 1e-20f;
            for (size_t j = 0; j < k; ++j) wt[j] = wt[j] / den;
        }
        const float rsf = static_cast<float>(c.routed_scaling_factor);
        for (size_t j = 0; j < k; ++j) wt[j] = wt[j] * rsf;
        s.emit(layer, S_MOE_WEIGHTS, t, wt, {static_cast<int64_t>(k)});
    }

    // moe.experts: each used expert runs once over the rows that chose it (with expert parallelism:
    // only the experts this rank owns; ep_exchange brings the other ranks' rows, ep.cpp)
    std::vector<float> ys(T * k * D);
    std::vector<std::vector<std::pair<size_t, size_t>>> users(E);  // (row, slot j)
    for (size_t t = 0; t < T; ++t)
        for (size_t j = 0; j < k; ++j) users[static_cast<size_t>(sel[t * k + j])].push_back({t, j});
    std::vector<float> xe, ye;
    for (size_t e = 0; e < E; ++e) {
        const auto& us = users[e];
        if (us.empty() || !s.E.ep.part.owns(static_cast<int64_t>(e))) continue;
        const size_t n = us.size();
        xe.resize(n * D);
        ye.resize(n * D);
        for (size_t i = 0; i < n; ++i) std::copy(x + us[i].first * D, x + (us[i].first + 1) * D, xe.begin() + i * D);
        swiglu(s, w.e_gate[e], w.e_up[e], w.e_down[e], xe.data(), D, n, ye.data(), -1);
        for (size_t i = 0; i < n; ++i)
            std::copy(ye.begin() + i * D, ye.begin() + (i + 1) * D, ys.begin() + (us[i].first * k + us[i].second) * D);
    }
    ep_exchange(s, layer, sel.data(), k, ys.data());  // no-op in one process
    for (size_t t = 0; t < T; ++t)
        s.emit(layer, S_MOE_EXPERTS, t, ys.data() + t * k * D, {static_cast<int64_t>(k), static_cast<int64_t>(D)});

    // moe.routed[d] = bf16(cdot over j of (y_j[d], w_j))
    std::vector<float> routed(T * D);
    const bool wide = !nm.seq_dot && k <= 8;  // eight channels at a time (smalldot.hpp)
    s.pool.parallel_for(T * D, 2 * k, [&](size_t a, size_t b) {
        float col[256];
        __m256 A[8], B[8];
        for (size_t i = a; i < b;) {
            const size_t t = i / D, d = i % D;
            if (wide && d + 8 <= D && i + 8 <= b) {
                for (size_t j = 0; j < k; ++j) {
                    A[j] = _mm256_loadu_ps(ys.data() + (t * k + j) * D + d);
                    B[j] = _mm256_set1_ps(wts[t * k + j]);
                }
                _mm256_storeu_ps(routed.data() + i, bf16_round8(cdot_small8(A, B, k)));
                i += 8;
            } else {
                for (size_t j = 0; j < k; ++j) col[j] = ys[(t * k + j) * D + d];
                routed[i] = bf16_round(nm.dot(col, wts.data() + t * k, k));
                i += 1;
            }
        }
    });
    s.emit_rows(layer, S_MOE_ROUTED, routed.data(), D, D, {static_cast<int64_t>(D)});
    // moe.shared
    std::vector<float> shared(T * D);
    swiglu(s, w.s_gate, w.s_up, w.s_down, x, D, T, shared.data(), -1);
    s.emit_rows(layer, S_MOE_SHARED, shared.data(), D, D, {static_cast<int64_t>(D)});
    // moe.out = bf16(routed + shared)
    for (size_t i = 0; i < T * D; ++i) out[i] = bf16_round(routed[i] + shared[i]);
    s.emit_rows(layer, S_MOE_OUT, out, D, D, {static_cast<int64_t>(D)});
}

}  // namespace glm::cpu
