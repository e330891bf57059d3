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
// k_hc_m: one block of 64 threads per (token, row of fn) for the two long dots (block64_dot);
// k_hc_coef: one block per token, one thread per coefficient (hc <= 16); k_hc_collapse / k_hc_expand:
// one thread per (token, d), short dots in one thread (cdot_serial).
#include "engine.cuh"

namespace glm::cuda {
namespace {

constexpr int kHcMax = 16;

// 64 threads per (token, row r): thread k owns partial sums P[k/8][k%8] of both dots (cdot64(v, v) and
// cdot64(fn_r, v)), loads issued kU chunks ahead; the two 8x8 folds in thread 0.
constexpr int kU = 16;

__global__ void __launch_bounds__(64) k_hc_m(const float* __restrict__ X, int n, const double* __restrict__ fn,
                                             double eps, double* m, int R, Nm nm) {
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
        if (tid == 0) {
            double out[2];
            for (int q = 0; q < 2; ++q) {
                double P[64];
                for (int k = 0; k < 64; ++k) P[k] = red[q][k];
                for (int w = 4; w >= 1; w >>= 1)
                    for (int g = 0; g < w; ++g)
                        for (int l = 0; l < 8; ++l) P[8 * g + l] = dadd(P[8 * g + l], P[8 * (g + w) + l]);
                for (int w = 4; w >= 1; w >>= 1)
                    for (int l = 0; l < w; ++l) P[l] = dadd(P[l], P[l + w]);
                out[q] = P[0];
            }
            ss = out[0];
            dot = out[1];
        }
    } else if (tid == 0) {
        for (int i = 0; i < n; ++i) {
            const double v = static_cast<double>(x[i]);
            ss = dadd(ss, dmul(v, v));
            dot = dadd(dot, dmul(f[i], v));
        }
    }
    if (tid == 0) {
        const double inv = ddiv(1.0, dsqrt(dadd(ddiv(ss, static_cast<double>(n)), eps)));
        m[static_cast<int64_t>(t) * R + r] = dmul(dot, inv);
    }
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
                                                 Nm nm) {
    __shared__ double C[kHcMax * kHcMax];
    const int t = static_cast<int>(blockIdx.x);
    if (t >= T) return;
    const int tid = static_cast<int>(threadIdx.x);
    const bool own = tid < hc * hc;
    const int i = own ? tid / hc : 0, j = own ? tid % hc : 0;
    const double* mt = m + static_cast<int64_t>(t) * R;
    if (tid < hc) {
        pre[static_cast<int64_t>(t) * hc + tid] = dadd(sigmoid64(dadd(dmul(mt[tid], s0), base[tid])), eps);
        post[static_cast<int64_t>(t) * hc + tid] =
            dmul(2.0, sigmoid64(dadd(dmul(mt[hc + tid], s1), base[hc + tid])));
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

__global__ void k_hc_collapse(const float* __restrict__ X, const double* __restrict__ pre, int T, int hc, int D,
                              float* collapsed, Nm nm) {
    const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (k >= static_cast<int64_t>(T) * D) return;
    const int64_t t = k / D, d = k % D;
    const float* xt = X + t * hc * D;
    const double* p = pre + t * hc;
    collapsed[k] = bf16r64(cdot_serial<double>(hc, nm.seq, [&](int i, double& a, double& b) {
        a = static_cast<double>(xt[i * D + d]);
        b = p[i];
    }));
}

__global__ void k_hc_expand(float* X, const float* __restrict__ u, const double* __restrict__ post,
                            const double* __restrict__ comb, int T, int hc, int D, Nm nm) {
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

void hc_site(Step& s, int layer, bool ffn, const HcW& w, const float* X, double* pre, double* post, double* comb,
             float* collapsed) {
    const Config& c = s.c;
    const int T = s.T, hc = static_cast<int>(c.hc_mult), D = static_cast<int>(c.hidden_size);
    const int n = hc * D, R = static_cast<int>(c.hc_dim());
    const int S_PRE = ffn ? S_FFN_HC_PRE : S_ATTN_HC_PRE;
    double* m = s.scratch.d<double>(static_cast<size_t>(T) * R);
    {
        auto k = k_hc_m;
        GLM_LAUNCH(k, dim3(R, T), 64, 0, X, n, w.fn, c.rms_norm_eps, m, R, s.nm);
        check_launch("hc_m");
    }
    {
        auto k = k_hc_coef;
        GLM_LAUNCH(k, T, (hc * hc + 31) / 32 * 32, 0, m, T, R, hc, w.base, w.scale[0], w.scale[1], w.scale[2], c.hc_eps,
                   static_cast<int>(c.hc_sinkhorn_iters), pre, post, comb, s.nm);
        check_launch("hc_coef");
    }
    s.emit(layer, S_PRE, pre, hc, {hc});
    s.emit(layer, S_PRE + 1, post, hc, {hc});
    s.emit(layer, S_PRE + 2, comb, static_cast<int64_t>(hc) * hc, {hc, hc});
    {
        const int64_t total = static_cast<int64_t>(T) * D;
        auto k = k_hc_collapse;
        GLM_LAUNCH(k, static_cast<unsigned>((total + 127) / 128), 128, 0, X, pre, T, hc, D, collapsed, s.nm);
        check_launch("hc_collapse");
    }
    s.emit(layer, S_PRE + 3, collapsed, D, {D});
}

void hc_expand(Step& s, int layer, bool ffn, float* X, const float* u, const double* post, const double* comb) {
    const Config& c = s.c;
    const int T = s.T, hc = static_cast<int>(c.hc_mult), D = static_cast<int>(c.hidden_size);
    const int64_t total = static_cast<int64_t>(T) * D;
    auto k = k_hc_expand;
    GLM_LAUNCH(k, static_cast<unsigned>((total + 127) / 128), 128, 0, X, u, post, comb, T, hc, D, s.nm);
    check_launch("hc_expand");
    s.emit(layer, ffn ? S_FFN_HC_STREAMS : S_ATTN_HC_STREAMS, X, static_cast<int64_t>(hc) * D, {hc, D});
}

}  // namespace glm::cuda
