// The greedy token without every logit (docs/engine_cuda.md, "The bounded head"). A decode step that
// asks only for each row's greedy token needs the argmax of the canonical logits, not the logits:
//
//   1. W (lm_head) is rounded once per row to one byte an element: h = rint(w / s_w), s_w = max|w| / 127
//      (|h| <= 127), with the residual e = w - h s_w. x (final_norm) is rounded per row to 14-bit
//      integers q = rint(x 2^(13 - E)) with 2^E > max|x|, split q = 128 hi + lo (two int8 limbs). The
//      integer tensor cores give S = sum h q exactly (two products, h hi and h lo, into int32
//      accumulators: integer sums have no order), and A = S s_w 2^(E - 13) is the dot of the rounded
//      vectors. Reading one byte a weight (where two limbs of a 14-bit w were read until session 29)
//      halves the bytes of the step's largest matrix; the wider bound keeps more candidates (tens of
//      rows a token on random weights, against one or two), whose exact dots read a few rows each.
//   2. B bounds |canonical logit - A|: the canonical cdot's own error, gamma(ceil(K/64) + 6) sum|w x| <=
//      gamma ||w||_2 ||x||_2 (every term passes one FMA per chain step and six folds), plus the rounding of
//      the vectors: w x - w^ x^ = e x + w^ (x - x^), so ||e||_2 ||x||_2 + ||w^||_1 2^(E - 14) (each x
//      element moved by at most half a step), plus 2^-50 |A| (the rounding of S s_w); in double, widened
//      by 2^-30 (which also covers the rounding of each double operation, the square roots' included) and
//      one float step each way as floats [lo, hi] (a step keeps every hi and each token's largest lo).
//   3. The canonical argmax r* has logit >= every other, so A_r* + B_r* >= max_j (A_j - B_j): only rows
//      whose upper end reaches the largest lower end can win. Their canonical logits (group_dot, the same
//      association as every linear kernel) are computed and the best taken by np.argmax's rule.
//
// When a row's candidates exceed kHbCap, its x is not finite, or a logit could overflow, the step's
// flag is set and the caller runs the full head for the step (the same bits, more time).
#include "engine.cuh"

