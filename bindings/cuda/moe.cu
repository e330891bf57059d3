// Feed-forward (docs/numerics.md, FFN): the clamped SwiGLU (dense layers: mlp.gate, mlp.up, mlp.out;
// shared and routed experts) and the MoE (moe.logits, moe.selected, moe.weights, moe.experts,
// moe.routed, moe.shared, moe.out).
//
//   SwiGLU: g, u = lin(gate, x), lin(up, x); g' = min(g, L), u' = clamp(u, -L, L);
//           h = bf16(silu(g') * u'); y = lin(down, h)
//   router: logits = cdot(W_gate[e], x) (f32), s = sigmoid(logits), choice = s + bias; group-limited
//           top-k by choice (ties to the lower index, NaN as -inf), selected sorted by expert index;
//           w = s_sel [/ (csum(s_sel) + 1e-20f)] * routed_scaling_factor
//   routed[d] = bf16(cdot over j of (w_j, y_j[d])); out = bf16(routed + shared)
//
// Routing, the grouping of (token, slot) pairs by expert and the expert work list are made on the
// device; the expert matvecs then read each selected expert's weights once for all its pairs.
#include <cstdlib>
#include <chrono>

#include "engine.cuh"

namespace glm::cuda {
namespace {

GLM_DEV float swiglu_one(float g, float u, float L, const Nm& nm) {
    const float gv = g > L ? L : g;
    const float uv = u > L ? L : (u < -L ? -L : u);
    return bf16r(fmul(nm.silu(gv), uv));
}
__global__ void k_swiglu_act(const float* __restrict__ g, const float* __restrict__ u, float* h, int64_t n, float L,
                             Nm nm) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n) return;
    h[i] = swiglu_one(g[i], u[i], L, nm);
}
GLM_DEV float key_of(float v) { return is_nan(v) ? -INFINITY : v; }

// The routing order as one integer: larger is better. The f32 key (NaN as -inf, -0 as +0) mapped to
// an order-preserving u32 in the high word, the complement of the index in the low word (ties to the
// lower index). Every valid key is > 0; 0 marks "no candidate". A strict total order, so the k best
// under it are exactly the experts whose rank (number of better candidates) is < k.
GLM_DEV unsigned long long route_key(float v, int e) {
    uint32_t u = f32_bits(key_of(v));
    if ((u & 0x7FFFFFFFu) == 0u) u = 0u;
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return (static_cast<unsigned long long>(u) << 32) | static_cast<unsigned long long>(0xFFFFFFFFu - static_cast<uint32_t>(e));
}

GLM_DEV unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) {
        const unsigned long long m = __shfl_xor_sync(kFull, v, o);
        v = m > v ? m : v;
    }
    return v;
}

