// Latency of the mHC partial-sum chain (k_hc_mix: 8 threads, each a 256-long chain of double FMAs over
// staged columns), measured in cycles per chain step with clock64, in variants:
//   f32+cvt : x staged as f32, converted in the loop (the kernel as of session 6), predicated on i < n
//   f64     : x staged as f64 (converted while staging), no predicate
//   reg     : a dependent DFMA chain in registers (the FP64 pipe's latency)
//   dadd    : a dependent DADD chain in registers
// Build and run on the GPU machine: nvcc -O3 -arch=sm_90 tools/chain_latency.cu -o /tmp/cl && /tmp/cl
#include <cstdio>
#include <cuda_runtime.h>

constexpr int NCH = 256;

__global__ void k_chain(int variant, int n, long long* cycles, double* sink) {
    __shared__ float xs[NCH * 8];
    __shared__ double xd[NCH * 8];
    __shared__ double fs[NCH * 8];
    const int tid = threadIdx.x;
    for (int q = tid; q < NCH * 8; q += blockDim.x) {
        xs[q] = 1.0f + q * 1e-3f;
        xd[q] = 1.0 + q * 1e-3;
        fs[q] = 0.5 + q * 1e-4;
    }
    __syncthreads();
    if (tid >= 8) return;
    double pd = 0.0, ps = 0.0;
    const long long t0 = clock64();
    if (variant == 0) {
#pragma unroll 8
        for (int c = 0; c < NCH; ++c) {
            if (64 * c + 8 * blockIdx.x % 8 + tid < n) {
                const double v = static_cast<double>(xs[8 * c + tid]);
                ps = __fma_rn(v, v, ps);
                pd = __fma_rn(fs[8 * c + tid], v, pd);
            }
        }
    } else if (variant == 1) {
#pragma unroll 8
        for (int c = 0; c < NCH; ++c) {
            const double v = xd[8 * c + tid];
            ps = __fma_rn(v, v, ps);
            pd = __fma_rn(fs[8 * c + tid], v, pd);
        }
    } else if (variant == 2) {
        double a = xd[tid], b = fs[tid];
#pragma unroll 16
        for (int c = 0; c < NCH; ++c) pd = __fma_rn(a, b, pd);
    } else {
        double a = xd[tid];
#pragma unroll 16
        for (int c = 0; c < NCH; ++c) pd = __dadd_rn(pd, a);
    }
    const long long t1 = clock64();
    if (tid == 0) cycles[blockIdx.x] = t1 - t0;
    sink[blockIdx.x * 8 + tid] = pd + ps;
}

int main() {
    long long* cyc;
    double* sink;
    cudaMalloc(&cyc, 1024 * sizeof(long long));
    cudaMalloc(&sink, 1024 * 8 * sizeof(double));
    const char* names[] = {"f32+cvt", "f64", "reg dfma", "reg dadd"};
    int clk = 0;
    cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
    for (int blocks : {1, 192}) {
        for (int v = 0; v < 4; ++v) {
            k_chain<<<blocks, 256>>>(v, NCH * 64, cyc, sink);  // warm
            cudaEvent_t e0, e1;
            cudaEventCreate(&e0);
            cudaEventCreate(&e1);
            cudaEventRecord(e0);
            k_chain<<<blocks, 256>>>(v, NCH * 64, cyc, sink);
            cudaEventRecord(e1);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            long long h[1024];
            cudaMemcpy(h, cyc, blocks * sizeof(long long), cudaMemcpyDeviceToHost);
            long long mx = 0;
            for (int b = 0; b < blocks; ++b) mx = h[b] > mx ? h[b] : mx;
            printf("%-9s blocks %3d: %6lld cycles for %d steps = %5.1f cycles/step; kernel %.2f us (clock %d MHz)\n",
                   names[v], blocks, mx, NCH, double(mx) / NCH, ms * 1e3, clk / 1000);
        }
    }
    return 0;
}
