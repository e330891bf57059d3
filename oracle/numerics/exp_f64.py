"""exp64: the canonical float64 exponential.

This is glibc's exp (>= 2.28, from Arm's optimized routines, table size
N = 128, polynomial of degree 5) as its FMA build executes it on x86-64, with
every fused multiply-add written out (GCC contracts a*b + c there):

    kd   = fma(InvLn2N, x, SHIFT)                 # k = round(x * 128/ln2)
    ki   = bits(kd); kd -= SHIFT
    r    = fma(kd, NegLn2loN, fma(kd, NegLn2hiN, x))   # x = k ln2/128 + r
    tail = T[k % 128], sbits = H[k % 128] + (k << 45)  # 2^(k/128) ~ scale (1 + tail)
    r2   = r*r
    tmp  = fma(r2*r2, fma(r, C5, C4), fma(r2, fma(r, C3, C2), tail + r))
    exp  = fma(scale, tmp, scale)                 # scale (1 + tail + exp(r) - 1)

with glibc's special cases: |x| < 2^-54 (zeros and subnormals included) ->
1 + x; x = -inf -> +0; NaN or +inf -> 1 + x; |x| >= 1024 -> +0 or +inf;
512 <= |x| < 1024 goes through the same path and then a careful final scaling
(``_specialcase``) that keeps results near overflow exact and rounds
subnormal results only once.

Tables, from first principles (exact integer arithmetic, see below):
H[i] = bits(2^(i/128) correctly rounded to double) - (i << 45) and
T[i] = the double nearest to (2^(i/128) - H)/H, the relative error of H.
The polynomial coefficients and the split of ln2/128 are the published
constants of that implementation.

Accuracy: Arm documents a worst-case error of 0.511 ULP.  The tests measure it
against mpmath and check that every result is within 1 ULP of the correctly
rounded value (docs/numerics_primitives.md records the measured numbers), and
that the results equal the host's libm exp bit for bit on a large sample.
"""

from fractions import Fraction

import numpy as np
from numba import njit

from .bits import bits_to_f64, f64_to_bits
from .exp_f32 import _iroot, exp2_frac_table_bits
from .fused import fma

__all__ = ["exp64", "exp64_array", "EXP64_TABLE"]

_N = 128
_TAIL_PRECISION = 256  # fractional bits of the bounds of 2^(i/128) used to round T[i]


def _tail_bits(i):
    """Bits of the double nearest to (2^(i/N) - H)/H with H the double nearest 2^(i/N).

    2^(i/N) is bracketed by [F, F+1] / 2^P with F = floor(2^(i/N) 2^P) computed
    exactly; both ends must round to the same double, which proves the rounding.
    """
    h = Fraction(np.uint64(exp2_frac_table_bits(i, _N)).view(np.float64).item())
    h_mantissa = (exp2_frac_table_bits(i, _N) & ((1 << 52) - 1)) | (1 << 52)
    start = (h_mantissa + 1) << (_TAIL_PRECISION - 52)  # above 2^(i/N) 2^P: H is within half an ulp
    f = _iroot(1 << (_TAIL_PRECISION * _N + i), _N, start)
    if f**_N == 1 << (_TAIL_PRECISION * _N + i):  # 2^(i/N) = f / 2^P exactly (i = 0)
        return int(np.float64(float((Fraction(f, 1 << _TAIL_PRECISION) - h) / h)).view(np.uint64))
    lo = float((Fraction(f, 1 << _TAIL_PRECISION) - h) / h)  # int/int: correctly rounded
    hi = float((Fraction(f + 1, 1 << _TAIL_PRECISION) - h) / h)
    assert lo == hi, f"tail {i}: bracket too wide to decide the rounding"
    return int(np.float64(lo).view(np.uint64))


def _table():
    tab = []
    for i in range(_N):
        tab.append(_tail_bits(i))
        tab.append((exp2_frac_table_bits(i, _N) - (i << 45)) % (1 << 64))
    return np.array(tab, dtype=np.uint64)


EXP64_TABLE = _table()  # [2i] = T[i] (tail bits), [2i + 1] = H[i] - (i << 45)

