// The DSA k-pool indexer (docs/numerics.md, "DSA indexer"). Stages indexer.q, indexer.k, indexer.gate,
// indexer.weights, indexer.scores; its result is mla.selected.
//
// Keys of complete pools of kp consecutive positions are compressed once, when the pool completes,
// and kept on the GPU: per channel, a softmax over the pool of (gate + ape) weighs the pool's keys.
// A query at position t scores the (t+1)/kp pools it can see; with at most index_topk/kp of them it
// takes all, else the best index_topk/kp (ties to the lower pool index, NaN scores last); then the
// tail [n_pools*kp, t]. Positions ascending. The number of selected positions depends on t only, so
// the host knows every shape; which positions is decided on the device.
#include "engine.cuh"

namespace glm::cuda {
namespace {

// Positions a query at `pos` attends: every one while it sees at most `budget` pools, else the `budget`
// chosen pools' kp positions each and the tail after the last complete pool.
int64_t selected_count(int64_t pos, int kp, int budget) {
    const int64_t np = (pos + 1) / kp;
    return np <= budget ? pos + 1 : static_cast<int64_t>(budget) * kp + (pos + 1 - np * kp);
}

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

// indexer.scores for many queries at once (prefill chunks): the products of [queries x heads] rows
// with the pools' keys as a tiled matrix product. A block takes up to 64 (query, head) rows, the heads
// of 64 / ni (rounded down) consecutive queries of one segment (a tile of `tiles`), against 64 pools; each thread forms
// 4 rows x 4 pools of dots, whole, in the canonical order (cdot_tree_walk, cdot.cuh: partial sum k is
// fma(a[64c + k], b[64c + k], .) over the chunks c, the fold walked leaf by leaf). Elements past d_i
// are zeros in shared memory: fma(0, 0, P) = P for every partial P, which is never -0. Then
// max(dot * d_i^-1/2, 0) goes to shared memory and groups of eight threads weigh the heads of each
// (query, pool) as k_idx_scores does. Same bits as k_idx_scores; canonical dot only.
constexpr int kTileRows = 64, kTilePools = 64, kTileThreads = 256;
template <int C>  // chunks of 64 in d_i (d_i <= 64 C)
__global__ void __launch_bounds__(kTileThreads) k_idx_scores_tiled(const float* __restrict__ q,
                                                                   const float* __restrict__ wts, int ni, int di,
                                                                   int kp, const int2* __restrict__ tiles,
                                                                   const int* __restrict__ pos,
                                                                   const int64_t* __restrict__ off,
                                                                   const SegDev* __restrict__ segs,
                                                                   const int* __restrict__ seg_of, float qscale,
                                                                   float* scores) {
    pdl_enter();
    GLM_DYN_SMEM(float, sm);
    float* As = sm;                            // [64 C][64]: As[k][row]
    float* Bs = sm + 64 * C * kTileRows;       // [64 C][64]: Bs[k][pool]
    float* S = sm;                             // [64][65] relu'd head scores (after the products)
    const int tid = static_cast<int>(threadIdx.x);
    const int2 tile = tiles[blockIdx.x];
    const int t0 = tile.x, nq = tile.y, rows = nq * ni;
    const int p0 = static_cast<int>(blockIdx.y) * kTilePools;
    const int np_last = (pos[t0 + nq - 1] + 1) / kp;  // (positions ascend within a segment)
    if (p0 >= np_last) return;  // uniform over the block
    const float* pk = segs[seg_of[t0]].pk;
    const float* qa = q + static_cast<int64_t>(t0) * ni * di;
    const int k4n = di / 4;
    for (int i = tid; i < 16 * C * 64; i += kTileThreads) {
        const int m = i & 63, k4 = i >> 6;  // lanes over rows: the transposed stores hit 32 banks
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
        if (k4 < k4n) {
            if (m < rows) a = *reinterpret_cast<const float4*>(qa + static_cast<int64_t>(m) * di + 4 * k4);
            if (p0 + m < np_last) b = *reinterpret_cast<const float4*>(pk + static_cast<int64_t>(p0 + m) * di + 4 * k4);
        }
        store_kmajor4(As + (4 * k4) * kTileRows + m, a, kTileRows);
        store_kmajor4(Bs + (4 * k4) * kTilePools + m, b, kTilePools);
    }
    __syncthreads();
    const int tm = tid >> 4, tn = tid & 15;  // rows 4 tm.., pools 4 tn..
    float dots[4][4];
    cdot_tree_walk<4, 4>(dots, [&](int k, float (&v)[4][4]) {
        leaf_chain<C, 4, 4>(v, C, [&](int cc) { return As + (64 * cc + k) * kTileRows + 4 * tm; },
                         [&](int cc) { return Bs + (64 * cc + k) * kTilePools + 4 * tn; });
    });
    __syncthreads();  // (S overwrites As)
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float x = fmul(dots[r][c], qscale);
            S[(4 * tm + r) * (kTilePools + 1) + 4 * tn + c] = x > 0.0f ? x : 0.0f;
        }
    __syncthreads();
    const int grp = tid >> 3;
    for (int o = grp; o < (kTileRows / ni) * kTilePools; o += kTileThreads / 8) {  // (the same count on every lane)
        const int qi = o / kTilePools, pp = o % kTilePools;
        const int t = t0 + qi, p = p0 + pp;
        const bool live = qi < nq && p < (pos[qi < nq ? t : t0] + 1) / kp;
        const float* sr = S + (qi * ni) * (kTilePools + 1) + pp;
        const float* wt = wts + static_cast<int64_t>(live ? t : t0) * ni;
        const float score = group_dot<float>(live ? ni : 0, false, [&](int h, float& a, float& b) {
            a = sr[h * (kTilePools + 1)];
            b = wt[h];
        });
        if (live && lane8() == 0) scores[off[t] + p] = score;
    }
}

// Selection per row, one block: all positions, or the best `budget` pools + the tail, in O(pools).
// A score's key is num::select_key (order-preserving; -0 = +0; NaN lowest), so
// "best `budget` by score, ties to the lower pool index" is: every key above the budget-th largest
// key K, then the lowest-indexed pools whose key is K until there are `budget`. K is found by a radix
// select (four passes of a 256-bin histogram over the keys still matching K's high bits, MSB first),
// the pools are written in ascending order by a block-wide scan of the segment counts. The set is the
// canonical rule's (docs/numerics.md, "Ties at the indexer's selection boundary") however it is
// computed; the CPU engine takes it with nth_element.
constexpr int kSelThreads = 512;

using num::select_key;

__global__ void __launch_bounds__(kSelThreads) k_idx_select(const float* __restrict__ scores,
                                                            const int64_t* __restrict__ off,
                                                            const int* __restrict__ pos, int kp, int budget, int* sel,
                                                            const int64_t* __restrict__ sel_off) {
    pdl_enter();
    __shared__ unsigned hist[256];
    __shared__ unsigned s_prefix;
    __shared__ int s_need;
    __shared__ int scan_gt[kSelThreads], scan_eq[kSelThreads];
    const int tid = static_cast<int>(threadIdx.x), nt = static_cast<int>(blockDim.x);
    const int t = static_cast<int>(blockIdx.x);
    const int ps = pos[t];
    const int npools = (ps + 1) / kp;
    int* out = sel + sel_off[t];
    if (npools <= budget) {
        for (int i = tid; i <= ps; i += nt) out[i] = i;
        return;
    }
    const float* sc = scores + off[t];

    // K = the budget-th largest key; need = how many pools with key K are kept
    unsigned prefix = 0u, mask = 0u;
    int need = budget;
    const int nloop = (npools + nt - 1) / nt * nt;  // (every lane of a warp in every round: match_any)
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += nt) hist[i] = 0u;
        __syncthreads();
        // the lanes of a warp with the same bin add once (the first passes see a few bins only)
        for (int p = tid; p < nloop; p += nt) {
            const unsigned k = p < npools ? select_key(sc[p]) : 0u;
            const bool in = p < npools && (k & mask) == prefix;
            const unsigned bin = in ? (k >> shift) & 255u : 256u;
            const unsigned peers = __match_any_sync(kFull, bin);
            if (in && static_cast<int>(threadIdx.x & 31u) == __ffs(static_cast<int>(peers)) - 1)
                atomicAdd(&hist[bin], static_cast<unsigned>(__popc(peers)));
        }
        __syncthreads();
        // the bin d holding the need-th largest key: lane L of warp 0 sums bins 255-8L .. 248-8L, a
        // scan over the lanes finds the lane whose bins reach `need`, that lane walks its eight
        if (tid < 32) {
            int c[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                c[j] = static_cast<int>(hist[255 - 8 * tid - j]);
                sum += c[j];
            }
            int inc = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(kFull, inc, o);
                if (tid >= o) inc += v;
            }
            const unsigned reach = __ballot_sync(kFull, inc >= need);
            const int first = reach ? __ffs(static_cast<int>(reach)) - 1 : 31;  // (reach != 0: need <= the count)
            if (tid == first) {
                int above = inc - sum, d = 255 - 8 * tid;
                for (int j = 0; j < 8; ++j) {
                    d = 255 - 8 * tid - j;
                    if (d == 0 || above + c[j] >= need) break;
                    above += c[j];
                }
                s_prefix = prefix | (static_cast<unsigned>(d) << shift);
                s_need = need - above;
            }
        }
        __syncthreads();
        prefix = s_prefix;
        need = s_need;
        mask |= 255u << shift;
    }
    const unsigned K = prefix;

    // each thread a contiguous segment of pools: counts above K and equal to K, scanned over the block
    const int per = (npools + nt - 1) / nt;
    const int a = tid * per < npools ? tid * per : npools, b = a + per < npools ? a + per : npools;
    int gt = 0, eq = 0;
    for (int p = a; p < b; ++p) {
        const unsigned k = select_key(sc[p]);
        gt += k > K ? 1 : 0;
        eq += k == K ? 1 : 0;
    }
    scan_gt[tid] = gt;
    scan_eq[tid] = eq;
    __syncthreads();
    for (int d = 1; d < nt; d <<= 1) {  // inclusive scan (Hillis-Steele)
        const int vg = tid >= d ? scan_gt[tid - d] : 0, ve = tid >= d ? scan_eq[tid - d] : 0;
        __syncthreads();
        scan_gt[tid] += vg;
        scan_eq[tid] += ve;
        __syncthreads();
    }
    int eq_seen = scan_eq[tid] - eq;  // pools with key K before this segment
    int w = (scan_gt[tid] - gt) + (eq_seen < need ? eq_seen : need);
    for (int p = a; p < b; ++p) {
        const unsigned k = select_key(sc[p]);
        bool keep = k > K;
        if (k == K) keep = eq_seen++ < need;
        if (keep) {
            for (int j = 0; j < kp; ++j) out[w * kp + j] = p * kp + j;
            ++w;
        }
    }
    for (int tau = npools * kp + tid; tau <= ps; tau += nt) out[budget * kp + (tau - npools * kp)] = tau;
}

