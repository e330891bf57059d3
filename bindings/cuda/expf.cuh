// Transcendentals on the device (docs/contract.md §4.3, docs/numerics.md): the canonical expf (glibc's
// algorithm, N = 32, its five FMAs explicit) and the canonical double exp64 of mHC (glibc's exp,
// N = 128, degree-5 polynomial, special cases as glibc's FMA build), written once for both engines in
// bindings/numerics_dev.hpp -- no library call, no host round trip; the tests compare the device's
// results with the CPU engine's bit for bit (expf on all 2^32 inputs).
//
// `Nm` carries the engine's non-canonical switches into the kernels: expf="native" (CUDA's own
// expf) and dot="sequential" (cdot.cuh).
#pragma once

#include "compat.cuh"

namespace glm::cuda {

// The canonical expf, exp64 and sigmoid64: bindings/numerics_dev.hpp, shared with the CPU engine.
GLM_DEV float expf_c(float x) { return num::expf(x); }
using num::exp64;
using num::sigmoid64;

// The non-canonical expf of expf="native": the platform's own. On the device CUDA's expf (libdevice,
// <= 2 ulp); in the CPU emulation a classic Cephes-style polynomial (no GPU libm there).
GLM_DEV float expf_native(float x) {
#if defined(GLM_CUDA_EMU)
    return num::expf_cephes(x);
#else
    return ::expf(x);
#endif
}

// CUDA's fast intrinsic (for the census only).
GLM_DEV float expf_intrinsic(float x) {
#if defined(GLM_CUDA_EMU)
    return expf_native(x);
#else
    return __expf(x);
#endif
}

// The engine's switches, by value into every kernel.
struct Nm {
    bool seq = false;     // dot="sequential": plain left-to-right sums instead of cdot
    bool native = false;  // expf="native": the platform's expf
    GLM_DEV float exp(float x) const { return native ? expf_native(x) : expf_c(x); }
    GLM_DEV float sigmoid(float x) const { return fdiv(1.0f, fadd(1.0f, exp(-x))); }
    GLM_DEV float silu(float x) const { return fdiv(x, fadd(1.0f, exp(-x))); }
};

}  // namespace glm::cuda
