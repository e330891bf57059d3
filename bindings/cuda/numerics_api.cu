// The numerics entry points (tests, census): the device's expf / exp64 on given inputs or on every
// f32 bit pattern of a range, the census of CUDA's expf / __expf against the canonical expf, and the
// decode tables (engine_api.hpp declares them). They run the same device functions as the engine.
#include <chrono>

#include "engine.cuh"

namespace glm::cuda {

namespace {

__global__ void k_expf(const float* x, float* y, int64_t n, bool native) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) y[i] = native ? expf_native(x[i]) : expf_c(x[i]);
}

__global__ void k_expf_bits(uint64_t lo, int64_t n, float* y) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) y[i] = expf_c(f32_from_bits(static_cast<uint32_t>(lo + static_cast<uint64_t>(i))));
}

__global__ void k_exp64(const double* x, double* y, int64_t n) {
    pdl_enter();
    const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) y[i] = exp64(x[i]);
}

using num::bf16_bits_of;
GLM_DEV int64_t ordered(uint32_t u) {
    return (u & 0x80000000u) ? -static_cast<int64_t>(u & 0x7FFFFFFFu) - 1 : static_cast<int64_t>(u);
}

// stats: [0] differ, [1] differ_bf16, [2] differ_nonpos, [3] nonpos inputs, [4] max ulps, [5] first
__global__ void k_census(int kind, uint64_t lo, uint64_t n, unsigned long long* stats) {
    pdl_enter();
    unsigned long long d = 0, db = 0, dn = 0, np = 0, mu = 0, first = ~0ull;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const uint32_t bits = static_cast<uint32_t>(lo + i);
        const float x = f32_from_bits(bits);
        const float ref = expf_c(x);
        const float got = kind == 1 ? expf_native(x) : (kind == 2 ? expf_intrinsic(x) : expf_c(x));
        const uint32_t a = f32_bits(ref), b = f32_bits(got);
        const bool nonpos = x <= 0.0f;
        np += nonpos ? 1 : 0;
        if (a != b) {
            ++d;
            if (bf16_bits_of(a) != bf16_bits_of(b)) ++db;
            if (nonpos) ++dn;
            if (!is_nan(ref) && !is_nan(got)) {
                const int64_t diff = ordered(a) - ordered(b);
                const unsigned long long ad = static_cast<unsigned long long>(diff < 0 ? -diff : diff);
                mu = ad > mu ? ad : mu;
            }
            first = static_cast<unsigned long long>(bits) < first ? static_cast<unsigned long long>(bits) : first;
        }
    }
    if (d) {
        atomicAdd(&stats[0], d);
        atomicAdd(&stats[1], db);
        atomicAdd(&stats[2], dn);
        atomicMax(&stats[4], mu);
        atomicMin(&stats[5], first);
    }
    if (np) atomicAdd(&stats[3], np);
}

__global__ void k_decode_tables(int which, float* out, bool hw) {
    pdl_enter();
    const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if (which == 0 && i < 32) {  // e4m3: 256 codes through the eight-wide path
        uint32_t code[8];
        for (int l = 0; l < 8; ++l) code[l] = static_cast<uint32_t>(8 * i + l);
        const uint32_t lo = code[0] | (code[1] << 8) | (code[2] << 16) | (code[3] << 24);
        const uint32_t hi = code[4] | (code[5] << 8) | (code[6] << 16) | (code[7] << 24);
        float w[8];
        if (hw)
            e4m3x8<true>(lo, hi, w);
        else
            e4m3x8<false>(lo, hi, w);
        for (int l = 0; l < 8; ++l) out[8 * i + l] = w[l];
    } else if (which == 1 && i < 16) {
        out[i] = mxfp4_w(static_cast<uint32_t>(i), 1.0f);
    } else if (which == 2 && i < 256) {
        out[i] = e8m0(static_cast<uint32_t>(i));
    }
}

}  // namespace

