"""BF16: rounding float32 (and float64) values to bfloat16.

A BF16 value is carried as a float32 whose low 16 bits are zero; its 16-bit
encoding is the high half of the float32 encoding.

Rounding is to nearest, ties to even, on the bit pattern: adding 0x7FFF plus the
lowest kept bit and truncating rounds the 16 dropped bits correctly for every
finite value and for +-inf, and a carry out of the mantissa steps the exponent
(up to inf for values past the largest BF16 value), exactly as IEEE RNE does.

Every NaN, whatever its sign and payload, becomes the one canonical NaN 0x7FC0
(float32 bits 0x7FC00000).  Libraries disagree on NaN (ml_dtypes keeps the
sign, torch's CPU vector path gives 0xFFFF, CUDA 0x7FFF); one fixed answer keeps
hashes of BF16 tensors identical across engines.

From float64 the conversion is two roundings by definition: first to float32
(RNE), then to BF16 (RNE).  This is not always the same as rounding the float64
straight to BF16 (double rounding: e.g. 1 + 2^-8 + 2^-30 becomes 1 + 2^-8 in
float32, a BF16 tie that goes to even 1.0, while the direct rounding gives
1 + 2^-7); the two-step form is what a float32 pipeline computes, so it is the
canonical one.
"""

import numpy as np
from numba import njit

from .bits import bits_to_f32, f32_to_bits

__all__ = [
    "BF16_CANONICAL_NAN_BITS",
    "bf16_round",
    "bf16_round_array",
    "f32_to_bf16_bits",
    "bf16_bits_to_f32",
    "f64_to_bf16_round",
    "f64_to_bf16_round_array",
]

BF16_CANONICAL_NAN_BITS = 0x7FC0


@njit(cache=True)
def bf16_round(x):
    """float32 -> float32 holding the nearest BF16 value (RNE); NaN -> 0x7FC00000."""
    if np.isnan(x):
        return bits_to_f32(np.uint32(0x7FC00000))
    u = f32_to_bits(x)
    lowest_kept_bit = (u >> np.uint32(16)) & np.uint32(1)
    rounded = (u + np.uint32(0x7FFF) + lowest_kept_bit) & np.uint32(0xFFFF0000)
    return bits_to_f32(np.uint32(rounded))


@njit(cache=True)
def bf16_round_array(x):
    """Element-wise bf16_round of a float32 array of any shape (new C-ordered array)."""
    out = np.empty(x.shape, np.float32)
    out_flat = out.reshape(-1)
    x_flat = x.ravel()
    for i in range(x_flat.size):
        out_flat[i] = bf16_round(x_flat[i])
    return out


@njit(cache=True)
def f32_to_bf16_bits(x):
    """float32 array -> uint16 array of BF16 encodings (RNE, canonical NaN)."""
    out = np.empty(x.shape, np.uint16)
    out_flat = out.reshape(-1)
    x_flat = x.ravel()
    for i in range(x_flat.size):
        out_flat[i] = np.uint16(f32_to_bits(bf16_round(x_flat[i])) >> np.uint32(16))
    return out


@njit(cache=True)
def bf16_bits_to_f32(u):
    """uint16 array of BF16 encodings -> float32 array (exact; NaN payloads kept)."""
    out = np.empty(u.shape, np.float32)
    out_flat = out.reshape(-1)
    u_flat = u.ravel()
    for i in range(u_flat.size):
        out_flat[i] = bits_to_f32(np.uint32(np.uint32(u_flat[i]) << np.uint32(16)))
    return out


@njit(cache=True)
def f64_to_bf16_round(x):
    """float64 -> float32 holding a BF16 value: RNE to float32, then RNE to BF16."""
    return bf16_round(np.float32(x))


@njit(cache=True)
def f64_to_bf16_round_array(x):
    """Element-wise f64_to_bf16_round of a float64 array of any shape."""
    out = np.empty(x.shape, np.float32)
    out_flat = out.reshape(-1)
    x_flat = x.ravel()
    for i in range(x_flat.size):
        out_flat[i] = f64_to_bf16_round(x_flat[i])
    return out
