// RMSNorm (attn_norm, ffn_norm, mla.q_lat, mla.c, final_norm) and the indexer's LayerNorm
// (indexer.k); KDA's gated norm (kda.o_norm) is in kda.cu. As docs/numerics.md:
//   RMSNorm:   ss = cdot(x, x), inv = 1/sqrtf(ss/n + eps), y = bf16(bf16(x*inv) * w)
//   LayerNorm: mu = csum(x)/n, xc = x - mu, inv = 1/sqrtf(cdot(xc, xc)/n + eps), y = bf16((xc*inv)*w + b)
// One block per row; the row's sums are block64_dot (64 threads, one partial sum each).
// Also the small shared kernels: row copies and the one-element fault injection.
#include "engine.cuh"
#include "../inject_step.hpp"

namespace glm::cuda {
namespace {

constexpr int kNormThreads = 128;

__global__ void k_rmsnorm(const float* __restrict__ X, int64_t ldx, int n, const float* __restrict__ w, float eps,
                          float* Y, int64_t ldy, Nm nm) {
    pdl_enter();
    __shared__ float red[64];
    const float* x = X + static_cast<int64_t>(blockIdx.x) * ldx;
    float* y = Y + static_cast<int64_t>(blockIdx.x) * ldy;
    const float ss = block64_dot<float>(n, nm.seq, red, [&](int i, float& a, float& b) {
        a = x[i];
        b = x[i];
    });
    const float inv = rms_inv(ss, n, eps);
    for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) y[i] = rms_out(x[i], inv, w[i]);
}

__global__ void k_layernorm(const float* __restrict__ X, int n, const float* __restrict__ w,
                            const float* __restrict__ b, float eps, float* Y, Nm nm) {
    pdl_enter();
    __shared__ float red[64];
    const float* x = X + static_cast<int64_t>(blockIdx.x) * n;
    float* y = Y + static_cast<int64_t>(blockIdx.x) * n;
    const float fn = static_cast<float>(n);
    const float mu = fdiv(block64_dot<float>(n, nm.seq, red,
                                             [&](int i, float& a, float& o) {
                                                 a = x[i];
                                                 o = 1.0f;
                                             }),
                          fn);
    const float var = fdiv(block64_dot<float>(n, nm.seq, red,
                                              [&](int i, float& a, float& o) {
                                                  a = fsub(x[i], mu);
                                                  o = a;
                                              }),
                           fn);
    const float inv = fdiv(1.0f, fsqrt(fadd(var, eps)));
    for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x))
        y[i] = bf16r(fadd(fmul(fmul(fsub(x[i], mu), inv), w[i]), b[i]));
}

__global__ void k_copy_rows(const float* __restrict__ src, int64_t lds, float* __restrict__ dst, int64_t ldd,
                            int rows, int n) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= static_cast<int64_t>(rows) * n) return;
    const int64_t r = i / n, k = i % n;
    dst[r * ldd + k] = src[r * lds + k];
}

__global__ void k_inject(void* p, int dtype, int64_t ulps) {
    pdl_enter();
    switch (dtype) {
        case static_cast<int>(SDType::F32): {
            uint32_t* u = static_cast<uint32_t*>(p);
            *u = inject_step_f32(*u, ulps);
            break;
        }
        case static_cast<int>(SDType::BF16): {
            uint32_t* u = static_cast<uint32_t*>(p);
            *u = inject_step_bf16(*u, ulps);
            break;
        }
        case static_cast<int>(SDType::F64): {
            uint64_t* u = static_cast<uint64_t*>(p);
            *u = inject_step_f64(*u, ulps);
            break;
        }
        default: {
            int32_t* v = static_cast<int32_t*>(p);
            *v = inject_step_i32(*v, ulps);
            break;
        }
    }
}

}  // namespace

void rms_norm_rows(Step& s, const float* X, int64_t ldx, int rows, int n, const float* w, float eps, float* Y,
                   int64_t ldy) {
    if (rows <= 0) return;
    auto k = k_rmsnorm;
    GLM_LAUNCH(k, rows, kNormThreads, 0, X, ldx, n, w, eps, Y, ldy, s.nm);
    check_launch("rms_norm");
}

void layer_norm_rows(Step& s, const float* X, int rows, int n, const float* w, const float* b, float eps, float* Y) {
    if (rows <= 0) return;
    auto k = k_layernorm;
    GLM_LAUNCH(k, rows, kNormThreads, 0, X, n, w, b, eps, Y, s.nm);
    check_launch("layer_norm");
}

void copy_rows(const float* src, int64_t lds, float* dst, int64_t ldd, int rows, int n) {
    const int64_t total = static_cast<int64_t>(rows) * n;
    if (total <= 0) return;
    auto k = k_copy_rows;
    GLM_LAUNCH(k, static_cast<unsigned>((total + 255) / 256), 256, 0, src, lds, dst, ldd, rows, n);
    check_launch("copy_rows");
}

void inject_value(void* p, int dtype, int64_t ulps) {
    auto k = k_inject;
    GLM_LAUNCH(k, 1, 1, 0, p, dtype, ulps);
    check_launch("inject");
}

}  // namespace glm::cuda