// Routing of one row per block (256 threads): scores, choices, group-limited top-k; writes sel[t][k]
// ascending. The top-k: warp 0 takes the best remaining candidate k times (a warp max of route_key;
// each lane keeps the best of its own experts and recomputes it only when that one was taken), then
// sorts the winners by index.
template <int KR>
__global__ void __launch_bounds__(256) k_moe_route(const float* __restrict__ logits, const float* __restrict__ bias,
                                                   int E, int k, int G, int topk_group, float* scores, int* sel, Nm nm) {
    pdl_enter();
    GLM_DYN_SMEM(float, sm);
    float* ch = sm;                                        // [E]
    float* gscore = sm + E;                                // [G]
    int* gkeep = reinterpret_cast<int*>(sm + E + G);       // [G]
    int* wins = gkeep + G;                                 // [k]
    const int okey = (E + 2 * G + k + 1) & ~1;             // 8-byte aligned
    unsigned long long* key = reinterpret_cast<unsigned long long*>(sm + okey);  // [E]
    const int t = static_cast<int>(blockIdx.x);
    const int tid = static_cast<int>(threadIdx.x), nt = static_cast<int>(blockDim.x);
    const float* lg = logits + static_cast<int64_t>(t) * E;
    float* sc = scores + static_cast<int64_t>(t) * E;
    for (int e = tid; e < E; e += nt) {
        const float s = nm.sigmoid(lg[e]);
        sc[e] = s;
        ch[e] = fadd(s, bias[e]);
        if (G == 1) key[e] = route_key(ch[e], e);
    }
    __syncthreads();
    auto better = [&](int a, int b) {
        const float ka = key_of(ch[a]), kb = key_of(ch[b]);
        return ka > kb || (ka == kb && a < b);
    };
    const int per = E / G;
    if (G > 1) {
        for (int gi = tid; gi < G; gi += nt) {
            int m0 = gi * per, m1 = gi * per + 1;
            if (better(m1, m0)) {
                const int x = m0;
                m0 = m1;
                m1 = x;
            }
            for (int e = gi * per + 2; e < (gi + 1) * per; ++e) {
                if (better(e, m0)) {
                    m1 = m0;
                    m0 = e;
                } else if (better(e, m1)) {
                    m1 = e;
                }
            }
            gscore[gi] = fadd(ch[m0], ch[m1]);  // larger + smaller
        }
        __syncthreads();
        for (int gi = tid; gi < G; gi += nt) {
            const float kg = key_of(gscore[gi]);
            int rank = 0;
            for (int g2 = 0; g2 < G; ++g2) {
                const float k2 = key_of(gscore[g2]);
                rank += (k2 > kg || (k2 == kg && g2 < gi)) ? 1 : 0;
            }
            gkeep[gi] = rank < topk_group ? 1 : 0;
        }
        __syncthreads();
        for (int e = tid; e < E; e += nt) key[e] = gkeep[e / per] != 0 ? route_key(ch[e], e) : 0ull;
        __syncthreads();
    }
    if (tid >= 32) return;
    // KR > 0: lane L holds the keys of experts L + 32i (i < KR, E <= 32 KR) in registers; else in shared memory
    unsigned long long kr[KR > 0 ? KR : 1];
    if (KR > 0) {
#pragma unroll
        for (int i = 0; i < (KR > 0 ? KR : 1); ++i) kr[i] = tid + 32 * i < E ? key[tid + 32 * i] : 0ull;
    }
    auto local_best = [&]() {
        unsigned long long b = 0ull;
        if (KR > 0) {
#pragma unroll
            for (int i = 0; i < (KR > 0 ? KR : 1); ++i) b = kr[i] > b ? kr[i] : b;
        } else {
            for (int e = tid; e < E; e += 32) b = key[e] > b ? key[e] : b;
        }
        return b;
    };
    unsigned long long mine = local_best();
    int nwin = 0;
    for (int r = 0; r < k; ++r) {
        const unsigned long long best = warp_max_u64(mine);
        if (best == 0ull) break;  // fewer than k candidates (uniform over the warp)
        const int e = static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(best & 0xFFFFFFFFull));
        if (tid == 0) wins[r] = e;
        if (mine == best) {  // the owner (keys are distinct)
            if (KR > 0) {
#pragma unroll
                for (int i = 0; i < (KR > 0 ? KR : 1); ++i) kr[i] = kr[i] == best ? 0ull : kr[i];
            } else {
                key[e] = 0ull;
            }
            mine = local_best();
        }
        ++nwin;
    }
    __syncwarp();
    for (int j = tid; j < nwin; j += 32) {
        const int e = wins[j];
        int rank = 0;
        for (int i = 0; i < nwin; ++i) rank += wins[i] < e ? 1 : 0;
        sel[static_cast<int64_t>(t) * k + rank] = e;
    }
}

