"""exp64 against the host libm's exp (bit for bit) and against mpmath (ULP error).

exp64 is glibc's double exp as its FMA build runs it; on this host (glibc on
x86-64 with FMA) math.exp is that very function, so a large random sample must
match bit for bit.  Independently of any libm, mpmath gives the correctly
rounded value: every result must be within 1 ULP of it, and the error measured
in ULPs must stay below the implementation's analytical bound, 0.509 ULP
(0.5 + 1.11/128 + polynomial error; Arm's optimized-routines).
"""

import ctypes
import math
import time
from fractions import Fraction

import mpmath
import numpy as np
import pytest
from numba import njit

from oracle.numerics import exp64, sigmoid64
from oracle.numerics.exact import round_fraction, ulp_distance
from oracle.numerics.exp_f64 import EXP64_TABLE, exp64_array

_libm = ctypes.CDLL("libm.so.6")
libm_exp = _libm.exp
libm_exp.restype = ctypes.c_double
libm_exp.argtypes = [ctypes.c_double]

ERROR_BOUND_ULP = 0.509

OVERFLOW_X = float.fromhex("0x1.62e42fefa39efp+9")  # 709.78...: the largest x with a finite result
SUBNORMAL_LIMIT_X = -708.3964185322641  # about ln(2^-1022): results below it are subnormal
UNDERFLOW_X = -745.1332191019411  # about ln(2^-1074): the smallest nonzero result


