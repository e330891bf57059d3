// The engine's multi-token kernels (matvec.cpp) compiled again for AVX-512 F + VL: 512-bit passes of two groups a
// register (cdot.hpp, cdot_block_pass with Lanes16), 32 vector registers for larger register blocks (block_rows), the same
// bits. isa.hpp says why the names differ;
// matvec.cpp's lin_kernels() runs these only where the CPU and its OS have AVX-512F and AVX-512VL.
#define GLM_CPU_ISA avx512
#define GLM_CPU_ZMM 1  // (this translation unit: 512-bit passes, 32 registers, the AVX-512 table)
#include "isa.hpp"

#if GLM_CPU_BUILD_AVX512
// Everything the kernels include comes first, under the build's own target: the standard library's and
// numerics_dev.hpp's inline code here must be what every other translation unit compiles (the linker keeps one
// copy of each). Only what follows the pragma -- cdot.hpp's, formats.hpp's and matvec.cpp's own code, under the
// names of glm::cpu::avx512 -- may use AVX-512 instructions (tests/test_cpu_kernels_isa.py reads the module's
// machine code for any outside them).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../numerics_dev.hpp"
#include "matvec.hpp"

#pragma GCC target("avx512f,avx512vl")
// (GCC 12's AVX-512 intrinsics, _mm512_cvtph_ps and others, merge into _mm512_undefined_ps(), which
// -Wuninitialized and -Wmaybe-uninitialized report as used)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "matvec.cpp"
#endif