// moe.weights of row t: w_j = s[sel_j] [/ (csum + 1e-20f)] * rsf.
GLM_DEV void moe_weights_row(const float* __restrict__ scores, const int* __restrict__ sel, int t, int E, int k,
                             bool norm, float rsf, float* wts, const Nm& nm) {
    float* w = wts + static_cast<int64_t>(t) * k;
    for (int j = 0; j < k; ++j) w[j] = scores[static_cast<int64_t>(t) * E + sel[static_cast<int64_t>(t) * k + j]];
    if (norm) {
        const float den = fadd(cdot_serial<float>(k, nm.seq,
                                                  [&](int j, float& a, float& b) {
                                                      a = w[j];
                                                      b = 1.0f;
                                                  }),
                               1e-20f);
        for (int j = 0; j < k; ++j) w[j] = fdiv(w[j], den);
    }
    for (int j = 0; j < k; ++j) w[j] = fmul(w[j], rsf);
}

// The expert work list (one block of kPlanThreads): pairs p = t*k + j grouped by expert (ascending,
// ascending p within an expert), then items of at most `tile` pairs: (expert, first pair, count), in
// expert order. Counts by shared-memory atomics (order-free), an exclusive scan of (pairs, items) per
// expert (warp scans by shuffles, then the warp totals), each expert's items written by its thread;
// the scatter by warp 0 over the pairs in increasing order, 32 at a time (rank among the equal experts
// of lower lanes, then the cursor advanced by the last of them), so the result is the one-thread one.
// nshared > 0: pairs nrouted .. nrouted + nshared - 1 (one per row) are the shared expert's, entry E0
// of the tables: its items come last and run in the same launches as the routed ones. The T rows'
// moe.weights (thread t % kPlanThreads, each row whole) are made here too: one launch fewer, and they
// read the same selection (after moe.selected's injection).
constexpr int kPlanThreads = 1024;
struct WeightArgs {
    const float* scores;
    int T, k;
    bool norm;
    float rsf;
    float* wts;
};
// Big items (big_min > 0; weights.cuh, big_item_pairs): each expert's whole bigs of pairs, and its
// remainder when that holds at least big_min pairs, are items of `big` pairs in items_b (n_b of them); what
// remains, items of `tile` in items. An expert's pairs stay contiguous: its big items first.
__global__ void __launch_bounds__(kPlanThreads) k_moe_plan(const int* __restrict__ sel, int nrouted, int nshared,
                                                           int E0, int own_lo, int own_hi, int tile, int* pairs,
                                                           int* items, int* n_items, int big, int big_min,
                                                           int* items_b, int* n_b, WeightArgs wa, Nm nm) {
    pdl_enter();
    GLM_DYN_SMEM(int, cnt);  // [E]: count, then the fill cursor
    __shared__ int wc[32], wi[32], wb[32];
    const int tid = static_cast<int>(threadIdx.x), nt = static_cast<int>(blockDim.x);
    const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
    for (int t = tid; t < wa.T; t += nt) moe_weights_row(wa.scores, sel, t, E0, wa.k, wa.norm, wa.rsf, wa.wts, nm);
    const int E = nshared > 0 ? E0 + 1 : E0, npairs = nrouted + nshared;
    // (expert parallelism: routed pairs of experts outside [own_lo, own_hi) are another rank's: -1)
    auto expert_of = [&](int p) {
        const int e = p < nrouted ? sel[p] : E0;
        return p < nrouted && (e < own_lo || e >= own_hi) ? -1 : e;
    };
    for (int e = tid; e < E; e += nt) cnt[e] = 0;
    __syncthreads();
    for (int p = tid; p < npairs; p += nt) {
        const int e = expert_of(p);
        if (e >= 0) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    int carry_c = 0, carry_i = 0, carry_b = 0;
    for (int base = 0; base < E; base += nt) {
        const int e = base + tid;
        const int c = e < E ? cnt[e] : 0;
        const int cb = big_min > 0 ? big_item_pairs(c, big, big_min) : 0;  // pairs in big items
        const int ni = (c - cb + tile - 1) / tile, nb = big_min > 0 ? (cb + big - 1) / big : 0;
        int ic = c, ii = ni, ib = nb;  // inclusive scans over the warp
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int yc = __shfl_sync(kFull, ic, lane >= o ? lane - o : lane);
            const int yi = __shfl_sync(kFull, ii, lane >= o ? lane - o : lane);
            const int yb = __shfl_sync(kFull, ib, lane >= o ? lane - o : lane);
            if (lane >= o) {
                ic += yc;
                ii += yi;
                ib += yb;
            }
        }
        if (lane == 31) {
            wc[warp] = ic;
            wi[warp] = ii;
            wb[warp] = ib;
        }
        __syncthreads();
        int pc = carry_c, pi = carry_i, pb = carry_b;
        for (int w = 0; w < nw; ++w) {
            if (w < warp) {
                pc += wc[w];
                pi += wi[w];
                pb += wb[w];
            }
            carry_c += wc[w];
            carry_i += wi[w];
            carry_b += wb[w];
        }
        if (e < E) {
            const int off = pc + ic - c;
            int it = pb + ib - nb;
            for (int a = 0; a < cb; a += big, ++it) {
                items_b[3 * it] = e;
                items_b[3 * it + 1] = off + a;
                items_b[3 * it + 2] = cb - a < big ? cb - a : big;
            }
            it = pi + ii - ni;
            for (int a = cb; a < c; a += tile, ++it) {
                items[3 * it] = e;
                items[3 * it + 1] = off + a;
                items[3 * it + 2] = c - a < tile ? c - a : tile;
            }
            cnt[e] = off;
        }
        __syncthreads();  // wc/wi/wb reused; cursors visible to warp 0
    }
    if (tid == 0) {
        *n_items = carry_i;
        if (big_min > 0) *n_b = carry_b;
    }
    if (warp != 0) return;
    for (int base = 0; base < npairs; base += 32) {
        const int p = base + lane;
        const int e = p < npairs ? expert_of(p) : -1;
        // (the lanes of the same expert in one match: r of them before this lane, none after it for the last;
        // with 32 shuffles a window instead the launch took 241 us at 2048 tokens of the slice, with it 187)
        const unsigned same = __match_any_sync(kFull, static_cast<unsigned>(e));
        const int r = __popc(same & ((1u << lane) - 1u));
        const bool last = (same >> lane) == 1u;
        const int cur = e >= 0 ? cnt[e] : 0;
        __syncwarp();
        if (e >= 0) {
            pairs[cur + r] = p;
            if (last) cnt[e] = cur + r + 1;
        }
        __syncwarp();
    }
}

