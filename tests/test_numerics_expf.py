"""expf (docs/contract.md §4.3) against the host libm's expf, bit for bit.

The host is glibc on x86-64 with FMA, whose expf is the same algorithm with the
same FMAs; the slow test checks all 2^32 inputs.  NaN results are compared by
their bits too (glibc returns x + x, and so do we).
"""

import ctypes
import math
import time

import mpmath
import numpy as np
import pytest
from numba import njit, prange

from oracle.numerics import expf, expf_array
from oracle.numerics.bits import bits_to_f32, bits_to_f64, f32_to_bits, f64_to_bits
from oracle.numerics.exp_f32 import C0, C1, C2, EXPF_TABLE, INV_LN2_N, SHIFT

_libm = ctypes.CDLL("libm.so.6")
libm_expf = _libm.expf
libm_expf.restype = ctypes.c_float
libm_expf.argtypes = [ctypes.c_float]


@njit
def _libm_expf_array(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = libm_expf(x[i])
    return out


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _check_against_libm(bits):
    x = np.asarray(bits, dtype=np.uint32).view(np.float32)
    ours = _bits(expf_array(x))
    host = _bits(_libm_expf_array(x))
    bad = np.nonzero(ours != host)[0]
    assert bad.size == 0, [(hex(int(b)), hex(int(o)), hex(int(h)))
                           for b, o, h in zip(bits[bad][:10], ours[bad][:10], host[bad][:10])]


EDGE_BITS = np.array([
    0x4202422F, 0xC27C65D9,  # the two inputs where glibc's non-FMA build differs
    0x00000000, 0x80000000,  # +-0 -> 1
    0x00000001, 0x807FFFFF, 0x00400000,  # subnormal inputs -> 1
    0x7F800000, 0xFF800000,  # +inf -> inf, -inf -> +0
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FC12345, 0xFFFFFFFF,  # NaNs: x + x
    0x42B00000, 0xC2B00000, 0x42AFFFFF, 0xC2AFFFFF,  # |x| = 88 and just below: where checks start
    0x42B17217, 0x42B17218,  # 0x1.62e42ep6 (last finite result) and the next: overflow
    0xC2CFF1B4, 0xC2CFF1B5,  # -0x1.9fe368p6 (smallest nonzero result) and the next: underflow
    0xC2CE8ED0, 0xC2CE8ECF, 0xC2CE8ED1,  # about -103.28: results near 2^-149
    0xC2AEAC50, 0xC2AEAC4F, 0xC2AEAC51,  # about -87.34: results near the smallest normal 2^-126
    0xC2C80000, 0xC2BA0000,  # -100, -93: subnormal results
    0x3F800000, 0xBF800000, 0x3F317218, 0x33800000, 0xB3800000,  # 1, -1, ln 2, +-2^-24
    0x7F7FFFFF, 0xFF7FFFFF,  # the largest finite values
], dtype=np.uint32)


def test_edge_inputs_match_libm():
    _check_against_libm(EDGE_BITS)
    # and the spot values the contract names (docs/contract.md §4.3)
    assert _bits(expf(np.float32(-np.inf))) == 0
    assert _bits(expf(np.float32(0.0))) == 0x3F800000
    assert _bits(expf(np.float32(88.8))) == 0x7F800000
    nan = np.uint32(0x7F800001).view(np.float32)  # signalling NaN: x + x quietens it
    assert _bits(expf(nan)) == 0x7FC00001


def test_random_bit_patterns_match_libm():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, 2_000_000, dtype=np.uint64).astype(np.uint32)
    _check_against_libm(bits)
    # Dense coverage of the interesting range |x| < 104.
    x = rng.uniform(-104, 89, 2_000_000).astype(np.float32)
    _check_against_libm(x.view(np.uint32))


@njit
def _expf_without_fma(x):
    """glibc's SSE2 build of the same algorithm: x * InvLn2N rounded before the adds."""
    if abs(x) >= 88.0 or np.isnan(x):
        return expf(x)
    xd = np.float64(x)
    z = INV_LN2_N * xd
    kd = z + SHIFT
    ki = f64_to_bits(kd)
    kd = kd - SHIFT
    r = z - kd
    s = bits_to_f64(EXPF_TABLE[ki & np.uint64(31)] + (ki << np.uint64(47)))
    p = C0 * r + C1
    y = C2 * r + 1.0
    y = p * (r * r) + y
    return np.float32(y * s)


