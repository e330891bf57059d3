// Weights of the CPU engine, kept in their release format (docs/contract.md §3.3, 4.1).
//
// A `Lin` is a view of rows [row0, row0 + R) of one stored [*, C] tensor: BF16 bits, F32, FP8 E4M3
// codes with block-128 scale_inv, or MXFP4 nibbles with E8M0 group scales. The bytes are the
// checkpoint's own (memory-mapped numpy arrays that the Python side keeps alive); they are decoded
// exactly to f32 in registers inside the dot (matvec.hpp rows_*): for one token eight weight groups at
// a time, for several tokens each group once for up to six tokens (cdot.hpp cdot_multi). decode_row
// materializes one row (embeddings, load-time copies). Every output is cdot(W[r], x) bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace glm::cpu {

enum class WFmt : uint8_t { BF16 = 0, F32 = 1, FP8 = 2, MXFP4 = 3 };

const char* wfmt_name(WFmt f);

struct LinKernels;  // matvec.hpp

struct Lin {
    WFmt fmt = WFmt::BF16;
    size_t R = 0, C = 0;   // this view: R rows of C columns
    size_t row0 = 0;       // first row of the view in the stored tensor
    const void* data = nullptr;   // the stored tensor (row 0)
    const void* scale = nullptr;  // fp8: f32 [ceil(rows/128), ceil(C/128)]; mxfp4: u8 [rows, C/32]
    bool fp8_nan_free = false;    // fp8: no NaN code anywhere (checked once at load): no NaN checks in the dots
    // the instruction set's kernels matmul runs (matvec.hpp LinKernels); nullptr: lin_kernels()'s choice
    const LinKernels* kernels = nullptr;

    bool empty() const { return data == nullptr; }
    // rows [r0, r0 + n) of this view
    Lin rows(size_t r0, size_t n) const {
        Lin v = *this;
        v.row0 = row0 + r0;
        v.R = n;
        return v;
    }
    // Stored bytes of rows [0, R) of this view (weights + their scales): what one pass streams.
    size_t bytes() const;
    // out[c] = W[r][c] decoded exactly (r: row of the view).
    void decode_row(size_t r, float* out) const;
    // y[i] = cdot(W[r0 + i], x) for i < r1 - r0 (canonical cdot, decoded in registers).
    void matvec(size_t r0, size_t r1, const float* x, float* y) const;
    // Several tokens: Y[t * ldy + i] = cdot(W[r0 + i], X + t * ldx) for t < T, i < r1 - r0, bf16-rounded
    // when `round`. Each group of eight weights is decoded in registers once for up to eight tokens
    // (LinKernels in matvec.hpp); bit-identical to matvec once per token. Runs on the calling thread.
    void matmul(size_t r0, size_t r1, const float* X, size_t ldx, size_t T, float* Y, size_t ldy, bool round) const;
};

}  // namespace glm::cpu