// moe.routed; with `shared` given, moe.out = bf16(routed + shared) made from it in the same thread
// (when nothing observes routed: one launch fewer).
__global__ void k_moe_routed(const float* __restrict__ ys, const float* __restrict__ wts, int T, int k, int D,
                             const float* __restrict__ shared, float* out, Nm nm) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= static_cast<int64_t>(T) * D) return;
    const int64_t t = i / D, d = i % D;
    const float routed = bf16r(cdot_serial<float>(k, nm.seq, [&](int j, float& a, float& b) {
        a = ys[(t * k + j) * D + d];
        b = wts[t * k + j];
    }));
    out[i] = shared ? bf16r(fadd(routed, shared[i])) : routed;
}

__global__ void k_add_bf16(const float* __restrict__ a, const float* __restrict__ b, float* out, int64_t n) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) out[i] = bf16r(fadd(a[i], b[i]));
}

// ---- expert parallelism (docs/ep.md): the rows of other ranks' experts ---------------------------
//
// Wire format (no host synchronization, so no data-dependent sizes): every rank sends all T*k routed
// slots as BF16 bits, [T*k][D] uint16, its own slots filled and the others zero; the hook gathers
// [ranks][T*k][D]; slot i then takes its row from the rank that owns expert sel[i]. The values are
// BF16 already (each y_e is rounded by its linear): the bits move, nothing is computed on them.
struct EpBounds {
    int ranks, rank;
    int b[kMaxRanks + 1];
};
GLM_DEV int ep_owner(const EpBounds& eb, int e) {
    int o = 0;
    for (int r = 1; r < eb.ranks; ++r)
        if (e >= eb.b[r]) o = r;
    return o;
}
__global__ void k_ep_pack(const float* __restrict__ ys, const int* __restrict__ sel, int64_t slots, int D,
                          EpBounds eb, uint16_t* send) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= slots * D) return;
    const bool mine = ep_owner(eb, sel[i / D]) == eb.rank;
    send[i] = mine ? static_cast<uint16_t>(f32_bits(ys[i]) >> 16) : uint16_t{0};
}
// Every slot another rank owns takes that rank's row; the own rows are checked to have come back
// unchanged (*bad set otherwise: the transport altered them).
__global__ void k_ep_unpack(const uint16_t* __restrict__ recv, const uint16_t* __restrict__ send,
                            const int* __restrict__ sel, int64_t slots, int D, EpBounds eb, float* ys, int* bad) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= slots * D) return;
    const int o = ep_owner(eb, sel[i / D]);
    const uint16_t v = recv[static_cast<int64_t>(o) * slots * D + i];
    if (o != eb.rank) ys[i] = f32_from_bits(static_cast<uint32_t>(v) << 16);
    else if (v != send[i]) *bad = 1;
}

}  // namespace

