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
//
// The fast path (k_hc_mix, canonical dots, no injection into pre or collapsed): the long dots split
// by accumulator group, one block per (group g, row r, token): it stages the columns of its eight
// partial sums (64c + 8g + l) in shared memory with every thread, then eight threads run the chains.
// The last block of a token to finish (a ticket per token) folds the partial sums of every row, forms
// m, pre and post, the collapsed row and, when asked, its RMSNorm. The Sinkhorn (k_hc_coef: 39
// dependent normalizations, ~15 us) is needed only by hc_expand, after the sublayer: it runs on a
// side stream, overlapped with the sublayer, unless post or comb are captured or injected.
//
// The general path: k_hc_m, one block of 64 threads per (token, row of fn) for the two long dots
// (block64_dot); k_hc_coef: one block per token, one thread per coefficient (hc <= 16);
// k_hc_collapse / k_hc_expand: one thread per (token, d), short dots in one thread (cdot_serial).
#include <algorithm>

#include "engine.cuh"

namespace glm::cuda {
namespace {

constexpr int kHcMax = 16;

// The site's formulas, one definition for both paths (and the one-thread definition's order).
GLM_DEV double hc_m(double dot, double ss, int n, double eps) {  // m_r from cdot64(fn_r, v), cdot64(v, v)
    return dmul(dot, ddiv(1.0, dsqrt(dadd(ddiv(ss, static_cast<double>(n)), eps))));
}
GLM_DEV double hc_pre(double m, double s0, double base, double hc_eps) {
    return dadd(sigmoid64(dadd(dmul(m, s0), base)), hc_eps);
}
GLM_DEV double hc_post(double m, double s1, double base) { return dmul(2.0, sigmoid64(dadd(dmul(m, s1), base))); }
// collapsed = bf16(cdot64(pre, [x_0, ..., x_{hc-1}])), x_i = stream i's value
template <class X>
GLM_DEV float hc_collapse(const double* pre, int hc, bool seq, X x_of) {
    return bf16r64(cdot_serial<double>(hc, seq, [&](int i, double& a, double& b) {
        a = static_cast<double>(x_of(i));
        b = pre[i];
    }));
}

// 64 threads per (token, row r): thread k owns partial sums P[k/8][k%8] of both dots (cdot64(v, v) and
// cdot64(fn_r, v)), loads issued kU chunks ahead; the two 8x8 folds in thread 0.
constexpr int kU = 16;

__global__ void __launch_bounds__(64) k_hc_m(const float* __restrict__ X, int n, const double* __restrict__ fn,
                                             double eps, double* m, int R, Nm nm) {
    pdl_enter();
    __shared__ double red[2][64];
    const int r = static_cast<int>(blockIdx.x), t = static_cast<int>(blockIdx.y);
    const int tid = static_cast<int>(threadIdx.x);
    const float* x = X + static_cast<int64_t>(t) * n;
    const double* f = fn + static_cast<int64_t>(r) * n;
    double ss = 0.0, dot = 0.0;
    if (!nm.seq) {
        int i = tid;
        for (; i + 64 * (kU - 1) < n; i += 64 * kU) {
            float xv[kU];
            double fv[kU];
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                xv[u] = __ldg(x + i + 64 * u);
                fv[u] = __ldg(f + i + 64 * u);
            }
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                const double v = static_cast<double>(xv[u]);
                ss = dfma(v, v, ss);
                dot = dfma(fv[u], v, dot);
            }
        }
        for (; i < n; i += 64) {
            const double v = static_cast<double>(x[i]);
            ss = dfma(v, v, ss);
            dot = dfma(f[i], v, dot);
        }
        red[0][tid] = ss;
        red[1][tid] = dot;
        __syncthreads();
        // the 8x8 folds: warp 0 of the sum of squares, warp 1 of the dot
        const int q = tid >> 5, lane = tid & 31;
        const double f = warp_fold64(red[q][lane], red[q][lane + 32]);
        __syncthreads();
        if (lane == 0) red[q][0] = f;
        __syncthreads();
        ss = red[0][0];
        dot = red[1][0];
    } else if (tid == 0) {
        for (int i = 0; i < n; ++i) {
            const double v = static_cast<double>(x[i]);
            ss = dadd(ss, dmul(v, v));
            dot = dadd(dot, dmul(f[i], v));
        }
    }
    if (tid == 0) m[static_cast<int64_t>(t) * R + r] = hc_m(dot, ss, n, eps);
}