// The tiled scoring kernel applies: canonical dot, d_i a multiple of 4 up to 128, n_i <= 64.
bool tiled_scores_apply(int ni, int di, const Nm& nm) {
    return !nm.seq && di % 4 == 0 && di >= 4 && di <= 128 && ni >= 1 && ni <= 64;
}

// Tiles of 64 / ni (rounded down) consecutive rows of one segment: (first row, rows) for each segment's rows [t0, t0 + n).
std::vector<int2> score_tiles(const std::vector<std::pair<int, int>>& seg_rows, int ni) {
    const int qt = kTileRows / ni;
    std::vector<int2> tiles;
    for (const auto& [t0, n] : seg_rows)
        for (int t = t0; t < t0 + n; t += qt) tiles.push_back(make_int2(t, std::min(qt, t0 + n - t)));
    return tiles;
}

// indexer.scores of every row: scores[off[t] + p] for the (pos[t] + 1) / kp pools row t sees. d_tiles
// (n_tiles of score_tiles) selects the tiled kernel, nullptr the per-row one.
void launch_scores(const float* q, const float* wts, int ni, int di, int kp, int T, int max_np, const int* d_pos,
                   const int64_t* d_off, const SegDev* segs, const int* d_seg, float* scores, const Nm& nm,
                   const int2* d_tiles, int n_tiles) {
    const float qscale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(di)));
    if (d_tiles != nullptr) {
        const unsigned pool_tiles = static_cast<unsigned>((max_np + kTilePools - 1) / kTilePools);
        const int C = di <= 64 ? 1 : 2;
        const size_t smem = std::max<size_t>(2u * 64u * C * 64u, 64u * (kTilePools + 1)) * 4u;
        auto kk = C == 1 ? k_idx_scores_tiled<1> : k_idx_scores_tiled<2>;
        allow_smem(kk, smem);
        GLM_LAUNCH(kk, dim3(static_cast<unsigned>(n_tiles), pool_tiles), kTileThreads, smem, q, wts, ni, di, kp,
                   d_tiles, d_pos, d_off, segs, d_seg, qscale, scores);
        check_launch("idx_scores_tiled");
        return;
    }
    auto kk = k_idx_scores;
    // pools per block: one while there are few (latency), eight once there are many (q reuse)
    const int PT = static_cast<int64_t>(max_np) * T >= 1024 ? 8 : 1;
    GLM_LAUNCH(kk, dim3(blocks(max_np, PT), T), kIdxThreads, static_cast<size_t>(PT) * ni * 4, q, wts, ni, di, kp, PT,
               d_pos, d_off, segs, d_seg, qscale, scores, nm);
    check_launch("idx_scores");
}

}  // namespace