void swiglu(Step& s, const Lin& gate, const Lin& up, const Lin& down, const float* x, int rows, float* y,
            int cap_layer, const Lin& gate_up) {
    const int I = static_cast<int>(gate.R), D = static_cast<int>(down.R), Din = static_cast<int>(gate.C);
    const float L = static_cast<float>(s.c.swiglu_limit);
    float* g;
    float* u;
    if (rows == 1 && s.T == 1 && !gate_up.empty()) {  // one launch for both (the same rows, the same dots)
        float* o[2];
        linear_same_x(s, gate_up, {&gate, &up}, x, Din, o);
        g = o[0];
        u = o[1];
    } else {
        g = s.scratch.d<float>(static_cast<size_t>(rows) * I);
        u = s.scratch.d<float>(static_cast<size_t>(rows) * I);
        linear(gate, x, Din, g, I, rows, true, s.nm, s.hw8);
        linear(up, x, Din, u, I, rows, true, s.nm, s.hw8);
    }
    if (cap_layer >= 0) {  // the dense MLP's stages (the experts' are not stages)
        s.emit(cap_layer, S_MLP_GATE, g, I, {I});
        s.emit(cap_layer, S_MLP_UP, u, I, {I});
    }
    const int64_t n = static_cast<int64_t>(rows) * I;
    auto k = k_swiglu_act;
    GLM_LAUNCH(k, blocks(n, 256), 256, 0, g, u, g, n, L, s.nm);
    check_launch("swiglu");
    linear(down, g, I, y, D, rows, true, s.nm, s.hw8);
}

