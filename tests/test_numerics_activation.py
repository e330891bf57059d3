"""sigmoid, silu, inv_sqrt: the literal float32 formulas, operation by operation."""

import math

import numpy as np

from oracle.numerics import expf, expf_array, inv_sqrt, sigmoid, sigmoid_array, silu, silu_array

F32 = np.float32


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _inputs():
    rng = np.random.default_rng(0)
    return np.concatenate([
        rng.standard_normal(200_000).astype(F32) * F32(8),
        rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(F32),
        np.array([0.0, -0.0, 88.0, -88.0, 89.0, -89.0, 104.0, -104.0, 1e-45, -1e-45,
                  np.inf, -np.inf, 3.4e38, -3.4e38], F32),
    ])


def test_sigmoid_is_one_over_one_plus_expf():
    x = _inputs()
    x = x[~np.isnan(x)]
    with np.errstate(all="ignore"):
        want = F32(1) / (F32(1) + expf_array(-x))  # NumPy float32 ops: one IEEE rounding each
    assert np.array_equal(_bits(sigmoid_array(x)), _bits(want))
    for v, w in zip(x[:1000], want[:1000]):
        assert _bits(sigmoid(v)) == _bits(w)
    assert sigmoid(F32(-np.inf)) == 0.0 and sigmoid(F32(np.inf)) == 1.0


def test_silu_is_x_over_one_plus_expf():
    x = _inputs()
    x = x[~np.isnan(x)]
    with np.errstate(all="ignore"):
        want = x / (F32(1) + expf_array(-x))
    got = silu_array(x)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(_bits(got)[~np.isnan(want)], _bits(want)[~np.isnan(want)])
    for v, w in zip(x[:1000], want[:1000]):
        assert _bits(silu(v)) == _bits(w)
    assert math.isnan(silu(F32(-np.inf)))  # -inf / inf, as the formula says
    assert _bits(silu(F32(-100.0))) == 0x80000000  # -100 / inf = -0
    assert silu(F32(np.inf)) == np.inf


def test_silu_is_not_x_times_sigmoid():
    # The definition divides once; x * sigmoid(x) rounds twice and differs on some inputs.
    x = np.random.default_rng(1).standard_normal(100_000).astype(F32) * F32(4)
    assert np.count_nonzero(_bits(silu_array(x)) != _bits(x * sigmoid_array(x))) > 0


def test_activation_arrays_keep_shape():
    x = np.linspace(-3, 3, 30, dtype=F32).reshape(5, 6)
    for fn in (sigmoid_array, silu_array):
        y = fn(x)
        assert y.shape == x.shape and y.dtype == np.float32


def test_inv_sqrt_is_two_correctly_rounded_operations():
    rng = np.random.default_rng(2)
    v = np.concatenate([
        rng.integers(0, 0x7F800000, 500_000, dtype=np.int64).astype(np.uint32).view(F32),
        np.array([0.0, -0.0, 1e-45, 1.0, 4.0, 2.0, np.inf, -1.0, 1e-6 + 1.0], F32),
    ])
    with np.errstate(all="ignore"):
        want = F32(1) / np.sqrt(v)  # NumPy float32 sqrt and divide: IEEE, correctly rounded
    got = np.array([inv_sqrt(x) for x in v[:2000]] + [inv_sqrt(x) for x in v[-9:]], F32)
    ref = np.concatenate([want[:2000], want[-9:]])
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.array_equal(_bits(got)[ok], _bits(ref)[ok])
    assert inv_sqrt(F32(0.0)) == np.inf and _bits(inv_sqrt(F32(-0.0))) == 0xFF800000
    assert inv_sqrt(F32(np.inf)) == 0.0


def test_expf_scalar_and_array_agree():
    x = _inputs()[:5000]
    assert np.array_equal(_bits(expf_array(x)), _bits([expf(v) for v in x]))
