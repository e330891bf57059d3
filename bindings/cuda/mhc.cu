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
// k_hc_m: the 64 partial sums of every long dot (the rows of fn and the sum of squares, once per token),
// one thread per chain P[g][l], the block's slice of fn/x staged in shared memory by all its threads;
// k_hc_coef: one block per token: the folds, inv and m, then one thread per coefficient (hc <= 16);
// k_hc_collapse / k_hc_expand: one thread per (token, d), short dots in one thread (cdot_serial).
#include "engine.cuh"

namespace glm::cuda {
namespace {

constexpr int kHcMax = 16;

// k_hc_m: the partial sums of the canonical dots, P[g][l] for element i = 64c + 8g + l, of every
// (token t, row r) with r < R the rows of fn (cdot64(fn_r, v)) and r = R the sum of squares
// (cdot64(v, v), once per token). One block of kMThreads per (r, g, tile of TT tokens): the 8*TT
// chains P[g][0..8) of its tokens, each one thread running the dfma chain over the chunks in order.
// All threads first stage the block's slice of fn and x in shared memory (every load of a stage in
// flight at once), kMStage (chunk, lane) slots per stage: 256/TT chunks. The 4/2/1 folds in k_hc_coef.
// Pm[((t * (R + 1) + r) * 64 + 8g + l]. With nm.seq: one thread per (t, r), the plain sum in slot 0.
constexpr int kMThreads = 256;
constexpr int kMStage = 2048;
constexpr int kMPer = kMStage / kMThreads;

__global__ void __launch_bounds__(kMThreads) k_hc_m(const float* __restrict__ X, int T, int n,
                                                    const double* __restrict__ fn, int R, int TT,
                                                    double* __restrict__ Pm) {
    __shared__ double fs[kMStage];
    __shared__ float xs[kMStage];
    const int r = static_cast<int>(blockIdx.x) / 8, g = static_cast<int>(blockIdx.x) % 8;
    const int t0 = static_cast<int>(blockIdx.y) * TT;
    const int tid = static_cast<int>(threadIdx.x);
    const int PC = kMStage / 8 / TT;        // chunks per stage
    const int C = (n + 63) / 64;             // chunks of the dot
    const bool sq = r == R;                  // the sum of squares: a = b = v
    const double* f = fn + static_cast<int64_t>(sq ? 0 : r) * n;
    const int u = tid / 8, l = tid % 8;      // chain thread (tid < 8*TT): token t0 + u, lane l
    const bool chain = u < TT;
    double p = 0.0;
    for (int c0 = 0; c0 < C; c0 += PC) {
        double fr[kMPer];
        float xr[kMPer];
#pragma unroll
        for (int q = 0; q < kMPer; ++q) {
            const int s = tid + kMThreads * q;  // slot: token s / (8 PC), chunk c0 + (s / 8) % PC, lane s % 8
            const int uu = s / (8 * PC), c = c0 + (s / 8) % PC;
            const int i = 64 * c + 8 * g + (s % 8);
            const int t = t0 + uu;
            fr[q] = (!sq && s < 8 * PC && i < n) ? __ldg(f + i) : 0.0;
            xr[q] = (t < T && i < n) ? __ldg(X + static_cast<int64_t>(t) * n + i) : 0.0f;
        }
        __syncthreads();  // the previous stage's chains are done with fs/xs
#pragma unroll
        for (int q = 0; q < kMPer; ++q) {
            fs[tid + kMThreads * q] = fr[q];
            xs[tid + kMThreads * q] = xr[q];
        }
        __syncthreads();
        if (chain) {
            const int nc = (C - c0 < PC) ? C - c0 : PC;
            const float* xu = xs + u * 8 * PC;
#pragma unroll 8
            for (int cc = 0; cc < nc; ++cc) {
                if (64 * (c0 + cc) + 8 * g + l >= n) break;  // elements past n are skipped
                const double v = static_cast<double>(xu[8 * cc + l]);
                p = dfma(sq ? v : fs[8 * cc + l], v, p);
            }
        }
    }
    const int t = t0 + u;
    if (chain && t < T) Pm[(static_cast<int64_t>(t) * (R + 1) + r) * 64 + 8 * g + l] = p;
}

__global__ void k_hc_m_seq(const float* __restrict__ X, int T, int n, const double* __restrict__ fn, int R,
                           double* __restrict__ Pm) {
    const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (k >= static_cast<int64_t>(T) * (R + 1)) return;
    const int t = static_cast<int>(k / (R + 1)), r = static_cast<int>(k % (R + 1));
    const float* x = X + static_cast<int64_t>(t) * n;
    const double* f = fn + static_cast<int64_t>(r == R ? 0 : r) * n;
    double s = 0.0;
    for (int i = 0; i < n; ++i) {
        const double v = static_cast<double>(x[i]);
        s = dadd(s, dmul(r == R ? v : f[i], v));
    }
    Pm[k * 64] = s;
}

GLM_DEV double csum64(const double* x, int n, int stride, bool seq) {
    return cdot_serial<double>(n, seq, [&](int i, double& a, double& b) {
        a = x[i * stride];
        b = 1.0;
    });
}

// k_hc_coef, one block per token. First the folds of k_hc_m's partial sums (one thread per row, the
// 4/2/1 tree over g then over l) and m_r = dot_r * inv, inv = 1/sqrt(ss/n + eps) (every thread the
// same bits). Then pre/post (threads hc*hc.. or a second warp), and the Sinkhorn coefficients C_ij,
// thread (i, j) = (tid / hc, tid % hc). Every normalization's sum is csum64 over the same elements in
// the same order, computed redundantly by each thread of the row/column (the same bits), the division
// by the owning thread. hc*hc <= 32: one warp, the row/column gathered by shuffles (no barriers);
// otherwise through shared memory with barriers between the reads of a pass and its writes. Row maxima
// of the softmax likewise (same left-to-right scan). Identical operations to the one-thread definition.
constexpr int kWarpHc = 8;  // array size for hc*hc <= 32 (hc <= 5; cdot_serial's closed form reads up to 8)

__global__ void __launch_bounds__(256) k_hc_coef(const double* __restrict__ Pm, int T, int R, int n, double rms_eps,
                                                 int hc, const double* __restrict__ base, double s0, double s1,
                                                 double s2, double eps, int iters, double* pre, double* post,
                                                 double* comb, Nm nm) {
    __shared__ double M[(2 + kHcMax) * kHcMax + 1];
    __shared__ double C[kHcMax * kHcMax];
    const int t = static_cast<int>(blockIdx.x);
    if (t >= T) return;
    const int tid = static_cast<int>(threadIdx.x);
    for (int rr = tid; rr <= R; rr += static_cast<int>(blockDim.x)) {
        const double* pp = Pm + (static_cast<int64_t>(t) * (R + 1) + rr) * 64;
        double s;
        if (nm.seq) {
            s = pp[0];
        } else {
            double P[64];
#pragma unroll
            for (int k = 0; k < 64; ++k) P[k] = pp[k];
#pragma unroll
            for (int w = 4; w >= 1; w >>= 1)
#pragma unroll
                for (int g = 0; g < w; ++g)
#pragma unroll
                    for (int l = 0; l < 8; ++l) P[8 * g + l] = dadd(P[8 * g + l], P[8 * (g + w) + l]);
#pragma unroll
            for (int w = 4; w >= 1; w >>= 1)
#pragma unroll
                for (int l = 0; l < w; ++l) P[l] = dadd(P[l], P[l + w]);
            s = P[0];
        }
        M[rr] = s;
    }
    __syncthreads();
    const double inv = ddiv(1.0, dsqrt(dadd(ddiv(M[R], static_cast<double>(n)), rms_eps)));
    const int nc = hc * hc;
    const bool warp = nc <= 32;
    // pre/post: the second warp when the coefficients fit one warp, else threads [0, hc)
    const int pp0 = warp ? 32 : 0;
    if (tid >= pp0 && tid < pp0 + hc) {
        const int k = tid - pp0;
        pre[static_cast<int64_t>(t) * hc + k] = dadd(sigmoid64(dadd(dmul(dmul(M[k], inv), s0), base[k])), eps);
        post[static_cast<int64_t>(t) * hc + k] =
            dmul(2.0, sigmoid64(dadd(dmul(dmul(M[hc + k], inv), s1), base[hc + k])));
    }
    const bool own = tid < nc;
    const int i = own ? tid / hc : 0, j = own ? tid % hc : 0;
    const int r = 2 * hc + hc * i + j;
    if (warp) {
        if (tid >= 32) return;
        // z_ij, then e_ij = exp64(z_ij - max_j z_ij)
        const double z = dadd(dmul(dmul(M[r], inv), s2), base[r]);
        double e[kWarpHc];
        auto row = [&](double x) {
#pragma unroll
            for (int k = 0; k < kWarpHc; ++k)
                if (k < hc) e[k] = __shfl_sync(kFull, x, i * hc + k);
        };
        auto col = [&](double x) {
#pragma unroll
            for (int k = 0; k < kWarpHc; ++k)
                if (k < hc) e[k] = __shfl_sync(kFull, x, k * hc + j);
        };
        auto sum = [&] {  // csum64 of e[0..hc); e indexed by constants only (registers, not local memory)
            return cdot_serial<double>(hc, nm.seq, [&](int k, double& a, double& b) {
                a = e[0];
#pragma unroll
                for (int q = 1; q < kWarpHc; ++q)
                    if (k == q) a = e[q];
                b = 1.0;
            });
        };
        row(z);
        double zmax = e[0];
#pragma unroll
        for (int k = 1; k < kWarpHc; ++k)
            if (k < hc) zmax = (zmax < e[k]) ? e[k] : zmax;
        double v = exp64(dsub(z, zmax));
        row(v);
        v = dadd(ddiv(v, sum()), eps);
        col(v);
        v = ddiv(v, dadd(sum(), eps));
        for (int it = 0; it + 1 < iters; ++it) {
            row(v);
            v = ddiv(v, dadd(sum(), eps));
            col(v);
            v = ddiv(v, dadd(sum(), eps));
        }
        if (own) comb[static_cast<int64_t>(t) * nc + tid] = v;
        return;
    }
    if (own) C[tid] = dadd(dmul(dmul(M[r], inv), s2), base[r]);
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
    if (own) comb[static_cast<int64_t>(t) * nc + tid] = v;
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

// collapse + RMSNorm (attn_norm / ffn_norm) of one token per block: the collapsed row (exactly
// k_hc_collapse's operations) goes to `collapsed` and to shared memory with the norm weight (all loads of
// a batch in flight), then RMSNorm as rms_norm_rows: block64_dot over the row, y = bf16(bf16(x*inv)*w).
// Used when no injection targets the collapsed row (an injection must reach the norm's input).
constexpr int kCnThreads = 256;
constexpr int kCnPer = 8;
constexpr int kCnMaxD = 6000;  // 2D floats + red[64] within the default 48 KB of shared memory

__global__ void __launch_bounds__(kCnThreads) k_hc_collapse_norm(const float* __restrict__ X,
                                                                 const double* __restrict__ pre, int hc, int D,
                                                                 const float* __restrict__ w, float eps,
                                                                 float* collapsed, float* Y, Nm nm) {
    __shared__ float red[64];
    GLM_DYN_SMEM(float, sm);
    float* xs = sm;
    float* ws = sm + D;
    const int64_t t = blockIdx.x;
    const int tid = static_cast<int>(threadIdx.x);
    const float* xt = X + t * hc * D;
    const double* p = pre + t * hc;
    for (int i0 = 0; i0 < D; i0 += kCnThreads * kCnPer) {
        float cr[kCnPer], wr[kCnPer];
#pragma unroll
        for (int q = 0; q < kCnPer; ++q) {
            const int d = i0 + tid + kCnThreads * q;
            wr[q] = d < D ? __ldg(w + d) : 0.0f;
            cr[q] = d < D ? bf16r64(cdot_serial<double>(hc, nm.seq,
                                                        [&](int i, double& a, double& b) {
                                                            a = static_cast<double>(__ldg(xt + i * D + d));
                                                            b = p[i];
                                                        }))
                          : 0.0f;
        }
#pragma unroll
        for (int q = 0; q < kCnPer; ++q) {
            const int d = i0 + tid + kCnThreads * q;
            if (d < D) {
                xs[d] = cr[q];
                ws[d] = wr[q];
                collapsed[t * D + d] = cr[q];
            }
        }
    }
    // block64_dot starts with a barrier: the staged row is complete before it is read
    const float ss = block64_dot<float>(D, nm.seq, red, [&](int i, float& a, float& b) {
        a = xs[i];
        b = xs[i];
    });
    const float inv = fdiv(1.0f, fsqrt(fadd(fdiv(ss, static_cast<float>(D)), eps)));
    float* y = Y + t * D;
    for (int i = tid; i < D; i += kCnThreads) y[i] = bf16r(fmul(bf16r(fmul(xs[i], inv)), ws[i]));
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
             float* collapsed, const float* norm_w, float norm_eps, float* normed) {
    const Config& c = s.c;
    const int T = s.T, hc = static_cast<int>(c.hc_mult), D = static_cast<int>(c.hidden_size);
    const int n = hc * D, R = static_cast<int>(c.hc_dim());
    const int S_PRE = ffn ? S_FFN_HC_PRE : S_ATTN_HC_PRE;
    double* Pm = s.scratch.d<double>(static_cast<size_t>(T) * (R + 1) * 64);
    if (!s.nm.seq) {
        const int TT = T <= 2 ? 1 : T <= 8 ? 2 : T <= 32 ? 4 : 8;
        auto k = k_hc_m;
        GLM_LAUNCH(k, dim3(8 * (R + 1), (T + TT - 1) / TT), kMThreads, 0, X, T, n, w.fn, R, TT, Pm);
        check_launch("hc_m");
    } else {
        const int64_t total = static_cast<int64_t>(T) * (R + 1);
        auto k = k_hc_m_seq;
        GLM_LAUNCH(k, static_cast<unsigned>((total + 63) / 64), 64, 0, X, T, n, w.fn, R, Pm);
        check_launch("hc_m");
    }
    {
        const int nc = hc * hc;
        auto k = k_hc_coef;
        GLM_LAUNCH(k, T, nc <= 32 ? 64 : (nc + 31) / 32 * 32, 0, Pm, T, R, n, c.rms_norm_eps, hc, w.base,
                   w.scale[0], w.scale[1], w.scale[2], c.hc_eps, static_cast<int>(c.hc_sinkhorn_iters), pre, post,
                   comb, s.nm);
        check_launch("hc_coef");
    }
    s.emit(layer, S_PRE, pre, hc, {hc});
    s.emit(layer, S_PRE + 1, post, hc, {hc});
    s.emit(layer, S_PRE + 2, comb, static_cast<int64_t>(hc) * hc, {hc, hc});
    const bool inj_collapsed = s.inj.active && s.inj.layer == layer && s.inj.stage == S_PRE + 3;
    if (D <= kCnMaxD && !inj_collapsed) {
        auto k = k_hc_collapse_norm;
        GLM_LAUNCH(k, T, kCnThreads, 2 * static_cast<size_t>(D) * sizeof(float), X, pre, hc, D, norm_w, norm_eps,
                   collapsed, normed, s.nm);
        check_launch("hc_collapse_norm");
        s.emit(layer, S_PRE + 3, collapsed, D, {D});
        return;
    }
    {
        const int64_t total = static_cast<int64_t>(T) * D;
        auto k = k_hc_collapse;
        GLM_LAUNCH(k, static_cast<unsigned>((total + 127) / 128), 128, 0, X, pre, T, hc, D, collapsed, s.nm);
        check_launch("hc_collapse");
    }
    s.emit(layer, S_PRE + 3, collapsed, D, {D});
    rms_norm_rows(s, collapsed, D, T, D, norm_w, norm_eps, normed, D);
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