namespace {
// ys [T*k][D] (routed slots; this rank's experts computed): the other ranks' rows brought in.
void ep_exchange(Step& s, int layer, const int* sel, int64_t slots, float* ys) {
    EngineCore::Ep& ep = s.E.ep;
    const ExpertPartition& P = ep.part;
    if (!ep.hook || !*ep.hook) throw std::runtime_error("expert parallelism: no exchange hook is set");
    const int D = static_cast<int>(s.c.hidden_size);
    EpBounds eb{P.ranks, P.rank, {}};
    for (int r = 0; r <= P.ranks; ++r) eb.b[r] = static_cast<int>(P.bounds[static_cast<size_t>(r)]);
    const int64_t n = slots * D;
    uint16_t* send = s.scratch.d<uint16_t>(static_cast<size_t>(n));
    uint16_t* recv = s.scratch.d<uint16_t>(static_cast<size_t>(n) * static_cast<size_t>(P.ranks));
    int* bad = s.E.ep_flag();
    {
        auto kk = k_ep_pack;
        GLM_LAUNCH(kk, blocks(n, 256), 256, 0, ys, sel, slots, D, eb, send);
        check_launch("ep_pack");
    }
    const auto t0 = std::chrono::steady_clock::now();
    (*ep.hook)(layer, reinterpret_cast<uintptr_t>(send), reinterpret_cast<uintptr_t>(recv), static_cast<size_t>(slots),
               static_cast<size_t>(D));
    ep.stats.hook_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ep.stats.exchanges += 1;
    ep.stats.rows_sent += static_cast<uint64_t>(slots);
    ep.stats.bytes_sent += static_cast<uint64_t>(n) * sizeof(uint16_t);
    {
        auto kk = k_ep_unpack;
        GLM_LAUNCH(kk, blocks(n, 256), 256, 0, recv, send, sel, slots, D, eb, ys, bad);
        check_launch("ep_unpack");
    }
}
}  // namespace

