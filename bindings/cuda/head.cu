// The embedding (stage embed at layer 0, then hc copies as the streams) and the head (docs/numerics.md,
// Head; stages at layer index L): head.mean, final_norm, logits.
//   head.mean[d] = bf16(csum([X_0[d], ..., X_{hc-1}[d]]) / hc); final_norm = RMSNorm(norm.weight);
//   logits[v] = cdot(lm_head[v], final_norm) (f32; embed_tokens when tied).
#include "engine.cuh"

namespace glm::cuda {
namespace {

__global__ void k_embed(int fmt, const void* data, const void* scale, int64_t C, const int* __restrict__ tok, int T,
                        float* e) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= static_cast<int64_t>(T) * C) return;
    const int64_t t = i / C, d = i % C;
    e[i] = decode_elem(fmt, data, scale, tok[t], d, C);
}

__global__ void k_streams(const float* __restrict__ e, int T, int hc, int D, float* X) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= static_cast<int64_t>(T) * hc * D) return;
    const int64_t d = i % D, t = i / (static_cast<int64_t>(hc) * D);
    X[i] = e[t * D + d];
}

__global__ void k_head_mean(const float* __restrict__ X, const int* __restrict__ rows, int n, int hc, int D,
                            float* mean, Nm nm) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= static_cast<int64_t>(n) * D) return;
    const int64_t r = i / D, d = i % D;
    const float* xt = X + static_cast<int64_t>(rows[r]) * hc * D;
    const float sum = cdot_serial<float>(hc, nm.seq, [&](int j, float& a, float& b) {
        a = xt[static_cast<int64_t>(j) * D + d];
        b = 1.0f;
    });
    mean[i] = bf16r(fdiv(sum, static_cast<float>(hc)));
}

}  // namespace

void embed_rows(Step& s, const Lin& embed, int* d_tok, float* e, float* X) {
    const int T = s.T, D = static_cast<int>(s.c.hidden_size), hc = static_cast<int>(s.c.hc_mult);
    {
        auto k = k_embed;
        GLM_LAUNCH(k, blocks(static_cast<int64_t>(T) * D, 256), 256, 0, embed.fmt, embed.data, embed.scale, embed.C,
                   d_tok, T, e);
        check_launch("embed");
    }
    s.emit(0, S_EMBED, e, D, {D});
    auto k = k_streams;
    GLM_LAUNCH(k, blocks(static_cast<int64_t>(T) * hc * D, 256), 256, 0, e, T, hc, D, X);
    check_launch("streams");
}

