"""The C++ CPU primitives of fast._core, bit for bit (docs/contract.md §4.1-4.3).

Every comparison is on bits (``.view(np.uint32)`` etc.), never with a tolerance. Where a result is a
NaN, only NaN-ness is compared: IEEE leaves NaN payload propagation to the hardware and the
instruction's operand order, and the canonical NaN that matters (BF16 0x7FC0) is checked on bits.

Three independent references:
  * a plain-Python statement of docs/contract.md §4.2 over an exact FMA (Fractions, IEEE rules for inf/NaN),
  * ml_dtypes for the format tables, NumPy's IEEE float32 arithmetic and the host libm for expf,
  * the Numba oracle (oracle.numerics), when importable: C++ and Numba must agree bit for bit.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import time
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fast import _core as core

F32 = np.float32
U32 = np.uint32

# ---------------------------------------------------------------------------------------------
# The reference: docs/contract.md §4.2 in plain Python over an exact fma.
# ---------------------------------------------------------------------------------------------

# (precision in bits including the hidden one, minimum normal exponent, maximum exponent)
FMT32 = (24, -126, 127)
FMT64 = (53, -1022, 1023)


def round_exact(q: Fraction, fmt) -> float:
    """Round the exact rational q (nonzero) to the format, nearest-even, with subnormals and
    overflow to infinity. The result is returned as a Python float (exact for both formats)."""
    p, emin, emax = fmt
    sign = -1.0 if q < 0 else 1.0
    q = abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()  # 2^e <= q < 2^(e+2)
    if Fraction(2) ** e > q:
        e -= 1
    elif Fraction(2) ** (e + 1) <= q:
        e += 1
    e = max(e, emin)
    k = e - (p - 1)  # exponent of the unit in the last place
    scaled = q / Fraction(2) ** k
    n = scaled.numerator // scaled.denominator
    rem = scaled - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1):
        n += 1
    if n * Fraction(2) ** k >= Fraction(2) ** (emax + 1):
        return sign * math.inf
    return sign * math.ldexp(n, k)


def fma_exact(a: float, b: float, c: float, fmt) -> float:
    """IEEE fused multiply-add, one rounding, round-to-nearest-even."""
    if math.isnan(a) or math.isnan(b) or math.isnan(c):
        return math.nan
    if (math.isinf(a) and b == 0) or (a == 0 and math.isinf(b)):
        return math.nan
    if math.isinf(a) or math.isinf(b):
        p = math.copysign(math.inf, a) * math.copysign(1.0, b)
        if math.isinf(c) and c != p:
            return math.nan
        return p
    if math.isinf(c):
        return c
    prod = Fraction(a) * Fraction(b)
    s = prod + Fraction(c)
    if s == 0:
        if prod == 0 and c == 0:
            prod_negative = (math.copysign(1.0, a) * math.copysign(1.0, b)) < 0
            return -0.0 if prod_negative and math.copysign(1.0, c) < 0 else 0.0
        return 0.0  # exact cancellation: +0 in round-to-nearest
    return round_exact(s, fmt)


def ref_cdot(a, b, fmt) -> float:
    """docs/contract.md §4.2 literally: P[g][l], element i = 64c + 8g + l, 4/2/1 trees."""
    P = [[0.0] * 8 for _ in range(8)]
    for i, (x, y) in enumerate(zip(a, b)):
        g, lane = (i % 64) // 8, i % 8
        P[g][lane] = fma_exact(float(x), float(y), P[g][lane], fmt)
    add = lambda u, v: fma_exact(1.0, u, v, fmt)  # noqa: E731  (exact: u*1 + v, one rounding)
    for w in (4, 2, 1):
        for g in range(w):
            for lane in range(8):
                P[g][lane] = add(P[g][lane], P[g + w][lane])
    for w in (4, 2, 1):
        for lane in range(w):
            P[0][lane] = add(P[0][lane], P[0][lane + w])
    return P[0][0]


def same32(x, y) -> bool:
    """Bit-identical float32 values (any NaN matches any NaN)."""
    x, y = F32(x), F32(y)
    if np.isnan(x) or np.isnan(y):
        return bool(np.isnan(x) and np.isnan(y))
    return x.view(U32) == y.view(U32)


def same64(x, y) -> bool:
    x, y = np.float64(x), np.float64(y)
    if np.isnan(x) or np.isnan(y):
        return bool(np.isnan(x) and np.isnan(y))
    return x.view(np.uint64) == y.view(np.uint64)


def assert_same_bits(got: np.ndarray, want: np.ndarray):
    """Arrays equal bit for bit (NaN positions must agree; NaN payloads are not compared)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ui = {4: U32, 8: np.uint64, 2: np.uint16}[got.dtype.itemsize]
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_g, nan_w), f"NaN positions differ at {np.flatnonzero(nan_g != nan_w)[:10]}"
    diff = (got.view(ui) != want.view(ui)) & ~nan_g
    assert not diff.any(), (
        f"{int(diff.sum())} elements differ, first at {np.argwhere(diff)[0]}: "
        f"got {got[diff][0]!r} want {want[diff][0]!r}")


# ---------------------------------------------------------------------------------------------
# Input strategies: lengths 0..300, values incl. ±0, subnormals, inf, nan.
# ---------------------------------------------------------------------------------------------

def _specials(width):
    tiny = 2.0 ** -149 if width == 32 else 2.0 ** -1074
    big = float(np.finfo(np.float32 if width == 32 else np.float64).max)
    return [0.0, -0.0, math.inf, -math.inf, math.nan, tiny, -tiny, big, -big, 1.0, -1.0]


@st.composite
def vector_pairs(draw, width: int):
    n = draw(st.integers(0, 300))
    kind = draw(st.sampled_from(["nice", "tiny", "wide", "mixed", "any"]))
    floats = {
        "nice": st.floats(-1e3, 1e3, width=width),
        "tiny": (st.floats(-float(F32(1e-36)), float(F32(1e-36)), width=32) if width == 32
                 else st.floats(-1e-300, 1e-300)),
        "wide": st.floats(allow_nan=False, allow_infinity=False, width=width),
        "any": st.floats(width=width),
    }
    if kind == "mixed":
        elem = st.one_of(floats["nice"], floats["tiny"], floats["wide"])
    else:
        elem = floats[kind]
    a = draw(st.lists(elem, min_size=n, max_size=n))
    b = draw(st.lists(elem, min_size=n, max_size=n))
    if n and draw(st.booleans()):  # sprinkle a few special values
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, n - 1))
            (a if draw(st.booleans()) else b)[i] = draw(st.sampled_from(_specials(width)))
    dt = np.float32 if width == 32 else np.float64
    return np.array(a, dt), np.array(b, dt)