GLM_DEV double csum64(const double* x, int n, int stride, bool seq) {
    return cdot_serial<double>(n, seq, [&](int i, double& a, double& b) {
        a = x[i * stride];
        b = 1.0;
    });
}

// One block per token, thread (i, j) = (tid / hc, tid % hc) owns coefficient C_ij (hc*hc <= 256 threads,
// blockDim a multiple of 32). Every normalization's sum is csum64 over the same elements in the same
// order, computed redundantly by each thread of the row/column from shared memory (the same bits), the
// division by the owning thread; barriers between the reads of a pass and its writes. Row maxima of the
// softmax likewise (same left-to-right scan). Identical operations to the one-thread definition.
__global__ void __launch_bounds__(256) k_hc_coef(const double* __restrict__ m, int T, int R, int hc,
                                                 const double* __restrict__ base, double s0, double s1, double s2,
                                                 double eps, int iters, double* pre, double* post, double* comb,
                                                 Nm nm, bool comb_only) {
    pdl_enter();
    __shared__ double C[kHcMax * kHcMax];
    const int t = static_cast<int>(blockIdx.x);
    if (t >= T) return;
    const int tid = static_cast<int>(threadIdx.x);
    const bool own = tid < hc * hc;
    const int i = own ? tid / hc : 0, j = own ? tid % hc : 0;
    const double* mt = m + static_cast<int64_t>(t) * R;
    if (tid < hc && !comb_only) {
        pre[static_cast<int64_t>(t) * hc + tid] = hc_pre(mt[tid], s0, base[tid], eps);
        post[static_cast<int64_t>(t) * hc + tid] = hc_post(mt[hc + tid], s1, base[hc + tid]);
    }
    // z_ij, then e_ij = exp64(z_ij - max_j z_ij)
    if (own) {
        const int r = 2 * hc + hc * i + j;
        C[tid] = dadd(dmul(mt[r], s2), base[r]);
    }
    __syncthreads();
    double v = 0.0;
    if (own) {
        const double* zr = C + i * hc;
        double zmax = zr[0];
        for (int k = 1; k < hc; ++k) zmax = (zmax < zr[k]) ? zr[k] : zmax;
        v = exp64(dsub(C[tid], zmax));
    }
    __syncthreads();
    if (own) C[tid] = v;
    __syncthreads();
    if (own) v = dadd(ddiv(v, csum64(C + i * hc, hc, 1, nm.seq)), eps);
    __syncthreads();
    if (own) C[tid] = v;
    __syncthreads();
    auto normalize_cols = [&] {
        if (own) v = ddiv(v, dadd(csum64(C + j, hc, hc, nm.seq), eps));
        __syncthreads();
        if (own) C[tid] = v;
        __syncthreads();
    };
    auto normalize_rows = [&] {
        if (own) v = ddiv(v, dadd(csum64(C + i * hc, hc, 1, nm.seq), eps));
        __syncthreads();
        if (own) C[tid] = v;
        __syncthreads();
    };
    normalize_cols();
    for (int it = 0; it + 1 < iters; ++it) {
        normalize_rows();
        normalize_cols();
    }
    if (own) comb[static_cast<int64_t>(t) * hc * hc + tid] = v;
}

constexpr int kMixThreads = 256;

struct MixArgs {
    const float* X;    // [T][n] streams
    int n, R, hc, D;
    const double* fn;  // [R][n]
    const double* base;
    double s0, s1, rms_eps, hc_eps;
    double* part;           // [T][R + 1][64] partial sums (row R: cdot64(v, v))
    unsigned* tickets;      // [T], zero between launches
    double* m;              // [T][R]
    double* pre;            // [T][hc]
    double* post;           // [T][hc]
    float* collapsed;       // [T][D]
    const float* norm_w;    // RMSNorm of the collapsed row (nullptr: none)
    float norm_eps;
    float* xn;              // [T][D]
};