void moe_forward(Step& s, int layer, const FfnW& w, const float* x, float* out) {
    const Config& c = s.c;
    const Nm nm = s.nm;
    const int T = s.T, D = static_cast<int>(c.hidden_size), E = static_cast<int>(c.n_routed_experts);
    const int k = static_cast<int>(c.num_experts_per_tok), G = static_cast<int>(c.n_group);
    const int Im = static_cast<int>(c.moe_intermediate_size);

    s.mark("moe.router");
    // moe.logits (f32, no rounding)
    float* logits = s.scratch.d<float>(static_cast<size_t>(T) * E);
    linear(w.router, x, D, logits, E, T, false, nm, s.hw8);
    s.emit(layer, S_MOE_LOGITS, logits, E, {E});
    // moe.selected
    float* scores = s.scratch.d<float>(static_cast<size_t>(T) * E);
    int* sel = s.scratch.d<int>(static_cast<size_t>(T) * k);
    {
        auto kk = E <= 32 * 4 ? k_moe_route<4> : (E <= 32 * 16 ? k_moe_route<16> : k_moe_route<0>);
        const size_t okey = (static_cast<size_t>(E) + 2 * static_cast<size_t>(G) + static_cast<size_t>(k) + 1) & ~size_t(1);
        const size_t smem = (okey + 2 * static_cast<size_t>(E)) * 4;  // layout: k_moe_route
        GLM_LAUNCH(kk, T, 256, smem, logits, w.bias, E, k, G, static_cast<int>(c.topk_group), scores, sel, nm);
        check_launch("moe_route");
    }
    s.emit(layer, S_MOE_SELECTED, sel, k, {k});
    for (int t = 0; t < T; ++t) {
        if (s.inject_element(layer, S_MOE_SELECTED, t) < 0) continue;  // only an injection can leave the range
        std::vector<int> row(static_cast<size_t>(k));
        check(cudaMemcpy(row.data(), sel + static_cast<int64_t>(t) * k, row.size() * sizeof(int), cudaMemcpyDeviceToHost),
              "moe.selected read-back");
        for (int e : row)
            if (e < 0 || e >= E)
                throw std::invalid_argument("inject: moe.selected now holds expert " + std::to_string(e) +
                                            ", outside [0, " + std::to_string(E) + ")");
    }
    // moe.experts: each selected expert's weights once for all the pairs that chose it; with the shared
    // expert in the tables, T more pairs (rows T*k + t of the buffers) for it, in the same launches
    s.mark("moe.experts");
    const int npairs = T * k, nsh = w.shared_in_tables ? T : 0, nall = npairs + nsh;
    float* gbuf = s.scratch.d<float>(static_cast<size_t>(nall) * Im);
    float* ubuf = s.scratch.d<float>(static_cast<size_t>(nall) * Im);
    float* ys = s.scratch.d<float>(static_cast<size_t>(nall) * D);
    // Pairs per work item: weights.cuh's expert_tile (16 where the register-tiled kernel takes the gate,
    // up and down tables). The option expert_tile=1/4/8/16 forces the tile of batches (a benchmark's knob;
    // every tile gives the same bits; 16 falls back to 8 where that kernel does not apply).
    // (asked only where 16 can be the tile or items of 16 can join items of 8: not in one-token steps)
    const bool take16 = T > 1 && w.t_gate.data && experts_take_gemm(w.t_gate, x, D) && experts_take_gemm(w.t_up, x, D) &&
                        experts_take_gemm(w.t_down, gbuf, Im);
    const bool gemm16 = take16 && (experts_may_take16(T, k, E) || (T > 1 && s.E.opts.expert_tile == 16));
    // every item of 64 through the lane-pass kernel (its x rows in lane order) only when the option asks for
    // it: measured slower end to end than items of 16 (docs/perf.md, "Session 15"); else 16 where it does
    // not apply (the engine's rule takes items of 64 beside items of 16: lane items, below)
    const bool lanes_apply = w.t_gate.data && experts_take_lanes(w.t_gate, x, D) && experts_take_lanes(w.t_up, x, D) &&
                             experts_take_lanes(w.t_down, gbuf, Im);
    const bool lanes64 = T > 1 && s.E.opts.expert_tile == kLanesItem && lanes_apply;
    int tile = expert_tile(T, k, E, gemm16);
    const bool rule = T > 1 && s.E.opts.expert_tile == 0;  // (a forced tile takes every item)
    if (T > 1 && s.E.opts.expert_tile > 0)
        tile = lanes64 ? kLanesItem : (s.E.opts.expert_tile >= 16 ? (gemm16 ? 16 : 8) : s.E.opts.expert_tile);
    const bool lanes = tile == kLanesItem;
    // Big items beside the rule's tile (weights.cuh, big_item_pairs; the option: the smallest remainder that
    // takes one): lane items of 64 beside items of 16 (lanes_items), items of 16 beside items of 8 (items16)
    int big = 0, big_min = 0;
    if (rule && tile == 16 && s.E.opts.lanes_items > 0 && lanes_apply) big = kLanesItem, big_min = s.E.opts.lanes_items;
    const bool pairs8 = tile == 8 && w.t_gate.data &&
                        (experts_take_pairs(w.t_gate, x, D, nall) || experts_take_pairs(w.t_up, x, D, nall) ||
                         experts_take_pairs(w.t_down, gbuf, Im, nall));  // (items of 8 through the few-pair kernel)
    if (rule && tile == 8 && s.E.opts.items16 > 0 && take16 && !pairs8) big = 16, big_min = s.E.opts.items16;
    int* pairs = s.scratch.d<int>(static_cast<size_t>(nall));
    int* items = s.scratch.d<int>(static_cast<size_t>(nall) * 3);
    int* n_items = s.scratch.d<int>(1);
    int* items_b = big_min > 0 ? s.scratch.d<int>(static_cast<size_t>(nall) * 3) : nullptr;
    int* n_b = big_min > 0 ? s.scratch.d<int>(1) : nullptr;
    // moe.weights (made by the plan)
    float* wts = s.scratch.d<float>(static_cast<size_t>(T) * k);
    {
        const WeightArgs wa{scores, T, k, c.norm_topk_prob, static_cast<float>(c.routed_scaling_factor), wts};
        auto kk = k_moe_plan;
        const ExpertPartition& P = s.E.ep.part;  // (expert parallelism: only this rank's experts' pairs)
        const int lo = P.bounds.empty() ? 0 : static_cast<int>(P.bounds[static_cast<size_t>(P.rank)]);
        const int hi = P.bounds.empty() ? E : static_cast<int>(P.bounds[static_cast<size_t>(P.rank) + 1]);
        GLM_LAUNCH(kk, 1, kPlanThreads, static_cast<size_t>(E + 1) * 4, sel, npairs, nsh, E, lo, hi, tile, pairs,
                   items, n_items, big, big_min, items_b, n_b, wa, nm);
        check_launch("moe_plan");
    }
    s.emit(layer, S_MOE_WEIGHTS, wts, k, {k});
    if (w.t_gate.data) {  // (a rank of expert parallelism may hold no expert of the layer)
        // gate and up read the same x rows for the same work list (one launch when their tables match);
        // big items (at most one partly filled an expert: max_b) and the small ones read the same rows
        const int max_b = std::min(nall, nall / (big_min > 0 ? big : kLanesItem) + E + 1);  // (the shared expert: entry E)
        const int max_l = std::min(nall, nall / kLanesItem + E + 1);  // (every item of 64: likewise)
        if (big_min > 0)
            linear_experts2(w.t_gate, w.t_up, items_b, n_b, max_b, pairs, x, D, k, npairs, gbuf, ubuf, Im, big, nm, s.hw8);
        linear_experts2(w.t_gate, w.t_up, items, n_items, lanes ? max_l : nall, pairs, x, D, k, npairs, gbuf, ubuf, Im, tile, nm,
                        s.hw8);
        {
            const int64_t n = static_cast<int64_t>(nall) * Im;
            auto kk = k_swiglu_act;
            GLM_LAUNCH(kk, blocks(n, 256), 256, 0, gbuf, ubuf, gbuf, n, static_cast<float>(c.swiglu_limit), nm);
            check_launch("moe_act");
        }
        if (big_min > 0) linear_experts(w.t_down, items_b, n_b, max_b, pairs, gbuf, Im, 1, nall, ys, D, big, nm, s.hw8);
        linear_experts(w.t_down, items, n_items, lanes ? max_l : nall, pairs, gbuf, Im, 1, nall, ys, D, tile, nm, s.hw8);  // h row p
    }
    if (s.E.ep.part.distributed()) ep_exchange(s, layer, sel, npairs, ys);  // the other ranks' experts' rows
    s.emit(layer, S_MOE_EXPERTS, ys, static_cast<int64_t>(k) * D, {k, D});

    s.mark("moe.combine");
    const int64_t n = static_cast<int64_t>(T) * D;
    // moe.routed[d] = bf16(cdot over j of (y_j[d], w_j)); made with moe.out below when nothing observes it
    const bool apart = s.wants_any(layer, S_MOE_ROUTED) || s.injects(layer, S_MOE_ROUTED);
    float* routed = nullptr;
    if (apart) {
        routed = s.scratch.d<float>(static_cast<size_t>(T) * D);
        auto kk = k_moe_routed;
        GLM_LAUNCH(kk, blocks(n, 256), 256, 0, ys, wts, T, k, D, nullptr, routed, nm);
        check_launch("moe_routed");
        s.emit(layer, S_MOE_ROUTED, routed, D, {D});
    }
    // moe.shared (emitted in place: moe.out reads the emitted rows, injection included)
    float* shared = ys + static_cast<int64_t>(npairs) * D;
    if (!w.shared_in_tables) {
        s.mark("moe.shared");
        shared = s.scratch.d<float>(static_cast<size_t>(T) * D);
        swiglu(s, w.s_gate, w.s_up, w.s_down, x, T, shared, -1, w.s_gu);
    }
    s.emit(layer, S_MOE_SHARED, shared, D, {D});
    // moe.out = bf16(routed + shared)
    if (apart) {
        auto kk = k_add_bf16;
        GLM_LAUNCH(kk, blocks(n, 256), 256, 0, routed, shared, out, n);
        check_launch("moe_out");
    } else {
        auto kk = k_moe_routed;
        GLM_LAUNCH(kk, blocks(n, 256), 256, 0, ys, wts, T, k, D, shared, out, nm);
        check_launch("moe_out");
    }
    s.emit(layer, S_MOE_OUT, out, D, {D});
}

}  // namespace glm::cuda
