// The DSA k-pool indexer (docs/numerics.md, "DSA indexer"). Stages indexer.q, indexer.k, indexer.gate,
// indexer.weights, indexer.scores; its result is mla.selected.
//
// Keys of complete pools of kp consecutive positions are compressed once, when the pool completes,
// and kept on the GPU: per channel, a softmax over the pool of (gate + ape) weighs the pool's keys.
// A query at position t scores the (t+1)/kp pools it can see; with at most index_topk/kp of them it
// takes all, else the best index_topk/kp (ties to the lower pool index, NaN scores as -inf); then the
// tail [n_pools*kp, t]. Positions ascending. The number of selected positions depends on t only, so
// the host knows every shape; which positions is decided on the device.
#include "engine.cuh"

namespace glm::cuda {
namespace {

unsigned blocks(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

__global__ void k_scale(float* x, int64_t n, float s) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) x[i] = fmul(x[i], s);
}

// One thread per (new pool, channel). items: [n][2] = (segment, pool index).
__global__ void k_pools(const int* __restrict__ items, int n_items, int kp, int di, const float* __restrict__ ape,
                        const SegDev* __restrict__ segs, Nm nm) {
    pdl_enter();
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<int64_t>(n_items) * di) return;
    const int it = static_cast<int>(idx / di), ch = static_cast<int>(idx % di);
    const SegDev& sg = segs[items[2 * it]];
    const int64_t p = items[2 * it + 1];
    auto z = [&](int j) { return fadd(sg.gate[(p * kp + j) * di + ch], ape[static_cast<int64_t>(j) * di + ch]); };
    float mx = z(0);
    for (int j = 1; j < kp; ++j) {
        const float v = z(j);
        mx = (mx < v) ? v : mx;
    }
    auto e = [&](int j) { return nm.exp(fsub(z(j), mx)); };
    const float sum = cdot_serial<float>(kp, nm.seq, [&](int j, float& a, float& b) {
        a = e(j);
        b = 1.0f;
    });
    const float K = cdot_serial<float>(kp, nm.seq, [&](int j, float& a, float& b) {
        a = bf16r(fdiv(e(j), sum));
        b = sg.k[(p * kp + j) * di + ch];
    });
    sg.pk[p * di + ch] = bf16r(K);
}

// indexer.scores: block per (t, tile of PT pools), a group of eight threads per head (heads beyond 32
// loop): s_h = max(cdot(K_p, q_h) * d_i^-1/2, 0) into shared memory; then group pp of the block makes
// pool pp's score = cdot over h of (s_h, w_h) (group_dot: the canonical order over the head index, or
// the sequential sum).
constexpr int kIdxThreads = 256;
__global__ void __launch_bounds__(kIdxThreads) k_idx_scores(const float* __restrict__ q, const float* __restrict__ wts,
                                                            int ni, int di, int kp, int PT, const int* __restrict__ pos,
                                                            const int64_t* __restrict__ off,
                                                            const SegDev* __restrict__ segs,
                                                            const int* __restrict__ seg_of, float qscale,
                                                            float* scores, Nm nm) {
    pdl_enter();
    GLM_DYN_SMEM(float, sh);  // [PT][ni]
    const int t = static_cast<int>(blockIdx.y);
    const int grp = static_cast<int>(threadIdx.x >> 3), ngrp = kIdxThreads / 8;
    const int p0 = static_cast<int>(blockIdx.x) * PT;
    const int npools = (pos[t] + 1) / kp;
    if (p0 >= npools) return;  // uniform over the block
    const float* pk = segs[seg_of[t]].pk;
    const float* qt = q + static_cast<int64_t>(t) * ni * di;
    const float* wt = wts + static_cast<int64_t>(t) * ni;
    for (int pp = 0; pp < PT; ++pp) {
        const int p = p0 + pp;
        if (p >= npools) break;  // uniform
        const float* key = pk + static_cast<int64_t>(p) * di;
        for (int hb = 0; hb < ni; hb += ngrp) {
            const int h = hb + grp;
            const bool hl = h < ni;
            const float* qh = qt + static_cast<int64_t>(hl ? h : 0) * di;
            const float v = fmul(group_dot<float>(hl ? di : 0, nm.seq,
                                                  [&](int i, float& a, float& b) {
                                                      a = key[i];
                                                      b = qh[i];
                                                  }),
                                 qscale);
            if (hl && lane8() == 0) sh[pp * ni + h] = v > 0.0f ? v : 0.0f;
        }
    }
    __syncthreads();
    if (static_cast<int>(threadIdx.x >> 5) * 4 >= PT) return;  // warps without a pool (uniform per warp)
    const int p = p0 + grp;
    const bool live = grp < PT && p < npools;
    const float* s = sh + (live ? grp : 0) * ni;
    const float score = group_dot<float>(live ? ni : 0, nm.seq, [&](int h, float& a, float& b) {
        a = s[h];
        b = wt[h];
    });
    if (live && lane8() == 0) scores[off[t] + p] = score;
}

