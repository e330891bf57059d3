"""Numba kernels of `oracle census expf` (tools/census.py): the example implementations and the counting loops.

Kept apart from tools/census.py so that the CLI starts without importing Numba.
"""
from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
from numba import njit, prange

from oracle.numerics import expf
from oracle.numerics.bits import bits_to_f32, f32_to_bits

SUB = 1 << 14            # inputs per parallel work item

_libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
libm_expf = _libm.expf
libm_expf.restype = ctypes.c_float
libm_expf.argtypes = [ctypes.c_float]

# -- example non-canonical implementations --------------------------------------------------------

_F = np.float32
LOG2E = _F(1.44269504088896341)
HALF = _F(0.5)
ONE = _F(1.0)
C1 = _F(0.693359375)                # ln 2 split in two (Cephes)
C2 = _F(-2.12194440e-4)
P0, P1, P2 = _F(1.9875691500e-4), _F(1.3981999507e-3), _F(8.3334519073e-3)
P3, P4, P5 = _F(4.1665795894e-2), _F(1.6666665459e-1), _F(5.0000001201e-1)
MAXLOG, MINLOG = _F(88.72283905206835), _F(-103.972084)
TWO_M100, TWO_P100 = _F(2.0 ** -100), _F(2.0 ** 100)
SCH_A, SCH_B = _F(12102203.0), _F(1065353216.0)    # 2^23 / ln 2, 127 * 2^23


@njit(cache=True)
def _pow2(k):
    """2^k as f32 for -126 <= k <= 127."""
    return bits_to_f32(np.uint32((k + 127) << 23))


@njit(cache=True)
def cephes_expf(x):
    """A typical fast f32 exp: x = k ln2 + r, e^r by a degree-5 polynomial in r (times r^2), scaled by 2^k.

    No table, single precision throughout, a few ULPs off at most: what a "fast intrinsic" or a
    SIMD library does. Not canonical.
    """
    if x != x:
        return x + x
    if x > MAXLOG:
        return _F(np.inf)
    if x < MINLOG:
        return _F(0.0)
    fx = np.float32(np.floor(x * LOG2E + HALF))
    r = x - fx * C1
    r = r - fx * C2
    z = r * r
    y = (((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5) * z + r + ONE
    k = np.int32(fx)
    if k < -125:
        return y * _pow2(k + 100) * TWO_M100
    if k > 127:
        return y * _pow2(k - 100) * TWO_P100
    return y * _pow2(k)


@njit(cache=True)
def schraudolph_expf(x):
    """Schraudolph (1999): write a*x + b into the bits of a float. About 4% off; not canonical."""
    if x != x:
        return x + x
    if x > MAXLOG:
        return _F(np.inf)
    if x < _F(-87.0):
        return _F(0.0)
    return bits_to_f32(np.uint32(np.int32(SCH_A * x + SCH_B)))


# -- the kernels -----------------------------------------------------------------------------------

@njit(cache=True)
def _bf16_bits(u):
    """BF16 bits of an f32 (bits u): round to nearest even, every NaN -> 0x7FC0."""
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint32(0x7FC0)
    return (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@njit(cache=True)
def _ordered(u):
    if u & np.uint32(0x80000000):
        return -np.int64(u & np.uint32(0x7FFFFFFF)) - 1
    return np.int64(u)


@njit(cache=True)
def _is_nan(u):
    return (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)


@njit(cache=True)
def _softmax_input(b):
    """x <= 0 and not NaN: +0, or a negative number down to -inf."""
    return b == np.uint32(0) or (b >= np.uint32(0x80000000) and b <= np.uint32(0xFF800000))


@njit(parallel=True, cache=True)
def canonical_block(lo, n, out):
    """out[i] = bits of expf(x) for the inputs with bits lo + i."""
    for j in prange((n + SUB - 1) // SUB):
        for i in range(j * SUB, min(n, (j + 1) * SUB)):
            out[i] = f32_to_bits(expf(bits_to_f32(np.uint32(lo + i))))


@njit(cache=True)
def _tally(stats, j, b, c, o):
    if c != o:
        stats[j, 0] += 1
        if _bf16_bits(c) != _bf16_bits(o):
            stats[j, 1] += 1
        if _softmax_input(b):
            stats[j, 2] += 1
        if not _is_nan(c) and not _is_nan(o):
            d = abs(_ordered(c) - _ordered(o))
            if d > stats[j, 4]:
                stats[j, 4] = d
        if stats[j, 5] < 0:
            stats[j, 5] = np.int64(b)


@njit(parallel=True, cache=True)
def compare_block(lo, canon, other, stats):
    """Count differences between canonical result bits and another implementation's result bits.

    stats[j] per work item: differ, differ after bf16, differ with x <= 0, inputs with x <= 0, max ULP,
    first differing input bits (-1: none).
    """
    n = canon.size
    for j in prange((n + SUB - 1) // SUB):
        stats[j, 5] = -1
        for i in range(j * SUB, min(n, (j + 1) * SUB)):
            b = np.uint32(lo + i)
            if _softmax_input(b):
                stats[j, 3] += 1
            _tally(stats, j, b, canon[i], other[i])


@njit(parallel=True, cache=True)
def fused_block(lo, canon, which, stats):
    """compare_block for the Numba implementations: 1 cephes, 2 schraudolph, 3 oracle (computed inline)."""
    n = canon.size
    for j in prange((n + SUB - 1) // SUB):
        stats[j, 5] = -1
        for i in range(j * SUB, min(n, (j + 1) * SUB)):
            b = np.uint32(lo + i)
            x = bits_to_f32(b)
            if which == 1:
                y = cephes_expf(x)
            elif which == 2:
                y = schraudolph_expf(x)
            else:
                y = expf(x)
            if _softmax_input(b):
                stats[j, 3] += 1
            _tally(stats, j, b, canon[i], f32_to_bits(y))


@njit(parallel=True)          # not cached: Numba cannot cache a function that calls through a ctypes pointer
def libm_block(lo, canon, which, stats):
    """compare_block for the platform's expf, called through ctypes."""
    n = canon.size
    for j in prange((n + SUB - 1) // SUB):
        stats[j, 5] = -1
        for i in range(j * SUB, min(n, (j + 1) * SUB)):
            b = np.uint32(lo + i)
            if _softmax_input(b):
                stats[j, 3] += 1
            _tally(stats, j, b, canon[i], f32_to_bits(libm_expf(bits_to_f32(b))))
