// KDA: Kimi delta attention (docs/numerics.md, KDA). Stages kda.q_proj|k_proj|v_proj, kda.q|k|v,
// kda.g, kda.beta, kda.state, kda.o, kda.gate, kda.o_norm, kda.out.
//
// Per token: projections -> causal depthwise conv (cdot over the K taps, +0 before position 0) + SiLU
// -> per-head l2 norms -> the delta rule on the f32 state -> gated RMSNorm -> o_proj. The recurrence
// kernel gives each column j of each head's state to one group of eight threads, which holds the
// column in registers (thread g: rows i = 64c + 8g + l) through all the segment's tokens in position
// order, so a prefill chunk is the same per-token computation as decode, and the state stays on the
// GPU between steps (stored transposed, S[h][j][i], column contiguous).
#include "engine.cuh"
#include "../inject_step.hpp"

namespace glm::cuda {
namespace {

// A segment's pre-conv history of channel ch: hist[j] = j < K-1 ? tail[j] : qkv[t0 + j - (K-1)] (the K-1
// cached pre-conv rows, then the segment's rows); row i's window is hist[i .. i+K).
GLM_DEV float conv_hist(const SegDev& sg, const float* __restrict__ qkv, int C3, int K, int ch, int j) {
    return j < K - 1 ? sg.conv[static_cast<int64_t>(j) * C3 + ch]
                     : qkv[static_cast<int64_t>(sg.t0 + j - (K - 1)) * C3 + ch];
}

// conv: one thread per (row, channel).
__global__ void k_kda_conv(const float* __restrict__ qkv, int T, int C3, int K, const float* __restrict__ taps,
                           const SegDev* __restrict__ segs, const int* __restrict__ seg_of, float* act, Nm nm) {
    pdl_enter();
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<int64_t>(T) * C3) return;
    const int t = static_cast<int>(idx / C3), ch = static_cast<int>(idx % C3);
    const SegDev& sg = segs[seg_of[t]];
    const int i = t - sg.t0;  // row within the segment
    const float* w = taps + static_cast<int64_t>(ch) * K;
    const float c = cdot_serial<float>(K, nm.seq, [&](int k, float& a, float& b) {
        a = w[k];
        b = conv_hist(sg, qkv, C3, K, ch, i + k);
    });
    act[idx] = bf16r(nm.silu(c));
}

// The same for K taps known to the compiler, a thread per channel and TT consecutive rows: the taps loaded
// once, each row's window slid by one value from the row before it (same segment), no 64-bit division per
// output. Every output as k_kda_conv makes it (the same cdot_serial over the same values). A 2048-token
// prefill of the slice: k_kda_conv 0.72 ms (an output's four window loads, its taps and segment, and idx / C3
// in 64 bits), this kernel 0.25 ms.
template <int K, int TT>
__global__ void k_kda_conv_rows(const float* __restrict__ qkv, int T, int C3, const float* __restrict__ taps,
                                const SegDev* __restrict__ segs, const int* __restrict__ seg_of, float* act, Nm nm) {
    pdl_enter();
    const int ch = static_cast<int>(blockIdx.x) * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
    if (ch >= C3) return;
    const int t0 = static_cast<int>(blockIdx.y) * TT;
    float w[K], win[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        w[k] = taps[static_cast<int64_t>(ch) * K + k];
        win[k] = 0.0f;
    }
    int cur = -1, last = 0;  // the segment and row of the window held
#pragma unroll 1
    for (int u = 0; u < TT && t0 + u < T; ++u) {
        const int t = t0 + u, sgi = seg_of[t];
        const SegDev& sg = segs[sgi];
        const int i = t - sg.t0;  // row within the segment
        if (sgi == cur && i == last + 1) {
#pragma unroll
            for (int k = 0; k + 1 < K; ++k) win[k] = win[k + 1];
            win[K - 1] = conv_hist(sg, qkv, C3, K, ch, i + K - 1);
        } else {
#pragma unroll
            for (int k = 0; k < K; ++k) win[k] = conv_hist(sg, qkv, C3, K, ch, i + k);
        }
        cur = sgi;
        last = i;
        const float c = cdot_serial<float>(K, nm.seq, [&](int k, float& a, float& b) {
            a = w[k];
            b = win[k];
        });
        act[static_cast<int64_t>(t) * C3 + ch] = bf16r(nm.silu(c));
    }
}
constexpr int kConvRows = 8;

// The conv cache keeps the last K-1 pre-conv rows (after the conv kernel read the old ones).
__global__ void k_kda_conv_tail(const float* __restrict__ qkv, int nseg, int C3, int K, const SegDev* segs) {
    pdl_enter();
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<int64_t>(nseg) * C3) return;
    const int sgi = static_cast<int>(idx / C3), ch = static_cast<int>(idx % C3);
    const SegDev& sg = segs[sgi];
    const int keep = K - 1, n = sg.n;
    // new tail[k] = hist[n + k], increasing k reads only entries not yet overwritten
    for (int k = 0; k < keep; ++k) sg.conv[static_cast<int64_t>(k) * C3 + ch] = conv_hist(sg, qkv, C3, K, ch, n + k);
}