__global__ void __launch_bounds__(kMixThreads) k_hc_mix(MixArgs a, bool vec) {
    pdl_enter();
    GLM_DYN_SMEM(unsigned char, sm);
    const int g = static_cast<int>(blockIdx.x), r = static_cast<int>(blockIdx.y), t = static_cast<int>(blockIdx.z);
    const int tid = static_cast<int>(threadIdx.x);
    const int n = a.n, R = a.R, nch = (n + 63) / 64;
    double* fs = reinterpret_cast<double*>(sm);          // [nch][8]
    float* xs = reinterpret_cast<float*>(fs + 8 * nch);  // [nch][8]
    const float* x = a.X + static_cast<int64_t>(t) * n;
    const double* f = a.fn + static_cast<int64_t>(r) * n;
    // stage columns 64c + 8g + l (l < 8) of x and of fn row r: 16-byte pieces when the rows allow it
    if (vec) {
#pragma unroll 4
        for (int q = tid; q < 6 * nch; q += kMixThreads) {
            const int c = q / 6, k = q % 6, col = 64 * c + 8 * g;
            if (k < 2) {
                *reinterpret_cast<float4*>(xs + 8 * c + 4 * k) = __ldg(reinterpret_cast<const float4*>(x + col + 4 * k));
            } else {
                const int h = k - 2;
                *reinterpret_cast<double2*>(fs + 8 * c + 2 * h) = __ldg(reinterpret_cast<const double2*>(f + col + 2 * h));
            }
        }
    } else {
        for (int q = tid; q < 8 * nch; q += kMixThreads) {
            const int i = 64 * (q / 8) + 8 * g + q % 8;
            xs[q] = i < n ? x[i] : 0.0f;
            fs[q] = i < n ? f[i] : 0.0;
        }
    }
    __syncthreads();
    if (tid < 8) {  // partial sums P[g][tid] of cdot64(fn_r, v) and cdot64(v, v)
        double pd = 0.0, ps = 0.0;
#pragma unroll 8
        for (int c = 0; c < nch; ++c) {
            if (64 * c + 8 * g + tid < n) {
                const double v = static_cast<double>(xs[8 * c + tid]);
                ps = dfma(v, v, ps);
                pd = dfma(fs[8 * c + tid], v, pd);
            }
        }
        double* pt = a.part + static_cast<int64_t>(t) * (R + 1) * 64;
        pt[64 * r + 8 * g + tid] = pd;
        if (r == 0) pt[64 * R + 8 * g + tid] = ps;
    }
    // the last of the token's 8R blocks goes on (the classic ticket: fence, then count)
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(a.tickets + t, 1u) == static_cast<unsigned>(8 * R - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (tid == 0) a.tickets[t] = 0u;  // ready for the next launch
    // (the tail is one block: every loop below keeps its loads independent of its stores, so they
    // stay in flight together; a loop that reloads after each store pays the L2 latency per element)
    const int hc = a.hc, D = a.D;
    double* P = fs;                  // [R + 1][64]
    double* mt = P + 64 * (R + 1);   // [R]
    double* pre_s = mt + R;          // [hc]
    float* Q = reinterpret_cast<float*>(pre_s + hc);  // [64]
    float* cs = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(Q + 64) + 15) & ~uintptr_t(15));  // [D] the collapsed row
    {
        const double* __restrict__ pt = a.part + static_cast<int64_t>(t) * (R + 1) * 64;
#pragma unroll 4
        for (int q = tid; q < (R + 1) * 64; q += kMixThreads) P[q] = __ldcg(pt + q);
    }
    __syncthreads();
    {  // each row's 8x8 fold by one warp; the result in P[64 r]
        const int lane = tid & 31;
        for (int q = tid >> 5; q <= R; q += kMixThreads / 32) {
            const double f = warp_fold64(P[64 * q + lane], P[64 * q + lane + 32]);
            if (lane == 0) P[64 * q] = f;
        }
    }
    __syncthreads();
    for (int q = tid; q < R; q += kMixThreads) {
        mt[q] = hc_m(P[64 * q], P[64 * R], n, a.rms_eps);
        a.m[static_cast<int64_t>(t) * R + q] = mt[q];
    }
    __syncthreads();
    if (tid < hc) {
        pre_s[tid] = hc_pre(mt[tid], a.s0, a.base[tid], a.hc_eps);
        a.pre[static_cast<int64_t>(t) * hc + tid] = pre_s[tid];
        a.post[static_cast<int64_t>(t) * hc + tid] = hc_post(mt[hc + tid], a.s1, a.base[hc + tid]);
    }
    __syncthreads();
    // collapsed[d] = bf16(cdot64(pre, X[:, d])): four consecutive d per thread, the streams' values
    // loaded (16 bytes each) before any is used
    float* __restrict__ col = a.collapsed + static_cast<int64_t>(t) * D;
    if (vec && D % 4 == 0 && hc <= 8) {
        for (int d0 = 4 * tid; d0 < D; d0 += 4 * kMixThreads) {
            float4 v[8] = {};
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (i < hc) v[i] = __ldg(reinterpret_cast<const float4*>(x + static_cast<int64_t>(i) * D + d0));
            float o[4];
#pragma unroll
            for (int k = 0; k < 4; ++k)
                o[k] = hc_collapse(pre_s, hc, false, [&](int i) {
                    const float4 w4 = v[i & 7];
                    return k == 0 ? w4.x : k == 1 ? w4.y : k == 2 ? w4.z : w4.w;
                });
            *reinterpret_cast<float4*>(cs + d0) = make_float4(o[0], o[1], o[2], o[3]);
            *reinterpret_cast<float4*>(col + d0) = make_float4(o[0], o[1], o[2], o[3]);
        }
    } else {
        for (int d = tid; d < D; d += kMixThreads) {
            cs[d] = hc_collapse(pre_s, hc, false, [&](int i) { return x[static_cast<int64_t>(i) * D + d]; });
            col[d] = cs[d];
        }
    }
    if (!a.norm_w) return;
    // RMSNorm of the collapsed row (k_rmsnorm's operations): ss = cdot(c, c) from shared memory
    __syncthreads();
    if (tid < 64) {
        float p = 0.0f;
#pragma unroll 8
        for (int i = tid; i < D; i += 64) p = ffma(cs[i], cs[i], p);
        Q[tid] = p;
    }
    __syncthreads();
    if (tid < 32) {
        const float f = warp_fold64(Q[tid], Q[tid + 32]);
        if (tid == 0) Q[0] = f;
    }
    __syncthreads();
    const float inv = rms_inv(Q[0], D, a.norm_eps);
    const float* __restrict__ nw = a.norm_w;
    float* __restrict__ y = a.xn + static_cast<int64_t>(t) * D;