def test_the_fmas_are_part_of_the_definition():
    # Rounding x * InvLn2N separately (the SSE2 build) changes exactly these two results (per the
    # the exhaustive census of docs/contract.md §4.3); on other inputs the two builds agree.
    for b in (0x4202422F, 0xC27C65D9):
        x = np.uint32(b).view(np.float32)
        assert _bits(_expf_without_fma(x)) != _bits(expf(x)), hex(b)
        assert _bits(expf(x)) == _bits(libm_expf(x))
    rng = np.random.default_rng(3)
    for x in rng.uniform(-100, 88, 20000).astype(np.float32):
        assert _bits(_expf_without_fma(x)) == _bits(expf(x))


def test_expf_array_shapes():
    x = np.linspace(-5, 5, 24, dtype=np.float32).reshape(2, 3, 4)
    y = expf_array(x)
    assert y.shape == x.shape and y.dtype == np.float32
    assert np.array_equal(_bits(y).reshape(-1), _bits([expf(v) for v in x.reshape(-1)]))


def test_numpy_exp_is_not_canonical():
    # NumPy's float32 np.exp has its own (SIMD) algorithm; it is not correctly rounded either,
    # and disagrees with the canonical expf on a measurable fraction of inputs.
    rng = np.random.default_rng(1)
    x = rng.uniform(-87, 88, 1_000_000).astype(np.float32)
    differ = np.count_nonzero(_bits(np.exp(x)) != _bits(expf_array(x)))
    print(f"np.exp(float32) differs from expf on {differ / x.size:.2%} of uniform samples in [-87, 88]")
    assert differ > 0


def test_table_and_constants():
    # T[i] + (i << 47) are the bits of 2^(i/32) correctly rounded to double: check with mpmath.
    mpmath.mp.prec = 200
    for i in range(32):
        exact = mpmath.power(2, mpmath.mpf(i) / 32)
        h = (int(EXPF_TABLE[i]) + (i << 47)) % (1 << 64)
        value = np.uint64(h).view(np.float64)
        ulp = 2.0**-52
        err = abs(mpmath.mpf(float(value)) - exact)
        assert err <= mpmath.mpf(ulp) / 2, i  # nearest (a tie is impossible: 2^(i/32) is irrational)
    assert INV_LN2_N == float.fromhex("0x1.71547652b82fep+0") * 32
    assert SHIFT == float.fromhex("0x1.8p+52")
    assert (C0, C1, C2) == (float.fromhex("0x1.c6af84b912394p-20"), float.fromhex("0x1.ebfce50fac4f3p-13"),
                            float.fromhex("0x1.62e42ff0c52d6p-6"))


def test_expf_accuracy_against_mpmath():
    # Not part of the definition, a sanity check: within 1 ulp of e^x on a sample.
    mpmath.mp.prec = 100
    rng = np.random.default_rng(2)
    xs = rng.uniform(-87, 88, 2000).astype(np.float32)
    for x in xs:
        got = np.float32(expf(x))
        exact = mpmath.exp(mpmath.mpf(float(x)))
        ulp = math.ulp(float(np.float32(float(exact)))) * 2.0**29  # float32 ulp
        assert abs(mpmath.mpf(float(got)) - exact) < ulp


# ---------------------------------------------------------------------------------------------
# Exhaustive: all 2^32 inputs, in 2^16 blocks of 2^16, on all cores.
# ---------------------------------------------------------------------------------------------

@njit(parallel=True)
def _scan_all_inputs(counts, first_mismatch):
    block = 1 << 16
    for j in prange(1 << 16):
        base = np.uint32(j) << np.uint32(16)
        mismatches = 0
        first = np.int64(-1)
        for k in range(block):
            u = np.uint32(base + np.uint32(k))
            x = bits_to_f32(u)
            if f32_to_bits(expf(x)) != f32_to_bits(libm_expf(x)):
                mismatches += 1
                if first < 0:
                    first = np.int64(u)
        counts[j] = mismatches
        first_mismatch[j] = first


@pytest.mark.slow
def test_exhaustive_equals_libm():
    counts = np.zeros(1 << 16, np.int64)
    first = np.zeros(1 << 16, np.int64)
    t = time.perf_counter()
    _scan_all_inputs(counts, first)
    print(f"exhaustive expf vs libm: {time.perf_counter() - t:.1f} s (compile included), "
          f"{int(counts.sum())} mismatches")
    bad = np.nonzero(counts)[0]
    assert bad.size == 0, [hex(int(first[b])) for b in bad[:10]]