namespace glm::cuda {
namespace {

constexpr int kHbTiles = 8;     // 16-row tiles of a product block: 128 rows
constexpr int kHbKs = 4;        // k-steps (32 columns each) of a pipeline stage
constexpr int kHbDepth = 3;     // stages of the ring
constexpr int kHbCap = 1024;    // candidates a token keeps; more sets the flag
constexpr int kHbQ = 13;        // x: |q| <= 2^13
constexpr int kHbW = 127;       // lm_head: |h| <= 127
// Steps of fewer greedy rows keep the full head. With one byte a weight the bounded head reads half the
// full head's bytes, and it is faster from one row (b1 on the H200: 1215-1286 tok/s against 1069-1112,
// docs/perf.md "Session 29"); with two bytes (until session 29) it took 8 rows to pay for its launches.
constexpr int kHbMinRows = 1;

// The byte of element (row m < 16, column k < 32) in an A fragment [lane][word] of a 16 x 32 tile, and
// of element (k < 32, token n < 8) in a B fragment [lane][word] (compat.cuh: mma_s8_16832).
GLM_DEV int a_byte(int m, int k) {
    const int lane = (m & 7) * 4 + ((k & 15) >> 2), word = (m >> 3) + 2 * (k >> 4);
    return (lane * 4 + word) * 4 + (k & 3);
}
GLM_DEV int b_byte(int k, int n) {
    const int lane = n * 4 + ((k & 15) >> 2), word = k >> 4;
    return (lane * 2 + word) * 4 + (k & 3);
}

// Quantization exponent: the smallest E with 2^E > max|v| (max 0: a row of zeros, any E).
GLM_DEV int hb_exponent(double mx) {
    if (!(mx > 0.0)) return -140;
    int e = 0;
    (void)frexp(mx, &e);  // mx = f 2^e, f in [0.5, 1)
    return e;
}

// A row's max|v| and sum v^2 (thread i of STRIDE takes columns i, i + STRIDE, ...; then a butterfly over
// the lanes of its warp) and whether a value is not finite: both quantizers' first pass.
template <int STRIDE, class Get>
GLM_DEV void hb_row_stats(int C, int i, Get get, double& mx, double& ss, int& nonfinite) {
    mx = 0.0, ss = 0.0, nonfinite = 0;
#pragma unroll 8
    for (int k = i; k < C; k += STRIDE) {
        const double v = static_cast<double>(get(k));
        if (!(v - v == 0.0)) nonfinite = 1;
        const double a = v < 0 ? -v : v;
        mx = a > mx ? a : mx;
        ss = dfma(v, v, ss);  // (v v is exact: v is a float)
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) {
        const double m2 = __shfl_xor_sync(kFull, mx, o);
        mx = m2 > mx ? m2 : mx;
        ss = dadd(ss, __shfl_xor_sync(kFull, ss, o));
        nonfinite |= __shfl_xor_sync(kFull, nonfinite, o);
    }
}

// lm_head's rows, one warp a row: h = rint(w / s) (s = max|w| / 127) in A fragments [tile][k-step][lane][4
// words] (rows past R and columns past C stay zero), and per row s, ||w||_2, ||e||_2 (e = w - h s, each
// e_k by dsub(w, dmul(h, s)) and summed as dadd(e2, dmul(e, e)): the reference repeats these operations)
// and ||w^||_1 = s sum|h|. bad: set when a weight is not finite.
__global__ void __launch_bounds__(256) k_hb_quant_w(Lin W, int KS, int8_t* q, double* sw, double* n2, double* e2,
                                                    double* l1, int* bad) {
    pdl_enter();
    const int r = static_cast<int>((static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5);
    if (r >= W.R) return;  // (whole warps)
    const int C = static_cast<int>(W.C), lane = static_cast<int>(threadIdx.x & 31u);
    auto get = [&](int k) { return decode_elem(W.fmt, W.data, W.scale, W.row0 + r, k, W.C); };
    double mx, ss;
    int nonfinite;
    hb_row_stats<32>(C, lane, get, mx, ss, nonfinite);
    const double s = nonfinite ? 0.0 : ddiv(mx, static_cast<double>(kHbW));
    double es = 0.0;
    long long l1h = 0;
    if (s > 0.0) {
        for (int k = lane; k < C; k += 32) {
            const double v = static_cast<double>(get(k));
            double h = rint(ddiv(v, s));
            h = h > kHbW ? kHbW : (h < -kHbW ? -kHbW : h);
            const double e = dsub(v, dmul(h, s));
            es = dadd(es, dmul(e, e));
            const int hi = static_cast<int>(h);
            q[(static_cast<int64_t>(r >> 4) * KS + (k >> 5)) * 512 + a_byte(r & 15, k & 31)] = static_cast<int8_t>(hi);
            l1h += hi < 0 ? -hi : hi;
        }
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) {
        es = dadd(es, __shfl_xor_sync(kFull, es, o));
        l1h += __shfl_xor_sync(kFull, l1h, o);
    }
    if (lane == 0) {
        sw[r] = s;
        n2[r] = dsqrt(ss);
        e2[r] = dsqrt(es);
        l1[r] = dmul(static_cast<double>(l1h), s);  // (the integer sum is exact: below 2^53)
        if (nonfinite) bad[r] = 1;
    }
}

// The step's x rows (final_norm, [n][D] floats), a block of kQxThreads a row: the exponent, ||x||_2 and
// the two limbs of q in B fragments [8-token tile][k-step][limb][lane][2 words]. Thread i takes columns
// i, i + 256, ... (its sum of squares in that order), then a butterfly over the lanes of its warp and one
// over the warps (xor 4, 2, 1 of the warp index); the reference repeats it. (One warp a row spent ~20 us
// a b1 step on 128 dependent loads a lane.) Launched for whole 8-token tiles: the blocks past n, and
// every row's columns past D, write the zeros of the tiles' padding.
constexpr int kQxThreads = 256;
__global__ void __launch_bounds__(kQxThreads) k_hb_quant_x(const float* x, int n, int D, int KS, int8_t* q,
                                                           int* E_out, double* n2, int* bad, double n2w_max) {
    pdl_enter();
    __shared__ double wmx[kQxThreads / 32], wss[kQxThreads / 32];
    __shared__ int wbad[kQxThreads / 32];
    const int t = static_cast<int>(blockIdx.x), tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
    const float* xt = x + static_cast<int64_t>(t) * D;
    double mx, ss;
    int nonfinite;
    hb_row_stats<kQxThreads>(t < n ? D : 0, tid, [&](int k) { return xt[k]; }, mx, ss, nonfinite);
    if (lane == 0) wmx[warp] = mx, wss[warp] = ss, wbad[warp] = nonfinite;
    __syncthreads();
    double a[kQxThreads / 32];
    mx = 0.0, nonfinite = 0;
#pragma unroll
    for (int w = 0; w < kQxThreads / 32; ++w) {
        a[w] = wss[w];
        mx = wmx[w] > mx ? wmx[w] : mx;
        nonfinite |= wbad[w];
    }
#pragma unroll
    for (int o = kQxThreads / 64; o >= 1; o >>= 1) {
        double b[kQxThreads / 32];
#pragma unroll
        for (int w = 0; w < kQxThreads / 32; ++w) b[w] = dadd(a[w], a[w ^ o]);
#pragma unroll
        for (int w = 0; w < kQxThreads / 32; ++w) a[w] = b[w];
    }
    const int E = hb_exponent(mx);
#pragma unroll 4
    for (int k = tid; k < 32 * KS; k += kQxThreads) {
        int h = 0, l = 0;
        if (t < n && k < D && !nonfinite) {
            const int qq = static_cast<int>(rint(ldexp(static_cast<double>(xt[k]), kHbQ - E)));  // |q| <= 2^13
            h = (qq + 64) >> 7;                                                                  // floor((q + 64) / 128)
            l = qq - 128 * h;
        }
        const int64_t off = ((static_cast<int64_t>(t >> 3) * KS + (k >> 5)) * 2 * 32 * 8) + b_byte(k & 31, t & 7);
        q[off] = static_cast<int8_t>(h);
        q[off + 256] = static_cast<int8_t>(l);
    }
    if (tid == 0 && t < n) {
        E_out[t] = E;
        n2[t] = dsqrt(a[0]);
        // |logit| <= ||w||_2 ||x||_2: far from float's range, or the full head decides
        if (nonfinite || !(dmul(n2[t], n2w_max) < 0x1p100)) bad[t] = 1;
    }
}

GLM_DEV uint32_t order_key(float f) {  // a u32 whose order is the floats' (no NaN here)
    const uint32_t b = f32_bits(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
GLM_DEV float from_order_key(uint32_t k) { return f32_from_bits((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k); }

struct HbStats {
    const double *sw, *n2w, *e2w, *l1w;  // per lm_head row: s_w, ||w||_2, ||e||_2, ||w^||_1
    const int* Ex;                       // per token: x's exponent and ||x||_2
    const double* n2x;
    double gamma;
};

// The device buffers of one run over n rows (the step's scratch, or the test entry's own). zeroed: what
// one memset a run clears, keys [n] (64-bit), then bad, thr and tickets [n] (32-bit).
struct HbBufs {
    int8_t* xq;
    int *Ex, *cand;
    double* n2x;
    float *lo, *hi;
    unsigned char* zeroed;
    int n;
    unsigned long long* keys() const { return reinterpret_cast<unsigned long long*>(zeroed); }
    int* bad() const { return reinterpret_cast<int*>(zeroed + 8 * static_cast<size_t>(n)); }
    uint32_t* thr() const { return reinterpret_cast<uint32_t*>(zeroed + 12 * static_cast<size_t>(n)); }
    unsigned* tickets() const { return reinterpret_cast<unsigned*>(zeroed + 16 * static_cast<size_t>(n)); }
};
size_t zeroed_bytes(int n) { return 20 * static_cast<size_t>(n); }

// [A - B, A + B] for rows x tokens. A block: 8 row tiles (128 rows) x NH x NTW token tiles; warp w takes
// row tile w % 8 and token half w / 8 (NTW 8-token tiles). The limbs of W and x go through shared memory
// in a ring of kHbDepth stages of kHbKs k-steps (cp.async), so that each SM keeps two stages of W in
// flight from HBM while it multiplies the third. W's A fragments are one byte an element; x's B fragments
// two limbs.
template <int NTW, int NH>
struct HbShape {
    static constexpr int warps = kHbTiles * NH, threads = 32 * warps, tokens = 8 * NTW * NH;
    static constexpr int w_stage = kHbTiles * kHbKs * 32;  // uint4: tiles x k-steps x 32 lanes
    static constexpr int x_stage = NH * NTW * kHbKs * 64;  // uint2: token tiles x k-steps x 2 limbs x 32 lanes
    static constexpr size_t smem = kHbDepth * (w_stage * sizeof(uint4) + x_stage * sizeof(uint2));
};

template <int NTW, int NH>
__global__ void __launch_bounds__(HbShape<NTW, NH>::threads) k_hb_product(const uint4* __restrict__ wq,
                                                                          const uint2* __restrict__ xq, int R, int n,
                                                                          int KS, HbStats st, float* lo, float* hi,
                                                                          int64_t ld, uint32_t* thr) {
    pdl_enter();
    using Sh = HbShape<NTW, NH>;
    GLM_DYN_SMEM(uint4, wring);
    uint2* xring = reinterpret_cast<uint2*>(wring + kHbDepth * Sh::w_stage);
    __shared__ uint32_t tmax[kHbTiles][Sh::tokens];
    const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
    const int RT = (R + 15) / 16, NT = (n + 7) / 8;
    const int tile0 = static_cast<int>(blockIdx.x) * kHbTiles, nt0 = static_cast<int>(blockIdx.y) * NTW * NH;
    const int wt = warp % kHbTiles, half = warp / kHbTiles, tile = tile0 + wt;
    const int nst = (KS + kHbKs - 1) / kHbKs;
    auto issue = [&](int p) {  // stage p's limbs into its ring slot
        uint4* ws = wring + (p % kHbDepth) * Sh::w_stage;
        uint4* xs = reinterpret_cast<uint4*>(xring + (p % kHbDepth) * Sh::x_stage);
        const int ks0 = p * kHbKs, nks = KS - ks0 < kHbKs ? KS - ks0 : kHbKs;
        for (int e = tid; e < Sh::w_stage; e += Sh::threads) {
            const int i = e / (kHbKs * 32), c = e % (kHbKs * 32);
            if (tile0 + i < RT && c < nks * 32) cp_async16(ws + e, wq + (static_cast<int64_t>(tile0 + i) * KS + ks0) * 32 + c);
        }
        for (int e = tid; e < Sh::x_stage / 2; e += Sh::threads) {
            const int j = e / (kHbKs * 32), c = e % (kHbKs * 32);
            if (nt0 + j < NT && c < nks * 32)
                cp_async16(xs + e, reinterpret_cast<const uint4*>(xq + (static_cast<int64_t>(nt0 + j) * KS + ks0) * 64) + c);
        }
    };
    int acc[NTW][2][4];  // h hi, h lo
#pragma unroll
    for (int j = 0; j < NTW; ++j)
#pragma unroll
        for (int p = 0; p < 2; ++p)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][p][i] = 0;
#pragma unroll
    for (int p = 0; p < kHbDepth - 1; ++p) {
        if (p < nst) issue(p);
        cp_async_commit();
    }
    for (int sg = 0; sg < nst; ++sg) {
        cp_async_wait<kHbDepth - 2>();
        __syncthreads();  // stage sg landed for every thread's copies; slot (sg - 1) % depth is free
        if (sg + kHbDepth - 1 < nst) issue(sg + kHbDepth - 1);
        cp_async_commit();
        const uint4* ws = wring + (sg % kHbDepth) * Sh::w_stage + wt * (kHbKs * 32);
        const uint2* xs = xring + (sg % kHbDepth) * Sh::x_stage + half * NTW * (kHbKs * 64);
#pragma unroll
        for (int s = 0; s < kHbKs; ++s) {
            if (sg * kHbKs + s >= KS) break;
            const uint4 h4 = ws[s * 32 + lane];
            const uint32_t ah[4] = {h4.x, h4.y, h4.z, h4.w};
            uint32_t bh[NTW][2], bl[NTW][2];
#pragma unroll
            for (int j = 0; j < NTW; ++j) {
                const uint2 bh2 = xs[j * (kHbKs * 64) + s * 64 + lane], bl2 = xs[j * (kHbKs * 64) + s * 64 + 32 + lane];
                bh[j][0] = bh2.x, bh[j][1] = bh2.y, bl[j][0] = bl2.x, bl[j][1] = bl2.y;
            }
#pragma unroll
            for (int j = 0; j < NTW; ++j) {
                mma_s8_16832(acc[j][0], ah, bh[j]);
                mma_s8_16832(acc[j][1], ah, bl[j]);
            }
        }
    }
    // epilogue: the interval of each (row, token), and each token's largest lower end over the block
    const int g = lane >> 2, qd = lane & 3;
#pragma unroll
    for (int j = 0; j < NTW; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {  // the lane's two tokens of tile j
            const int tb = (half * NTW + j) * 8 + 2 * qd + c, t = nt0 * 8 + tb;
            uint32_t best = 0u;
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // rows g and g + 8
                const int i = 2 * h + c, r = tile * 16 + g + 8 * h;
                if (tile < RT && r < R && t < n) {
                    const long long S = (static_cast<long long>(acc[j][0][i]) << 7) + static_cast<long long>(acc[j][1][i]);
                    const int ex = st.Ex[t];
                    const double A = ldexp(dmul(static_cast<double>(S), st.sw[r]), ex - kHbQ);
                    const double n2x = st.n2x[t];
                    double B = dmul(dmul(st.gamma, st.n2w[r]), n2x);
                    B = dadd(B, dmul(st.e2w[r], n2x));
                    B = dadd(B, ldexp(st.l1w[r], ex - kHbQ - 1));
                    B = dadd(B, ldexp(A < 0 ? -A : A, -50));
                    B = dadd(dmul(B, 1.0 + 0x1p-30), 0x1p-120);
                    const float lof = nextafterf(static_cast<float>(dsub(A, B)), -INFINITY);
                    const float hif = nextafterf(static_cast<float>(dadd(A, B)), INFINITY);
                    if (lo) lo[static_cast<int64_t>(t) * ld + r] = lof;  // (the test entry's; a step needs only hi)
                    hi[static_cast<int64_t>(t) * ld + r] = hif;
                    const uint32_t k = order_key(lof);
                    best = k > best ? k : best;
                }
            }
#pragma unroll
            for (int o = 4; o <= 16; o <<= 1) {  // over the 8 lanes of the same token
                const uint32_t other = __shfl_xor_sync(kFull, best, o);
                best = other > best ? other : best;
            }
            if (g == 0) tmax[wt][tb] = best;
        }
    }
    __syncthreads();
    if (tid < Sh::tokens) {
        uint32_t best = 0u;
        for (int w = 0; w < kHbTiles; ++w) best = tmax[w][tid] > best ? tmax[w][tid] : best;
        const int t = nt0 * 8 + tid;
        if (t < n && best != 0u) atomicMax(thr + t, best);
    }
}

template <int NTW, int NH>
void launch_product(const HeadBound& hb, int R, int n, const HbStats& st, const HbBufs& b) {
    using Sh = HbShape<NTW, NH>;
    auto k = k_hb_product<NTW, NH>;
    allow_smem(k, Sh::smem);
    const dim3 grid(blocks((R + 15) / 16, kHbTiles), blocks(n, Sh::tokens));
    GLM_LAUNCH(k, grid, Sh::threads, Sh::smem, hb.wq.as<uint4>(), reinterpret_cast<const uint2*>(b.xq), R, n, hb.KS, st,
               b.lo, b.hi, static_cast<int64_t>(R), b.thr());
    check_launch("head bound product");
}

// The rows whose upper end reaches the token's largest lower end: kSelRows rows a thread (16-byte loads
// where R and ld are multiples of 4; one float a thread kept 8 KB in flight an SM: b128's 79 MB of upper
// ends took 94 us). The candidates' order is the atomics' (k_hb_exact's choice does not depend on it).
constexpr int kSelRows = 4;
__global__ void __launch_bounds__(256) k_hb_select(const float* hi, int R, int64_t ld, const uint32_t* thr, int* count,
                                                   int* cand) {
    pdl_enter();
    const int t = static_cast<int>(blockIdx.y);
    const int r0 = (static_cast<int>(blockIdx.x) * 256 + static_cast<int>(threadIdx.x)) * kSelRows;
    if (r0 >= R) return;
    const float* h = hi + static_cast<int64_t>(t) * ld;
    float v[kSelRows];
    if (R % 4 == 0 && ld % 4 == 0) {
        const float4 q = __ldcg(reinterpret_cast<const float4*>(h + r0));
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
#pragma unroll
        for (int k = 0; k < kSelRows; ++k) v[k] = r0 + k < R ? h[r0 + k] : -INFINITY;
    }
    const float th = from_order_key(thr[t]);
#pragma unroll
    for (int k = 0; k < kSelRows; ++k)
        if (r0 + k < R && v[k] >= th) {
            const int i = atomicAdd(count + t, 1);
            if (i < kHbCap) cand[static_cast<int64_t>(t) * kHbCap + i] = r0 + k;
        }
}

// The candidates' canonical logits (eight threads a dot: group_dot, every linear kernel's association)
// and the best by np.argmax's rule; the flag when the bound could not decide. A token's candidates are
// dealt round-robin over P = gridDim.y blocks (candidate c to block c % P, 32 dots a round): one token
// takes kExactParts1 (its tens of candidates one dot a block, each on its own SM: b1 18.6 -> 15.5 us against
// session 29's eight blocks of 32 consecutive candidates), more tokens kExactParts (at b128, 32 blocks a
// token were 30.0 -> 67.8 us: thousands of blocks of one or two dots). Each block's best goes to
// the token's key by a 64-bit atomicMax (the logit's order key above the row's complement: the larger
// logit, then the lower row; logits here are finite, and -0 counts as +0 as np.argmax's comparison
// does), and the token's last block (a ticket) writes the token and the flag.
constexpr int kExactParts = 8, kExactParts1 = 32;
// (x, count, cand and bad_x come from this step's earlier kernels: not __restrict__, or the compiler may load
// them before pdl_enter's wait, as it did in two variants measured in session 29: docs/engine_cuda.md, "PDL")
__global__ void __launch_bounds__(256) k_hb_exact(Lin W, const float* x, int D, const int* count, const int* cand,
                                                  const int* bad_x, unsigned long long* keys,
                                                  unsigned* tickets, int* out, int* flag) {
    pdl_enter();
    __shared__ float bv[32];
    __shared__ int bi[32];
    const int t = static_cast<int>(blockIdx.x), part = static_cast<int>(blockIdx.y), P = static_cast<int>(gridDim.y);
    const int grp = static_cast<int>(threadIdx.x >> 3);  // 32 groups of eight
    const int nc = count[t] < kHbCap ? count[t] : kHbCap;
    const float* xt = x + static_cast<int64_t>(t) * D;
    // BF16 rows of whole 8-weight groups, 16-byte aligned (lm_head's: 40 us a step of scalar loads before)
    const bool bf16_rows = W.fmt == W_BF16 && W.C == D && D % 8 == 0 && reinterpret_cast<uintptr_t>(W.data) % 16 == 0 &&
                           reinterpret_cast<uintptr_t>(xt) % 16 == 0;
    if (bf16_rows) {  // this block's rows requested into L2 at once, one bulk prefetch a row (with session 29's
                      // parts: b1's exact dots 24.2 -> 20.4 us; what they still wait on is not known, docs/engine_cuda.md)
        const int c = part + P * static_cast<int>(threadIdx.x);
        if (c < nc)
            prefetch_l2(static_cast<const uint16_t*>(W.data) + (W.row0 + cand[static_cast<int64_t>(t) * kHbCap + c]) * W.C,
                        static_cast<uint32_t>(D) * 2u);
    }
    float best_v = 0.0f;
    int best_i = -1;
    for (int base = 0; part + P * base < nc; base += 32) {  // (block-uniform: group_dot's shuffles)
        const int c = part + P * (base + grp);
        const int r = c < nc ? cand[static_cast<int64_t>(t) * kHbCap + c] : 0;
        float v;
        if (bf16_rows) {  // group_dot's association, a chunk's eight weights and x values in 16-byte loads
            const int g = static_cast<int>(threadIdx.x & 7u);
            const uint16_t* wr = static_cast<const uint16_t*>(W.data) + (W.row0 + r) * W.C;
            float acc[8];
            zero8(acc);
#pragma unroll 8
            for (int col = 8 * g; col < (c < nc ? D : 0); col += 64) {
                const uint4 wq = __ldg(reinterpret_cast<const uint4*>(wr + col));
                const float4 x0 = *reinterpret_cast<const float4*>(xt + col), x1 = *reinterpret_cast<const float4*>(xt + col + 4);
                const uint32_t wv[4] = {wq.x, wq.y, wq.z, wq.w};
                const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                for (int l = 0; l < 8; ++l)
                    acc[l] = fma_(bf16_to_f32(static_cast<uint16_t>(wv[l / 2] >> (16 * (l % 2)))), xv[l], acc[l]);
            }
            v = group_fold(acc);
        } else {
            v = group_dot<float>(c < nc ? D : 0, false, [&](int i, float& a, float& b) {
                a = decode_elem(W.fmt, W.data, W.scale, W.row0 + r, i, W.C);
                b = xt[i];
            });
        }
        if (c < nc && num::argmax_better(v, r, best_v, best_i)) {
            best_v = v;
            best_i = r;
        }
    }
    if ((threadIdx.x & 7u) == 0) {
        bv[grp] = best_v;
        bi[grp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int q = 0; q < 32; ++q)
        if (num::argmax_better(bv[q], bi[q], best_v, best_i)) {
            best_v = bv[q];
            best_i = bi[q];
        }
    if (best_i >= 0) {
        const unsigned long long key = (static_cast<unsigned long long>(order_key(best_v == 0.0f ? 0.0f : best_v)) << 32) |
                                       static_cast<unsigned long long>(~static_cast<uint32_t>(best_i));
        atomicMax(keys + t, key);
    }
    __threadfence();
    if (atomicAdd(tickets + t, 1u) != static_cast<unsigned>(gridDim.y) - 1u) return;
    __threadfence();
    const unsigned long long key = atomicMax(keys + t, 0ull);  // (a read through the atomics' path)
    out[t] = key == 0ull ? 0 : static_cast<int>(~static_cast<uint32_t>(key & 0xFFFFFFFFull));
    if (count[t] > kHbCap || count[t] < 1 || bad_x[t]) atomicMax(flag, 1);
}

size_t xq_bytes(int n, int KS) { return static_cast<size_t>((n + 7) / 8) * KS * 2 * 32 * 8; }

// lm_head's limbs and row statistics; false where a value is not finite or they do not fit in device
// memory (the full head always decides then).
bool prepare(const Lin& W, HeadBound& hb) {
    const int R = static_cast<int>(W.R), C = static_cast<int>(W.C);
    hb.tried = true;
    hb.KS = (C + 31) / 32;
    const int RT = (R + 15) / 16;
    DBuf bad;
    try {
        hb.wq = DBuf(static_cast<size_t>(RT) * hb.KS * 32 * 16);
        hb.sw = DBuf(static_cast<size_t>(R) * sizeof(double));
        hb.n2 = DBuf(static_cast<size_t>(R) * sizeof(double));
        hb.e2 = DBuf(static_cast<size_t>(R) * sizeof(double));
        hb.l1 = DBuf(static_cast<size_t>(R) * sizeof(double));
        bad = DBuf(static_cast<size_t>(R) * sizeof(int));
    } catch (const std::runtime_error&) {  // (cudaMalloc: out of memory, not a sticky error)
        (void)cudaGetLastError();
        hb.wq = DBuf();
        hb.sw = DBuf();
        hb.n2 = DBuf();
        hb.e2 = DBuf();
        hb.l1 = DBuf();
        hb.usable = false;
        return false;
    }
    check(cudaMemset(hb.wq.p, 0, hb.wq.n), "head bound");
    check(cudaMemset(bad.p, 0, bad.n), "head bound");
    auto k = k_hb_quant_w;
    GLM_LAUNCH(k, blocks(static_cast<int64_t>(R) * 32, 256), 256, 0, W, hb.KS, hb.wq.as<int8_t>(), hb.sw.as<double>(),
               hb.n2.as<double>(), hb.e2.as<double>(), hb.l1.as<double>(), bad.as<int>());
    check_launch("head bound");
    std::vector<int> b(static_cast<size_t>(R));
    std::vector<double> n2(static_cast<size_t>(R));
    check(cudaMemcpy(b.data(), bad.p, bad.n, cudaMemcpyDeviceToHost), "head bound");
    check(cudaMemcpy(n2.data(), hb.n2.p, hb.n2.n, cudaMemcpyDeviceToHost), "head bound");
    hb.n2max = 0.0;
    bool finite = true;
    for (int r = 0; r < R; ++r) {
        finite = finite && b[static_cast<size_t>(r)] == 0;
        hb.n2max = n2[static_cast<size_t>(r)] > hb.n2max ? n2[static_cast<size_t>(r)] : hb.n2max;
    }
    hb.usable = finite && R > 0 && C > 0;
    return hb.usable;
}

// The greedy tokens of n rows of x ([n][D] floats) into d_next [n], then the flag and each row's candidate
// count (d_next + n, [n + 1]).
void run(const HeadBound& hb, const Lin& W, const float* x, int n, int D, const HbBufs& b, int* d_next) {
    const int R = static_cast<int>(W.R), KS = hb.KS;
    int *d_flag = d_next + n, *count = d_next + n + 1;
    check(cudaMemsetAsync(b.zeroed, 0, zeroed_bytes(n), 0), "head bound");
    check(cudaMemsetAsync(d_flag, 0, static_cast<size_t>(n + 1) * sizeof(int), 0), "head bound");
    {
        auto k = k_hb_quant_x;
        GLM_LAUNCH(k, (n + 7) / 8 * 8, kQxThreads, 0, x, n, D, KS, b.xq, b.Ex, b.n2x, b.bad(), hb.n2max);
        check_launch("head bound x");
    }
    // gamma(m) = m u / (1 - m u), u = 2^-24, m = ceil(D / 64) + 6 roundings on a term's path
    const double m = static_cast<double>((D + 63) / 64 + 6), u = 0x1p-24;
    const HbStats st{hb.sw.as<double>(), hb.n2.as<double>(), hb.e2.as<double>(), hb.l1.as<double>(), b.Ex, b.n2x,
                     m * u / (1.0 - m * u)};
    // token tiles a warp holds: from 16 tokens two warps share a row tile, each with half the tokens:
    // sixteen warps a block (one block an SM: its three stages take 120 KB), where eight warps of
    // twice the tiles left the tensor products' latencies exposed (ncu at 32 tokens: 0.5 eligible warps
    // a scheduler, 36 % of the DRAM bandwidth)
    if (n <= 8) launch_product<1, 1>(hb, R, n, st, b);
    else if (n <= 16) launch_product<1, 2>(hb, R, n, st, b);
    else if (n <= 32) launch_product<2, 2>(hb, R, n, st, b);
    else if (n <= 64) launch_product<4, 2>(hb, R, n, st, b);
    else launch_product<8, 2>(hb, R, n, st, b);
    {
        auto k = k_hb_select;
        GLM_LAUNCH(k, dim3(blocks((R + kSelRows - 1) / kSelRows, 256), static_cast<unsigned>(n)), 256, 0, b.hi, R,
                   static_cast<int64_t>(R), b.thr(), count, b.cand);
        check_launch("head bound select");
    }
    {
        auto k = k_hb_exact;
        GLM_LAUNCH(k, dim3(static_cast<unsigned>(n), n == 1 ? kExactParts1 : kExactParts), 256, 0, W, x, D, count, b.cand, b.bad(), b.keys(),
                   b.tickets(), d_next, d_flag);
        check_launch("head bound exact");
    }
}

}  // namespace

bool head_bound_applies(Step& s, int rows) {
    const int L = static_cast<int>(s.c.num_hidden_layers);
    if (!launch_options().head_bound || rows < kHbMinRows || s.nm.seq || s.wants_any(L, S_LOGITS) ||
        (s.inj.active && s.inj.layer == L && s.inj.stage == S_LOGITS))
        return false;
    HeadBound& hb = s.E.head_bound;
    return hb.tried ? hb.usable : prepare(s.E.lm_head, hb);
}

void head_argmax_bounded(Step& s, const float* normed, int n, int* d_next) {
    const HeadBound& hb = s.E.head_bound;
    const int R = static_cast<int>(s.E.lm_head.R);
    s.mark("head.bound");
    HbBufs b{};
    b.xq = s.scratch.d<int8_t>(xq_bytes(n, hb.KS));
    b.Ex = s.scratch.d<int>(static_cast<size_t>(n));
    b.cand = s.scratch.d<int>(static_cast<size_t>(n) * kHbCap);
    b.n2x = s.scratch.d<double>(static_cast<size_t>(n));
    b.lo = nullptr;  // (each token's largest lower end is all the selection needs: thr)
    b.hi = s.scratch.d<float>(static_cast<size_t>(n) * R);
    b.zeroed = s.scratch.d<unsigned char>(zeroed_bytes(n));
    b.n = n;
    run(hb, s.E.lm_head, normed, n, static_cast<int>(s.c.hidden_size), b, d_next);
}

HeadBoundLimits head_bound_limits() { return {kHbQ, kHbCap, kHbMinRows}; }

HeadBoundRun head_bound_device(const uint16_t* w_bits, int R, int C, const float* x, int n) {
    if (R < 1 || C < 1 || n < 1) throw std::invalid_argument("head_bound: needs at least one row, column and token");
    DBuf w(static_cast<size_t>(R) * C * sizeof(uint16_t)), xd(static_cast<size_t>(n) * C * sizeof(float));
    check(cudaMemcpy(w.p, w_bits, w.n, cudaMemcpyHostToDevice), "head_bound");
    check(cudaMemcpy(xd.p, x, xd.n, cudaMemcpyHostToDevice), "head_bound");
    Lin W;
    W.fmt = W_BF16;
    W.R = R;
    W.C = C;
    W.data = w.p;
    HeadBound hb;
    HeadBoundRun r;
    r.usable = prepare(W, hb);
    if (!r.usable) return r;
    DBuf xq(xq_bytes(n, hb.KS)), Ex(n * sizeof(int)), cand(static_cast<size_t>(n) * kHbCap * sizeof(int)),
        n2x(n * sizeof(double)), lo(static_cast<size_t>(n) * R * sizeof(float)),
        hi(static_cast<size_t>(n) * R * sizeof(float)), zeroed(zeroed_bytes(n)), out(static_cast<size_t>(2 * n + 1) * sizeof(int));
    const HbBufs b{xq.as<int8_t>(), Ex.as<int>(), cand.as<int>(), n2x.as<double>(), lo.as<float>(), hi.as<float>(),
                   zeroed.as<unsigned char>(), n};
    run(hb, W, xd.as<float>(), n, C, b, out.as<int>());
    check(cudaDeviceSynchronize(), "head_bound");
    r.lo.resize(static_cast<size_t>(n) * R);
    r.hi.resize(static_cast<size_t>(n) * R);
    std::vector<int> o(static_cast<size_t>(2 * n + 1));
    check(cudaMemcpy(r.lo.data(), lo.p, lo.n, cudaMemcpyDeviceToHost), "head_bound");
    check(cudaMemcpy(r.hi.data(), hi.p, hi.n, cudaMemcpyDeviceToHost), "head_bound");
    check(cudaMemcpy(o.data(), out.p, out.n, cudaMemcpyDeviceToHost), "head_bound");
    r.tokens.assign(o.begin(), o.begin() + n);
    r.flag = o[static_cast<size_t>(n)];
    r.counts.assign(o.begin() + n + 1, o.end());
    return r;
}

}  // namespace glm::cuda