def _oracle():
    """The Numba oracle's numerics, or a skip when it is not importable (yet)."""
    on = pytest.importorskip("oracle.numerics")
    needed = ["cdot", "cdot64", "csum", "expf_array", "bf16_round_array", "f32_to_bf16_bits",
              "decode_e4m3", "decode_e2m1", "decode_e8m0", "decode_fp8_weight", "decode_mxfp4_weight",
              "matvec"]
    missing = [n for n in needed if not hasattr(on, n)]
    if missing:
        pytest.skip(f"oracle.numerics does not export {missing} yet")
    return on


# ---------------------------------------------------------------------------------------------
# cdot / cdot64 / csum
# ---------------------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(vector_pairs(32))
def test_cdot_matches_spec_reference(ab):
    a, b = ab
    got = core.cdot(a, b)
    assert isinstance(got, np.float32)
    assert same32(got, ref_cdot(a.tolist(), b.tolist(), FMT32))


@settings(max_examples=100, deadline=None)
@given(vector_pairs(64))
def test_cdot64_matches_spec_reference(ab):
    a, b = ab
    assert same64(core.cdot64(a, b), ref_cdot(a.tolist(), b.tolist(), FMT64))


@settings(max_examples=60, deadline=None)
@given(vector_pairs(32))
def test_csum_is_cdot_with_ones(ab):
    a, _ = ab
    ones = np.ones_like(a)
    assert same32(core.csum(a), core.cdot(a, ones))
    assert same32(core.csum(a), ref_cdot(a.tolist(), ones.tolist(), FMT32))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 71, 72, 100, 127, 128, 129, 200, 300])
def test_cdot_tail_keeps_negative_zero(n):
    # Every product is -2^-200, which rounds to -0: each touched P[g][l] is -0, untouched ones +0.
    # Skipping elements past n must leave partial sums alone: fma(0, 0, -0) would give +0.
    a = np.full(n, -(2.0 ** -100), F32)
    b = np.full(n, 2.0 ** -100, F32)
    want = ref_cdot(a.tolist(), b.tolist(), FMT32)
    assert same32(core.cdot(a, b), want)
    assert same64(core.cdot64(a.astype(np.float64) * 2.0 ** -450, b.astype(np.float64) * 2.0 ** -450),
                  ref_cdot((a.astype(np.float64) * 2.0 ** -450).tolist(),
                           (b.astype(np.float64) * 2.0 ** -450).tolist(), FMT64))
    if n >= 64:
        assert math.copysign(1.0, float(core.cdot(a, b))) == -1.0


def test_cdot_order_is_the_canonical_one():
    # 1 + 2^-24 + ... is sensitive to the order of additions: a sequential sum would give 1.0.
    rng = np.random.default_rng(1)
    for n in (5, 64, 65, 130, 257, 1000, 4096 + 32):
        a = rng.standard_normal(n).astype(F32) * F32(2.0) ** rng.integers(-20, 20, n).astype(F32)
        b = rng.standard_normal(n).astype(F32)
        assert same32(core.cdot(a, b), ref_cdot(a.tolist(), b.tolist(), FMT32)), n


# ---------------------------------------------------------------------------------------------
# C++ vs the Numba oracle
# ---------------------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(vector_pairs(32))
def test_cdot_matches_oracle(ab):
    on = _oracle()
    a, b = ab
    assert same32(core.cdot(a, b), on.cdot(a, b))
    assert same32(core.csum(a), on.csum(a))


@settings(max_examples=100, deadline=None)
@given(vector_pairs(64))
def test_cdot64_matches_oracle(ab):
    on = _oracle()
    a, b = ab
    assert same64(core.cdot64(a, b), on.cdot64(a, b))


def test_expf_matches_oracle():
    on = _oracle()
    rng = np.random.default_rng(2)
    x = np.concatenate([
        rng.integers(0, 2 ** 32, 1 << 20, dtype=np.uint64).astype(U32).view(F32),
        rng.uniform(-110, 95, 1 << 18).astype(F32),
        np.array([0x4202422F, 0xC27C65D9, 0x7F800000, 0xFF800000, 0x7FC00000, 0x42B17217, 0x42B17218,
                  0xC2CFF1B4, 0xC2CFF1B5, 0x42B00000, 0xC2B00000], U32).view(F32),
    ])
    assert_same_bits(core.expf(x), on.expf_array(x))


def test_bf16_matches_oracle():
    on = _oracle()
    x = _bf16_inputs()
    assert_same_bits(core.bf16_from_f32(x), on.f32_to_bf16_bits(x))
    assert_same_bits((core.bf16_from_f32(x).astype(U32) << 16).view(F32), on.bf16_round_array(x))


def test_decoders_match_oracle():
    on = _oracle()
    codes = np.arange(256, dtype=np.uint8)
    assert_same_bits(core.decode_e4m3(codes), on.decode_e4m3(codes))
    assert_same_bits(core.decode_e8m0(codes), on.decode_e8m0(codes))
    assert_same_bits(core.decode_e2m1(codes[:16]), on.decode_e2m1(codes[:16]))
    rng = np.random.default_rng(3)
    q, s = _fp8_weight(rng, 130, 260)
    assert_same_bits(core.decode_fp8_weight(q, s), on.decode_fp8_weight(q, s))
    p, e = _mxfp4_weight(rng, 9, 160)
    assert_same_bits(core.decode_mxfp4_weight(p, e), on.decode_mxfp4_weight(p, e))


@pytest.mark.parametrize("C", [96, 160, 200, 4096 + 32])
def test_matvec_matches_oracle(C):
    on = _oracle()
    rng = np.random.default_rng(C)
    x = _activations(rng, C)
    W = _bf16_weight(rng, 7, C)
    assert_same_bits(core.matvec_bf16(W, x), on.matvec((W.astype(U32) << 16).view(F32), x))
    q, s = _fp8_weight(rng, 7, C)
    assert_same_bits(core.matvec_fp8(q, s, x), on.matvec(on.decode_fp8_weight(q, s), x))
    if C % 32 == 0:
        p, e = _mxfp4_weight(rng, 7, C)
        assert_same_bits(core.matvec_mxfp4(p, e, x), on.matvec(on.decode_mxfp4_weight(p, e), x))


# ---------------------------------------------------------------------------------------------
# matvec: each row is cdot(decoded W[r], x)
# ---------------------------------------------------------------------------------------------