// Selection per row (one block): all positions, or the best `budget` pools + the tail.
__global__ void k_idx_select(const float* __restrict__ scores, const int64_t* __restrict__ off,
                             const int* __restrict__ pos, int kp, int budget, int* flags, int* sel,
                             const int64_t* __restrict__ sel_off) {
    pdl_enter();
    const int t = static_cast<int>(blockIdx.x);
    const int ps = pos[t];
    const int npools = (ps + 1) / kp;
    int* out = sel + sel_off[t];
    if (npools <= budget) {
        for (int i = static_cast<int>(threadIdx.x); i <= ps; i += static_cast<int>(blockDim.x)) out[i] = i;
        return;
    }
    const float* sc = scores + off[t];
    int* fl = flags + off[t];
    for (int p = static_cast<int>(threadIdx.x); p < npools; p += static_cast<int>(blockDim.x)) {
        const float kpv = is_nan(sc[p]) ? -INFINITY : sc[p];
        int rank = 0;
        for (int q2 = 0; q2 < npools; ++q2) {
            const float kq = is_nan(sc[q2]) ? -INFINITY : sc[q2];
            rank += (kq > kpv || (kq == kpv && q2 < p)) ? 1 : 0;
        }
        fl[p] = rank < budget ? 1 : 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int w = 0;
        for (int p = 0; p < npools; ++p)
            if (fl[p])
                for (int j = 0; j < kp; ++j) out[w++] = p * kp + j;
        for (int tau = npools * kp; tau <= ps; ++tau) out[w++] = tau;
    }
}

}  // namespace

