// The DSA k-pool indexer (docs/numerics.md, "DSA indexer"). Stages indexer.q, indexer.k, indexer.gate,
// indexer.weights, indexer.scores; its result is mla.selected.
//
// Keys of complete pools of kp consecutive positions are compressed once, when the pool completes:
// per channel, a softmax over the pool of (gate + ape) weighs the pool's keys. A query at position t
// scores the (t+1)/kp pools it can see; with at most index_topk/kp of them it takes all, else the best
// index_topk/kp (ties to the lower pool index); then the tail [n_pools*kp, t]. Positions ascending.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "../numerics_dev.hpp"
#include "engine.hpp"
#include "formats.hpp"

namespace glm::cpu {
namespace {

// Compress every pool whose kp positions are all cached and that has no key yet.
void complete_pools(const Numerics& nm, const MlaWeights& w, size_t kp, size_t di, MlaState& st) {
    const size_t len = st.k.size() / di;
    size_t have = st.pool_keys.size() / di;
    std::vector<float> z(kp), e(kp), pi(kp), kc(kp);
    for (size_t p = have; p < len / kp; ++p) {
        st.pool_keys.resize((p + 1) * di);
        float* K = st.pool_keys.data() + p * di;
        for (size_t ch = 0; ch < di; ++ch) {
            for (size_t j = 0; j < kp; ++j) z[j] = st.gate[(p * kp + j) * di + ch] + w.ape[j * di + ch];
            float mx = z[0];
            for (size_t j = 1; j < kp; ++j) mx = std::max(mx, z[j]);
            for (size_t j = 0; j < kp; ++j) e[j] = nm.exp(z[j] - mx);
            const float sum = nm.sum(e.data(), kp);
            for (size_t j = 0; j < kp; ++j) {
                pi[j] = bf16_round(e[j] / sum);
                kc[j] = st.k[(p * kp + j) * di + ch];
            }
            K[ch] = bf16_round(nm.dot(pi.data(), kc.data(), kp));
        }
    }
}

}  // namespace

void indexer_select(Step& s, int layer, const MlaWeights& w, const float* x, const float* q_lat, Selection& sel) {
    const EngineConfig& c = s.c;
    const Numerics& nm = s.nm;
    const size_t T = s.T, D = static_cast<size_t>(c.hidden_size), rq = static_cast<size_t>(c.q_lora_rank);
    const size_t ni = static_cast<size_t>(c.index_n_heads), di = static_cast<size_t>(c.index_head_dim);
    const size_t kp = static_cast<size_t>(c.index_kpool), budget = static_cast<size_t>(c.index_topk / c.index_kpool);

    // indexer.q = lin(wq_b, q_lat)
    std::vector<float> q(T * ni * di);
    s.linear(w.wq_b, q_lat, rq, q.data(), ni * di, true);
    s.emit_rows(layer, S_IDX_Q, q.data(), ni * di, ni * di, {static_cast<int64_t>(ni * di)});
    // indexer.k = LayerNorm(lin(wk, x)), eps 1e-6
    std::vector<float> kraw(T * di), k(T * di);
    s.linear(w.wk, x, D, kraw.data(), di, true);
    for (size_t t = 0; t < T; ++t)
        layer_norm_row(nm, kraw.data() + t * di, di, w.k_norm_w.data(), w.k_norm_b.data(), 1e-6f, k.data() + t * di);
    s.emit_rows(layer, S_IDX_K, k.data(), di, di, {static_cast<int64_t>(di)});
    // indexer.gate = lin(index_kpool_compress_gate, x)
    std::vector<float> gate(T * di);
    s.linear(w.kpool_gate, x, D, gate.data(), di, true);
    s.emit_rows(layer, S_IDX_GATE, gate.data(), di, di, {static_cast<int64_t>(di)});
    // indexer.weights = lin(weights_proj, x) * (float)(n_i^-1/2), f32
    std::vector<float> wts(T * ni);
    s.linear(w.weights_proj, x, D, wts.data(), ni, true);
    const float wscale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(ni)));
    for (float& v : wts) v = v * wscale;
    s.emit_rows(layer, S_IDX_WEIGHTS, wts.data(), ni, ni, {static_cast<int64_t>(ni)});

    // cache k and gate, then compress the pools that completed
    for (const Segment& g : s.segs) {
        MlaState& st = g.seq->mla[layer];
        st.k.insert(st.k.end(), k.data() + g.t0 * di, k.data() + (g.t0 + g.n) * di);
        st.gate.insert(st.gate.end(), gate.data() + g.t0 * di, gate.data() + (g.t0 + g.n) * di);
    }
    s.pool.parallel_for(s.segs.size(), kp * di * 8, [&](size_t a, size_t b) {
        for (size_t i = a; i < b; ++i) complete_pools(nm, w, kp, di, s.segs[i].seq->mla[layer]);
    });

    // indexer.scores per row: score_p = cdot over heads of (weights_h, max(cdot(q_h, K_p) * d_i^-1/2, 0))
    const float qscale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(di)));
    sel.assign(T, {});
    for (size_t t = 0; t < T; ++t) {
        const int64_t pos = s.pos[t];
        const size_t npools = static_cast<size_t>(pos + 1) / kp;
        const float* keys = s.segs[s.seg_of[t]].seq->mla[layer].pool_keys.data();
        std::vector<float> score(npools);
        const float* qt = q.data() + t * ni * di;
        const float* wt = wts.data() + t * ni;
        s.pool.parallel_for(npools, ni * di, [&](size_t a, size_t b) {
            std::vector<float> sh(ni);
            for (size_t p = a; p < b; ++p) {
                for (size_t h = 0; h < ni; ++h) {
                    const float v = nm.dot(keys + p * di, qt + h * di, di) * qscale;
                    sh[h] = v > 0.0f ? v : 0.0f;
                }
                score[p] = nm.dot(sh.data(), wt, ni);
            }
        });
        s.emit(layer, S_IDX_SCORES, t, score.data(), {static_cast<int64_t>(npools)});

        // selection: all pools, or the best `budget` (ties to the lower pool index), ascending
        std::vector<size_t> pools(npools);
        std::iota(pools.begin(), pools.end(), size_t{0});
        if (npools > budget) {
            auto key = [&](size_t p) { return num::select_key(score[p]); };
            // a strict total order, so the kept set is unique however it is found: O(pools) on average
            std::nth_element(pools.begin(), pools.begin() + static_cast<std::ptrdiff_t>(budget), pools.end(),
                             [&](size_t a, size_t b) {
                                 const uint32_t ka = key(a), kb = key(b);
                                 return ka > kb || (ka == kb && a < b);
                             });
            pools.resize(budget);
            std::sort(pools.begin(), pools.end());
        }
        std::vector<int32_t>& out = sel[t];
        out.reserve(pools.size() * kp + kp);
        for (size_t p : pools)
            for (size_t j = 0; j < kp; ++j) out.push_back(static_cast<int32_t>(p * kp + j));
        for (int64_t tau = static_cast<int64_t>(npools * kp); tau <= pos; ++tau) out.push_back(static_cast<int32_t>(tau));
    }
}

}  // namespace glm::cpu