def _activations(rng, C):
    x = (rng.standard_normal(C) * 2.0 ** rng.integers(-6, 6, C)).astype(F32)
    x[rng.integers(0, C, max(1, C // 50))] = 0.0
    return x


def _bf16_weight(rng, R, C):
    w = (rng.standard_normal((R, C)) * 0.05).astype(F32)
    W = core.bf16_from_f32(w)
    W[0, : min(C, 3)] = [0x8000, 0x0001, 0x807F][: min(C, 3)]  # -0 and subnormals
    return W


def _fp8_weight(rng, R, C):
    q = rng.integers(0, 256, (R, C), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x3C  # no NaN codes (the loader refuses them)
    s = (2.0 ** rng.integers(-12, 2, ((R + 127) // 128, (C + 127) // 128)) *
         rng.uniform(1, 2, ((R + 127) // 128, (C + 127) // 128))).astype(F32)
    return q, s


def _mxfp4_weight(rng, R, C):
    p = rng.integers(0, 256, (R, C // 2), dtype=np.uint8)
    e = rng.integers(110, 130, (R, C // 32), dtype=np.uint8)
    e[0, 0] = 0  # 2^-127: subnormal products
    return p, e


def _rows_are_cdots(y, Wd, x):
    assert y.dtype == F32 and y.shape == (Wd.shape[0],)
    want = np.array([core.cdot(np.ascontiguousarray(Wd[r]), x) for r in range(Wd.shape[0])], F32)
    assert_same_bits(y, want)


MATVEC_C = [1, 7, 8, 9, 63, 64, 65, 96, 100, 160, 200, 4096 + 32, 4096 + 37]


@pytest.mark.parametrize("C", MATVEC_C)
def test_matvec_bf16_rows_are_cdots(C):
    rng = np.random.default_rng(10 + C)
    W, x = _bf16_weight(rng, 7, C), _activations(rng, C)
    Wd = (W.astype(U32) << 16).view(F32)
    _rows_are_cdots(core.matvec_bf16(W, x), Wd, x)
    assert_same_bits(core.matvec_bf16(W.view(ml_dtypes.bfloat16), x), core.matvec_bf16(W, x))


@pytest.mark.parametrize("R,C", [(7, c) for c in MATVEC_C] + [(130, 260), (257, 129)])
def test_matvec_fp8_rows_are_cdots(R, C):
    rng = np.random.default_rng(20 + C)
    (q, s), x = _fp8_weight(rng, R, C), _activations(rng, C)
    Wd = core.decode_fp8_weight(q, s)
    _rows_are_cdots(core.matvec_fp8(q, s, x), Wd, x)


@pytest.mark.parametrize("C", [32, 64, 96, 160, 224, 4096 + 32])
def test_matvec_mxfp4_rows_are_cdots(C):
    rng = np.random.default_rng(30 + C)
    (p, e), x = _mxfp4_weight(rng, 7, C), _activations(rng, C)
    Wd = core.decode_mxfp4_weight(p, e)
    _rows_are_cdots(core.matvec_mxfp4(p, e, x), Wd, x)


@pytest.mark.parametrize("C", [9, 96, 200])
def test_matvec_against_spec_reference(C):
    # independent of the C++ cdot: the plain-Python docs/contract.md §4.2 on the decoded rows
    rng = np.random.default_rng(40 + C)
    x = _activations(rng, C)
    W = _bf16_weight(rng, 3, C)
    Wd = (W.astype(U32) << 16).view(F32)
    y = core.matvec_bf16(W, x)
    for r in range(3):
        assert same32(y[r], ref_cdot(Wd[r].tolist(), x.tolist(), FMT32))


def test_matvec_threads_change_nothing():
    rng = np.random.default_rng(5)
    R, C = 300, 1024 + 40
    x = _activations(rng, C)
    W = _bf16_weight(rng, R, C)
    q, s = _fp8_weight(rng, R, C)
    p, e = _mxfp4_weight(rng, R, 1024)
    x4 = x[:1024].copy()
    for t in (0, 2, 3, 64):
        assert_same_bits(core.matvec_bf16(W, x, threads=t), core.matvec_bf16(W, x, threads=1))
        assert_same_bits(core.matvec_fp8(q, s, x, threads=t), core.matvec_fp8(q, s, x, threads=1))
        assert_same_bits(core.matvec_mxfp4(p, e, x4, threads=t), core.matvec_mxfp4(p, e, x4, threads=1))


def test_matvec_special_values():
    # inf/NaN weights and inputs propagate exactly as in cdot of the decoded row
    C = 70
    x = np.ones(C, F32)
    x[3] = np.inf
    W = np.full((4, C), 0x3F80, np.uint16)  # 1.0
    W[1, 3] = 0x0000  # 0 * inf = NaN
    W[2, 69] = 0x7F80  # inf in the tail
    W[3, 5] = 0xFF80  # -inf + inf = NaN
    _rows_are_cdots(core.matvec_bf16(W, x), (W.astype(U32) << 16).view(F32), x)
    q = np.full((2, C), 0x38, np.uint8)  # 1.0
    q[1, 69] = 0x7F  # NaN code
    s = np.ones((1, 1), F32)
    _rows_are_cdots(core.matvec_fp8(q, s, x), core.decode_fp8_weight(q, s), x)


@pytest.mark.parametrize("scale", [2.0 ** 121, 2.0 ** 127 * 1.5, np.inf, np.nan, 2.0 ** -149, 0.0, -3.0])
def test_matvec_fp8_extreme_scales(scale):
    # scales whose product with 2^8 overflows take the unfolded path; inf/NaN/subnormal/zero/negative
    rng = np.random.default_rng(14)
    R, C = 130, 200
    q, s = _fp8_weight(rng, R, C)
    s[1, 0] = scale
    x = _activations(rng, C)
    Wd = core.decode_fp8_weight(q, s)
    _rows_are_cdots(core.matvec_fp8(q, s, x), Wd, x)
    if np.isfinite(scale):
        with np.errstate(over="ignore"):
            assert_same_bits(Wd, q.view(ml_dtypes.float8_e4m3fn).astype(F32) *
                             np.repeat(np.repeat(s, 128, 0), 128, 1)[:R, :C])


def test_matvec_empty_shapes():
    x0 = np.zeros(0, F32)
    assert core.matvec_bf16(np.zeros((3, 0), np.uint16), x0).view(U32).tolist() == [0, 0, 0]
    assert core.matvec_bf16(np.zeros((0, 5), np.uint16), np.ones(5, F32)).shape == (0,)
    assert core.matvec_fp8(np.zeros((2, 0), np.uint8), np.zeros((1, 0), F32), x0).view(U32).tolist() == [0, 0]
    assert core.matvec_mxfp4(np.zeros((2, 0), np.uint8), np.zeros((2, 0), np.uint8), x0).tolist() == [0, 0]
    assert core.cdot(x0, x0).view(U32) == 0 and core.csum(x0).view(U32) == 0
    assert same64(core.cdot64(np.zeros(0), np.zeros(0)), 0.0)


# ---------------------------------------------------------------------------------------------
# linear: the engine's Lin kernels (weights.hpp; one token, and several tokens per decoded weight
# group) give every (token, row) exactly cdot(decoded W[r], x_t)
# ---------------------------------------------------------------------------------------------

LINEAR_T = list(range(1, 10)) + [13, 20, 25]  # several token blocks; 20: FP8/MXFP4 rows of <= 1024
# Each linear test runs every instruction set's kernels (matvec.hpp LinKernels; cdot.hpp block_rows: AVX-512VL
# takes larger register blocks), where they run; each must give the cdots' bits.
KERNELS = ("avx2", "avx512")


def _kernels(k):
    if k not in core.cpu_kernels()["available"]:
        pytest.skip(f"the {k} kernels do not run here (this CPU, its OS or this build lacks them)")
    return k
# pre-decoded to f32; longer rows turned into FP16 bits (matvec.cpp takes_half): FP8 from 13 tokens
# (Fp8HalfRow), MXFP4 from 7 (Mxfp4HalfRow)


def _linear_weight(release, rng, R, C):
    """(data, scale, decoded f32 [R, C]) of a random weight in a release format."""
    if release == "bf16":
        W = _bf16_weight(rng, R, C)
        return W, None, (W.astype(U32) << 16).view(F32)
    if release == "f32":
        W = (rng.standard_normal((R, C)) * 0.05).astype(F32)
        W[0, : min(C, 2)] = [-0.0, 1e-45][: min(C, 2)]
        return W, None, W
    if release == "fp8":
        q, s = _fp8_weight(rng, R, C)
        return q, s, core.decode_fp8_weight(q, s)
    p, e = _mxfp4_weight(rng, R, C)
    return p, e, core.decode_mxfp4_weight(p, e)


def _tokens(rng, T, C):
    X = np.stack([_activations(rng, C) for _ in range(T)]) if T else np.zeros((0, C), F32)
    if T and C:
        X[0, :: max(1, C // 5)] = -0.0  # -0 products: a masked-off tail lane must keep a -0 sum
        X[-1, -1] = 1e-45
    return np.ascontiguousarray(X)


def _per_token_cdots(Wd, X):
    return np.array([[core.cdot(np.ascontiguousarray(Wd[r]), X[t]) for r in range(Wd.shape[0])]
                     for t in range(X.shape[0])], F32).reshape(X.shape[0], Wd.shape[0])


@pytest.mark.parametrize("release,C", [(r, c) for r in ("bf16", "f32", "fp8")
                                        for c in (1, 5, 8, 9, 63, 64, 65, 96, 200, 352, 1033, 4096 + 32)] +
                         [("mxfp4", c) for c in (32, 96, 224, 352, 4096 + 32)])
@pytest.mark.parametrize("kernels", KERNELS)
def test_linear_tokens_are_cdots(release, C, kernels):
    k = _kernels(kernels)
    rng = np.random.default_rng(60 + C)
    R = 140  # crosses a 128-row FP8 scale block
    data, scale, Wd = _linear_weight(release, rng, R, C)
    X = _tokens(rng, max(LINEAR_T), C)
    want = _per_token_cdots(Wd, X)
    for nan_free in ((False, True) if release == "fp8" else (False,)):
        for T in LINEAR_T:
            assert_same_bits(core.linear(release, data, scale, X[:T].copy(), nan_free=nan_free, kernels=k), want[:T])
        for r0, r1 in ((3, 131), (129, 140), (127, 128), (5, 5)):
            for T in (1, 2, 7, 20, 25):
                got = core.linear(release, data, scale, X[:T].copy(), r0, r1, nan_free=nan_free, kernels=k)
                assert_same_bits(got, want[:T, r0:r1])


@pytest.mark.parametrize("C", [9, 96, 200])
def test_linear_against_spec_reference(C):
    # independent of the C++ cdot: the plain-Python docs/contract.md §4.2 on the decoded rows, several tokens
    rng = np.random.default_rng(70 + C)
    q, s = _fp8_weight(rng, 3, C)
    Wd = core.decode_fp8_weight(q, s)
    X = _tokens(rng, 4, C)
    Y = core.linear("fp8", q, s, X, nan_free=True)
    for t in range(4):
        for r in range(3):
            assert same32(Y[t, r], ref_cdot(Wd[r].tolist(), X[t].tolist(), FMT32))


@pytest.mark.parametrize("kernels", KERNELS)
def test_linear_special_values(kernels):
    # inf/NaN weights, inputs and NaN codes propagate exactly as in cdot of the decoded row
    k = _kernels(kernels)
    rng = np.random.default_rng(71)
    C, T = 70, 20
    X = _tokens(rng, T, C)
    X[2, 3] = np.inf
    X[4, 69] = -np.inf
    X[5, 10] = np.nan
    W = core.bf16_from_f32((rng.standard_normal((6, C)) * 0.05).astype(F32))
    W[1, 3] = 0x0000  # 0 * inf = NaN
    W[2, 69] = 0x7F80  # inf in the tail
    W[3, 5] = 0xFF80
    W[4, 3] = 0x7FC1  # a NaN weight
    assert_same_bits(core.linear("bf16", W, None, X, kernels=k), _per_token_cdots((W.astype(U32) << 16).view(F32), X))
    q, s = _fp8_weight(rng, 6, C)
    q[1, 69] = 0x7F  # NaN codes: only without nan_free
    q[2, 0] = 0xFF
    want = _per_token_cdots(core.decode_fp8_weight(q, s), X)
    assert_same_bits(core.linear("fp8", q, s, X, kernels=k), want)
    with pytest.raises(ValueError, match="^nan_free: expected"):
        core.linear("fp8", q, s, X, nan_free=True)
    # MXFP4 rows with a NaN scale (code 0xFF: every row goes through the nibble table, at any length) and negative
    # codes under it: the sign is OR'd onto NaN products as onto any other
    for c in (96, 1056):
        p, e = _mxfp4_weight(rng, 6, c)
        e[1, 0] = e[3, c // 32 - 1] = 0xFF
        Xm = _tokens(rng, T, c)
        assert_same_bits(core.linear("mxfp4", p, e, Xm, kernels=k),
                         _per_token_cdots(core.decode_mxfp4_weight(p, e), Xm))


@pytest.mark.parametrize("kernels", KERNELS)
def test_linear_mxfp4_every_scale_and_code(kernels):
    # every (E8M0 scale, E2M1 code) pair through the rows' table of scaled magnitudes (formats.hpp e2m1_scaled_row):
    # scale 0 gives subnormal products, 253-254 products past the largest finite (inf), 0xFF NaN. Row 16 e + q holds
    # code q at column 5 under scale e, code 0 elsewhere; every token is 1 at column 5, so a row's output is its one
    # product (the others +0 * 0) and the want is NumPy's f32 product of the two decoded values, not the engine's
    rng = np.random.default_rng(75)
    e = np.repeat(np.arange(256), 16).astype(np.uint8)
    q = np.tile(np.arange(16), 256).astype(np.uint8)
    p = np.zeros((4096, 16), np.uint8)
    p[:, 2] = q << 4  # column 5: byte 2's high nibble
    mags = np.array([0, .5, 1, 1.5, 2, 3, 4, 6] * 2, F32) * np.where(np.arange(16) < 8, 1, -1).astype(F32)
    scale = np.array([2.0 ** (k - 127) if k < 255 else np.nan for k in range(256)], np.float64).astype(F32)
    with np.errstate(over="ignore", invalid="ignore"):
        Wd = np.zeros((4096, 32), F32)
        Wd[:, 5] = mags[q] * scale[e]
        Wd[e == 255] = np.nan  # 0 * NaN
    X = np.zeros((31, 32), F32)
    X[:, 5] = 1.0
    X[:, 9] = float(rng.uniform(1, 2))  # (a code-0 column: +0 * x)
    for T in (1, 2, 3, 6, 7, 8, 18, 31):
        assert_same_bits(core.linear("mxfp4", p, e.reshape(4096, 1), X[:T].copy(), kernels=_kernels(kernels)),
                         _per_token_cdots(Wd, X[:T]))


@pytest.mark.parametrize("release,C", [("bf16", 72), ("f32", 72), ("fp8", 1056), ("mxfp4", 1056)])
@pytest.mark.parametrize("kernels", KERNELS)
def test_linear_token_groups(release, C, kernels):
    # more tokens than one packed x holds (cdot.hpp kPackTokens, 512): Lin::matmul goes in groups of tokens
    rng = np.random.default_rng(74)
    data, scale, Wd = _linear_weight(release, rng, 5, C)
    X = np.ascontiguousarray((rng.standard_normal((1100, C)) * 0.5).astype(F32))
    got = core.linear(release, data, scale, X, nan_free=release == "fp8", kernels=_kernels(kernels))
    assert_same_bits(got, _per_token_cdots(Wd, X))


@pytest.mark.parametrize("C", [200, 1088])  # 1088: the AVX2 build turns rows into FP16 bits from 13 tokens (Fp8HalfRow)
@pytest.mark.parametrize("scale", [2.0 ** 121, 2.0 ** 127 * 1.5, np.inf, np.nan, 2.0 ** -149, 0.0, -3.0])
@pytest.mark.parametrize("kernels", KERNELS)
def test_linear_fp8_extreme_scales(scale, C, kernels):
    # a scale whose product with 2^8 overflows makes the kernel skip the folded form for the call;
    # inf/NaN/subnormal/zero/negative scales decode as fl32(e4m3 * s)
    rng = np.random.default_rng(72)
    R = 260
    q, s = _fp8_weight(rng, R, C)
    s[1, 0] = scale
    X = _tokens(rng, 25, C)
    want = _per_token_cdots(core.decode_fp8_weight(q, s), X)
    k = _kernels(kernels)
    for T in (1, 2, 3, 6, 9, 20, 25):
        assert_same_bits(core.linear("fp8", q, s, X[:T].copy(), nan_free=True, kernels=k), want[:T])
        assert_same_bits(core.linear("fp8", q, s, X[:T].copy(), 120, 140, nan_free=True, kernels=k), want[:T, 120:140])


def test_linear_threads_round_and_empty():
    rng = np.random.default_rng(73)
    R, C = 301, 1024 + 16
    X = _tokens(rng, 20, C)
    for release in ("bf16", "f32", "fp8", "mxfp4"):
        c = 1024 if release == "mxfp4" else C
        data, scale, _ = _linear_weight(release, rng, R, c)
        Xc = np.ascontiguousarray(X[:, :c])
        for T in (1, 3, 8, 20):
            one = core.linear(release, data, scale, Xc[:T].copy())
            for th in (2, 3, 64):
                assert_same_bits(core.linear(release, data, scale, Xc[:T].copy(), threads=th), one)
            rounded = core.linear(release, data, scale, Xc[:T].copy(), round=True, threads=2)
            assert_same_bits(rounded, (core.bf16_from_f32(one).astype(U32) << 16).view(F32))
        assert core.linear(release, data, scale, np.zeros((0, c), F32)).shape == (0, R)
    assert core.linear("bf16", np.zeros((3, 0), np.uint16), None, np.zeros((2, 0), F32)).view(U32).tolist() == \
        [[0, 0, 0], [0, 0, 0]]


# ---------------------------------------------------------------------------------------------
# Formats: decode tables vs ml_dtypes for every code; weights; BF16
# ---------------------------------------------------------------------------------------------

def test_decode_e4m3_every_code():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(F32)
    got = core.decode_e4m3(codes)
    assert_same_bits(got, want)
    assert np.flatnonzero(np.isnan(got)).tolist() == [0x7F, 0xFF]
    assert got[0x7E] == 448 and got[0xFE] == -448 and got[0x01] == 2.0 ** -9
    assert got[0x80].view(U32) == 0x80000000
    assert_same_bits(core.decode_e4m3(codes.view(ml_dtypes.float8_e4m3fn)), got)


def test_decode_e2m1_every_code():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(F32)
    got = core.decode_e2m1(codes)
    assert_same_bits(got, want)
    assert got.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert got[8].view(U32) == 0x80000000


def test_decode_e8m0_every_code():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e8m0fnu).astype(F32)
    got = core.decode_e8m0(codes)
    assert_same_bits(got, want)
    assert got[0].view(U32) == 0x00400000  # 2^-127, an f32 subnormal
    assert got[127] == 1.0 and got[254] == 2.0 ** 127 and np.isnan(got[255])
    assert np.isnan(got).sum() == 1


def test_decode_any_shape():
    c = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    assert core.decode_e4m3(c).shape == (2, 3, 4)
    assert core.decode_e8m0(np.full((), 127, np.uint8)).shape == ()


def test_decode_fp8_weight_vs_numpy():
    rng = np.random.default_rng(6)
    for R, C in [(1, 1), (7, 200), (130, 260), (128, 128), (129, 257)]:
        q, s = _fp8_weight(rng, R, C)
        s.flat[0] = 2.0 ** -140  # subnormal products
        e4 = q.view(ml_dtypes.float8_e4m3fn).astype(F32)
        full = np.repeat(np.repeat(s, 128, 0), 128, 1)[:R, :C]
        assert_same_bits(core.decode_fp8_weight(q, s), e4 * full)  # one IEEE f32 multiply


def test_decode_mxfp4_weight_vs_numpy():
    rng = np.random.default_rng(7)
    for R, C in [(1, 32), (7, 96), (3, 4096 + 32)]:
        p, e = _mxfp4_weight(rng, R, C)
        e[-1, -1] = 254  # 6 * 2^127 overflows to inf
        nib = np.empty((R, C), np.uint8)
        nib[:, 0::2] = p & 15  # column 2b: low nibble
        nib[:, 1::2] = p >> 4  # column 2b+1: high nibble
        vals = nib.view(ml_dtypes.float4_e2m1fn).astype(F32)
        scales = np.repeat(e.view(ml_dtypes.float8_e8m0fnu).astype(F32), 32, 1)
        with np.errstate(over="ignore"):
            want = vals * scales
        assert_same_bits(core.decode_mxfp4_weight(p, e), want)


def _bf16_inputs():
    rng = np.random.default_rng(8)
    hi = np.arange(1 << 16, dtype=U32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], U32)  # every tie / rounding class
    structured = (hi[:, None] | lows[None, :]).ravel()
    rand = rng.integers(0, 2 ** 32, 1 << 20, dtype=np.uint64).astype(U32)
    return np.concatenate([structured, rand]).view(F32)


def test_bf16_from_f32_vs_ml_dtypes():
    x = _bf16_inputs()
    got = core.bf16_from_f32(x)
    assert got.dtype == np.uint16
    nan = np.isnan(x)
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)  # RNE, keeps NaN signs
    assert np.array_equal(got[~nan], want[~nan])
    assert (got[nan] == 0x7FC0).all()


def test_bf16_ties_and_nans():
    b = lambda *u: core.bf16_from_f32(np.array(u, U32).view(F32)).tolist()  # noqa: E731
    # ties go to even
    assert b(0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF) == [0x3F80, 0x3F82, 0x3F81, 0x3F80]
    assert b(0xBF808000, 0xBF818000) == [0xBF80, 0xBF82]
    # overflow to infinity, infinities kept, the largest finite below the tie stays finite
    assert b(0x7F7FFFFF, 0x7F7F7FFF, 0x7F800000, 0xFF800000) == [0x7F80, 0x7F7F, 0x7F80, 0xFF80]
    # subnormals and zeros
    assert b(0x00000001, 0x00008000, 0x00018000, 0x80000000) == [0x0000, 0x0000, 0x0002, 0x8000]
    # every NaN (quiet, signalling, negative, any payload) -> 0x7FC0
    assert b(0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FBF0000) == [0x7FC0] * 7


def test_bf16_from_f64_rounds_twice():
    x = np.array([1 + 2.0 ** -8 + 2.0 ** -30,  # f32: 1 + 2^-8 (a bf16 tie) -> 1.0; one rounding would go up
                  1 + 2.0 ** -8 + 2.0 ** -20,  # stays above the tie in f32 -> rounds up
                  math.nan, -math.nan, math.inf, 1e300, 1e-300, -0.0, 2.0 ** -140], np.float64)
    got = core.bf16_from_f64(x)
    assert got.tolist() == [0x3F80, 0x3F81, 0x7FC0, 0x7FC0, 0x7F80, 0x7F80, 0x0000, 0x8000, 0x0000]
    rng = np.random.default_rng(9)
    y = rng.standard_normal(1 << 16) * 2.0 ** rng.integers(-140, 130, 1 << 16)
    with np.errstate(over="ignore"):
        y32 = y.astype(F32)
    assert np.array_equal(core.bf16_from_f64(y), core.bf16_from_f32(y32))


# ---------------------------------------------------------------------------------------------
# expf
# ---------------------------------------------------------------------------------------------

def _libm_expf():
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    f = libm.expf
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return f


def ref_expf(x: float) -> float:
    """docs/contract.md §4.3 in plain Python: the five FMAs exact (Fraction), other ops IEEE double."""
    u = int(np.array(x, F32).view(U32))
    if ((u >> 20) & 0x7FF) >= 0x42B:
        if u == 0xFF800000:
            return 0.0
        if ((u >> 20) & 0x7FF) >= 0x7F8:
            return x + x
        if x > float.fromhex("0x1.62e42ep6"):
            return math.inf
        if x < -float.fromhex("0x1.9fe368p6"):
            return 0.0
    fma = lambda a, b, c: fma_exact(a, b, c, FMT64)  # noqa: E731
    N = 32
    inv = float.fromhex("0x1.71547652b82fep0") * N
    shift = float.fromhex("0x1.8p+52")
    c0 = float.fromhex("0x1.c6af84b912394p-5") / N / N / N
    c1 = float.fromhex("0x1.ebfce50fac4f3p-3") / N / N
    c2 = float.fromhex("0x1.62e42ff0c52d6p-1") / N
    kd = fma(inv, x, shift)
    ki = int(np.array(kd).view(np.uint64))
    kd -= shift
    r = fma(inv, x, -kd)
    t = (int(core.expf_table()[ki % N]) + (ki << 47)) % 2 ** 64
    s = float(np.array(t, np.uint64).view(np.float64))
    z = fma(c0, r, c1)
    r2 = r * r
    y = fma(c2, r, 1.0)
    y = fma(z, r2, y)
    return float(F32(y * s))


EXPF_SPECIAL_BITS = [
    0x4202422F, 0xC27C65D9,  # glibc's SSE2 (no-FMA) variant differs here: the FMAs are in the definition
    0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x3F800000, 0xBF800000,
    0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFFFFFFFF,  # inf, NaN
    0x42AFFFFF, 0x42B00000, 0x42B00001, 0xC2AFFFFF, 0xC2B00000, 0xC2B00001,  # |x| = 88 threshold
    0x42B17217, 0x42B17218, 0x42B17216,  # 0x1.62e42ep6: largest x with a finite result
    0xC2CFF1B4, 0xC2CFF1B5, 0xC2CFF1B3,  # -0x1.9fe368p6: below it the result is +0
    0xC2CE8ED0, 0xC2CE8ECF,  # -0x1.9d1d9ep6 (log 2^-149)
    0xC2C80000, 0xC2BC0000, 0xC2B20000, 0xC2AEAC50,  # subnormal results (-100, -94, -89, -87.33)
    0x7F7FFFFF, 0xFF7FFFFF, 0x42B20000, 0x3F000000, 0x33800000,
]


def test_expf_special_inputs_vs_libm_and_spec():
    bits = np.array(EXPF_SPECIAL_BITS, U32)
    x = bits.view(F32)
    for u in EXPF_SPECIAL_BITS:  # the C++ comparison against the host libm on the exact bits
        assert core.expf_check_range(u, u + 1) == (0, None), hex(u)
        assert core.expf_avx2_check_range(u, u + 1) == (0, None), hex(u)
    # scalar tail and 8-wide paths, against the plain-Python docs/contract.md §4.3 and libm through ctypes
    libm = _libm_expf()
    for n in (len(x), 8, 5):
        got = core.expf(x[:n])
        want = np.array([ref_expf(float(v)) for v in x[:n]], F32)
        assert_same_bits(got, want)
        assert_same_bits(got, np.array([libm(float(v)) for v in x[:n]], F32))
    got = core.expf(x)
    assert got[EXPF_SPECIAL_BITS.index(0xFF800000)].view(U32) == 0  # -inf -> +0
    assert got[EXPF_SPECIAL_BITS.index(0x7F800000)] == np.inf
    assert np.isnan(got[EXPF_SPECIAL_BITS.index(0x7FC00000)])
    assert got[EXPF_SPECIAL_BITS.index(0x42B17218)] == np.inf
    assert np.isfinite(got[EXPF_SPECIAL_BITS.index(0x42B17217)])
    assert got[EXPF_SPECIAL_BITS.index(0xC2CFF1B5)].view(U32) == 0
    assert 0 < got[EXPF_SPECIAL_BITS.index(0xC2C80000)].view(U32) < 0x00800000  # subnormal result
    assert got[EXPF_SPECIAL_BITS.index(0x00000000)] == 1.0


def test_expf_fmas_matter():
    # On the two inputs glibc lists, computing x*InvLn2N separately (no FMA) changes the result;
    # ours must be the FMA result.
    for u in (0x4202422F, 0xC27C65D9):
        x = float(np.array(u, U32).view(F32))
        assert same32(core.expf(np.array([x], F32))[0], ref_expf(x))


def test_expf_random_vs_spec_reference():
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.uniform(-104, 89, 300), rng.standard_normal(100) * 5]).astype(F32)
    got = core.expf(x)
    assert_same_bits(got, np.array([ref_expf(float(v)) for v in x], F32))


def test_expf_shapes_and_lengths():
    rng = np.random.default_rng(12)
    x = rng.uniform(-90, 90, 1000).astype(F32)
    full = core.expf(x)
    for n in (0, 1, 7, 8, 9, 15, 16, 17):  # scalar tail vs 8-wide body give the same bits
        assert_same_bits(core.expf(x[:n].copy()), full[:n])
    assert core.expf(x[:24].reshape(2, 3, 4)).shape == (2, 3, 4)
    assert_same_bits(core.expf(x[:24].reshape(2, 3, 4)).ravel(), full[:24])


def test_expf_table_is_correctly_rounded():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.prec = 200
    for i, t in enumerate(core.expf_table().tolist()):
        exact = mpmath.mpf(2) ** (mpmath.mpf(i) / 32)
        d = float(np.array((t + (i << 47)) % 2 ** 64, np.uint64).view(np.float64))
        # d is the double nearest to 2^(i/32): its distance is under half an ulp
        assert abs(mpmath.mpf(d) - exact) < mpmath.mpf(math.ulp(d)) / 2, i


def test_expf_check_range_small():
    assert core.expf_check_range(0x3F000000, 0x3F100000) == (0, None)
    assert core.expf_avx2_check_range(0xC2A00000, 0xC2D00003) == (0, None)  # odd length: partial group
    assert core.expf_check_range(5, 5) == (0, None)


@pytest.mark.slow
def test_expf_exhaustive_scalar():
    t0 = time.perf_counter()
    assert core.expf_check_range(0, 2 ** 32) == (0, None)
    print(f"exhaustive scalar expf vs libm: {time.perf_counter() - t0:.1f} s")


@pytest.mark.slow
def test_expf_exhaustive_avx2():
    t0 = time.perf_counter()
    assert core.expf_avx2_check_range(0, 2 ** 32) == (0, None)
    print(f"exhaustive AVX2 expf vs libm: {time.perf_counter() - t0:.1f} s")


# ---------------------------------------------------------------------------------------------
# Bad inputs: ValueError naming the argument, never a crash
# ---------------------------------------------------------------------------------------------

f = np.ones(64, F32)
d = np.ones(64, np.float64)
u16w = np.ones((4, 64), np.uint16)
q8 = np.ones((4, 64), np.uint8)
s8 = np.ones((1, 1), F32)
pk = np.ones((4, 32), np.uint8)
sc = np.ones((4, 2), np.uint8)
unaligned = np.frombuffer(bytearray(4 * 65), dtype=F32, offset=1, count=64)

BAD_CALLS = [
    ("cdot", (d, f), "a"),
    ("cdot", (f, f[:63]), "b"),
    ("cdot", (f.reshape(8, 8), f.reshape(8, 8)), "a"),
    ("cdot", (f[::2], f[::2]), "a"),
    ("cdot", (f.tolist(), f), "a"),
    ("cdot", (None, f), "a"),
    ("cdot", (f.astype(">f4"), f), "a"),
    ("cdot", (unaligned, f), "a"),
    ("cdot", (f, np.ones(64, np.int32)), "b"),
    ("cdot64", (f, f), "a"),
    ("cdot64", (d, d[:3]), "b"),
    ("csum", (d,), "x"),
    ("csum", (f.reshape(1, 64),), "x"),
    ("expf", (d,), "x"),
    ("expf", (np.ones((4, 4), F32)[:, ::2],), "x"),
    ("expf", (1.0,), "x"),
    ("expf_check_range", (0, 2 ** 32 + 1), "hi_bits"),
    ("expf_check_range", (-1, 5), "lo_bits"),
    ("expf_check_range", (10, 5), "hi_bits"),
    ("expf_check_range", (0.5, 5), "lo_bits"),
    ("expf_avx2_check_range", (0, 2 ** 40), "hi_bits"),
    ("bf16_from_f32", (d,), "x"),
    ("bf16_from_f64", (f,), "x"),
    ("decode_e4m3", (np.ones(4, np.int8),), "codes"),
    ("decode_e4m3", (np.ones(4, np.uint16),), "codes"),
    ("decode_e2m1", (np.array([3, 16], np.uint8),), "codes"),
    ("decode_e8m0", (f,), "codes"),
    ("decode_fp8_weight", (q8, np.ones((1, 2), F32)), "scale_inv"),
    ("decode_fp8_weight", (q8[0], s8), "q"),
    ("decode_fp8_weight", (q8, s8.astype(np.float64)), "scale_inv"),
    ("decode_fp8_weight", (np.asfortranarray(np.ones((4, 3), np.uint8)), s8), "q"),
    ("decode_mxfp4_weight", (np.ones((4, 24), np.uint8), np.ones((4, 1), np.uint8)), "packed"),
    ("decode_mxfp4_weight", (pk, np.ones((4, 3), np.uint8)), "scale"),
    ("decode_mxfp4_weight", (pk, sc.astype(F32)), "scale"),
    ("matvec_bf16", (u16w, f[:63]), "x"),
    ("matvec_bf16", (u16w.astype(np.int16), f), "W"),
    ("matvec_bf16", (u16w[:, ::2], f[:32]), "W"),
    ("matvec_bf16", (u16w, d), "x"),
    ("matvec_bf16", (u16w.ravel(), f), "W"),
    ("matvec_fp8", (q8, np.ones((2, 1), F32), f), "scale_inv"),
    ("matvec_fp8", (q8, s8, f[:10]), "x"),
    ("matvec_fp8", (q8.astype(np.int8), s8, f), "q"),
    ("matvec_mxfp4", (pk, sc, f[:32]), "x"),
    ("matvec_mxfp4", (np.ones((4, 8), np.uint8), np.ones((4, 0), np.uint8), f[:16]), "packed"),
    ("matvec_mxfp4", (pk, sc[:3], f), "scale"),
    ("matvec_mxfp4", (pk, sc, f, -1), "threads"),
    ("linear", ("bf17", u16w, None, f.reshape(1, 64)), "release"),
    ("linear", ("bf16", u16w, None, f), "X"),
    ("linear", ("bf16", u16w, None, f[:32].reshape(1, 32)), "X"),
    ("linear", ("bf16", u16w, None, f.reshape(1, 64), 5), "r0"),
    ("linear", ("bf16", u16w, None, f.reshape(1, 64), 2, 1), "r1"),
    ("linear", ("fp8", q8, s8.astype(np.float64), f.reshape(1, 64)), "scale"),
    ("linear", ("fp8", q8, np.ones((2, 1), F32), f.reshape(1, 64)), "scale"),
    ("linear", ("mxfp4", pk, sc[:3], f.reshape(1, 64)), "scale"),
    ("linear", ("bf16", u16w, None, f.reshape(1, 64), 0, None, True), "nan_free"),
    ("div_probe", (f, "3"), "d"),
    ("div_probe", (d, 3.0), "x"),
]


@pytest.mark.parametrize("name,args,argname", BAD_CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)])
def test_bad_inputs_raise_value_error(name, args, argname):
    with pytest.raises(ValueError, match=rf"^{argname}: expected"):
        getattr(core, name)(*args)


def test_bad_input_message_names_shapes():
    with pytest.raises(ValueError) as e:
        core.matvec_fp8(q8, np.ones((2, 1), F32), f)
    assert "(1, 1)" in str(e.value) and "(2, 1)" in str(e.value)
    with pytest.raises(ValueError) as e:
        core.cdot(d, f)
    assert "float32" in str(e.value) and "float64" in str(e.value)


def test_accepted_ml_dtypes_views():
    rng = np.random.default_rng(13)
    q, s = _fp8_weight(rng, 5, 70)
    x = _activations(rng, 70)
    assert_same_bits(core.matvec_fp8(q.view(ml_dtypes.float8_e4m3fn), s, x), core.matvec_fp8(q, s, x))
    p, e = _mxfp4_weight(rng, 5, 64)
    assert_same_bits(core.matvec_mxfp4(p, e.view(ml_dtypes.float8_e8m0fnu), x[:64].copy()),
                     core.matvec_mxfp4(p, e, x[:64].copy()))


def test_bad_input_messages_print_shapes_as_python_tuples():
    with pytest.raises(ValueError) as e:
        core.matvec_fp8(q8, s8, f[:10])
    assert str(e.value) == "x: expected shape (64,) ([C] for q of shape (4, 64)), given (10,)"
    with pytest.raises(ValueError) as e:
        core.matvec_bf16(u16w, np.ones((), F32))
    assert str(e.value) == "x: expected a 1-D array, given 0-D with shape ()"


def _undefined_dynamic_symbols(path):
    """Names of the undefined symbols in an x86-64 ELF shared object's .dynsym (what it imports)."""
    import struct
    data = open(path, "rb").read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path}: not a little-endian ELF64 file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type != 11:  # SHT_DYNSYM
            continue
        stroff = sections[link][4]
        for k in range(size // entsize):
            st_name, _, _, st_shndx = struct.unpack_from("<IBBH", data, off + k * entsize)
            if st_shndx == 0 and st_name:  # SHN_UNDEF
                names.append(data[stroff + st_name:data.index(b"\0", stroff + st_name)].decode())
    return names


def test_core_uses_no_iostreams():
    # Stream output consults the locale's facets by facet ids that belong to one libstdc++. fast._core
    # built by the GPU machine's toolchain carries its own libstdc++ while the process holds another,
    # and its first ostringstream (every matvec/linear call formatted a shape for its messages) called
    # the wrong facet and crashed. Messages are made with std::to_string; nothing may bring streams back.
    imported = _undefined_dynamic_symbols(core.__file__)
    assert any(n.startswith("Py") for n in imported)  # the reader works: the module imports the C API
    streams = [n for n in imported if n.startswith(("_ZNSo", "_ZNSi", "_ZNSt6locale", "_ZNSt8ios_base"))
               or "basic_ostringstream" in n or "basic_ios" in n or "basic_streambuf" in n]
    assert not streams, f"fast._core imports iostream/locale symbols: {streams[:5]}"


@pytest.mark.parametrize("release", ["bf16", "f32", "fp8", "mxfp4"])
@pytest.mark.parametrize("kernels", KERNELS)
def test_linear_one_block_of_eight(release, kernels):
    # 7-8 tokens against rows of more than 1 MiB go as one token block (cdot.hpp most_tokens; of one row a register
    # block with AVX2, two with AVX-512VL); fewer rows' bytes, or 6 / 9 tokens, as blocks of at most six
    rng = np.random.default_rng(75)
    # (MXFP4 rows longer than 1024 are turned into FP16 bits from 7 tokens: its rows here are 1024 long)
    C = 1024 if release == "mxfp4" else 4100
    R = {"bf16": 140, "f32": 70, "fp8": 300, "mxfp4": 2000}[release]  # each just over 1 MiB of rows
    data, scale, Wd = _linear_weight(release, rng, R, C)
    X = _tokens(rng, 9, C)
    want = _per_token_cdots(Wd, X)
    k = _kernels(kernels)
    for T in (6, 7, 8, 9):
        assert_same_bits(core.linear(release, data, scale, X[:T].copy(), nan_free=release == "fp8", kernels=k),
                         want[:T])
        # (rows 3 .. R - 9: under 1 MiB, so blocks of at most six)
        assert_same_bits(core.linear(release, data, scale, X[:T].copy(), 3, R - 9, nan_free=release == "fp8",
                                     kernels=k), want[:T, 3:R - 9])
