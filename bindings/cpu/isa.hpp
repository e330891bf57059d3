// Which instruction set a translation unit's kernels are compiled for.
//
// Every translation unit compiles the inline and template kernels of cdot.hpp and formats.hpp for AVX2 + FMA
// (the build's flags), in the inline namespace glm::cpu::avx2. matvec_avx512.cpp compiles the multi-token
// kernels again for AVX-512 F + VL (`#pragma GCC target`), in glm::cpu::avx512, with GLM_CPU_ZMM: two groups of
// eight chains a 512-bit register (cdot.hpp, cdot_block_pass with Lanes16) and 32 vector registers for larger register blocks
// (block_rows); every accumulator still takes its elements in the canonical order, so the bits are the same
// (tests/test_cpu_kernels_isa.py). The two namespaces keep the two compilations' inline functions apart: under
// one name the linker would keep one copy for both, and an AVX-512 copy would run on a CPU without it.
// matvec.hpp's lin_kernels() picks the set at run time (docs/engine_cpu.md, "Instruction sets").
#pragma once

#ifndef GLM_CPU_ISA
#define GLM_CPU_ISA avx2
#endif

// The AVX-512VL kernels are built where the compiler takes `#pragma GCC target` for x86-64 (GCC).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define GLM_CPU_BUILD_AVX512 1
#else
#define GLM_CPU_BUILD_AVX512 0
#endif