std::vector<int> index_select_device(const float* scores, int64_t n_scores, int pos, int kp, int budget) {
    if (kp < 1 || budget < 1 || pos < 0) throw std::invalid_argument("index_select: kp, budget >= 1 and pos >= 0");
    const int64_t np = (static_cast<int64_t>(pos) + 1) / kp;
    if (n_scores != np)
        throw std::invalid_argument("index_select: a query at position " + std::to_string(pos) + " sees " +
                                    std::to_string(np) + " pools, got " + std::to_string(n_scores) + " scores");
    const int64_t n = selected_count(pos, kp, budget);
    const int64_t zero = 0;
    DBuf ds(static_cast<size_t>(std::max<int64_t>(np, 1)) * 4), doff(8), dpos(4), dsel(static_cast<size_t>(n) * 4),
        dsoff(8);
    if (np) check(cudaMemcpy(ds.p, scores, static_cast<size_t>(np) * 4, cudaMemcpyHostToDevice), "index_select");
    check(cudaMemcpy(doff.p, &zero, 8, cudaMemcpyHostToDevice), "index_select");
    check(cudaMemcpy(dsoff.p, &zero, 8, cudaMemcpyHostToDevice), "index_select");
    check(cudaMemcpy(dpos.p, &pos, 4, cudaMemcpyHostToDevice), "index_select");
    auto kk = k_idx_select;
    GLM_LAUNCH(kk, 1, kSelThreads, 0, ds.as<float>(), doff.as<int64_t>(), dpos.as<int>(), kp, budget, dsel.as<int>(),
               dsoff.as<int64_t>());
    check_launch("index_select");
    std::vector<int> out(static_cast<size_t>(n));
    check(cudaMemcpy(out.data(), dsel.p, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToHost), "index_select");
    return out;
}

