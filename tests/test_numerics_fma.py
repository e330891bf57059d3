"""fma is a true single-rounding FMA, Numba does not contract a*b + c, bit casts are exact."""

import math

import numpy as np
import pytest
from numba import njit

from oracle.numerics import fma, fma_py
from oracle.numerics.bits import bits_to_f32, bits_to_f64, f32_to_bits, f64_to_bits
from oracle.numerics.exact import fma_exact


@njit(cache=True)
def _fused(a, b, c):
    return fma(a, b, c)


@njit(cache=True)
def _unfused(a, b, c):
    return a * b + c  # must stay two roundings (no fastmath, no contraction)


def _bits(x, dtype):
    return np.array([x], dtype=dtype).view(np.uint32 if dtype == np.float32 else np.uint64)[0]


def test_fma_float32_single_rounding():
    a = np.float32(1 + 2.0**-12)
    c = np.float32(-(1 + 2.0**-11))
    # a*a = 1 + 2^-11 + 2^-24 exactly; rounded first it is 1 + 2^-11 (a tie to even).
    assert np.float32(_fused(a, a, c)) == np.float32(2.0**-24)
    assert np.float32(fma_py(a, a, c)) == np.float32(2.0**-24)
    assert np.float32(_unfused(a, a, c)) == np.float32(0.0)


def test_fma_float64_single_rounding():
    a = 1 + 2.0**-27
    c = -(1 + 2.0**-26)
    assert _fused(a, a, c) == 2.0**-54
    assert fma_py(a, a, c) == 2.0**-54
    assert _unfused(a, a, c) == 0.0


def test_fma_keeps_float32():
    # The float32 fma must round once to float32, not compute in double and round twice:
    # a*b + c = 1 + 2^-24 + 2^-59 exactly.  Rounded to float32 once: 1 + 2^-23.  Rounded to
    # double first, the 2^-59 is lost, 1 + 2^-24 is a float32 tie, and it goes to even 1.0.
    a = np.float32(math.ldexp(8390656, -35))
    b = np.float32(math.ldexp(16773121, -35))
    c = np.float32(1 - 2.0**-24)
    assert np.float32(_fused(a, b, c)) == np.float32(1 + 2.0**-23)
    assert fma_exact(a, b, c) == np.float32(1 + 2.0**-23)
    assert np.float32(_fused(float(a), float(b), float(c))) == np.float32(1.0)  # double rounding


def test_fma_random_against_exact():
    rng = np.random.default_rng(1)
    for dtype, unsigned, n in ((np.float32, np.uint32, 3000), (np.float64, np.uint64, 3000)):
        bits = rng.integers(0, np.iinfo(unsigned).max, size=(n, 3), dtype=unsigned, endpoint=True)
        # Keep exponents moderate so that the three terms interact.
        vals = bits.view(dtype)
        vals = np.where(np.isfinite(vals) & (np.abs(vals) < 1e30) & (np.abs(vals) > 1e-30), vals,
                        dtype(1.5))
        scale = rng.integers(-4, 4, size=(n, 3))
        vals = (np.frexp(vals)[0] * np.exp2(scale)).astype(dtype)
        for a, b, c in vals:
            got = _fused(a, b, c)
            want = fma_exact(a, b, c)
            assert _bits(got, dtype) == _bits(want, dtype), (a, b, c, got, want)


def test_fma_special_values():
    f = np.float32
    cases = [
        (f(np.inf), f(0.0), f(1.0)),
        (f(np.inf), f(1.0), f(-np.inf)),
        (f(-0.0), f(1.0), f(-0.0)),
        (f(0.0), f(-1.0), f(-0.0)),
        (f(1.0), f(-1.0), f(1.0)),
        (f(3.4e38), f(2.0), f(-3.4e38)),
        (f(1e-45), f(0.5), f(0.0)),
        (f(np.inf), f(-2.0), f(5.0)),
    ]
    for a, b, c in cases:
        got = f(_fused(a, b, c))
        want = fma_exact(a, b, c)
        if np.isnan(want):
            assert np.isnan(got)
        else:
            assert _bits(got, np.float32) == _bits(want, np.float32), (a, b, c)


def test_fma_refuses_mixed_types():
    with pytest.raises(Exception, match="fma needs three float32 or three float64"):
        fma_py(np.float32(1.0), 1.0, 1.0)


@njit(cache=True)
def _casts(x32, x64, u32, u64):
    return f32_to_bits(x32), f64_to_bits(x64), bits_to_f32(u32), bits_to_f64(u64)


def test_bit_casts():
    x32 = np.float32(-1.5)
    x64 = -2.25
    u32 = np.uint32(0x7FC00001)
    u64 = np.uint64(0x7FF8000000000123)
    b32, b64, f32, f64 = _casts(x32, x64, u32, u64)
    assert b32 == 0xBFC00000
    assert b64 == np.float64(x64).view(np.uint64)
    assert np.float32(f32).view(np.uint32) == 0x7FC00001  # payload kept
    assert np.float64(f64).view(np.uint64) == 0x7FF8000000000123