#pragma unroll 4
    for (int d = tid; d < D; d += kMixThreads) y[d] = rms_out(cs[d], inv, __ldg(nw + d));
}

__global__ void k_hc_collapse(const float* __restrict__ X, const double* __restrict__ pre, int T, int hc, int D,
                              float* collapsed, Nm nm) {
    pdl_enter();
    const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (k >= static_cast<int64_t>(T) * D) return;
    const int64_t t = k / D, d = k % D;
    const float* xt = X + t * hc * D;
    const double* p = pre + t * hc;
    collapsed[k] = hc_collapse(p, hc, nm.seq, [&](int i) { return xt[i * D + d]; });
}

__global__ void k_hc_expand(float* X, const float* __restrict__ u, const double* __restrict__ post,
                            const double* __restrict__ comb, int T, int hc, int D, Nm nm) {
    pdl_enter();
    const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (k >= static_cast<int64_t>(T) * D) return;
    const int64_t t = k / D, d = k % D;
    float* xt = X + t * hc * D;
    double row[kHcMax + 1];
    row[0] = static_cast<double>(u[t * D + d]);
    for (int i = 0; i < hc; ++i) row[1 + i] = static_cast<double>(xt[i * D + d]);
    const double* po = post + t * hc;
    const double* co = comb + t * hc * hc;
    float out[kHcMax];
    for (int j = 0; j < hc; ++j) {
        out[j] = bf16r64(cdot_serial<double>(hc + 1, nm.seq, [&](int i, double& a, double& b) {
            a = row[i];
            b = i == 0 ? po[j] : co[(i - 1) * hc + j];
        }));
    }
    for (int j = 0; j < hc; ++j) xt[j * D + d] = out[j];
}

}  // namespace

namespace {
// The fast path applies: canonical dots, no injection into pre or collapsed (they would have to land
// between the kernel's steps), and its shared memory within bounds.
bool mix_applies(const Step& s, int layer, int S_PRE, int hc, int n, int R, size_t& smem) {
    if (s.nm.seq || hc > kHcMax || s.injects(layer, S_PRE) || s.injects(layer, S_PRE + 3)) return false;
    const size_t nch = (static_cast<size_t>(n) + 63) / 64;
    const size_t stage = nch * 8 * (sizeof(double) + sizeof(float));
    const size_t tail = (static_cast<size_t>(R) + 1) * 64 * sizeof(double) + (R + hc) * sizeof(double) +
                        (64 + static_cast<size_t>(n / hc) + 4) * sizeof(float);
    smem = std::max(stage, tail);
    return smem <= 96 * 1024;
}
}  // namespace