@njit
def _libm_exp_array(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = libm_exp(x[i])
    return out


def _bits(x):
    return np.asarray(x, np.float64).view(np.uint64)


def _check_against_libm(x):
    x = np.asarray(x, np.float64)
    ours = _bits(exp64_array(x))
    host = _bits(_libm_exp_array(x))
    bad = np.nonzero(ours != host)[0]
    assert bad.size == 0, [(repr(x[i]), hex(int(ours[i])), hex(int(host[i]))) for i in bad[:10]]


def _edge_inputs():
    xs = [0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 2.0**-54, -(2.0**-54),
          np.nextafter(2.0**-54, 0), 2.0**-53, 1e-10, -1e-10, 1.0, -1.0, 0.5, math.log(2),
          OVERFLOW_X, np.nextafter(OVERFLOW_X, 0), np.nextafter(OVERFLOW_X, 1e9),
          SUBNORMAL_LIMIT_X, np.nextafter(SUBNORMAL_LIMIT_X, 0), np.nextafter(SUBNORMAL_LIMIT_X, -1e9),
          UNDERFLOW_X, np.nextafter(UNDERFLOW_X, 0), np.nextafter(UNDERFLOW_X, -1e9),
          -745.13321910194122, -746.0, -800.0, -1000.0, -1023.999, -1024.0, -1e300,
          512.0, -512.0, np.nextafter(512.0, 0), 700.0, 709.0, 710.0, 1000.0, 1024.0, 1e300,
          1.7976931348622157e308, -1.7976931348622157e308,
          math.inf, -math.inf]
    nans = np.array([0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001,
                     0x7FF8000000012345, 0xFFFFFFFFFFFFFFFF], np.uint64).view(np.float64)
    return np.concatenate([np.array(xs, np.float64), nans])


def test_edge_cases_match_libm():
    _check_against_libm(_edge_inputs())


def test_edge_case_values():
    assert exp64(0.0) == 1.0 and exp64(-0.0) == 1.0 and exp64(5e-324) == 1.0
    assert exp64(math.inf) == math.inf
    assert _bits(exp64(-math.inf)) == 0  # +0
    assert _bits(exp64(-1000.0)) == 0
    assert exp64(1000.0) == math.inf
    assert math.isfinite(exp64(OVERFLOW_X)) and exp64(np.nextafter(OVERFLOW_X, 1e9)) == math.inf
    assert exp64(UNDERFLOW_X) == 5e-324  # the smallest subnormal
    assert 0 < exp64(-740.0) < 2.2250738585072014e-308  # a subnormal result
    snan = np.uint64(0x7FF0000000000001).view(np.float64)
    assert _bits(exp64(snan)) == 0x7FF8000000000001  # 1 + x: the NaN, quietened
    assert math.isnan(exp64(math.nan))


def test_large_sample_matches_libm():
    rng = np.random.default_rng(0)
    samples = [
        rng.uniform(-746, 710, 2_000_000),  # the whole interesting range
        rng.uniform(-1, 1, 1_000_000),
        rng.uniform(-2.0**-40, 2.0**-40, 200_000),  # tiny |x|, around the 2^-54 cut
        rng.uniform(UNDERFLOW_X - 0.5, SUBNORMAL_LIMIT_X + 0.5, 500_000),  # subnormal results
        rng.uniform(512, OVERFLOW_X + 0.01, 500_000),  # k > 0 special case, up to overflow
        rng.uniform(-1024, -512, 200_000),  # k < 0 special case
        rng.integers(0, 1 << 64, 1_000_000, dtype=np.uint64).view(np.float64),  # any bit pattern
    ]
    x = np.concatenate(samples)
    assert x.size >= 5_000_000
    _check_against_libm(x)


def test_matches_math_exp():
    # The same check through Python's math.exp (which calls the host libm's exp).
    rng = np.random.default_rng(1)
    for x in rng.uniform(-750, 712, 100_000):
        try:
            want = math.exp(x)
        except OverflowError:
            want = math.inf
        got = exp64(x)
        assert _bits(got) == _bits(want), x


def test_exp64_array_shapes():
    x = np.linspace(-3, 3, 12).reshape(3, 4)
    y = exp64_array(x)
    assert y.shape == x.shape and y.dtype == np.float64
    assert np.array_equal(_bits(y).reshape(-1), _bits([exp64(v) for v in x.reshape(-1)]))


def test_table_against_mpmath():
    mpmath.mp.prec = 200
    for i in range(128):
        exact = mpmath.power(2, mpmath.mpf(i) / 128)
        h = np.uint64((int(EXP64_TABLE[2 * i + 1]) + (i << 45)) % (1 << 64)).view(np.float64)
        assert abs(mpmath.mpf(float(h)) - exact) <= mpmath.mpf(2.0**-53), i  # H nearest to 2^(i/128)
        tail = np.uint64(EXP64_TABLE[2 * i]).view(np.float64)
        rel = (exact - mpmath.mpf(float(h))) / mpmath.mpf(float(h))
        want = round_fraction(_fraction(rel), np.float64)
        assert _bits(tail) == _bits(want), i  # T nearest to the relative error of H


def _fraction(v):
    """An mpmath number as an exact Fraction."""
    if v == 0:
        return Fraction(0)
    man, exp = v.man_exp  # man is the magnitude
    return (-1 if v < 0 else 1) * Fraction(int(abs(man))) * Fraction(2) ** int(exp)


def _ulp_errors(x):
    """(error in ULPs of the correctly rounded value, ULP distance to it) for each x."""
    mpmath.mp.prec = 120
    y = exp64_array(x)
    errors = np.empty(x.size)
    correctly_rounded = np.empty(x.size)
    for i, (xi, yi) in enumerate(zip(x, y)):
        exact = mpmath.exp(mpmath.mpf(float(xi)))
        q = _fraction(exact)
        cr = round_fraction(q, np.float64)
        correctly_rounded[i] = cr
        if math.isinf(cr) or math.isinf(yi):
            errors[i] = 0.0 if yi == cr else math.inf
            continue
        ulp = max(float(np.spacing(np.float64(cr))), 5e-324)
        errors[i] = float(abs(Fraction(float(yi)) - q) / Fraction(ulp))
    return errors, ulp_distance(y, correctly_rounded)


def _mpmath_sample(n, seed):
    rng = np.random.default_rng(seed)
    return np.concatenate([
        rng.uniform(UNDERFLOW_X - 0.1, OVERFLOW_X, n),
        rng.uniform(-1, 1, n // 4),
        rng.uniform(UNDERFLOW_X - 0.1, SUBNORMAL_LIMIT_X, n // 4),
        [v for v in _edge_inputs() if abs(v) < 750],  # finite edge inputs in range
    ])


def test_ulp_error_against_mpmath():
    errors, distance = _ulp_errors(_mpmath_sample(20_000, 2))
    assert distance.max() <= 1
    assert errors.max() <= ERROR_BOUND_ULP, errors.max()


@pytest.mark.slow
def test_ulp_error_against_mpmath_large():
    t = time.perf_counter()
    x = _mpmath_sample(1_000_000, 3)
    errors, distance = _ulp_errors(x)
    print(f"exp64 vs mpmath on {x.size} inputs: max error {errors.max():.4f} ULP, "
          f"{np.count_nonzero(distance)} results 1 ULP from the correctly rounded value "
          f"({time.perf_counter() - t:.0f} s)")
    assert distance.max() <= 1
    assert errors.max() <= ERROR_BOUND_ULP


def test_sigmoid64_definition():
    rng = np.random.default_rng(4)
    for x in np.concatenate([rng.uniform(-40, 40, 2000), [0.0, -0.0, 800.0, -800.0, math.inf, -math.inf]]):
        assert _bits(sigmoid64(x)) == _bits(1.0 / (1.0 + exp64(-x)))
    assert sigmoid64(-math.inf) == 0.0 and sigmoid64(math.inf) == 1.0 and sigmoid64(0.0) == 0.5