INV_LN2_N = float.fromhex("0x1.71547652b82fep0") * _N  # 128/ln2
NEG_LN2_HI_N = float.fromhex("-0x1.62e42fefa0000p-8")  # -ln2/128, high part (exact k*hi)
NEG_LN2_LO_N = float.fromhex("-0x1.cf79abc9e3b3ap-47")  # -ln2/128, low part
SHIFT = float.fromhex("0x1.8p52")
C2 = float.fromhex("0x1.ffffffffffdbdp-2")  # exp(r) - 1 ~ r + C2 r^2 + ... + C5 r^5
C3 = float.fromhex("0x1.555555555543cp-3")
C4 = float.fromhex("0x1.55555cf172b91p-5")
C5 = float.fromhex("0x1.1111167a4d017p-7")
TWO_P1009 = float.fromhex("0x1p1009")
TWO_M1022 = float.fromhex("0x1p-1022")
ABSTOP_TINY = 0x3C9  # (bits(2^-54) >> 52) & 0x7ff
ABSTOP_512 = 0x408
ABSTOP_1024 = 0x409
ABSTOP_INF = 0x7FF


@njit(cache=True)
def _specialcase(tmp, sbits, ki):
    """Final step for 512 <= |x| < 1024, where scale itself may over- or underflow."""
    if (ki & np.uint64(0x80000000)) == np.uint64(0):
        # k > 0: the exponent of scale may exceed the range by up to 460; scale down first.
        sbits = sbits - (np.uint64(1009) << np.uint64(52))
        scale = bits_to_f64(sbits)
        return TWO_P1009 * fma(scale, tmp, scale)
    # k < 0: the result may be subnormal; round it once, at the subnormal precision.
    # Here glibc's FMA build does not fuse: scale*tmp is rounded once and used twice.
    sbits = sbits + (np.uint64(1022) << np.uint64(52))
    scale = bits_to_f64(sbits)
    scale_tmp = scale * tmp
    y = scale + scale_tmp
    if y < 1.0:
        lo = (scale - y) + scale_tmp  # y + lo ~ scale (1 + tmp) more exactly
        hi = 1.0 + y
        lo = ((1.0 - hi) + y) + lo
        y = (hi + lo) - 1.0  # rounded where 2^-1022 y keeps the subnormal's bits
        if y == 0.0:
            y = 0.0  # +0, never -0
    return TWO_M1022 * y


@njit(cache=True)
def exp64(x):
    """Canonical e^x for a float64 x."""
    abstop = (f64_to_bits(x) >> np.uint64(52)) & np.uint64(0x7FF)
    large = False
    if abstop < ABSTOP_TINY:  # |x| < 2^-54, zeros and subnormals included
        return 1.0 + x
    if abstop >= ABSTOP_512:
        if abstop >= ABSTOP_1024:
            if f64_to_bits(x) == np.uint64(0xFFF0000000000000):  # -inf
                return 0.0
            if abstop >= ABSTOP_INF:  # NaN or +inf
                return 1.0 + x
            if x < 0.0:
                return 0.0  # underflow
            return np.inf  # overflow
        large = True  # 512 <= |x| < 1024: finished by _specialcase
    kd = fma(INV_LN2_N, x, SHIFT)
    ki = f64_to_bits(kd)
    kd = kd - SHIFT
    r = fma(kd, NEG_LN2_LO_N, fma(kd, NEG_LN2_HI_N, x))
    idx = np.uint64(2) * (ki & np.uint64(_N - 1))
    top = ki << np.uint64(45)
    tail = bits_to_f64(EXP64_TABLE[idx])
    sbits = EXP64_TABLE[idx + np.uint64(1)] + top  # wraps mod 2^64
    r2 = r * r
    tmp = fma(r2 * r2, fma(r, C5, C4), fma(r2, fma(r, C3, C2), tail + r))
    if large:
        return _specialcase(tmp, sbits, ki)
    scale = bits_to_f64(sbits)
    return fma(scale, tmp, scale)


@njit(cache=True)
def exp64_array(x):
    """Element-wise exp64 of a float64 array of any shape."""
    out = np.empty(x.shape, np.float64)
    out_flat = out.reshape(-1)
    x_flat = x.ravel()
    for i in range(x_flat.size):
        out_flat[i] = exp64(x_flat[i])
    return out