void expf_device(const float* x, float* y, size_t n, bool native) {
    if (n == 0) return;
    DBuf dx(n * 4), dy(n * 4);
    check(cudaMemcpy(dx.p, x, n * 4, cudaMemcpyHostToDevice), "expf_device");
    auto k = k_expf;
    GLM_LAUNCH(k, static_cast<unsigned>((n + 255) / 256), 256, 0, dx.as<float>(), dy.as<float>(),
               static_cast<int64_t>(n), native);
    check_launch("expf_device");
    check(cudaMemcpy(y, dy.p, n * 4, cudaMemcpyDeviceToHost), "expf_device");
}

void expf_device_bits(uint64_t lo, size_t n, float* y) {
    if (n == 0) return;
    DBuf dy(n * 4);
    auto k = k_expf_bits;
    GLM_LAUNCH(k, static_cast<unsigned>((n + 255) / 256), 256, 0, lo, static_cast<int64_t>(n), dy.as<float>());
    check_launch("expf_device_bits");
    check(cudaMemcpy(y, dy.p, n * 4, cudaMemcpyDeviceToHost), "expf_device_bits");
}

void exp64_device(const double* x, double* y, size_t n) {
    if (n == 0) return;
    DBuf dx(n * 8), dy(n * 8);
    check(cudaMemcpy(dx.p, x, n * 8, cudaMemcpyHostToDevice), "exp64_device");
    auto k = k_exp64;
    GLM_LAUNCH(k, static_cast<unsigned>((n + 255) / 256), 256, 0, dx.as<double>(), dy.as<double>(),
               static_cast<int64_t>(n));
    check_launch("exp64_device");
    check(cudaMemcpy(y, dy.p, n * 8, cudaMemcpyDeviceToHost), "exp64_device");
}

CensusResult expf_census(const std::string& kind, uint64_t lo, uint64_t hi) {
    int k = -1;
    if (kind == "canonical") k = 0;
    else if (kind == "expf") k = 1;
    else if (kind == "__expf") k = 2;
    else throw std::invalid_argument("census kind must be 'expf', '__expf' or 'canonical', got '" + kind + "'");
    if (hi > (uint64_t{1} << 32) || lo > hi) throw std::invalid_argument("census range must satisfy lo <= hi <= 2^32");
    CensusResult r;
    r.inputs = hi - lo;
    if (hi == lo) return r;
    unsigned long long init[6] = {0, 0, 0, 0, 0, ~0ull};
    DBuf st(sizeof(init));
    check(cudaMemcpy(st.p, init, sizeof(init), cudaMemcpyHostToDevice), "census");
    const auto t0 = std::chrono::steady_clock::now();
#if defined(GLM_CUDA_EMU)
    const unsigned nblocks = 4;
#else
    const unsigned nblocks = 132 * 16;
#endif
    auto kern = k_census;
    GLM_LAUNCH(kern, nblocks, 256, 0, k, lo, hi - lo, st.as<unsigned long long>());
    check_launch("census");
    check(cudaDeviceSynchronize(), "census");
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    unsigned long long got[6];
    check(cudaMemcpy(got, st.p, sizeof(got), cudaMemcpyDeviceToHost), "census");
    r.differ = got[0];
    r.differ_bf16 = got[1];
    r.differ_nonpos = got[2];
    r.nonpos_inputs = got[3];
    r.max_ulps = got[4];
    r.first = got[5] == ~0ull ? -1 : static_cast<int64_t>(got[5]);
    return r;
}

std::vector<float> decode_table_device(const std::string& which) {
    int w;
    size_t n;
    bool hw = true;
    if (which == "e4m3") {
        w = 0;
        n = 256;
    } else if (which == "e4m3_sw") {
        w = 0;
        n = 256;
        hw = false;
    } else if (which == "e2m1") {
        w = 1;
        n = 16;
    } else if (which == "e8m0") {
        w = 2;
        n = 256;
    } else {
        throw std::invalid_argument("decode table must be 'e4m3', 'e4m3_sw', 'e2m1' or 'e8m0'");
    }
    DBuf d(n * 4);
    auto k = k_decode_tables;
    GLM_LAUNCH(k, 1, 256, 0, w, d.as<float>(), hw);
    check_launch("decode tables");
    std::vector<float> out(n);
    check(cudaMemcpy(out.data(), d.p, n * 4, cudaMemcpyDeviceToHost), "decode tables");
    return out;
}

}  // namespace glm::cuda