__global__ void k_kda_gate(float* g, int T, int P, int d, const float* __restrict__ decay,
                           const float* __restrict__ dt_bias, float lb, Nm nm) {
    pdl_enter();
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<int64_t>(T) * P) return;
    const int ch = static_cast<int>(idx % P);
    g[idx] = fmul(lb, nm.sigmoid(fmul(decay[ch / d], fadd(g[idx], dt_bias[ch]))));
}

__global__ void k_sigmoid(float* x, int64_t n, Nm nm) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) x[i] = nm.sigmoid(x[i]);
}

// Per (row, head), one warp: the l2 norms (lanes 0-7 as one group), then qs, kn, eg elementwise.
__global__ void k_kda_prep(const float* __restrict__ act, const float* __restrict__ g, int T, int H, int d,
                           float qscale, float* qs, float* kn, float* eg, Nm nm) {
    pdl_enter();
    const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = static_cast<int>(threadIdx.x & 31);
    const bool live = warp < T * H;
    const int item = live ? warp : 0;
    const int t = item / H, h = item % H;
    const int P = H * d;
    const float* q = act + static_cast<int64_t>(t) * 3 * P + static_cast<int64_t>(h) * d;
    const float* k = q + P;
    const int n = (live && lane < 8) ? d : 0;
    const float sq = group_dot<float>(n, nm.seq, [&](int i, float& a, float& b) {
        a = q[i];
        b = q[i];
    });
    const float sk = group_dot<float>(n, nm.seq, [&](int i, float& a, float& b) {
        a = k[i];
        b = k[i];
    });
    const float nq = fsqrt(fadd(__shfl_sync(kFull, sq, 0), 1e-6f));
    const float nk = fsqrt(fadd(__shfl_sync(kFull, sk, 0), 1e-6f));
    if (!live) return;
    const int64_t o = static_cast<int64_t>(t) * P + static_cast<int64_t>(h) * d;
    for (int e = lane; e < d; e += 32) {
        qs[o + e] = fmul(fdiv(q[e], nq), qscale);
        kn[o + e] = fdiv(k[e], nk);
        eg[o + e] = nm.exp(g[o + e]);
    }
}

// The recurrence. Group (seg, h, j) over the segment's tokens:
//   S[:, j] *= eg; pred = cdot(kn, S[:, j]); u = (v_j - pred) * beta; S[i][j] = fma(kn_i, u, S[i][j]);
//   o_j = cdot(qs, S[:, j]).
// dot="sequential": sum over i of a[i] * S[i][j] left to right, the running sum passed from thread to
// thread of the group (thread g holds rows 64c + 8g .. +7 of the column). Every lane calls it.
template <int NC>
GLM_DEV float seq_column_dot(const float* a, const float (&S)[NC][8], int g, int d, bool act) {
    float sacc = 0.0f;
    for (int c = 0; c < NC; ++c)
        for (int gg = 0; gg < 8; ++gg) {
            if (g == gg)
                for (int l = 0; l < 8; ++l) {
                    const int i = 64 * c + 8 * gg + l;
                    if (act && i < d) sacc = fadd(sacc, fmul(a[i], S[c][l]));
                }
            sacc = __shfl_sync(kFull, sacc, gg, 8);
        }
    return sacc;
}