bool hc_site(Step& s, int layer, bool ffn, const HcW& w, const float* X, double* pre, double* post, double* comb,
             float* collapsed, const float* norm_w, float norm_eps, float* xn) {
    const Config& c = s.c;
    const int T = s.T, hc = static_cast<int>(c.hc_mult), D = static_cast<int>(c.hidden_size);
    const int n = hc * D, R = static_cast<int>(c.hc_dim());
    const int S_PRE = ffn ? S_FFN_HC_PRE : S_ATTN_HC_PRE;
    double* m = s.scratch.d<double>(static_cast<size_t>(T) * R);
    size_t smem = 0;
    const bool mix = mix_applies(s, layer, S_PRE, hc, n, R, smem);
    const bool norm = mix && norm_w != nullptr;
    if (mix) {
        MixArgs a{};
        a.X = X;
        a.n = n;
        a.R = R;
        a.hc = hc;
        a.D = D;
        a.fn = w.fn;
        a.base = w.base;
        a.s0 = w.scale[0];
        a.s1 = w.scale[1];
        a.rms_eps = c.rms_norm_eps;
        a.hc_eps = c.hc_eps;
        a.part = s.scratch.d<double>(static_cast<size_t>(T) * (R + 1) * 64);
        a.tickets = s.E.hc_tickets(T);
        a.m = m;
        a.pre = pre;
        a.post = post;
        a.collapsed = collapsed;
        a.norm_w = norm ? norm_w : nullptr;
        a.norm_eps = norm_eps;
        a.xn = xn;
        const bool vec = n % 64 == 0 && reinterpret_cast<uintptr_t>(X) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(w.fn) % 16 == 0;
        auto k = k_hc_mix;
        static bool attr_set = false;
        if (!attr_set) {
            check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024), "smem attribute");
            attr_set = true;
        }
        GLM_LAUNCH(k, dim3(8, R, T), kMixThreads, smem, a, vec);
        check_launch("hc_mix");
    } else {
        auto k = k_hc_m;
        GLM_LAUNCH(k, dim3(R, T), 64, 0, X, n, w.fn, c.rms_norm_eps, m, R, s.nm);
        check_launch("hc_m");
    }
    // the Sinkhorn: off the critical path on the side stream when nothing observes post or comb before
    // hc_expand (which waits for it)
    const bool side = mix && !s.wants_any(layer, S_PRE + 1) && !s.wants_any(layer, S_PRE + 2) &&
                      !s.injects(layer, S_PRE + 1) && !s.injects(layer, S_PRE + 2);
    {
        auto k = k_hc_coef;
        const unsigned threads = (hc * hc + 31) / 32 * 32;
        if (side) {
            cudaStream_t st = s.E.side.fork();
            GLM_LAUNCH_ON(st, k, T, threads, 0, m, T, R, hc, w.base, w.scale[0], w.scale[1], w.scale[2], c.hc_eps,
                          static_cast<int>(c.hc_sinkhorn_iters), pre, post, comb, s.nm, true);
            check_launch("hc_coef");
            s.E.side.join_later();
        } else {
            GLM_LAUNCH(k, T, threads, 0, m, T, R, hc, w.base, w.scale[0], w.scale[1], w.scale[2], c.hc_eps,
                       static_cast<int>(c.hc_sinkhorn_iters), pre, post, comb, s.nm, mix);
            check_launch("hc_coef");
        }
    }
    s.emit(layer, S_PRE, pre, hc, {hc});
    s.emit(layer, S_PRE + 1, post, hc, {hc});
    s.emit(layer, S_PRE + 2, comb, static_cast<int64_t>(hc) * hc, {hc, hc});
    if (!mix) {
        const int64_t total = static_cast<int64_t>(T) * D;
        auto k = k_hc_collapse;
        GLM_LAUNCH(k, static_cast<unsigned>((total + 127) / 128), 128, 0, X, pre, T, hc, D, collapsed, s.nm);
        check_launch("hc_collapse");
    }
    s.emit(layer, S_PRE + 3, collapsed, D, {D});
    return norm;
}

void hc_expand(Step& s, int layer, bool ffn, float* X, const float* u, const double* post, const double* comb) {
    s.E.side.join();  // the site's Sinkhorn, when it ran on the side stream
    const Config& c = s.c;
    const int T = s.T, hc = static_cast<int>(c.hc_mult), D = static_cast<int>(c.hidden_size);
    const int64_t total = static_cast<int64_t>(T) * D;
    auto k = k_hc_expand;
    GLM_LAUNCH(k, static_cast<unsigned>((total + 127) / 128), 128, 0, X, u, post, comb, T, hc, D, s.nm);
    check_launch("hc_expand");
    s.emit(layer, ffn ? S_FFN_HC_STREAMS : S_ATTN_HC_STREAMS, X, static_cast<int64_t>(hc) * D, {hc, D});
}

}  // namespace glm::cuda
