"""expf: the canonical float32 exponential (docs/contract.md §4.3).

This is glibc's expf (>= 2.28, from Arm's optimized routines) as its FMA build
executes it, with the five fused multiply-adds written out:

    kd = fma(InvLn2N, (double)x, SHIFT)      # k = round(x * 32/ln2), in the low bits
    ki = bits(kd); kd -= SHIFT
    r  = fma(InvLn2N, (double)x, -kd)        # x*32/ln2 = k + r, |r| <= 1/2
    s  = asdouble(T[ki % 32] + (ki << 47))   # 2^(k/32)
    z  = fma(C0, r, C1); r2 = r*r
    y  = fma(C2, r, 1); y = fma(z, r2, y)    # 2^(r/32) ~ 1 + C2 r + C1 r^2 + C0 r^3
    y  = y * s
    return (float)y

All arithmetic between the conversions is in double; the single final rounding
to float makes the result correct in almost all cases.  Special cases are
looked at only when |x| >= 88 (or x is NaN), exactly as glibc does:
x = -inf -> +0; NaN or +inf -> x + x (a NaN stays a NaN with its payload,
quietened); x > 0x1.62e42ep6 -> +inf; x < -0x1.9fe368p6 -> +0; anything else
(e.g. x = 88.5) takes the normal path.

The FMAs are part of the definition: glibc's SSE2 build (no FMA) rounds
x*InvLn2N separately and differs on exactly two inputs (0x4202422f,
0xc27c65d9).  NumPy's float32 np.exp is a different algorithm altogether.

T[i] = bits(2^(i/32) correctly rounded to double) - (i << 47), computed below
from first principles with exact integer arithmetic (and checked against
mpmath and glibc's published table by the tests).
"""

import math

import numpy as np
from numba import njit

from .bits import bits_to_f64, f32_to_bits, f64_to_bits
from .fused import fma

__all__ = ["expf", "expf_array", "exp2_frac_table_bits", "EXPF_TABLE"]


def _iroot(x, n, start=None):
    """floor(x ** (1/n)) for integers x >= 1, n >= 1 (Newton's method on integers).

    ``start`` may give any integer >= the root to begin from (a close one saves
    iterations); by default 2^ceil(bits/n).  From above, integer Newton steps
    decrease monotonically and stop exactly at the floor of the root.
    """
    g = start if start is not None else 1 << -(-x.bit_length() // n)
    assert g**n >= x, "start must not be below the root"
    while True:
        y = ((n - 1) * g + x // g ** (n - 1)) // n
        if y >= g:
            return g
        g = y


def exp2_frac_table_bits(i, n):
    """Bits of the double nearest to 2^(i/n), 0 <= i < n (ties cannot occur for i > 0).

    2^(i/n) lies in [1, 2), so the double is M * 2^-52 with the integer
    M = round(2^(52 + i/n)).  floor(2^(52 + i/n)) = iroot(2^(52n + i), n) exactly,
    and M is one more when (F + 1/2)^n < 2^(52n + i), i.e. (2F + 1)^n < 2^(52n + i + n).
    """
    assert 0 <= i < n
    start = int(math.ldexp(2.0 ** (i / n), 52)) + 2  # libm's pow is within an ulp: an upper bound
    f = _iroot(1 << (52 * n + i), n, start)
    m = f + 1 if (2 * f + 1) ** n < 1 << (52 * n + i + n) else f
    assert (1 << 52) <= m < (1 << 53)
    return 0x3FF0000000000000 + (m - (1 << 52))


_N = 32
EXPF_TABLE = np.array(
    [(exp2_frac_table_bits(i, _N) - (i << 47)) % (1 << 64) for i in range(_N)], dtype=np.uint64
)

INV_LN2_N = float.fromhex("0x1.71547652b82fep+0") * _N  # 32/ln2
SHIFT = float.fromhex("0x1.8p+52")  # adding it rounds to an integer, kept in the low bits
C0 = float.fromhex("0x1.c6af84b912394p-5") / _N**3  # polynomial for 2^(r/32), r in [-1/2, 1/2]
C1 = float.fromhex("0x1.ebfce50fac4f3p-3") / _N**2
C2 = float.fromhex("0x1.62e42ff0c52d6p-1") / _N
OVERFLOW_BOUND = np.float32(float.fromhex("0x1.62e42ep6"))  # above: exp(x) rounds to inf
UNDERFLOW_BOUND = np.float32(-float.fromhex("0x1.9fe368p6"))  # below: exp(x) rounds to 0
ABSTOP_88 = 0x42B  # (bits(88.0f) >> 20) & 0x7ff
ABSTOP_INF = 0x7F8  # (bits(inf) >> 20) & 0x7ff


@njit(cache=True)
def expf(x):
    """Canonical e^x for a float32 x, as float32."""
    abstop = (f32_to_bits(x) >> np.uint32(20)) & np.uint32(0x7FF)
    if abstop >= ABSTOP_88:  # |x| >= 88 or x is NaN
        if f32_to_bits(x) == np.uint32(0xFF800000):  # -inf
            return np.float32(0.0)
        if abstop >= ABSTOP_INF:  # NaN or +inf
            return x + x
        if x > OVERFLOW_BOUND:
            return np.float32(np.inf)
        if x < UNDERFLOW_BOUND:
            return np.float32(0.0)
    xd = np.float64(x)
    kd = fma(INV_LN2_N, xd, SHIFT)
    ki = f64_to_bits(kd)
    kd = kd - SHIFT
    r = fma(INV_LN2_N, xd, -kd)
    t = EXPF_TABLE[ki & np.uint64(_N - 1)] + (ki << np.uint64(47))  # wraps mod 2^64
    s = bits_to_f64(t)
    z = fma(C0, r, C1)
    r2 = r * r
    y = fma(C2, r, 1.0)
    y = fma(z, r2, y)
    y = y * s
    return np.float32(y)


@njit(cache=True)
def expf_array(x):
    """Element-wise expf of a float32 array of any shape."""
    out = np.empty(x.shape, np.float32)
    out_flat = out.reshape(-1)
    x_flat = x.ravel()
    for i in range(x_flat.size):
        out_flat[i] = expf(x_flat[i])
    return out
