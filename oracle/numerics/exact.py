"""Exact reference arithmetic for tests and tools (plain Python, no Numba).

Nothing in the model uses this module.  It rounds exact rationals to float32
or float64 (round to nearest, ties to even, with subnormals and overflow), and
builds an IEEE fused multiply-add on top, so that tests can state a definition
independently of the Numba code they check.
"""

import math
from fractions import Fraction

import numpy as np

__all__ = ["round_fraction", "fma_exact", "ulp_distance"]

# (significand bits including the hidden one, smallest normal exponent, largest exponent)
_FORMATS = {
    np.dtype(np.float32): (24, -126, 127),
    np.dtype(np.float64): (53, -1022, 1023),
}


def _floor_log2(q):
    """floor(log2(q)) for a Fraction q > 0."""
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    return e


def round_fraction(q, dtype, negative_zero=False):
    """The dtype value nearest to the rational q (ties to even); inf past the range.

    A zero result is +0 unless q is negative (a negative value that rounds to
    zero gives -0) or ``negative_zero`` asks for -0 when q == 0.
    """
    precision, emin, emax = _FORMATS[np.dtype(dtype)]
    dtype = np.dtype(dtype).type
    if q == 0:
        return dtype(-0.0 if negative_zero else 0.0)
    sign = -1 if q < 0 else 1
    a = abs(q)
    e = max(_floor_log2(a), emin)
    quantum = Fraction(2) ** (e - precision + 1)
    n = round(a / quantum)  # Fraction.__round__: nearest integer, ties to even
    if n == 0:
        return dtype(-0.0 if sign < 0 else 0.0)
    value = n * quantum
    if value >= Fraction(2) ** (emax + 1):
        return dtype(sign * math.inf)
    return dtype(sign * float(value))  # value is exact in float64


def fma_exact(a, b, c):
    """IEEE-754 fusedMultiplyAdd(a, b, c) in the dtype of the arguments (all one dtype),
    rounding to nearest even.  NaN results are returned as a NaN of that dtype (their
    payload is not modelled)."""
    dtype = type(a)
    assert type(b) is dtype and type(c) is dtype, (type(a), type(b), type(c))
    nan = dtype(math.nan)
    if np.isnan(a) or np.isnan(b) or np.isnan(c):
        return nan
    product_negative = bool(np.signbit(a)) != bool(np.signbit(b))
    if np.isinf(a) or np.isinf(b):
        if a == 0 or b == 0:
            return nan  # inf * 0
        if np.isinf(c) and bool(np.signbit(c)) != product_negative:
            return nan  # inf - inf
        return dtype(-math.inf if product_negative else math.inf)
    if np.isinf(c):
        return c
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if exact == 0:
        # An exact zero sum is +0 in round-to-nearest, except (-0) + (-0).
        product_is_zero = a == 0 or b == 0
        both_negative_zeros = product_is_zero and product_negative and c == 0 and np.signbit(c)
        return round_fraction(exact, dtype, negative_zero=both_negative_zeros)
    return round_fraction(exact, dtype)


def ulp_distance(x, y):
    """Number of representable values between two finite floats of one dtype (0 = same)."""
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.dtype in (np.float32, np.float64)
    int_type, unsigned = (np.int32, np.uint32) if x.dtype == np.float32 else (np.int64, np.uint64)
    top = 1 << (8 * x.dtype.itemsize - 1)

    def ordered(v):
        # Map the bit patterns to integers that are monotonic in the value (-0 and +0 both 0).
        bits = v.view(unsigned).astype(object)
        return np.where(bits >= top, top - bits, bits)

    return np.abs(ordered(x) - ordered(y)).astype(np.int64)
