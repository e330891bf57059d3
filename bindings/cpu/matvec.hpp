// Matrix-vector kernels that decode the weights in registers inside the dot (no decoded matrix is
// ever materialized). Row r of the result is bit-identical to cdot(decoded W[r], x).
// Rows are independent, so they may be split over threads without changing any bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace glm::cpu {

// threads: 0 = pick from the problem size and the hardware; 1 = run on the calling thread.
// W: [R, C] bf16 bits; x: [C]; y: [R].
void matvec_bf16(const uint16_t* W, size_t R, size_t C, const float* x, float* y, unsigned threads = 0);
// q: [R, C] E4M3 codes; scale_inv: [ceil(R/128), ceil(C/128)].
void matvec_fp8(const uint8_t* q, const float* scale_inv, size_t R, size_t C, const float* x, float* y,
                unsigned threads = 0);
// packed: [R, C/2] E2M1 nibbles (column 2b low, 2b+1 high); scale: [R, C/32] E8M0; C % 32 == 0.
void matvec_mxfp4(const uint8_t* packed, const uint8_t* scale, size_t R, size_t C, const float* x, float* y,
                  unsigned threads = 0);

// ---- the engine's entry points (weights.cpp `Lin`) ----------------------------------------------
// Rows [r0, r1) of a stored [*, C] weight (the pointers are the tensor's row 0 and its scales), against
// T token rows X[t * ldx ...] (C floats each): Y[t * ldy + i] = cdot(W[r0 + i], X[t]) for i < r1 - r0,
// bf16-rounded when `round`. Bit-identical to one cdot per token and row, whatever T, r0, r1 and whichever
// instruction set's kernels run them. T = 1 runs the one-token kernel (eight accumulators in registers); T >= 2
// decodes each group of eight weights once for up to eight tokens (detail::cdot_multi). Runs on the calling
// thread. T >= 2 packs x into a per-thread buffer of about 4 T C bytes, kept: Lin::matmul calls with at most
// detail::kPackTokens. FP8's nan_free: the caller has checked once that no code of the tensor is a NaN code (the
// engine does at load), so no row is scanned; otherwise each group of eight codes is checked in registers.
// MXFP4: C % 32 == 0.
struct LinKernels {
    const char* isa;  // "avx2" or "avx512" (isa.hpp)
    void (*rows_bf16)(const uint16_t* W, size_t C, size_t r0, size_t r1, const float* X, size_t ldx, size_t T,
                      float* Y, size_t ldy, bool round);
    void (*rows_f32)(const float* W, size_t C, size_t r0, size_t r1, const float* X, size_t ldx, size_t T, float* Y,
                     size_t ldy, bool round);
    void (*rows_fp8)(const uint8_t* q, const float* scale_inv, size_t C, size_t r0, size_t r1, const float* X,
                     size_t ldx, size_t T, float* Y, size_t ldy, bool round, bool nan_free);
    void (*rows_mxfp4)(const uint8_t* packed, const uint8_t* scale, size_t C, size_t r0, size_t r1, const float* X,
                       size_t ldx, size_t T, float* Y, size_t ldy, bool round);
    // The FMA peak's probe in this build's widest vectors (the machine's peak is the widest's: tools/bench_cpu.py):
    // kFmaChains independent chains of `iters` multiply-adds of fma_lanes lanes each, from `seed`; returns a lane.
    float (*fma_chains)(long iters, float seed);
    unsigned fma_lanes;
};
inline constexpr int kFmaChains = 12;  // (enough to cover the FMA latency on two ports)
// The kernels this process runs: AVX-512VL's where the build has them and the CPU and its OS run them, else
// AVX2's; the environment's GLM_CPU_KERNELS=avx2 asks for AVX2's, =avx512 for AVX-512VL's (refused where they
// cannot run). Chosen once, at the first call; an unknown value is refused then (std::invalid_argument naming it).
const LinKernels& lin_kernels();
// One instruction set's kernels by name (one of kLinKernelNames), or nullptr for another name or where this build
// or this CPU has none.
inline constexpr const char* kLinKernelNames[] = {"avx2", "avx512"};
const LinKernels* lin_kernels_named(const char* isa);
// Why lin_kernels_named(isa) gave nullptr, in words.
std::string lin_kernels_refusal(const char* isa);

}  // namespace glm::cpu
