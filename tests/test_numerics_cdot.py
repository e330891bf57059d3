"""cdot / cdot64 / csum / matvec / matmat against an independent loop over docs/contract.md §4.2.

The reference below is written from the text of docs/contract.md §4.2, element by element, with an
exact fma (oracle.numerics.exact: rational arithmetic, rounded once) and plain
IEEE additions (NumPy float32 scalars / Python floats).  Results are compared
bit for bit; for NaN results only NaN-ness is compared, because a NaN's payload
and sign follow the hardware's NaN propagation and are not canonical (BF16
rounding makes every NaN 0x7FC0).
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oracle.numerics import cdot, cdot64, csum, csum64, matmat, matmat64, matvec, matvec64
from oracle.numerics.exact import fma_exact


def spec_cdot(a, b, dtype):
    """docs/contract.md §4.2, literally: P[g][l], element i = 64c + 8g + l, then the 4/2/1 folds."""
    zero = dtype(0.0)
    P = [[zero] * 8 for _ in range(8)]
    n = len(a)
    with np.errstate(all="ignore"):
        for c in range((n + 63) // 64):
            for g in range(8):
                for l in range(8):
                    i = 64 * c + 8 * g + l
                    if i < n:
                        P[g][l] = fma_exact(a[i], b[i], P[g][l])
        for w in (4, 2, 1):
            for g in range(w):
                for l in range(8):
                    P[g][l] = dtype(P[g][l] + P[g + w][l])
        for w in (4, 2, 1):
            for l in range(w):
                P[0][l] = dtype(P[0][l] + P[0][l + w])
    return P[0][0]


def assert_same(got, want, dtype):
    got = dtype(got)
    if np.isnan(want):
        assert np.isnan(got), (got, want)
        return
    unsigned = np.uint32 if dtype == np.float32 else np.uint64
    assert np.array(got, dtype).view(unsigned) == np.array(want, dtype).view(unsigned), (got, want)


# ---------------------------------------------------------------------------------------------
# Value strategies: ±0, subnormals, huge and tiny magnitudes, ordinary values; specials apart.
# ---------------------------------------------------------------------------------------------

def finite_values(width):
    tiny = 1.4e-45 if width == 32 else 5e-324
    huge = 3.4e38 if width == 32 else 1.7e308
    return st.one_of(
        st.floats(-4.0, 4.0, width=width),
        st.floats(width=width, allow_nan=False, allow_infinity=False),  # anything finite
        st.floats(-2.0**-120 if width == 32 else -2.0**-1015,
                  2.0**-120 if width == 32 else 2.0**-1015, width=width),  # subnormals, tiny normals
        st.sampled_from([0.0, -0.0, tiny, -tiny, huge, -huge, 1.0, -1.0, 2.0**-24, 1e30, -1e30]),
    )


def special_values(width):
    return st.one_of(finite_values(width), st.sampled_from([math.inf, -math.inf, math.nan]))


def vector_pair(width, values):
    dtype = np.float32 if width == 32 else np.float64

    @st.composite
    def pair(draw):
        n = draw(st.integers(0, 300))
        a = draw(st.lists(values, min_size=n, max_size=n))
        b = draw(st.lists(values, min_size=n, max_size=n))
        return np.array(a, dtype), np.array(b, dtype)

    return pair()


def check_cdot(a, b):
    dtype = a.dtype.type
    fn = cdot if dtype == np.float32 else cdot64
    want = spec_cdot([dtype(v) for v in a], [dtype(v) for v in b], dtype)
    assert_same(fn(a, b), want, dtype)


@settings(max_examples=150, deadline=None)
@given(vector_pair(32, finite_values(32)))
def test_cdot_finite(ab):
    check_cdot(*ab)


@settings(max_examples=60, deadline=None)
@given(vector_pair(32, special_values(32)))
def test_cdot_with_inf_nan(ab):
    check_cdot(*ab)


@settings(max_examples=100, deadline=None)
@given(vector_pair(64, finite_values(64)))
def test_cdot64_finite(ab):
    check_cdot(*ab)


@settings(max_examples=40, deadline=None)
@given(vector_pair(64, special_values(64)))
def test_cdot64_with_inf_nan(ab):
    check_cdot(*ab)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 63, 64, 65, 127, 128, 129, 300, 1000])
def test_cdot_lengths_random(n):
    rng = np.random.default_rng(n)
    for dtype in (np.float32, np.float64):
        a = rng.standard_normal(n).astype(dtype)
        b = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(dtype)
        check_cdot(a, b)


def test_empty_is_positive_zero():
    e32 = np.zeros(0, np.float32)
    e64 = np.zeros(0, np.float64)
    assert np.float32(cdot(e32, e32)).view(np.uint32) == 0
    assert np.float64(cdot64(e64, e64)).view(np.uint64) == 0
    assert np.float32(csum(e32)).view(np.uint32) == 0
    assert np.float64(csum64(e64)).view(np.uint64) == 0


def test_negative_zeros_sum_to_positive_zero():
    # Accumulators start at +0.0, so fma(-0, 1, +0) = +0: the result is +0 even for all -0 inputs.
    x = np.full(5, -0.0, np.float32)
    assert np.float32(csum(x)).view(np.uint32) == 0


def test_cdot_uses_fma():
    # Elements 0 and 64 share the accumulator P[0][0]: P = fma(a64, b64, a0*b0).
    a = np.zeros(65, np.float32)
    b = np.zeros(65, np.float32)
    a[0], b[0] = -(1 + 2.0**-11), 1.0
    a[64] = b[64] = 1 + 2.0**-12
    assert cdot(a, b) == 2.0**-24  # a separate multiply and add would give 0
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    a64[0], a64[64] = -(1 + 2.0**-26), 1 + 2.0**-27
    b64[64] = a64[64]
    assert cdot64(a64, b64) == 2.0**-54


def test_order_matters():
    # The canonical order is not the sequential one: 2^24 + 1 + 1 sequentially loses both ones
    # (each addition is a tie that goes to even), while lanes 1 and 3 first add to 2.
    x = np.zeros(4, np.float32)
    x[0], x[1], x[3] = 2.0**24, 1.0, 1.0
    sequential = np.float32(0.0)
    for v in x:
        sequential = np.float32(sequential + v)
    assert sequential == 2.0**24
    assert csum(x) == 2.0**24 + 2
    # The same on ordinary data: the canonical sum is not NumPy's pairwise sum nor a plain loop.
    rng = np.random.default_rng(0)
    y = (rng.standard_normal(4096) * 100).astype(np.float32)
    seq = np.float32(0.0)
    for v in y:
        seq = np.float32(seq + v)
    assert csum(y) == spec_cdot(list(y), [np.float32(1.0)] * len(y), np.float32)
    assert csum(y) != seq


def test_csum_is_cdot_with_ones():
    rng = np.random.default_rng(3)
    for n in (0, 5, 64, 200):
        x = rng.standard_normal(n).astype(np.float32)
        assert_same(csum(x), cdot(x, np.ones(n, np.float32)), np.float32)
        x64 = x.astype(np.float64) / 3
        assert_same(csum64(x64), cdot64(x64, np.ones(n)), np.float64)


def test_cdot64_widens_float32_exactly():
    rng = np.random.default_rng(4)
    a = rng.standard_normal(150).astype(np.float32)
    b = rng.standard_normal(150)
    assert_same(cdot64(a, b), cdot64(a.astype(np.float64), b), np.float64)


def test_cdot_refuses_float64():
    with pytest.raises(Exception, match="fma needs three float32 or three float64"):
        cdot(np.ones(3), np.ones(3))


def test_cdot_length_mismatch():
    with pytest.raises(ValueError):
        cdot(np.ones(3, np.float32), np.ones(4, np.float32))


def test_cdot_non_contiguous():
    rng = np.random.default_rng(5)
    M = rng.standard_normal((70, 9)).astype(np.float32)
    v = rng.standard_normal(70).astype(np.float32)
    assert_same(cdot(M[:, 3], v), cdot(np.ascontiguousarray(M[:, 3]), v), np.float32)


@pytest.mark.parametrize("rows,cols,tokens", [(1, 0, 1), (3, 5, 2), (17, 130, 3), (288, 4096, 2)])
def test_matvec_matmat_are_rowwise_cdot(rows, cols, tokens):
    rng = np.random.default_rng(rows * 1000 + cols)
    W = rng.standard_normal((rows, cols)).astype(np.float32)
    X = rng.standard_normal((tokens, cols)).astype(np.float32)
    Y = matmat(W, X)
    assert Y.shape == (tokens, rows) and Y.dtype == np.float32
    for t in range(tokens):
        y = matvec(W, X[t])
        assert y.dtype == np.float32
        want = np.array([cdot(W[r], X[t]) for r in range(rows)], np.float32)
        assert np.array_equal(y.view(np.uint32), want.view(np.uint32))
        assert np.array_equal(Y[t].view(np.uint32), want.view(np.uint32))
    W64, X64 = W.astype(np.float64) / 3, X.astype(np.float64) / 7
    Y64 = matmat64(W64, X64)
    assert Y64.shape == (tokens, rows) and Y64.dtype == np.float64
    for t in range(tokens):
        want = np.array([cdot64(W64[r], X64[t]) for r in range(rows)])
        assert np.array_equal(matvec64(W64, X64[t]).view(np.uint64), want.view(np.uint64))
        assert np.array_equal(Y64[t].view(np.uint64), want.view(np.uint64))


def test_rows_are_independent_of_the_batch():
    # A row's result must not depend on which other rows or tokens are computed with it.
    rng = np.random.default_rng(6)
    W = rng.standard_normal((40, 333)).astype(np.float32)
    X = rng.standard_normal((5, 333)).astype(np.float32)
    full = matmat(W, X)
    assert np.array_equal(matmat(W[7:9], X[2:4]).view(np.uint32), full[2:4, 7:9].view(np.uint32))
