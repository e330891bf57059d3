// A CPU emulation of the small subset of CUDA that bindings/cuda uses, for developing and testing
// the kernels on a machine without a GPU (built only by bindings/cuda/emu/CMakeLists.txt, never by
// the package build). Every CUDA thread runs as a fiber (a stack of its own and a hand-written
// x86-64 context switch); the threads of one block run interleaved on the calling thread, blocks one
// after the other. __syncthreads() and the warp shuffles are barriers over the block / the warp, so
// the kernels run unchanged: their arithmetic is the same IEEE arithmetic on the host (compiled
// with -ffp-contract=off), their thread-to-element assignment and their shuffle trees are executed
// as written. A barrier that can never complete (a shuffle not reached by every lane of a warp, a
// __syncthreads() in divergent code) aborts with a message instead of hanging.
//
// Device memory is host memory; copies are memcpy; streams and events are ordered trivially.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __constant__
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct uint3 {
    unsigned x = 0, y = 0, z = 0;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(8) int2 {
    int x, y;
};
inline int2 make_int2(int x, int y) { return int2{x, y}; }
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) double2 {
    double x, y;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

namespace glm_emu {

// Run fn once per thread of every block of the grid (fn reads threadIdx/blockIdx/...).
void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& fn);
void* dyn_smem();  // the current block's dynamic shared memory (zero-filled per block)
void syncthreads();
void syncwarp();
// Let the other threads of the block run (a thread waiting on a memory barrier spins through this).
void spin();
// Shuffle through the warp's exchange slots: every live lane of the warp must call it.
uint64_t shfl_raw(uint64_t v, int src_lane_of_me);
int lane();

template <class T>
inline uint64_t to_raw(T v) {
    uint64_t u = 0;
    std::memcpy(&u, &v, sizeof(T));
    return u;
}
template <class T>
inline T from_raw(uint64_t u) {
    T v;
    std::memcpy(&v, &u, sizeof(T));
    return v;
}

}  // namespace glm_emu

inline void __syncthreads() { glm_emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { glm_emu::syncwarp(); }

template <class T>
inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
    const int l = glm_emu::lane();
    const int s = (l / width) * width + (src % width);
    return glm_emu::from_raw<T>(glm_emu::shfl_raw(glm_emu::to_raw(v), s));
}
template <class T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int l = glm_emu::lane();
    const int s = (l % width) + static_cast<int>(delta) < width ? l + static_cast<int>(delta) : l;
    return glm_emu::from_raw<T>(glm_emu::shfl_raw(glm_emu::to_raw(v), s));
}
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    const int l = glm_emu::lane();
    const int s0 = l ^ mask;
    const int s = s0 < ((l / width) + 1) * width ? s0 : l;
    return glm_emu::from_raw<T>(glm_emu::shfl_raw(glm_emu::to_raw(v), s));
}

template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int l = glm_emu::lane();
    const int s = (l % width) >= static_cast<int>(delta) ? l - static_cast<int>(delta) : l;
    return glm_emu::from_raw<T>(glm_emu::shfl_raw(glm_emu::to_raw(v), s));
}
// (every lane of the warp calls these, as the shuffles: each reads all 32 lanes' values)
inline unsigned __ballot_sync(unsigned, int pred) {
    unsigned r = 0;
    for (int s = 0; s < 32; ++s)
        if (glm_emu::shfl_raw(pred ? 1u : 0u, s) != 0u) r |= 1u << s;
    return r;
}
inline unsigned __match_any_sync(unsigned, unsigned v) {
    unsigned r = 0;
    for (int s = 0; s < 32; ++s)
        if (static_cast<unsigned>(glm_emu::shfl_raw(v, s)) == v) r |= 1u << s;
    return r;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }

// ---- arithmetic intrinsics (IEEE round-to-nearest; the host build has -ffp-contract=off) -------
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline float __double2float_rn(double a) { return static_cast<float>(a); }
inline float __int2float_rn(int a) { return static_cast<float>(a); }
inline unsigned __float_as_uint(float x) { return glm_emu::from_raw<unsigned>(glm_emu::to_raw(x)); }
inline float __uint_as_float(unsigned u) { return glm_emu::from_raw<float>(u); }
inline long long __double_as_longlong(double x) { return glm_emu::from_raw<long long>(glm_emu::to_raw(x)); }
inline double __longlong_as_double(long long u) { return glm_emu::from_raw<double>(static_cast<uint64_t>(u)); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t pool = (static_cast<uint64_t>(y) << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned sel = (s >> (4 * i)) & 7u;
        r |= static_cast<unsigned>((pool >> (8 * sel)) & 0xFFu) << (8 * i);
    }
    return r;
}
template <class T>
inline T __ldg(const T* p) {
    return *p;
}
template <class T>
inline T __ldcg(const T* p) {
    return *p;
}
inline void __threadfence() {}

// ---- atomics (the emulation runs one thread at a time) ------------------------------------------
template <class T>
inline T atomicAdd(T* p, T v) {
    T o = *p;
    *p = o + v;
    return o;
}
template <class T>
inline T atomicMax(T* p, T v) {
    T o = *p;
    if (v > o) *p = v;
    return o;
}
template <class T>
inline T atomicMin(T* p, T v) {
    T o = *p;
    if (v < o) *p = v;
    return o;
}

// ---- the runtime API subset ---------------------------------------------------------------------
typedef int cudaError_t;
typedef void* cudaStream_t;
typedef struct EmuEvent* cudaEvent_t;
enum { cudaSuccess = 0, cudaErrorMemoryAllocation = 2 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
enum { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct cudaDeviceProp {
    char name[256];
    int multiProcessorCount;
    size_t totalGlobalMem;
    int major, minor;
    int l2CacheSize;
    size_t sharedMemPerBlockOptin;
};

cudaError_t cudaMalloc(void** p, size_t n);
cudaError_t cudaFree(void* p);
cudaError_t cudaMallocHost(void** p, size_t n);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind);
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t = nullptr);
cudaError_t cudaMemset(void* d, int v, size_t n);
cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t = nullptr);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaStreamSynchronize(cudaStream_t);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t);
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaGetDevice(int* d);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d);
enum { cudaStreamNonBlocking = 1, cudaEventDisableTiming = 2 };
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b);
cudaError_t cudaMemGetInfo(size_t* free_b, size_t* total_b);
template <class F>
inline cudaError_t cudaFuncSetAttribute(F, int, int) {
    return cudaSuccess;
}