template <int NC>
__global__ void __launch_bounds__(256) k_kda_rec(const float* __restrict__ qs, const float* __restrict__ kn,
                                                 const float* __restrict__ eg, const float* __restrict__ act,
                                                 const float* __restrict__ beta, const SegDev* __restrict__ segs,
                                                 int nseg, int H, int d, float* o, float* cap, int inj_t,
                                                 int64_t inj_el, int64_t inj_ulps, Nm nm) {
    pdl_enter();
    const int g = lane8();
    const int grp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 3);
    const int total = nseg * H * d;
    const bool live = grp < total;
    const int item = live ? grp : 0;
    const int sgi = item / (H * d), h = (item / d) % H, j = item % d;
    const SegDev& sg = segs[sgi];
    const int P = H * d;
    float* col = sg.S + (static_cast<int64_t>(h) * d + j) * d;
    // Elements 64c + 8g .. + 7 of a d-vector (a column of S, a row of kn, qs or eg), 0 past d: two 16-byte
    // loads where d is whole chunks (every such vector then starts 16-byte aligned), else one at a time.
    // (They had been 48 scalar loads a thread a token; with these, H200, slice FP8: 0.92 -> 0.83 ms a b128
    // step, 5.4 -> 3.9 ms a 2048-token prefill.)
    const bool whole = d % 64 == 0;
    auto rows8 = [&](const float* p, int c, float (&v)[8]) {
        const int i0 = 64 * c + 8 * g;
        if (whole) {
            const float4 a = *reinterpret_cast<const float4*>(p + i0), b = *reinterpret_cast<const float4*>(p + i0 + 4);
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        } else {
#pragma unroll
            for (int l = 0; l < 8; ++l) v[l] = i0 + l < d ? p[i0 + l] : 0.0f;
        }
    };
    float S[NC][8];
#pragma unroll
    for (int c = 0; c < NC; ++c) rows8(col, c, S[c]);
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int l = 0; l < 8; ++l) S[c][l] = live ? S[c][l] : 0.0f;
    const int ntok = live ? sg.n : 0;
    const int nmax = warp_max_int(ntok);
    for (int tt = 0; tt < nmax; ++tt) {
        const bool act_t = tt < ntok;
        const int t = sg.t0 + (act_t ? tt : 0);
        const int64_t rowo = static_cast<int64_t>(t) * P + static_cast<int64_t>(h) * d;
        const float* kr = kn + rowo;
        const float* qr = qs + rowo;
        const float* er = eg + rowo;
        float acc[8], kv[NC][8], ev[NC][8], qv[NC][8];
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            rows8(kr, c, kv[c]);
            rows8(er, c, ev[c]);
            rows8(qr, c, qv[c]);
        }
        zero8(acc);
        // S[i][j] *= expf(g_i); pred = cdot(kn, S[:, j])
#pragma unroll
        for (int c = 0; c < NC; ++c)
#pragma unroll
            for (int l = 0; l < 8; ++l) {
                const int i = 64 * c + 8 * g + l;
                if (act_t && i < d) {
                    S[c][l] = fmul(S[c][l], ev[c][l]);
                    if (!nm.seq) acc[l] = ffma(kv[c][l], S[c][l], acc[l]);
                }
            }
        const float pred = nm.seq ? seq_column_dot<NC>(kr, S, g, d, act_t) : group_fold(acc);
        const float vj = act_t ? act[static_cast<int64_t>(t) * 3 * P + 2 * P + static_cast<int64_t>(h) * d + j] : 0.0f;
        const float bt = act_t ? beta[static_cast<int64_t>(t) * H + h] : 0.0f;
        const float u = fmul(fsub(vj, pred), bt);
        zero8(acc);
