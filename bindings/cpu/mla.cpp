// MLA: multi-head latent attention in the absorbed form, NoPE (docs/numerics.md, MLA). Stages
// mla.q_lat, mla.q, mla.c, mla.q_abs, mla.selected, mla.scores, mla.probs, mla.o_lat, mla.o, mla.out.
//
// The cache holds only the normalized latent c (kv_lora_rank values) per position. Each head folds
// W_UK into its query (q_abs_h[k] = bf16(cdot over i < d_n of q_h[i] W_UK_h[i][k])) and applies W_UV
// after the weighted sum over the selected positions.
#include <algorithm>
#include <cmath>
#include <vector>

#include "engine.hpp"
#include "formats.hpp"

namespace glm::cpu {

void mla_forward(Step& s, int layer, const MlaWeights& w, const float* x, float* out, Selection& sel) {
    const EngineConfig& c = s.c;
    const Numerics& nm = s.nm;
    const size_t T = s.T, D = static_cast<size_t>(c.hidden_size);
    const size_t nh = static_cast<size_t>(c.num_attention_heads), dn = static_cast<size_t>(c.qk_nope_head_dim);
    const size_t dv = static_cast<size_t>(c.v_head_dim), r = static_cast<size_t>(c.kv_lora_rank);
    const size_t rq = static_cast<size_t>(c.q_lora_rank), kva = r + static_cast<size_t>(c.qk_rope_head_dim);
    const float eps = static_cast<float>(c.rms_norm_eps);
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim)));

    // mla.q_lat = RMSNorm(lin(q_a, x))
    std::vector<float> qa(T * rq), q_lat(T * rq);
    s.linear(w.q_a, x, D, qa.data(), rq, true);
    rms_norm_rows(s, qa.data(), T, rq, w.q_a_norm.data(), eps, q_lat.data());
    s.emit_rows(layer, S_MLA_Q_LAT, q_lat.data(), rq, rq, {static_cast<int64_t>(rq)});
    // mla.q = lin(q_b, q_lat)
    std::vector<float> q(T * nh * dn);
    s.linear(w.q_b, q_lat.data(), rq, q.data(), nh * dn, true);
    s.emit_rows(layer, S_MLA_Q, q.data(), nh * dn, nh * dn, {static_cast<int64_t>(nh * dn)});
    // mla.c = RMSNorm(lin(kv_a, x)[:r]) -> appended to the latent cache
    std::vector<float> kv(T * kva), lat(T * r);
    s.linear(w.kv_a, x, D, kv.data(), kva, true);
    s.pool.parallel_for(T, 4 * r, [&](size_t a, size_t b) {
        for (size_t t = a; t < b; ++t) rms_norm_row(nm, kv.data() + t * kva, r, w.kv_a_norm.data(), eps, lat.data() + t * r);
    });
    s.emit_rows(layer, S_MLA_C, lat.data(), r, r, {static_cast<int64_t>(r)});
    for (const Segment& g : s.segs) {
        std::vector<float>& cc = g.seq->mla[layer].c;
        cc.insert(cc.end(), lat.data() + g.t0 * r, lat.data() + (g.t0 + g.n) * r);
    }

    // mla.q_abs[t][h][k] = bf16(cdot(W_UK_h^T[k], q_h))
    std::vector<float> q_abs(T * nh * r);
    s.pool.parallel_for(T * nh, r * dn, [&](size_t a, size_t b) {
        for (size_t item = a; item < b; ++item) {
            const size_t t = item / nh, h = item % nh;
            const float* qh = q.data() + t * nh * dn + h * dn;
            const float* wt = w.w_uk_t.data() + h * r * dn;
            float* dst = q_abs.data() + item * r;
            for (size_t k = 0; k < r; ++k) dst[k] = bf16_round(nm.dot(wt + k * dn, qh, dn));
        }
    });
    s.emit_rows(layer, S_MLA_Q_ABS, q_abs.data(), nh * r, nh * r, {static_cast<int64_t>(nh), static_cast<int64_t>(r)});

    // the selection: this layer's indexer, or the previous full layer's (shared layers)
    if (w.has_indexer) indexer_select(s, layer, w, x, q_lat.data(), sel);
    if (sel.size() != T) throw std::logic_error("MLA layer without a selection (shared layer with no full layer before it)");
    for (size_t t = 0; t < T; ++t) {
        s.emit_i32(layer, S_MLA_SELECTED, t, sel[t].data(), {static_cast<int64_t>(sel[t].size())});
        if (s.inject_element(layer, S_MLA_SELECTED, t) >= 0) {  // an injected position must exist
            const size_t len = s.segs[s.seg_of[t]].seq->mla[layer].c.size() / r;
            for (int32_t tau : sel[t])
                if (tau < 0 || static_cast<size_t>(tau) >= len)
                    throw std::invalid_argument("inject: mla.selected now holds position " + std::to_string(tau) +
                                                ", outside the cache [0, " + std::to_string(len) + ")");
        }
    }

    // per row: the selected latents transposed (CT[k][j] = c_{tau_j}[k]), shared by the heads
    std::vector<std::vector<float>> CT(T);
    std::vector<std::vector<float>> scores(T), probs(T);
    s.pool.parallel_for(T, r * 64, [&](size_t a, size_t b) {
        for (size_t t = a; t < b; ++t) {
            const std::vector<int32_t>& st = sel[t];
            const size_t ns = st.size();
            const float* cache = s.segs[s.seg_of[t]].seq->mla[layer].c.data();
            CT[t].resize(r * ns);
            for (size_t j = 0; j < ns; ++j) {
                const float* cj = cache + static_cast<size_t>(st[j]) * r;
                for (size_t k = 0; k < r; ++k) CT[t][k * ns + j] = cj[k];
            }
            scores[t].resize(nh * ns);
            probs[t].resize(nh * ns);
        }
    });
    std::vector<float> o_lat(T * nh * r);
    size_t max_sel = 1;
    for (const std::vector<int32_t>& st : sel) max_sel = std::max(max_sel, st.size());
    s.pool.parallel_for(T * nh, 3 * r * max_sel, [&](size_t a, size_t b) {
        std::vector<float> e;
        for (size_t item = a; item < b; ++item) {
            const size_t t = item / nh, h = item % nh;
            const std::vector<int32_t>& st = sel[t];
            const size_t ns = st.size();
            const float* cache = s.segs[s.seg_of[t]].seq->mla[layer].c.data();
            const float* qh = q_abs.data() + item * r;
            // mla.scores: s_h(tau) = cdot(q_abs_h, c_tau) * scale
            float* sc = scores[t].data() + h * ns;
            for (size_t j = 0; j < ns; ++j) sc[j] = nm.dot(qh, cache + static_cast<size_t>(st[j]) * r, r) * scale;
            s.inject_f32(layer, S_MLA_SCORES, t, sc, h * ns, ns);
            // mla.probs: p = bf16(e / csum(e)), e = expf(s - max)
            float mx = sc[0];
            for (size_t j = 1; j < ns; ++j) mx = std::max(mx, sc[j]);
            e.resize(ns);
            for (size_t j = 0; j < ns; ++j) e[j] = nm.exp(sc[j] - mx);
            const float sum = nm.sum(e.data(), ns);
            float* p = probs[t].data() + h * ns;
            for (size_t j = 0; j < ns; ++j) p[j] = bf16_round(e[j] / sum);
            s.inject_f32(layer, S_MLA_PROBS, t, p, h * ns, ns);
            // mla.o_lat[k] = bf16(cdot over rank j of (p_j, c_{tau_j}[k]))
            float* ol = o_lat.data() + item * r;
            for (size_t k = 0; k < r; ++k) ol[k] = bf16_round(nm.dot(p, CT[t].data() + k * ns, ns));
            s.inject_f32(layer, S_MLA_O_LAT, t, ol, h * r, r);
        }
    });
    for (size_t t = 0; t < T; ++t) {
        const int64_t ns = static_cast<int64_t>(sel[t].size());
        if (s.wants_row(layer, S_MLA_SCORES, t))
            s.capture(layer, S_MLA_SCORES, t, scores[t].data(), 4, {static_cast<int64_t>(nh), ns});
        if (s.wants_row(layer, S_MLA_PROBS, t))
            s.capture(layer, S_MLA_PROBS, t, probs[t].data(), 4, {static_cast<int64_t>(nh), ns});
        if (s.wants_row(layer, S_MLA_O_LAT, t))
            s.capture(layer, S_MLA_O_LAT, t, o_lat.data() + t * nh * r, 4, {static_cast<int64_t>(nh), static_cast<int64_t>(r)});
    }

    // mla.o: o_h = lin(W_UV_h, o_lat_h), W_UV_h = rows h(d_n+d_v) + d_n + [0, d_v) of kv_b_proj
    std::vector<float> o(T * nh * dv);
    for (size_t h = 0; h < nh; ++h)
        s.linear(w.kv_b.rows(h * (dn + dv) + dn, dv), o_lat.data() + h * r, nh * r, o.data() + h * dv, nh * dv, true);
    s.emit_rows(layer, S_MLA_O, o.data(), nh * dv, nh * dv, {static_cast<int64_t>(nh * dv)});
    // mla.out = lin(o_proj, o)
    s.linear(w.o_proj, o.data(), nh * dv, out, D, true);
    s.emit_rows(layer, S_MLA_OUT, out, D, D, {static_cast<int64_t>(D)});
}

}  // namespace glm::cpu