IndexScores index_scores_device(const float* q, const float* wts, const float* keys, int64_t n_keys,
                                const std::vector<int>& pos, int ni, int di, int kp, int budget, bool tiled,
                                int reps) {
    const int T = static_cast<int>(pos.size());
    if (T < 1 || ni < 1 || di < 1 || kp < 1 || budget < 1) throw std::invalid_argument("index_scores: empty shape");
    for (int t = 0; t < T; ++t)
        if (pos[t] < 0 || (t > 0 && pos[t] < pos[t - 1]))
            throw std::invalid_argument("index_scores: positions must be >= 0 and ascending");
    const int max_np = (pos[T - 1] + 1) / kp;
    if (n_keys < max_np)
        throw std::invalid_argument("index_scores: a query at position " + std::to_string(pos[T - 1]) + " sees " +
                                    std::to_string(max_np) + " pools, got " + std::to_string(n_keys) + " keys");
    const Nm nm{};
    if (tiled && !tiled_scores_apply(ni, di, nm))
        throw std::invalid_argument("index_scores: the tiled kernel needs di % 4 == 0, di <= 128 and ni <= 64");
    std::vector<int64_t> off(static_cast<size_t>(T)), sel_off(static_cast<size_t>(T));
    int64_t total = 0, stotal = 0;
    for (int t = 0; t < T; ++t) {
        const int64_t np = (pos[t] + 1) / kp;
        off[t] = total;
        sel_off[t] = stotal;
        total += np;
        stotal += selected_count(pos[t], kp, budget);
    }
    const std::vector<int2> tiles = score_tiles({{0, T}}, ni);
    auto up = [](DBuf& b, const void* src, size_t n) {
        if (n) check(cudaMemcpy(b.p, src, n, cudaMemcpyHostToDevice), "index_scores");
    };
    const size_t nq = static_cast<size_t>(T) * ni * di, nk = static_cast<size_t>(std::max<int64_t>(n_keys, 1)) * di;
    DBuf dq(nq * 4), dw(static_cast<size_t>(T) * ni * 4), dk(nk * 4), dpos(static_cast<size_t>(T) * 4),
        doff(static_cast<size_t>(T) * 8), dsoff(static_cast<size_t>(T) * 8), dseg(static_cast<size_t>(T) * 4),
        dtiles(tiles.size() * sizeof(int2)), dsegs(sizeof(SegDev)),
        dsc(static_cast<size_t>(std::max<int64_t>(total, 1)) * 4), dsel(static_cast<size_t>(std::max<int64_t>(stotal, 1)) * 4);
    up(dq, q, nq * 4);
    up(dw, wts, static_cast<size_t>(T) * ni * 4);
    up(dk, keys, static_cast<size_t>(n_keys) * di * 4);
    up(dpos, pos.data(), static_cast<size_t>(T) * 4);
    up(doff, off.data(), static_cast<size_t>(T) * 8);
    up(dsoff, sel_off.data(), static_cast<size_t>(T) * 8);
    check(cudaMemset(dseg.p, 0, static_cast<size_t>(T) * 4), "index_scores");
    up(dtiles, tiles.data(), tiles.size() * sizeof(int2));
    SegDev sg{};
    sg.pk = dk.as<float>();
    up(dsegs, &sg, sizeof(SegDev));
    check(cudaMemset(dsc.p, 0xFF, static_cast<size_t>(std::max<int64_t>(total, 1)) * 4), "index_scores");  // (NaN: unwritten shows)
    auto once = [&] {
        launch_scores(dq.as<float>(), dw.as<float>(), ni, di, kp, T, max_np, dpos.as<int>(), doff.as<int64_t>(),
                      dsegs.as<SegDev>(), dseg.as<int>(), dsc.as<float>(), nm, tiled ? dtiles.as<int2>() : nullptr,
                      static_cast<int>(tiles.size()));
    };
    once();
    check(cudaDeviceSynchronize(), "index_scores");
    IndexScores r;
    r.scores.resize(static_cast<size_t>(total));
    if (total) check(cudaMemcpy(r.scores.data(), dsc.p, static_cast<size_t>(total) * 4, cudaMemcpyDeviceToHost), "index_scores");
    if (reps > 0) {
        r.ms = median_us(reps, false, once) / 1e3;
        r.select_ms = median_us(reps, false, [&] {
                          auto kk = k_idx_select;
                          GLM_LAUNCH(kk, T, kSelThreads, 0, dsc.as<float>(), doff.as<int64_t>(), dpos.as<int>(), kp,
                                     budget, dsel.as<int>(), dsoff.as<int64_t>());
                          check_launch("idx_select");
                      }) /
                      1e3;
    }
    return r;
}

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
        // the tiled kernel for prefill-sized work (its 64-row tiles are mostly empty for a few queries)
        const bool tiled = launch_options().idx_tiled && T >= 16 && static_cast<int64_t>(max_np) * T >= 16384 &&
                           tiled_scores_apply(ni, di, nm);
        std::vector<int2> tiles;
        if (tiled) {
            std::vector<std::pair<int, int>> seg_rows;
            for (const Segment& g : s.segs) seg_rows.emplace_back(g.t0, g.n);
            tiles = score_tiles(seg_rows, ni);
        }
        launch_scores(q, wts, ni, di, kp, T, max_np, s.d_pos, d_off, segs, s.d_seg, scores, nm,
                      tiled ? s.scratch.up(tiles) : nullptr, static_cast<int>(tiles.size()));
    }
    if (!lean) s.emit_var(layer, S_IDX_SCORES, scores, off, shapes);

    // the selection
    s.sel_off.assign(static_cast<size_t>(T), 0);
    s.sel_n.assign(static_cast<size_t>(T), 0);
    int64_t stotal = 0;
    for (int t = 0; t < T; ++t) {
        const int64_t ps = s.pos[static_cast<size_t>(t)];
        const int64_t n = selected_count(ps, kp, budget);
        s.sel_off[static_cast<size_t>(t)] = stotal;
        s.sel_n[static_cast<size_t>(t)] = n;
        stotal += n;
    }
    s.sel_total = stotal;
    s.d_sel = s.scratch.d<int>(static_cast<size_t>(stotal));
    s.d_sel_off = s.scratch.up(s.sel_off);
    std::vector<int> n32(s.sel_n.begin(), s.sel_n.end());
    s.d_sel_n = s.scratch.up(n32);
    {
        auto kk = k_idx_select;
        GLM_LAUNCH(kk, T, kSelThreads, 0, scores, d_off, s.d_pos, kp, budget, s.d_sel, s.d_sel_off);
        check_launch("idx_select");
    }
    s.have_sel = true;
    s.sel_dense = dense;  // (k_idx_select: out[i] = i for every position i the row sees)
}

}  // namespace glm::cuda