#pragma unroll
        for (int c = 0; c < NC; ++c)
#pragma unroll
            for (int l = 0; l < 8; ++l) {
                const int i = 64 * c + 8 * g + l;
                if (act_t && i < d) {
                    S[c][l] = ffma(kv[c][l], u, S[c][l]);
                    if (!nm.seq) acc[l] = ffma(qv[c][l], S[c][l], acc[l]);
                }
            }
        const float oj = nm.seq ? seq_column_dot<NC>(qr, S, g, d, act_t) : group_fold(acc);
        if (act_t && g == 0) o[rowo + j] = oj;
        // kda.state, as the oracle: injected after o (it shows from the next token on), then captured
        if (act_t && t == inj_t && inj_el / (static_cast<int64_t>(d) * d) == h) {
            const int64_t rr = inj_el % (static_cast<int64_t>(d) * d);
            const int ii = static_cast<int>(rr / d), jj = static_cast<int>(rr % d);
            if (jj == j) {
#pragma unroll
                for (int c = 0; c < NC; ++c)
#pragma unroll
                    for (int l = 0; l < 8; ++l)
                        if (64 * c + 8 * g + l == ii)
                            S[c][l] = f32_from_bits(inject_step_f32(f32_bits(S[c][l]), inj_ulps));
            }
        }
        if (act_t && cap != nullptr) {
            float* dst = cap + (static_cast<int64_t>(t) * H + h) * d * d;
#pragma unroll
            for (int c = 0; c < NC; ++c)
#pragma unroll
                for (int l = 0; l < 8; ++l) {
                    const int i = 64 * c + 8 * g + l;
                    if (i < d) dst[static_cast<int64_t>(i) * d + j] = S[c][l];
                }
        }
    }
    // The state back as it was read: two 16-byte stores where d is whole chunks (scalar stores, eight
    // threads 32 bytes apart, had each store of a warp touch 32 sectors for 4 bytes of each).
    if (live) {
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int i0 = 64 * c + 8 * g;
            if (whole) {
                *reinterpret_cast<float4*>(col + i0) = make_float4(S[c][0], S[c][1], S[c][2], S[c][3]);
                *reinterpret_cast<float4*>(col + i0 + 4) = make_float4(S[c][4], S[c][5], S[c][6], S[c][7]);
            } else {
#pragma unroll
                for (int l = 0; l < 8; ++l)
                    if (i0 + l < d) col[i0 + l] = S[c][l];
            }
        }
    }
}

// kda.o_norm per (row, head), one warp: inv = 1/sqrtf(cdot(o,o)/d + eps), y = bf16(((o*inv)*w)*sigmoid(gate)).
__global__ void k_kda_onorm(const float* __restrict__ o, const float* __restrict__ gate, int T, int H, int d,
                            const float* __restrict__ w, float eps, float* y, Nm nm) {
    pdl_enter();
    const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = static_cast<int>(threadIdx.x & 31);
    const bool live = warp < T * H;
    const int item = live ? warp : 0;
    const int64_t off = static_cast<int64_t>(item / H) * H * d + static_cast<int64_t>(item % H) * d;
    const float* oh = o + off;
    const int n = (live && lane < 8) ? d : 0;
    const float ss = __shfl_sync(kFull, group_dot<float>(n, nm.seq,
                                                         [&](int i, float& a, float& b) {
                                                             a = oh[i];
                                                             b = oh[i];
                                                         }),
                                 0);
    if (!live) return;
    const float inv = rms_inv(ss, d, eps);
    for (int e = lane; e < d; e += 32)
        y[off + e] = bf16r(fmul(fmul(fmul(oh[e], inv), w[e]), nm.sigmoid(gate[off + e])));
}

}  // namespace

