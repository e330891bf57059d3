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
// The fused paths (canonical dots, no injection into pre or collapsed). Up to 8 tokens (decode),
// k_hc_mix, shaped for latency, splits the two long dots of a site by accumulator group: blocks per
// (group g, rows of fn, token) stage the columns of their eight partial sums (64c + 8g + l), eight lanes
// run each chain, and the last block of a token to finish (a ticket per token) folds the partial sums
// it needs, forms pre, the collapsed row and, when asked, its RMSNorm. From 9 tokens (decode batches,
// prefill) k_hc_part_chains makes every partial sum, a thread per (chain, row, tokens), and
// k_hc_mix_many, a block per token, folds them and goes on as that last block does. The Sinkhorn
// (k_hc_coef: 39 dependent normalizations, ~15 us) and post are needed only by hc_expand, after the
// sublayer: k_hc_coef runs on a side stream, overlapped with the sublayer, unless post or comb are
// captured or injected.
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

// stream j's new value at one column: bf16(cdot64([post_j, C_0j, ..., C_{hc-1,j}], row)), row = [u[d],
// X_0[d], ..., X_{hc-1}[d]] in double
GLM_DEV float hc_expand_one(const double* row, int hc, int j, const double* po, const double* co, bool seq) {
    return bf16r64(cdot_serial<double>(hc + 1, seq, [&](int i, double& a, double& b) {
        a = row[i];
        b = i == 0 ? po[j] : co[(i - 1) * hc + j];
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
// m: the site's R values m_r (the general path, k_hc_m), or nullptr and part: k_hc_mix's partial sums
// [T][R + 1][64], folded here (each row's 8x8 fold by one warp, as k_hc_mix's tail folds its rows) so
// that the mix kernel's tail keeps only what the sublayer waits for. pre: written when write_pre
// (the mix kernel writes it otherwise).
constexpr int kCoefRows = 18 * kHcMax;  // R = (2 + hc) * hc

__global__ void __launch_bounds__(256) k_hc_coef(const double* __restrict__ m, const double* __restrict__ part, int n,
                                                 double rms_eps, int T, int R, int hc, const double* __restrict__ base,
                                                 double s0, double s1, double s2, double eps, int iters, double* pre,
                                                 double* post, double* comb, Nm nm, bool write_pre) {
    pdl_enter();
    __shared__ double C[kHcMax * kHcMax];
    __shared__ double M[kCoefRows + 1];
    const int t = static_cast<int>(blockIdx.x);
    if (t >= T) return;
    const int tid = static_cast<int>(threadIdx.x);
    const bool own = tid < hc * hc;
    const int i = own ? tid / hc : 0, j = own ? tid % hc : 0;
    const double* mt = M;
    if (!part) {
        mt = m + static_cast<int64_t>(t) * R;
    } else {
        const double* pt = part + static_cast<int64_t>(t) * (R + 1) * 64;
        const int lane = tid & 31, warps = static_cast<int>(blockDim.x) >> 5;
        for (int q = tid >> 5; q <= R; q += warps) {
            const double f = warp_fold64(__ldcg(pt + 64 * q + lane), __ldcg(pt + 64 * q + lane + 32));
            if (lane == 0) M[q] = f;
        }
        __syncthreads();
        for (int q = tid; q < R; q += static_cast<int>(blockDim.x)) M[q] = hc_m(M[q], M[R], n, rms_eps);
        __syncthreads();
    }
    if (tid < hc) {
        if (write_pre) pre[static_cast<int64_t>(t) * hc + tid] = hc_pre(mt[tid], s0, base[tid], eps);
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

// What both fused kernels take (hc_site fills it once).
struct SiteArgs {
    const float* X = nullptr;  // [T][n] streams
    int n = 0, R = 0, hc = 0, D = 0;
    const double* fn = nullptr;  // [R][n]
    const double* base = nullptr;
    double s0 = 0, rms_eps = 0, hc_eps = 0;
    double* part = nullptr;        // [T][R + 1][64] partial sums (row R: cdot64(v, v))
    unsigned* tickets = nullptr;   // [T], zero between launches
    double* pre = nullptr;         // [T][hc]
    float* collapsed = nullptr;    // [T][D]
    const float* norm_w = nullptr; // RMSNorm of the collapsed row (nullptr: none)
    float norm_eps = 0;
    float* xn = nullptr;           // [T][D]
};

// The fused kernels' RMSNorm of the collapsed row c [D] (shared memory) into y, k_rmsnorm's operations:
// ss = cdot(c, c) by 64 threads, the 8x8 fold by one warp; Q: 64 floats of shared memory; nw(d): the
// weight. Every thread of the block calls it.
template <int THREADS, class Nw>
GLM_DEV void norm_collapsed(const float* c, int D, float eps, Nw nw, float* Q, float* __restrict__ y, int tid) {
    __syncthreads();
    if (tid < 64) {
        float p = 0.0f;
#pragma unroll 8
        for (int i = tid; i < D; i += 64) p = ffma(c[i], c[i], p);
        Q[tid] = p;
    }
    __syncthreads();
    if (tid < 32) {
        const float fo = warp_fold64(Q[tid], Q[tid + 32]);
        if (tid == 0) Q[0] = fo;
    }
    __syncthreads();
    const float inv = rms_inv(Q[0], D, eps);
#pragma unroll 4
    for (int d = tid; d < D; d += THREADS) y[d] = rms_out(c[d], inv, nw(d));
}

// ---- few tokens (decode): k_hc_mix ----------------------------------------------------------------
// Every sublayer of a decode step waits for its site's collapsed row, so this kernel is shaped for
// latency. 512 threads per (group g, pair of fn rows, token): fn rows and x staged by asynchronous
// copies, x converted to double once; one warp runs the three 256-step chains (two rows, and the sum
// of squares in the first pair's blocks) side by side in its lanes. The last block of the token (a
// ticket) folds only the rows pre needs (the sum of squares, fn rows 0 .. hc-1; k_hc_coef folds them
// all for post and comb, off the critical path) and requests every load it makes at once: the partial
// sums (one group), then the token's streams and norm_w (another), which arrive while pre is computed.
// Measured on the H200 (session 6, phase times by GLM_HC_PROBE): copies 2-4.7 us, a chain 3.4 us
// (23 cycles per step with the f32 -> f64 conversion in the loop, 15 without, 9 the DFMA latency),
// the one-block tail 7.5 us at 256 threads (partials 1.7, pre 1.0, collapse 2.9, norm 1.9).
#if defined(GLM_HC_PROBE) && !defined(GLM_CUDA_EMU)
// (a measurement build, -DGLM_HC_PROBE: the last block prints the tail's phase times at T = 1)
#define PROBE(...) __VA_ARGS__
GLM_DEV unsigned long long gtime() {
    unsigned long long v;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
    return v;
}
#else
#define PROBE(...)
#endif

constexpr int kMixThreads = 512;
constexpr int kMixRows = 2;  // rows of fn per block

struct MixArgs : SiteArgs {
    const float* Xin = nullptr;  // [T][n] the previous site's streams, before its hc_expand (expand only;
                                 // X, written by this kernel's first blocks, then holds them after it)
    float* Xout = nullptr;       // = X, writable (expand only)
    const float* u = nullptr;    // [T][D] the previous site's sublayer output: this kernel makes its
                                 // hc_expand (or nullptr)
    const double* post_prev = nullptr;  // [T][hc] and [T][hc][hc]: that site's post and comb
    const double* comb_prev = nullptr;
};

// Shared memory. Main phase: fn [kMixRows][nch][8] and x [nch][8] in double, x [nch][8] as staged; with
// expand, the previous site's u [D/64][8], post [hc] and comb [hc][hc].
// Tail: P [hc + 1][64] (row 0: the sum of squares, row 1 + i: fn row i), pre [hc], Q [64] floats, then
// the token's streams [hc][D] (the collapsed row written over stream 0) and norm_w [D].
size_t mix_bytes(int hc, int D, bool norm) {
    const size_t nch = (static_cast<size_t>(hc) * D + 63) / 64;
    const size_t main = nch * 8 * ((kMixRows + 1) * sizeof(double) + sizeof(float)) + D / 8 * sizeof(float) +
                        (static_cast<size_t>(hc) + hc * hc) * sizeof(double);
    const size_t head = ((static_cast<size_t>(hc) + 1) * 64 + hc) * sizeof(double) + 64 * sizeof(float);
    const size_t tail = (head + 15) / 16 * 16 + (static_cast<size_t>(hc) * D + (norm ? D : 0)) * sizeof(float);
    return std::max(main, tail);
}

// k_hc_mix's collapse for a compile-time hc: columns d0 .. d0+3 per thread and pass, the hc streams'
// values loaded (16 bytes each) before any is used, the result written over stream 0's.
template <int HC>
GLM_DEV void mix_collapse(float* rows, const double* pre_s, int D, float* __restrict__ col, int tid) {
    double pr[HC];
#pragma unroll
    for (int i = 0; i < HC; ++i) pr[i] = pre_s[i];
    for (int d0 = 4 * tid; d0 < D; d0 += 4 * kMixThreads) {
        float4 v[HC];
#pragma unroll
        for (int i = 0; i < HC; ++i) v[i] = *reinterpret_cast<const float4*>(rows + static_cast<int64_t>(i) * D + d0);
        float o[4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            o[kk] = hc_collapse(pr, HC, false, [&](int i) {
                return kk == 0 ? v[i].x : kk == 1 ? v[i].y : kk == 2 ? v[i].z : v[i].w;
            });
        *reinterpret_cast<float4*>(rows + d0) = make_float4(o[0], o[1], o[2], o[3]);
        *reinterpret_cast<float4*>(col + d0) = make_float4(o[0], o[1], o[2], o[3]);
    }
}

// The previous site's hc_expand for this block's columns: flat element 64c + 8g + l of the streams is
// stream j = c / (D/64) at column d = 64 (c % (D/64)) + 8g + l (D % 64 == 0), so the block staged every
// stream's value of its columns: each thread makes the HC new values of one column in place.
template <int HC>
GLM_DEV void mix_expand(float* xs, const float* us, const double* pc, int dc, int tid) {
    for (int col = tid; col < 8 * dc; col += kMixThreads) {
        const int c0 = col >> 3, l = col & 7;
        double row[HC + 1];
        row[0] = static_cast<double>(us[col]);
#pragma unroll
        for (int i = 0; i < HC; ++i) row[1 + i] = static_cast<double>(xs[8 * (i * dc + c0) + l]);
        float o[HC];
#pragma unroll
        for (int j = 0; j < HC; ++j) o[j] = hc_expand_one(row, HC, j, pc, pc + HC, false);
#pragma unroll
        for (int j = 0; j < HC; ++j) xs[8 * (j * dc + c0) + l] = o[j];
    }
}

__global__ void __launch_bounds__(kMixThreads) k_hc_mix(MixArgs a) {
    pdl_enter();
    PROBE(unsigned long long tp[8]; tp[0] = gtime();)
    GLM_DYN_SMEM(unsigned char, sm);
    const int g = static_cast<int>(blockIdx.x), rb = static_cast<int>(blockIdx.y), t = static_cast<int>(blockIdx.z);
    const int tid = static_cast<int>(threadIdx.x);
    const int n = a.n, R = a.R, nch = n / 64;  // (n % 64 == 0: mix_applies)
    const int r0 = kMixRows * rb, nr = R - r0 < kMixRows ? R - r0 : kMixRows, blocks = 8 * ((R + kMixRows - 1) / kMixRows);
    double* fs = reinterpret_cast<double*>(sm);            // [kMixRows][nch][8]
    double* xd = fs + kMixRows * 8 * nch;                  // [nch][8]
    float* xs = reinterpret_cast<float*>(xd + 8 * nch);    // [nch][8]
    float* us = xs + 8 * nch;                              // [D/64][8] (expand)
    double* pc = reinterpret_cast<double*>(us + a.D / 8);  // post [hc], comb [hc][hc] (expand)
    const float* x = a.X + static_cast<int64_t>(t) * n;
    const double* f = a.fn + static_cast<int64_t>(r0) * n;
    // columns 64c + 8g + l (l < 8) of the fn rows and of x, in 16-byte pieces
    for (int q = tid; q < 4 * nch * nr; q += kMixThreads) {
        const int k = q / (4 * nch), c = (q >> 2) - k * nch, p = q & 3;
        cp_async16(fs + 8 * (k * nch + c) + 2 * p, f + static_cast<int64_t>(k) * n + 64 * c + 8 * g + 2 * p);
    }
    const float* xsrc = a.u ? a.Xin + static_cast<int64_t>(t) * n : x;
    for (int q = tid; q < 2 * nch; q += kMixThreads) cp_async16(xs + 4 * q, xsrc + 64 * (q >> 1) + 8 * g + 4 * (q & 1));
    const int dc = a.D / 64;
    if (a.u) {
        const float* ut = a.u + static_cast<int64_t>(t) * a.D;
        for (int q = tid; q < 2 * dc; q += kMixThreads) cp_async16(us + 4 * q, ut + 64 * (q >> 1) + 8 * g + 4 * (q & 1));
        const int hc = a.hc;
        if (tid < hc + hc * hc)
            pc[tid] = tid < hc ? a.post_prev[static_cast<int64_t>(t) * hc + tid]
                               : a.comb_prev[static_cast<int64_t>(t) * hc * hc + tid - hc];
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    if (a.u) {  // the previous site's hc_expand (the first row pair's blocks write the new streams back)
        if (a.hc == 4)
            mix_expand<4>(xs, us, pc, dc, tid);
        else
            mix_expand<2>(xs, us, pc, dc, tid);
        __syncthreads();
        if (rb == 0) {
            float* xo = a.Xout + static_cast<int64_t>(t) * n;
            for (int q = tid; q < 2 * nch; q += kMixThreads)
                *reinterpret_cast<float4*>(xo + 64 * (q >> 1) + 8 * g + 4 * (q & 1)) = *reinterpret_cast<const float4*>(xs + 4 * q);
        }
    }
    for (int q = tid; q < 8 * nch; q += kMixThreads) xd[q] = static_cast<double>(xs[q]);  // (exact)
    __syncthreads();
    // lane 8k + l: P[g][l] of cdot64(fn_{r0+k}, v) for k < nr, of cdot64(v, v) for k = kMixRows (rb 0)
    const int k = tid >> 3, l = tid & 7;
    if (k < nr || (k == kMixRows && rb == 0)) {
        const double* w = k < nr ? fs + 8 * k * nch : xd;
        double p = 0.0;
#pragma unroll 8
        for (int c = 0; c < nch; ++c) p = dfma(w[8 * c + l], xd[8 * c + l], p);
        a.part[(static_cast<int64_t>(t) * (R + 1) + (k < nr ? r0 + k : R)) * 64 + 8 * g + l] = p;
    }
    // the last of the token's blocks goes on (the classic ticket: fence, then count)
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(a.tickets + t, 1u) == static_cast<unsigned>(blocks - 1);
    __syncthreads();
    if (!last) return;
    PROBE(tp[1] = gtime();)
    __threadfence();
    if (tid == 0) a.tickets[t] = 0u;  // ready for the next launch
    const int hc = a.hc, D = a.D, K = hc + 1;
    double* P = reinterpret_cast<double*>(sm);  // [K][64]
    double* pre_s = P + 64 * K;                 // [hc]
    float* Q = reinterpret_cast<float*>(pre_s + hc);  // [64]
    float* rows = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(Q + 64) + 15) & ~uintptr_t(15));  // [hc][D]
    float* nw_s = rows + static_cast<size_t>(hc) * D;  // [D]
    const double* __restrict__ pt = a.part + static_cast<int64_t>(t) * (R + 1) * 64;
    for (int q = tid; q < K * 32; q += kMixThreads) {  // 16-byte pieces of rows R, 0, 1, .. hc-1
        const int kk = q >> 5, row = kk == 0 ? R : kk - 1;
        cp_async16(P + 64 * kk + 2 * (q & 31), pt + 64 * row + 2 * (q & 31));
    }
    cp_async_commit();
    for (int q = tid; q < n / 4; q += kMixThreads) cp_async16(rows + 4 * q, x + 4 * q);
    if (a.norm_w)
        for (int q = tid; q < D / 4; q += kMixThreads) cp_async16(nw_s + 4 * q, a.norm_w + 4 * q);
    cp_async_commit();
    const double base_i = tid < hc ? __ldg(a.base + tid) : 0.0;
    cp_async_wait<1>();
    __syncthreads();
    PROBE(tp[2] = gtime();)
    {  // each row's 8x8 fold by one warp; the result in P[64 k]
        const int lane = tid & 31;
        for (int kk = tid >> 5; kk < K; kk += kMixThreads / 32) {
            const double fo = warp_fold64(P[64 * kk + lane], P[64 * kk + lane + 32]);
            if (lane == 0) P[64 * kk] = fo;
        }
    }
    __syncthreads();
    if (tid < hc) {
        pre_s[tid] = hc_pre(hc_m(P[64 * (1 + tid)], P[0], n, a.rms_eps), a.s0, base_i, a.hc_eps);
        a.pre[static_cast<int64_t>(t) * hc + tid] = pre_s[tid];
    }
    cp_async_wait<0>();
    __syncthreads();
    PROBE(tp[3] = gtime();)
    // collapsed[d] = bf16(cdot64(pre, X[:, d])): four consecutive d per thread, written over stream 0's
    // values of the same columns (read by this thread only, and already read)
    float* __restrict__ col = a.collapsed + static_cast<int64_t>(t) * D;
    switch (hc) {  // (hc known to the compiler: the streams' values and pre stay in registers)
        case 4: mix_collapse<4>(rows, pre_s, D, col, tid); break;
        case 2: mix_collapse<2>(rows, pre_s, D, col, tid); break;
        case 8: mix_collapse<8>(rows, pre_s, D, col, tid); break;
        default:
            for (int d = tid; d < D; d += kMixThreads) {
                const float o = hc_collapse(pre_s, hc, false, [&](int i) { return rows[static_cast<int64_t>(i) * D + d]; });
                rows[d] = o;  // (column d is this thread's alone, and read)
                col[d] = o;
            }
    }
    PROBE(tp[4] = gtime();)
    if (a.norm_w)
        norm_collapsed<kMixThreads>(rows, D, a.norm_eps, [&](int d) { return nw_s[d]; }, Q,
                                    a.xn + static_cast<int64_t>(t) * D, tid);
    PROBE(__syncthreads(); if (tid == 0 && gridDim.z == 1) {
        tp[5] = gtime();
        printf("hc_mix: chains + ticket %llu, partials %llu, pre + rows %llu, collapse %llu, norm %llu ns\n",
               tp[1] - tp[0], tp[2] - tp[1], tp[3] - tp[2], tp[4] - tp[3], tp[5] - tp[4]);
    })
}

// ---- many tokens (decode batches of 9+, prefill): k_hc_part_chains, then k_hc_mix_many ---------------
constexpr int kManyThreads = 256;

struct ManyArgs : SiteArgs {
    double* m = nullptr;  // [T][R]
};

// The partial sums of the site's two long dots, a thread per (chain k, row r, TPT tokens): part[t][r][k]
// = the fma chain of fn_r[64c + k] x v[64c + k] over the chunks c (row R: v x v), P[k / 8][k % 8] of
// cdot64. A block is the 64 chains of one row for 4 TPT tokens (the four token slots meet each fn value
// in L1): at 128 tokens 25 x 16 blocks. Each chain is a sequential walk of n / 64 steps, so what bounds
// it is how many loads are in flight, not the FMAs: 33 us a site at 128 tokens, 552 at 2048 (H200,
// perf.md "Session 19"), where the per-(group, row, token) blocks of 8 working threads took 388 us at
// 128 and an 8-token block of all rows (a thread every row's chain) 760 us at 2048.
template <int TPT>
__global__ void __launch_bounds__(256) k_hc_part_chains(const float* __restrict__ X, const double* __restrict__ fn,
                                                       int n, int T, int R, double* __restrict__ part) {
    pdl_enter();
    const int k = static_cast<int>(threadIdx.x) & 63, s = static_cast<int>(threadIdx.x) >> 6;
    const int r = static_cast<int>(blockIdx.y);  // r == R: v x v
    const int tb = static_cast<int>(blockIdx.x) * 4 * TPT;
    const float* x[TPT];
#pragma unroll
    for (int u = 0; u < TPT; ++u) {
        const int t = tb + s + 4 * u;
        x[u] = X + static_cast<int64_t>(t < T ? t : T - 1) * n;
    }
    const double* f = r < R ? fn + static_cast<int64_t>(r) * n : nullptr;
    double acc[TPT];
#pragma unroll
    for (int u = 0; u < TPT; ++u) acc[u] = 0.0;
    // Steps of B chunks: every load of a step's chunks issued before its first fma (left to itself the
    // compiler put each fn load just ahead of its fma, and every chunk waited a memory latency: 90 us a
    // site whether 32 or 128 tokens). A last chunk shorter than 64 is tested element by element.
    constexpr int B = 8;
    const int nfull = n / 64;
    auto steps = [&](int c0, auto nb_, auto last_) {
        constexpr int nb = decltype(nb_)::value;
        double w[nb], v[nb][TPT];
#pragma unroll
        for (int j = 0; j < nb; ++j) {
            const int i = 64 * (c0 + j) + k;
            const bool in = !decltype(last_)::value || i < n;
#pragma unroll
            for (int u = 0; u < TPT; ++u) v[j][u] = in ? static_cast<double>(__ldg(x[u] + i)) : 0.0;
            w[j] = in && f != nullptr ? __ldg(f + i) : 0.0;
        }
#pragma unroll
        for (int j = 0; j < nb; ++j) {
            if (decltype(last_)::value && 64 * (c0 + j) + k >= n) continue;
#pragma unroll
            for (int u = 0; u < TPT; ++u) acc[u] = dfma(f != nullptr ? w[j] : v[j][u], v[j][u], acc[u]);
        }
    };
    int c = 0;
    for (; c + B <= nfull; c += B) steps(c, std::integral_constant<int, B>{}, std::false_type{});
    for (; c < nfull; ++c) steps(c, std::integral_constant<int, 1>{}, std::false_type{});
    if (n % 64 != 0) steps(nfull, std::integral_constant<int, 1>{}, std::true_type{});
#pragma unroll
    for (int u = 0; u < TPT; ++u) {
        const int t = tb + s + 4 * u;
        if (t < T) part[(static_cast<int64_t>(t) * (R + 1) + r) * 64 + k] = acc[u];
    }
}

// A block per token after k_hc_part_chains: folds every row's partial sums, writes m (k_hc_coef reads it)
// and pre, and makes the collapsed row and its norm.
__global__ void __launch_bounds__(kManyThreads) k_hc_mix_many(ManyArgs a, bool vec) {
    pdl_enter();
    GLM_DYN_SMEM(unsigned char, sm);
    const int t = static_cast<int>(blockIdx.x);
    const int tid = static_cast<int>(threadIdx.x);
    const int n = a.n, R = a.R;
    const float* x = a.X + static_cast<int64_t>(t) * n;
    // (every loop below keeps its loads independent of its stores, so they stay in flight together; a
    // loop that reloads after each store pays the L2 latency per element)
    const int hc = a.hc, D = a.D;
    double* P = reinterpret_cast<double*>(sm);  // [R + 1][64]
    double* mt = P + 64 * (R + 1);   // [R]
    double* pre_s = mt + R;          // [hc]
    float* Q = reinterpret_cast<float*>(pre_s + hc);  // [64]
    float* cs = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(Q + 64) + 15) & ~uintptr_t(15));  // [D] the collapsed row
    {
        const double* __restrict__ pt = a.part + static_cast<int64_t>(t) * (R + 1) * 64;
#pragma unroll 4
        for (int q = tid; q < (R + 1) * 64; q += kManyThreads) P[q] = __ldcg(pt + q);
    }
    __syncthreads();
    {  // each row's 8x8 fold by one warp; the result in P[64 r]
        const int lane = tid & 31;
        for (int q = tid >> 5; q <= R; q += kManyThreads / 32) {
            const double f = warp_fold64(P[64 * q + lane], P[64 * q + lane + 32]);
            if (lane == 0) P[64 * q] = f;
        }
    }
    __syncthreads();
    for (int q = tid; q < R; q += kManyThreads) {
        mt[q] = hc_m(P[64 * q], P[64 * R], n, a.rms_eps);
        a.m[static_cast<int64_t>(t) * R + q] = mt[q];
    }
    __syncthreads();
    if (tid < hc) {
        pre_s[tid] = hc_pre(mt[tid], a.s0, a.base[tid], a.hc_eps);
        a.pre[static_cast<int64_t>(t) * hc + tid] = pre_s[tid];
    }
    __syncthreads();
    // collapsed[d] = bf16(cdot64(pre, X[:, d])): four consecutive d per thread, the streams' values
    // loaded (16 bytes each) before any is used
    float* __restrict__ col = a.collapsed + static_cast<int64_t>(t) * D;
    if (vec && D % 4 == 0 && hc <= 8) {
        for (int d0 = 4 * tid; d0 < D; d0 += 4 * kManyThreads) {
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
        for (int d = tid; d < D; d += kManyThreads) {
            cs[d] = hc_collapse(pre_s, hc, false, [&](int i) { return x[static_cast<int64_t>(i) * D + d]; });
            col[d] = cs[d];
        }
    }
    if (a.norm_w)
        norm_collapsed<kManyThreads>(cs, D, a.norm_eps, [&](int d) { return __ldg(a.norm_w + d); }, Q,
                                     a.xn + static_cast<int64_t>(t) * D, tid);
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

// HC: hc known to the compiler (2, 4, 8: the row and the outputs in registers; with hc at run time, HC = 0,
// they are in local memory: 265 us a site at 2048 tokens of the slice against ~130 for its bytes).
template <int HC>
__global__ void k_hc_expand(const float* Xin, float* Xout, const float* __restrict__ u, const double* __restrict__ post,
                            const double* __restrict__ comb, int T, int hc_rt, int D, Nm nm) {
    pdl_enter();
    const int hc = HC > 0 ? HC : hc_rt;
    const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (k >= static_cast<int64_t>(T) * D) return;
    const int64_t t = k / D, d = k % D;
    const float* xt = Xin + t * hc * D;  // (Xout may be Xin: each thread reads its column before writing it)
    constexpr int N = HC > 0 ? HC : kHcMax;
    double row[N + 1];
    row[0] = static_cast<double>(u[t * D + d]);
#pragma unroll
    for (int i = 0; i < N; ++i)
        if (i < hc) row[1 + i] = static_cast<double>(xt[i * D + d]);
    const double* po = post + t * hc;
    const double* co = comb + t * hc * hc;
    float out[N];
#pragma unroll
    for (int j = 0; j < N; ++j)
        if (j < hc) out[j] = hc_expand_one(row, hc, j, po, co, nm.seq);
#pragma unroll
    for (int j = 0; j < N; ++j)
        if (j < hc) Xout[t * hc * D + j * D + d] = out[j];
}

}  // namespace

namespace {
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Which mHC kernels a site takes. The fused kernels need canonical dots and no injection into pre or
// collapsed (they would have to land between the kernel's steps): k_hc_mix for a few tokens with
// rows in 16-byte pieces and its shared memory within bounds, else k_hc_mix_many within its bounds;
// else the general path (k_hc_m, k_hc_coef, k_hc_collapse).
enum class HcPath { few, many, general };
HcPath hc_path(const Step& s, int layer, int S_PRE, int hc, int D, int R, const HcW& w, const float* X,
               const float* norm_w, size_t& smem) {
    const int n = hc * D;
    if (s.nm.seq || hc > kHcMax || s.injects(layer, S_PRE) || s.injects(layer, S_PRE + 3)) return HcPath::general;
    if (s.T <= 8 && hc <= 8 && n % 64 == 0 && D % 4 == 0 && aligned16(X) && aligned16(w.fn) &&
        (!norm_w || aligned16(norm_w))) {
        smem = mix_bytes(hc, D, norm_w != nullptr);
        if (smem <= 200 * 1024) return HcPath::few;
    }
    smem = (static_cast<size_t>(R) + 1) * 64 * sizeof(double) + (static_cast<size_t>(R) + hc) * sizeof(double) +
           (64 + static_cast<size_t>(D) + 4) * sizeof(float);  // k_hc_mix_many's
    return smem <= 96 * 1024 ? HcPath::many : HcPath::general;
}
}  // namespace

bool hc_site(Step& s, int layer, bool ffn, const HcW& w, const float* X, double* pre, double* post, double* comb,
             float* collapsed, const float* norm_w, float norm_eps, float* xn) {
    const Config& c = s.c;
    const int T = s.T, hc = static_cast<int>(c.hc_mult), D = static_cast<int>(c.hidden_size);
    const int n = hc * D, R = static_cast<int>(c.hc_dim());
    const int S_PRE = ffn ? S_FFN_HC_PRE : S_ATTN_HC_PRE;
    size_t smem = 0;
    const HcPath path = hc_path(s, layer, S_PRE, hc, D, R, w, X, norm_w, smem);
    const bool mix = path != HcPath::general;
    const bool norm = mix && norm_w != nullptr;
    double* m = nullptr;     // m_r, by k_hc_m or k_hc_mix_many
    double* part = nullptr;  // k_hc_mix's partial sums (k_hc_coef folds them)
    SiteArgs sa{};
    if (mix) {
        sa.X = X;
        sa.n = n;
        sa.R = R;
        sa.hc = hc;
        sa.D = D;
        sa.fn = w.fn;
        sa.base = w.base;
        sa.s0 = w.scale[0];
        sa.rms_eps = c.rms_norm_eps;
        sa.hc_eps = c.hc_eps;
        sa.part = s.scratch.d<double>(static_cast<size_t>(T) * (R + 1) * 64);
        if (path == HcPath::few) sa.tickets = s.E.hc_tickets(T);  // (k_hc_mix's last-block tickets)
        sa.pre = pre;
        sa.collapsed = collapsed;
        sa.norm_w = norm ? norm_w : nullptr;
        sa.norm_eps = norm_eps;
        sa.xn = xn;
    }
    const bool fuse = s.hc_pending.in != nullptr && path == HcPath::few;
    if (s.hc_pending.in && !fuse) hc_flush(s);
    if (path == HcPath::few) {
        MixArgs a{};
        static_cast<SiteArgs&>(a) = sa;
        part = sa.part;
        if (fuse) {  // the previous site's hc_expand, made here (X is its output buffer)
            s.E.side.join();  // (that site's post and comb, when they ran on the side stream)
            a.Xin = s.hc_pending.in;
            a.Xout = s.hc_pending.out;
            a.u = s.hc_pending.u;
            a.post_prev = s.hc_pending.post;
            a.comb_prev = s.hc_pending.comb;
            s.hc_pending = {};
        }
        auto k = k_hc_mix;
        allow_smem(k, smem);
        GLM_LAUNCH(k, dim3(8, (R + kMixRows - 1) / kMixRows, T), kMixThreads, smem, a);
        check_launch("hc_mix");
    } else if (path == HcPath::many) {
        m = s.scratch.d<double>(static_cast<size_t>(T) * R);
        ManyArgs a{};
        static_cast<SiteArgs&>(a) = sa;
        a.m = m;
        const bool vec = n % 64 == 0 && aligned16(X) && aligned16(w.fn);
        // (tokens a thread: enough blocks to keep the SMs' loads in flight at 9-63 tokens, fewer x
        // loads per fma from 64 and from 256)
        const int tpt = T >= 256 ? 4 : (T >= 64 ? 2 : 1);
        auto kc = tpt == 4 ? k_hc_part_chains<4> : (tpt == 2 ? k_hc_part_chains<2> : k_hc_part_chains<1>);
        GLM_LAUNCH(kc, dim3(static_cast<unsigned>((T + 4 * tpt - 1) / (4 * tpt)), static_cast<unsigned>(R + 1)), 256, 0, X,
                   w.fn, n, T, R, sa.part);
        check_launch("hc_part_chains");
        auto k = k_hc_mix_many;
        allow_smem(k, 96 * 1024);
        GLM_LAUNCH(k, static_cast<unsigned>(T), kManyThreads, smem, a, vec);
        check_launch("hc_mix_many");
    } else {
        m = s.scratch.d<double>(static_cast<size_t>(T) * R);
        auto k = k_hc_m;
        GLM_LAUNCH(k, dim3(R, T), 64, 0, X, n, w.fn, c.rms_norm_eps, m, R, s.nm);
        check_launch("hc_m");
    }
    // the Sinkhorn and post (after k_hc_mix, with the fold of their rows): off the critical path on the
    // side stream when nothing observes post or comb before hc_expand (which waits for it)
    const bool side = mix && !s.wants_any(layer, S_PRE + 1) && !s.wants_any(layer, S_PRE + 2) &&
                      !s.injects(layer, S_PRE + 1) && !s.injects(layer, S_PRE + 2);
    {
        auto k = k_hc_coef;
        const unsigned threads = part ? 256u : static_cast<unsigned>((hc * hc + 31) / 32 * 32);
        cudaStream_t st = side ? s.E.side.fork() : cudaStream_t(0);
        GLM_LAUNCH_ON(st, k, T, threads, 0, m, part, n, c.rms_norm_eps, T, R, hc, w.base, w.scale[0], w.scale[1],
                      w.scale[2], c.hc_eps, static_cast<int>(c.hc_sinkhorn_iters), pre, post, comb, s.nm, !mix);
        check_launch("hc_coef");
        if (side) s.E.side.join_later();
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

namespace {
void launch_expand(Step& s, const float* Xin, float* Xout, const float* u, const double* post, const double* comb) {
    s.E.side.join();  // the site's Sinkhorn and post, when they ran on the side stream
    const int T = s.T, hc = static_cast<int>(s.c.hc_mult), D = static_cast<int>(s.c.hidden_size);
    const int64_t total = static_cast<int64_t>(T) * D;
    auto k = hc == 4 ? k_hc_expand<4> : (hc == 2 ? k_hc_expand<2> : (hc == 8 ? k_hc_expand<8> : k_hc_expand<0>));
    GLM_LAUNCH(k, static_cast<unsigned>((total + 127) / 128), 128, 0, Xin, Xout, u, post, comb, T, hc, D, s.nm);
    check_launch("hc_expand");
}
}  // namespace

void hc_flush(Step& s) {
    if (!s.hc_pending.in) return;
    const Step::HcPending p = s.hc_pending;
    s.hc_pending = {};
    launch_expand(s, p.in, p.out, p.u, p.post, p.comb);
}

float* hc_expand(Step& s, int layer, bool ffn, float* X, float* spare, const float* u, const double* post,
                 const double* comb, bool last) {
    const int hc = static_cast<int>(s.c.hc_mult), D = static_cast<int>(s.c.hidden_size);
    const int stage = ffn ? S_FFN_HC_STREAMS : S_ATTN_HC_STREAMS;
    // deferred into the next site's k_hc_mix (which reads X and writes the new streams into spare) when
    // nothing observes the streams in between; that site launches it here after all if it cannot
    if (s.E.opts.hc_fuse && spare && !last && s.T <= 8 && !s.nm.seq && (hc == 2 || hc == 4) && D % 64 == 0 &&
        !s.wants_any(layer, stage) && !s.injects(layer, stage) && aligned16(X) && aligned16(spare) && aligned16(u)) {
        s.hc_pending = {X, spare, u, post, comb};
        return spare;
    }
    launch_expand(s, X, X, u, post, comb);
    s.emit(layer, stage, X, static_cast<int64_t>(hc) * D, {hc, D});
    return X;
}

}  // namespace glm::cuda
