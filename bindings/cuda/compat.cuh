// Build glue shared by every file of the CUDA engine: the CUDA runtime (or its CPU emulation,
// GLM_CUDA_EMU, bindings/cuda/emu), kernel launches, dynamic shared memory, error checks, and the
// IEEE arithmetic used by every kernel.
//
// Exactness (docs/contract.md §4.6): every floating-point operation of a definition is written as an explicit
// round-to-nearest intrinsic (__fadd_rn, __fmul_rn, __fmaf_rn, __fdiv_rn, __fsqrt_rn and the double
// twins), so nothing depends on the compiler's contraction or fast-math settings; the build adds
// --fmad=false -prec-div=true -prec-sqrt=true --ftz=false on top and never --use_fast_math.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>

#if defined(GLM_CUDA_EMU)
#include "emu/emu.hpp"
#define GLM_LAUNCH(kernel, grid, block, smem, ...) \
    ::glm_emu::launch(dim3(grid), dim3(block), (smem), [&] { kernel(__VA_ARGS__); })
// (the emulation runs every launch to completion in program order: a stream changes nothing)
#define GLM_LAUNCH_ON(stream, kernel, grid, block, smem, ...) \
    ((void)(stream), ::glm_emu::launch(dim3(grid), dim3(block), (smem), [&] { kernel(__VA_ARGS__); }))
#define GLM_DYN_SMEM(type, name) type* name = reinterpret_cast<type*>(::glm_emu::dyn_smem())
#else
#include <cuda_runtime.h>
#include <utility>
// Every launch may overlap the tail of the kernel before it in its stream (programmatic dependent
// launch, sm_90): the kernel's blocks start as the previous grid's blocks retire, and each kernel
// waits for its predecessor's completion (pdl_enter) before it touches global memory, so results
// are those of plain stream order. The engine option pdl=False launches without the attribute.
#define GLM_LAUNCH(kernel, grid, block, smem, ...) \
    ::glm::cuda::launch_kernel(kernel, dim3(grid), dim3(block), (smem), cudaStream_t(0), __VA_ARGS__)
#define GLM_LAUNCH_ON(stream, kernel, grid, block, smem, ...) \
    ::glm::cuda::launch_kernel(kernel, dim3(grid), dim3(block), (smem), (stream), __VA_ARGS__)
#define GLM_DYN_SMEM(type, name)                              \
    extern __shared__ __align__(16) unsigned char glm_smem_[]; \
    type* name = reinterpret_cast<type*>(glm_smem_)
#endif

#define GLM_DEV __device__ __forceinline__

// the scalar numerics shared with the CPU engine (bit views, BF16, expf, exp64): glm::num
#include "../numerics_dev.hpp"

namespace glm::cuda {

#if !defined(GLM_CUDA_EMU)
bool pdl_enabled();  // model.cu: the pdl option of the engine call in progress

template <typename... P, typename... A>
inline void launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          A&&... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl_enabled() ? 1 : 0;
    (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);  // an error surfaces in check_launch
}
#endif

// The first statement of every kernel (tests/test_cuda_sources.py checks it): let the next kernel in
// the stream be scheduled now, then wait until the previous one has completed and its writes are
// visible. Nothing before it may read or write global memory. Without a programmatic launch both
// instructions do nothing.
GLM_DEV void pdl_enter() {
#if !defined(GLM_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// pdl_enter in two halves, for a kernel that reads memory no kernel writes (weights uploaded at load)
// before it waits: pdl_release() first, pdl_wait() before anything a previous kernel may have written
// (tests/test_cuda_sources.py checks that a kernel starting with pdl_release() calls pdl_wait()).
GLM_DEV void pdl_release() {
#if !defined(GLM_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
GLM_DEV void pdl_wait() {
#if !defined(GLM_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

inline void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}
// After a launch: a launch-configuration error is reported here (execution errors at the next sync).
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

// Raise a kernel's dynamic shared memory limit to `bytes`, once per kernel.
template <class K>
void allow_smem(K kernel, size_t bytes) {
    static std::map<const void*, size_t> done;
    size_t& have = done[reinterpret_cast<const void*>(kernel)];  // (0 the first time)
    if (have >= bytes) return;
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
          "smem attribute");
    have = bytes;
}

// A hint: bring `bytes` (a multiple of 16, from a 16-byte aligned address) of global memory into L2 (sm_90's
// bulk prefetch, one instruction; elsewhere and in the emulation nothing).
GLM_DEV void prefetch_l2(const void* p, uint32_t bytes) {
#if !defined(GLM_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#else
    (void)p;
    (void)bytes;
#endif
}

// ---- cp.async: 16-byte copies global -> shared in commit groups (the emulation copies at issue) ----
// The copy to a shared address from smem_u32 (the dynamic block's 32-bit shared-window address, computed
// once: a generic pointer is converted at every copy, a cluster-id read and two more each).
GLM_DEV uint32_t smem_u32(const void* p) {
#if defined(GLM_CUDA_EMU)
    return static_cast<uint32_t>(static_cast<const unsigned char*>(p) - static_cast<const unsigned char*>(::glm_emu::dyn_smem()));
#else
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#endif
}
GLM_DEV void cp_async16_s(uint32_t sa, const void* gmem) {
#if defined(GLM_CUDA_EMU)
    std::memcpy(static_cast<unsigned char*>(::glm_emu::dyn_smem()) + sa, gmem, 16);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gmem) : "memory");