void indexer_select(Step& s, int layer, const MlaW& w, const float* x, const float* q_lat) {
    const Config& c = s.c;
    const Nm nm = s.nm;
    const int T = s.T, D = static_cast<int>(c.hidden_size), rq = static_cast<int>(c.q_lora_rank);
    const int ni = static_cast<int>(c.index_n_heads), di = static_cast<int>(c.index_head_dim);
    const int kp = static_cast<int>(c.index_kpool), budget = static_cast<int>(c.index_topk / c.index_kpool);

    // Dense (every query sees at most `budget` pools, so each selects every position it sees) and
    // nothing observing q, the weights or the scores: those three only rank pools, so they are not
    // made (the query's wq_b read, the scaling and the scoring launches). k and gate still go to the
    // cache: later queries score the pools they form. Same selection, same bits.
    bool dense = true;
    for (int t = 0; t < T; ++t) dense = dense && (s.pos[static_cast<size_t>(t)] + 1) / kp <= budget;
    auto observed = [&](int stage) { return s.wants_any(layer, stage) || s.injects(layer, stage); };
    const bool lean = dense && !observed(S_IDX_Q) && !observed(S_IDX_WEIGHTS) && !observed(S_IDX_SCORES);

    // indexer.q = lin(wq_b, q_lat)
    float* q = nullptr;
    if (!lean) {
        q = s.scratch.d<float>(static_cast<size_t>(T) * ni * di);
        linear(w.wq_b, q_lat, rq, q, static_cast<int64_t>(ni) * di, T, true, nm, s.hw8);
        s.emit(layer, S_IDX_Q, q, static_cast<int64_t>(ni) * di, {static_cast<int64_t>(ni) * di});
    }
    // wk, kpool_gate and weights_proj of x (one launch for one token when they are one matrix)
    float* kgw[3];
    linear_same_x(s, w.kgw, {&w.wk, &w.kpool_gate, &w.weights_proj}, x, D, kgw);
    float *kraw = kgw[0], *gate = kgw[1], *wts = kgw[2];
    // indexer.k = LayerNorm(lin(wk, x)), eps 1e-6
    float* k = s.scratch.d<float>(static_cast<size_t>(T) * di);
    layer_norm_rows(s, kraw, T, di, w.k_norm_w, w.k_norm_b, 1e-6f, k);
    s.emit(layer, S_IDX_K, k, di, {di});
    // indexer.gate = lin(index_kpool_compress_gate, x)
    s.emit(layer, S_IDX_GATE, gate, di, {di});
    // indexer.weights = lin(weights_proj, x) * (float)(n_i^-1/2), f32
    if (!lean) {
        auto kk = k_scale;
        const int64_t n = static_cast<int64_t>(T) * ni;
        GLM_LAUNCH(kk, blocks(n, 256), 256, 0, wts, n, static_cast<float>(1.0 / std::sqrt(static_cast<double>(ni))));
        check_launch("idx_weights");
    }
    if (!lean) s.emit(layer, S_IDX_WEIGHTS, wts, ni, {ni});

    // cache k and gate, then compress the pools that completed in this step
    append_rows(s, layer, k, di, di, 1);
    append_rows(s, layer, gate, di, di, 2);
    std::vector<int> items;
    for (size_t i = 0; i < s.segs.size(); ++i) {
        const int64_t a = s.segs[i].pos0 / kp, b = (s.segs[i].pos0 + s.segs[i].n) / kp;
        for (int64_t p = a; p < b; ++p) {
            items.push_back(static_cast<int>(i));
            items.push_back(static_cast<int>(p));
        }
    }
    SegDev* segs = s.seg_table(layer);
    if (!items.empty()) {
        const int n_items = static_cast<int>(items.size() / 2);
        int* d_items = s.scratch.up(items);
        auto kk = k_pools;
        GLM_LAUNCH(kk, blocks(static_cast<int64_t>(n_items) * di, 128), 128, 0, d_items, n_items, kp, di, w.ape, segs, nm);
        check_launch("idx_pools");
    }

    // indexer.scores per row
    std::vector<int64_t> off(static_cast<size_t>(T));
    std::vector<std::vector<int64_t>> shapes(static_cast<size_t>(T));
    int64_t total = 0;
    int max_np = 0;
    for (int t = 0; t < T; ++t) {
        const int np = static_cast<int>((s.pos[static_cast<size_t>(t)] + 1) / kp);
        off[static_cast<size_t>(t)] = total;
        shapes[static_cast<size_t>(t)] = {np};
        total += np;
        max_np = std::max(max_np, np);
    }
    // (the dense selection reads no scores)
    float* scores = lean ? nullptr : s.scratch.d<float>(static_cast<size_t>(std::max<int64_t>(total, 1)));
    int64_t* d_off = lean ? nullptr : s.scratch.up(off);
    if (max_np > 0 && !lean) {
        auto kk = k_idx_scores;
        // pools per block: one while there are few (latency), eight once there are many (q reuse)
        const int PT = static_cast<int64_t>(max_np) * T >= 1024 ? 8 : 1;
        GLM_LAUNCH(kk, dim3(blocks(max_np, PT), T), kIdxThreads, static_cast<size_t>(PT) * ni * 4, q, wts, ni, di, kp,
                   PT, s.d_pos, d_off, segs, s.d_seg, static_cast<float>(1.0 / std::sqrt(static_cast<double>(di))),
                   scores, nm);
        check_launch("idx_scores");
    }
    if (!lean) s.emit_var(layer, S_IDX_SCORES, scores, off, shapes);

    // the selection
    s.sel_off.assign(static_cast<size_t>(T), 0);
    s.sel_n.assign(static_cast<size_t>(T), 0);
    int64_t stotal = 0;
    for (int t = 0; t < T; ++t) {
        const int64_t ps = s.pos[static_cast<size_t>(t)];
        const int64_t np = (ps + 1) / kp;
        const int64_t n = np <= budget ? ps + 1 : static_cast<int64_t>(budget) * kp + (ps + 1 - np * kp);
        s.sel_off[static_cast<size_t>(t)] = stotal;
        s.sel_n[static_cast<size_t>(t)] = n;
        stotal += n;
    }
    s.sel_total = stotal;
    s.d_sel = s.scratch.d<int>(static_cast<size_t>(stotal));
    s.d_sel_off = s.scratch.up(s.sel_off);
    std::vector<int> n32(s.sel_n.begin(), s.sel_n.end());
    s.d_sel_n = s.scratch.up(n32);
    int* flags = s.scratch.d<int>(static_cast<size_t>(std::max<int64_t>(total, 1)));
    {
        auto kk = k_idx_select;
        GLM_LAUNCH(kk, T, 256, 0, scores, d_off, s.d_pos, kp, budget, flags, s.d_sel, s.d_sel_off);
        check_launch("idx_select");
    }
    s.have_sel = true;
}

}  // namespace glm::cuda