void kda_forward(Step& s, int layer, const KdaW& w, const float* x, float* out) {
    const Config& c = s.c;
    const int T = s.T, D = static_cast<int>(c.hidden_size);
    const int H = static_cast<int>(c.linear_num_heads), d = static_cast<int>(c.linear_head_dim);
    const int P = H * d, K = static_cast<int>(c.linear_conv_kernel_dim);
    const float eps = static_cast<float>(c.rms_norm_eps);
    const Nm nm = s.nm;
    s.mark("kda.proj");
    // kda.q_proj, kda.k_proj, kda.v_proj: qkv [T][3P] (q | k | v)
    float* qkv = s.scratch.d<float>(static_cast<size_t>(T) * 3 * P);
    if (!w.qkv.empty()) {  // the three as one matrix: its rows are q | k | v, the layout of qkv
        linear(w.qkv, x, D, qkv, 3 * P, T, true, nm, s.hw8);
    } else {
        linear(w.q_proj, x, D, qkv, 3 * P, T, true, nm, s.hw8);
        linear(w.k_proj, x, D, qkv + P, 3 * P, T, true, nm, s.hw8);
        linear(w.v_proj, x, D, qkv + 2 * P, 3 * P, T, true, nm, s.hw8);
    }
    s.emit(layer, S_KDA_Q_PROJ, qkv, 3 * P, {P});
    s.emit(layer, S_KDA_K_PROJ, qkv + P, 3 * P, {P});
    s.emit(layer, S_KDA_V_PROJ, qkv + 2 * P, 3 * P, {P});

    s.mark("kda.conv");
    SegDev* segs = s.seg_table(layer);
    const int nseg = static_cast<int>(s.segs.size());
    float* act = s.scratch.d<float>(static_cast<size_t>(T) * 3 * P);
    {
        if (K == 4) {  // (the real config's kernel; other widths the general kernel)
            auto k = k_kda_conv_rows<4, kConvRows>;
            const dim3 grid(static_cast<unsigned>((3 * P + 255) / 256),
                            static_cast<unsigned>((T + kConvRows - 1) / kConvRows));
            GLM_LAUNCH(k, grid, 256, 0, qkv, T, 3 * P, w.conv, segs, s.d_seg, act, nm);
        } else {
            auto k = k_kda_conv;
            GLM_LAUNCH(k, blocks(static_cast<int64_t>(T) * 3 * P, 256), 256, 0, qkv, T, 3 * P, K, w.conv, segs, s.d_seg,
                       act, nm);
        }
        check_launch("kda_conv");
    }
    if (K > 1) {
        auto k = k_kda_conv_tail;
        GLM_LAUNCH(k, blocks(static_cast<int64_t>(nseg) * 3 * P, 256), 256, 0, qkv, nseg, 3 * P, K, segs);
        check_launch("kda_conv_tail");
    }
    s.emit(layer, S_KDA_Q, act, 3 * P, {P});
    s.emit(layer, S_KDA_K, act + P, 3 * P, {P});
    s.emit(layer, S_KDA_V, act + 2 * P, 3 * P, {P});

    s.mark("kda.gates");
    // kda.g = lb * sigmoid(expf(A_log[h]) * (f + dt_bias)), f = lin(f_b, lin(f_a, x))
    // f_a, b_proj and g_a of x (one launch for one token when they are one matrix)
    float* fbg[3];
    linear_same_x(s, w.fbg, {&w.f_a, &w.b_proj, &w.g_a}, x, D, fbg);
    float *fa = fbg[0], *beta = fbg[1], *ga = fbg[2];
    float* g = s.scratch.d<float>(static_cast<size_t>(T) * P);
    linear(w.f_b, fa, d, g, P, T, true, nm, s.hw8);
    {
        auto k = k_kda_gate;
        GLM_LAUNCH(k, blocks(static_cast<int64_t>(T) * P, 256), 256, 0, g, T, P, d, w.decay, w.dt_bias,
                   static_cast<float>(c.linear_lower_bound), nm);
        check_launch("kda_gate");
    }
    s.emit(layer, S_KDA_G, g, P, {P});
    // kda.beta = sigmoid(lin(b_proj, x)), kept f32
    {
        auto k = k_sigmoid;
        GLM_LAUNCH(k, blocks(static_cast<int64_t>(T) * H, 256), 256, 0, beta, static_cast<int64_t>(T) * H, nm);
        check_launch("kda_beta");
    }
    s.emit(layer, S_KDA_BETA, beta, H, {H});

    s.mark("kda.recurrence");
    float* qs = s.scratch.d<float>(static_cast<size_t>(T) * P);
    float* kn = s.scratch.d<float>(static_cast<size_t>(T) * P);
    float* eg = s.scratch.d<float>(static_cast<size_t>(T) * P);
    const float qscale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    {
        auto k = k_kda_prep;
        GLM_LAUNCH(k, blocks(static_cast<int64_t>(T) * H * 32, 256), 256, 0, act, g, T, H, d, qscale, qs, kn, eg, nm);
        check_launch("kda_prep");
    }
    float* o = s.scratch.d<float>(static_cast<size_t>(T) * P);
    float* cap = nullptr;
    if (s.wants_any(layer, S_KDA_STATE)) cap = s.scratch.d<float>(static_cast<size_t>(T) * H * d * d);
    int inj_t = -1;
    for (int t = 0; t < T; ++t) {
        const int64_t el = s.inject_element(layer, S_KDA_STATE, t);
        if (el >= 0 && el < static_cast<int64_t>(H) * d * d) {
            inj_t = t;
            s.out->injected += 1;
        }
    }
    {
        const int64_t threads = static_cast<int64_t>(nseg) * H * d * 8;
        const int NC = (d + 63) / 64;
        const unsigned nb = blocks(threads, 256);
        if (NC == 1) {
            auto k = k_kda_rec<1>;
            GLM_LAUNCH(k, nb, 256, 0, qs, kn, eg, act, beta, segs, nseg, H, d, o, cap, inj_t, s.inj.element, s.inj.ulps, nm);
        } else if (NC == 2) {
            auto k = k_kda_rec<2>;
            GLM_LAUNCH(k, nb, 256, 0, qs, kn, eg, act, beta, segs, nseg, H, d, o, cap, inj_t, s.inj.element, s.inj.ulps, nm);
        } else if (NC <= 4) {
            auto k = k_kda_rec<4>;
            GLM_LAUNCH(k, nb, 256, 0, qs, kn, eg, act, beta, segs, nseg, H, d, o, cap, inj_t, s.inj.element, s.inj.ulps, nm);
        } else {
            throw std::invalid_argument("linear_head_dim > 256 is not supported by the CUDA engine");
        }
        check_launch("kda_rec");
    }
    if (cap) s.capture(layer, S_KDA_STATE, cap, static_cast<int64_t>(H) * d * d, {H, d, d});
    s.emit(layer, S_KDA_O, o, P, {P});

    s.mark("kda.out");
    // kda.gate = lin(g_b, lin(g_a, x))
    float* gate = s.scratch.d<float>(static_cast<size_t>(T) * P);
    linear(w.g_b, ga, d, gate, P, T, true, nm, s.hw8);
    s.emit(layer, S_KDA_GATE, gate, P, {P});
    // kda.o_norm
    float* y = s.scratch.d<float>(static_cast<size_t>(T) * P);
    {
        auto k = k_kda_onorm;
        GLM_LAUNCH(k, blocks(static_cast<int64_t>(T) * H * 32, 256), 256, 0, o, gate, T, H, d, w.o_norm, eps, y, nm);
        check_launch("kda_onorm");
    }
    s.emit(layer, S_KDA_O_NORM, y, P, {P});
    // kda.out = lin(o_proj, o_norm)
    linear(w.o_proj, y, P, out, D, T, true, nm, s.hw8);
    s.emit(layer, S_KDA_OUT, out, D, {D});
}

}  // namespace glm::cuda