namespace {

// The greedy choice over each row of n logits (num::argmax_better: np.argmax's rule), one block per row.
using num::argmax_better;
constexpr int kArgmaxThreads = 1024;

// The winner of sv[0..n), si[0..n) into element 0 (n a power of two: the block's threads, every one of
// which calls it; their candidates written, and a barrier since).
GLM_DEV void tree_argmax(float* sv, int* si, int t, int n) {
    for (int w = n / 2; w >= 1; w /= 2) {
        if (t < w && argmax_better(sv[t + w], si[t + w], sv[t], si[t])) {
            sv[t] = sv[t + w];
            si[t] = si[t + w];
        }
        __syncthreads();
    }
}

// The argmax of x[0..n) over a block of kArgmaxThreads threads (sv, si: that many elements of shared
// memory each), on every thread.
GLM_DEV int block_argmax(const float* __restrict__ x, int n, float* sv, int* si) {
    const int t = static_cast<int>(threadIdx.x);
    float v = 0.0f;
    int iv = -1;
    // eight loads in flight before their comparisons, which stay in index order: one row of 154880
    // logits is one block, and a load at a time left its latency 151 times on the step's path
    constexpr int U = 8;
    for (int i0 = t; i0 < n; i0 += U * kArgmaxThreads) {
        float a[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = i0 + u * kArgmaxThreads;
            a[u] = i < n ? x[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = i0 + u * kArgmaxThreads;
            if (i < n && argmax_better(a[u], i, v, iv)) {
                v = a[u];
                iv = i;
            }
        }
    }
    sv[t] = v;
    si[t] = iv;
    __syncthreads();
    tree_argmax(sv, si, t, kArgmaxThreads);
    return si[0];
}

// The greedy choice at the step's end (k_argmax_part, then k_argmax_final): a row of 154880 logits in
// one block left its load latency ~40 times on the step's path (24 us of a 0.9 ms b1 step), so each row
// is cut into segments, a block a segment (16-byte loads where the row allows, four in flight), and one
// warp a row folds the segments' winners. argmax_better is a total order on (value, index), so this tree
// gives the scan's index.
constexpr int kPartThreads = 256;
constexpr int kSegMin = 2048;  // logits a segment at least (two 16-byte loads a thread)
struct ArgmaxCut {
    int parts, seg;  // segments a row, logits a segment (a multiple of 4)
};
ArgmaxCut argmax_cut(int n, int rows) {
    const int want = (2 * sm_count() + rows - 1) / rows;  // about two blocks an SM over all the rows
    const int most = (n + kSegMin - 1) / kSegMin;
    const int parts = std::max(1, std::min(want, most));
    const int seg = ((n + parts - 1) / parts + 3) / 4 * 4;
    return {(n + seg - 1) / seg, seg};
}

__global__ void __launch_bounds__(kPartThreads) k_argmax_part(const float* __restrict__ x, int n, int seg, bool vec,
                                                             float* pv, int* pi) {
    pdl_enter();
    const int row = static_cast<int>(blockIdx.y), part = static_cast<int>(blockIdx.x), t = static_cast<int>(threadIdx.x);
    x += static_cast<int64_t>(row) * n;
    const int lo = part * seg, hi = n - lo < seg ? n : lo + seg;
    float v = 0.0f;
    int iv = -1;
    auto take = [&](float a, int i) {
        if (argmax_better(a, i, v, iv)) v = a, iv = i;
    };
    if (vec) {  // (lo and hi multiples of 4 but the row's last segment's end)
        constexpr int U = 4;
        for (int i0 = lo + 4 * t; i0 < hi; i0 += 4 * U * kPartThreads) {
            float4 a[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int i = i0 + 4 * u * kPartThreads;
                a[u] = i < hi ? __ldcg(reinterpret_cast<const float4*>(x + i)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int i = i0 + 4 * u * kPartThreads;
                if (i < hi) take(a[u].x, i), take(a[u].y, i + 1), take(a[u].z, i + 2), take(a[u].w, i + 3);
            }
        }
    } else {
        for (int i = lo + t; i < hi; i += kPartThreads) take(x[i], i);
    }
    __shared__ float sv[kPartThreads];
    __shared__ int si[kPartThreads];
    sv[t] = v;
    si[t] = iv;
    __syncthreads();
    tree_argmax(sv, si, t, kPartThreads);
    if (t == 0) {
        const int64_t o = static_cast<int64_t>(row) * gridDim.x + part;
        pv[o] = sv[0];
        pi[o] = si[0];
    }
}

// a warp a row: the winners of its parts segments
__global__ void __launch_bounds__(32) k_argmax_final(const float* __restrict__ pv, const int* __restrict__ pi, int parts,
                                                    int* out) {
    pdl_enter();
    const int row = static_cast<int>(blockIdx.x), t = static_cast<int>(threadIdx.x);
    __shared__ float sv[32];
    __shared__ int si[32];
    float v = 0.0f;
    int iv = -1;
    for (int p = t; p < parts; p += 32) {
        const int64_t o = static_cast<int64_t>(row) * parts + p;
        if (argmax_better(pv[o], pi[o], v, iv)) v = pv[o], iv = pi[o];
    }
    sv[t] = v;
    si[t] = iv;
    __syncthreads();
    tree_argmax(sv, si, t, 32);
    if (t == 0) out[row] = si[0];
}

// The greedy token of each row and, where slot[row] >= 0 (every row when slot is null: slot = row), its
// log-probability into lp[slot]: oracle.sampling.log_softmax(x)[token] bit for bit. d_i = x_i - x_t
// (x_t, the first maximum, is the oracle's max), s = csum(expf(d)) as block64_dot forms it (partial
// k < 64 owns the elements i = k (mod 64), in order), with the expf of a tile of kArgmaxThreads elements
// made by every thread first; then num::logprob_from. NaN where the row holds a NaN or an infinity.
__global__ void __launch_bounds__(kArgmaxThreads) k_argmax_logprob(const float* __restrict__ x, int n, int* out,
                                                                  float* lp, const int* __restrict__ slot) {
    pdl_enter();
    const int row = static_cast<int>(blockIdx.x);
    x += static_cast<int64_t>(row) * n;
    __shared__ float sv[kArgmaxThreads];
    __shared__ int si[kArgmaxThreads];
    __shared__ float e[kArgmaxThreads];
    __shared__ int nonfinite;
    const int t = static_cast<int>(threadIdx.x);
    if (t == 0) nonfinite = 0;  // (block_argmax's barriers order it before the writes below)
    const int best = block_argmax(x, n, sv, si);
    if (t == 0) out[row] = best;
    const int k = slot ? slot[row] : row;
    if (k < 0) return;  // (the whole block)
    const float m = x[best];
    float p = 0.0f;
    for (int base = 0; base < n; base += kArgmaxThreads) {
        if (base + t < n) {
            const float z = x[base + t];
            if ((num::f32_bits(z) & 0x7F800000u) == 0x7F800000u) nonfinite = 1;
            e[t] = expf_c(fsub(z, m));
        }
        __syncthreads();
        if (t < 64)
            for (int j = t; j < kArgmaxThreads && base + j < n; j += 64) p = fma_(e[j], 1.0f, p);
        __syncthreads();
    }
    if (t < 64) sv[t] = p;
    __syncthreads();
    if (t < 32) {
        const float sum = warp_fold64(sv[t], sv[t + 32]);
        if (t == 0) lp[k] = nonfinite ? num::f32_from_bits(0x7FC00000u) : num::logprob_from(fsub(x[best], m), sum);
    }
}

size_t argmax_scratch_bytes(int n, int rows) {
    const ArgmaxCut c = argmax_cut(n, rows);
    return static_cast<size_t>(rows) * c.parts * (sizeof(float) + sizeof(int));
}

// scratch: device memory of argmax_scratch_bytes(n, rows), the segments' winners
void argmax_into(const float* logits, int n, int* out, int rows, void* scratch) {
    const ArgmaxCut c = argmax_cut(n, rows);
    float* pv = static_cast<float*>(scratch);
    int* pi = reinterpret_cast<int*>(pv + static_cast<size_t>(rows) * c.parts);
    const bool vec = n % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
    {
        auto k = k_argmax_part;
        GLM_LAUNCH(k, dim3(static_cast<unsigned>(c.parts), static_cast<unsigned>(rows)), kPartThreads, 0, logits, n,
                   c.seg, vec, pv, pi);
        check_launch("argmax");
    }
    auto k = k_argmax_final;
    GLM_LAUNCH(k, static_cast<unsigned>(rows), 32, 0, pv, pi, c.parts, out);
    check_launch("argmax");
}

}  // namespace

void argmax_into(Step& s, const float* logits, int n, int* out, int rows) {
    argmax_into(logits, n, out, rows, s.scratch.dev(argmax_scratch_bytes(n, rows)));
}

void argmax_logprob_into(const float* logits, int n, int* out, float* lp, const int* slot, int rows) {
    auto k = k_argmax_logprob;
    GLM_LAUNCH(k, static_cast<unsigned>(rows), kArgmaxThreads, 0, logits, n, out, lp, slot);
    check_launch("argmax_logprob");
}

std::vector<int> argmax_device(const float* host, int n, int rows) {
    if (n < 1 || rows < 1) throw std::invalid_argument("argmax: needs at least one value a row");
    const size_t total = static_cast<size_t>(n) * rows;
    DBuf x(total * sizeof(float)), r(static_cast<size_t>(rows) * sizeof(int)), part(argmax_scratch_bytes(n, rows));
    check(cudaMemcpy(x.p, host, total * sizeof(float), cudaMemcpyHostToDevice), "argmax");
    argmax_into(x.as<float>(), n, r.as<int>(), rows, part.p);
    std::vector<int> idx(static_cast<size_t>(rows), -1);
    check(cudaMemcpy(idx.data(), r.p, idx.size() * sizeof(int), cudaMemcpyDeviceToHost), "argmax");
    return idx;
}

std::pair<int, float> argmax_logprob_device(const float* host, int n) {
    if (n < 1) throw std::invalid_argument("argmax_logprob: needs at least one value");
    DBuf x(static_cast<size_t>(n) * sizeof(float)), r(sizeof(int)), l(sizeof(float));
    check(cudaMemcpy(x.p, host, static_cast<size_t>(n) * sizeof(float), cudaMemcpyHostToDevice), "argmax_logprob");
    argmax_logprob_into(x.as<float>(), n, r.as<int>(), l.as<float>(), static_cast<const int*>(nullptr), 1);
    int idx = -1;
    float lp = 0.0f;
    check(cudaMemcpy(&idx, r.p, sizeof(int), cudaMemcpyDeviceToHost), "argmax_logprob");
    check(cudaMemcpy(&lp, l.p, sizeof(float), cudaMemcpyDeviceToHost), "argmax_logprob");
    return {idx, lp};
}

// head.mean and final_norm of the rows (emitted where captured): the head's x, [rows][D] floats.
const float* head_normed(Step& s, const float* X, const std::vector<int>& rows) {
    const Config& c = s.c;
    const int n = static_cast<int>(rows.size()), hc = static_cast<int>(c.hc_mult), D = static_cast<int>(c.hidden_size);
    const int L = static_cast<int>(c.num_hidden_layers);
    s.mark("head");
    int* d_rows = s.scratch.up(rows);
    float* mean = s.scratch.d<float>(static_cast<size_t>(n) * D);
    float* normed = s.scratch.d<float>(static_cast<size_t>(n) * D);
    {
        auto k = k_head_mean;
        GLM_LAUNCH(k, blocks(static_cast<int64_t>(n) * D, 256), 256, 0, X, d_rows, n, hc, D, mean, s.nm);
        check_launch("head_mean");
    }
    s.emit_rows(L, S_HEAD_MEAN, mean, D, {D}, rows);
    rms_norm_rows(s, mean, D, n, D, s.E.final_norm, static_cast<float>(c.rms_norm_eps), normed, D);
    s.emit_rows(L, S_FINAL_NORM, normed, D, {D}, rows);
    return normed;
}

// logits = lm_head final_norm for the rows (emitted where captured).
void head_logits(Step& s, const float* normed, const std::vector<int>& rows, float* logits) {
    const Config& c = s.c;
    const int n = static_cast<int>(rows.size()), D = static_cast<int>(c.hidden_size);
    const int V = static_cast<int>(c.vocab_size), L = static_cast<int>(c.num_hidden_layers);
    linear(s.E.lm_head, normed, D, logits, V, n, false, s.nm, s.hw8);
    s.emit_rows(L, S_LOGITS, logits, V, {V}, rows);
}

void head_forward(Step& s, const float* X, const std::vector<int>& rows, float* logits) {
    if (rows.empty()) return;
    head_logits(s, head_normed(s, X, rows), rows, logits);
}

}  // namespace glm::cuda