#endif
}
// 16 zero bytes at a shared address from smem_u32 (a piece that a stage takes instead of a copy)
GLM_DEV void store_zero16_s(uint32_t sa) {
#if defined(GLM_CUDA_EMU)
    std::memset(static_cast<unsigned char*>(::glm_emu::dyn_smem()) + sa, 0, 16);
#else
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(sa), "r"(0) : "memory");
#endif
}
// ... from a generic pointer into any shared memory (the emulation copies to the pointer itself)
GLM_DEV void cp_async16(void* smem, const void* gmem) {
#if defined(GLM_CUDA_EMU)
    std::memcpy(smem, gmem, 16);
#else
    cp_async16_s(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), gmem);
#endif
}
GLM_DEV void cp_async_commit() {
#if !defined(GLM_CUDA_EMU)
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
GLM_DEV void cp_async_wait() {
#if !defined(GLM_CUDA_EMU)
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}


// ---- integer tensor-core product: d += A B, A 16 x 32 and B 32 x 8 signed bytes, int32 (exact) -----
// Fragments as PTX lays out mma.m16n8k32 .s8 (lane = 4 g + q): A word j of lane (g, q) holds
// A[g + 8 (j & 1)][16 (j >> 1) + 4 q + b] in its byte b; B word j holds B[16 j + 4 q + b][g]; d[i] is
// D[g + 8 (i >> 1)][2 q + (i & 1)]. Integer sums have no order, so the emulation is the hardware's result.
// Every lane of the warp calls it.
GLM_DEV void mma_s8_16832(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(GLM_CUDA_EMU)
    const int lane = static_cast<int>(threadIdx.x & 31u), g = lane >> 2, q = lane & 3;
    int A[16][32], B[32][8];
    for (int src = 0; src < 32; ++src) {
        const int sg = src >> 2, sq = src & 3;
        for (int j = 0; j < 4; ++j) {
            const uint32_t w = __shfl_sync(0xffffffffu, a[j], src);
            for (int by = 0; by < 4; ++by)
                A[sg + 8 * (j & 1)][16 * (j >> 1) + 4 * sq + by] = static_cast<int8_t>((w >> (8 * by)) & 0xFFu);
        }
        for (int j = 0; j < 2; ++j) {
            const uint32_t w = __shfl_sync(0xffffffffu, b[j], src);
            for (int by = 0; by < 4; ++by) B[16 * j + 4 * sq + by][sg] = static_cast<int8_t>((w >> (8 * by)) & 0xFFu);
        }
    }
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * q + (i & 1);
        int s = 0;
        for (int k = 0; k < 32; ++k) s += A[row][k] * B[k][col];
        d[i] += s;
    }
#else
    asm(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// ---- arithmetic (all round-to-nearest-even, never fused unless written as an fma) ---------------
GLM_DEV float fadd(float a, float b) { return __fadd_rn(a, b); }
GLM_DEV float fsub(float a, float b) { return __fsub_rn(a, b); }
GLM_DEV float fmul(float a, float b) { return __fmul_rn(a, b); }
GLM_DEV float fdiv(float a, float b) { return __fdiv_rn(a, b); }
GLM_DEV float fsqrt(float a) { return __fsqrt_rn(a); }
GLM_DEV float ffma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
GLM_DEV double dadd(double a, double b) { return __dadd_rn(a, b); }
GLM_DEV double dsub(double a, double b) { return __dsub_rn(a, b); }
GLM_DEV double dmul(double a, double b) { return __dmul_rn(a, b); }
GLM_DEV double ddiv(double a, double b) { return __ddiv_rn(a, b); }
GLM_DEV double dsqrt(double a) { return __dsqrt_rn(a); }
GLM_DEV double dfma(double a, double b, double c) { return __fma_rn(a, b, c); }
// Overloads so that templates over float/double read like the definition.
GLM_DEV float add(float a, float b) { return __fadd_rn(a, b); }
GLM_DEV double add(double a, double b) { return __dadd_rn(a, b); }
GLM_DEV float mul(float a, float b) { return __fmul_rn(a, b); }
GLM_DEV double mul(double a, double b) { return __dmul_rn(a, b); }
GLM_DEV float fma_(float a, float b, float c) { return __fmaf_rn(a, b, c); }
GLM_DEV double fma_(double a, double b, double c) { return __fma_rn(a, b, c); }

using num::f32_bits;
using num::f32_from_bits;
using num::f64_bits;
using num::f64_from_bits;
GLM_DEV bool is_nan(float x) { return (f32_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
GLM_DEV bool is_nan64(double x) { return (f64_bits(x) & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull; }

constexpr unsigned kFull = 0xffffffffu;

// Blocks of `threads` that cover n items.
inline unsigned blocks(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

}  // namespace glm::cuda
