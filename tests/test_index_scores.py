"""The indexer's scoring on made-up queries and pool keys: the CUDA engine's two kernels (per-row
k_idx_scores, and k_idx_scores_tiled: the [queries x heads] x [pools] product in 64 x 64 tiles whose
dots walk the canonical fold tree leaf by leaf, bindings/cuda/indexer.cu) against the oracle's own
function (oracle/layers/indexer.py `_pool_scores`), compared as uint32 bit patterns. Shapes from the
real model (32 index heads of 128) and narrower ones (n_i <= 64, dividing 64 or not, d_i <= 128, d_i < 64 and
not a multiple of 64: the zero padding), queries at arbitrary positions (a tile's rows see different
numbers of pools, tiles straddle pool tiles), special values (zeros: relu ties; -0, inf, NaN; a NaN's
payload is the platform's and not compared, as everywhere in the tests)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from oracle.layers.indexer import Indexer
from oracle.layers.ops import Precision

pytestmark = pytest.mark.gpu
EMU = os.environ.get("GLM_CUDA_EMU", "") not in ("", "0")


def _cuda():
    from fast.cuda import cuda_available, cuda_module
    if not cuda_available():
        pytest.skip("no CUDA engine (fast._cuda not built or no device)")
    return cuda_module()


def oracle_scores(q, wts, keys, pos, kp):
    """Each query's pool scores by the oracle's function, one row after the other."""
    ni, di = q.shape[1], q.shape[2]
    ix = Indexer.__new__(Indexer)
    ix.P, ix.n, ix.d, ix.kp = Precision("canonical"), ni, di, kp
    return np.concatenate([ix._pool_scores(q[i], wts[i], keys[:(p + 1) // kp]) for i, p in enumerate(pos)]
                          + [np.zeros(0, np.float32)]).astype(np.float32)


# name, queries, index heads, head dim, kpool, first position, special values
CASES = [
    ("real-heads", 9, 32, 128, 16, 1500, None),
    ("real-heads-kp4", 6, 32, 128, 4, 300, None),
    ("one-head-per-row", 3, 64, 128, 4, 257, None),
    ("narrow-di", 17, 8, 40, 4, 130, None),
    ("di-64", 5, 16, 64, 2, 190, None),
    ("di-100", 4, 32, 100, 4, 260, None),
    ("three-heads", 30, 3, 24, 4, 200, None),          # (the deep zoo's indexer: 21 queries of 3 heads a tile)
    ("heads-not-dividing-64", 7, 20, 32, 4, 150, None),
    ("zeros-ties", 8, 32, 128, 4, 270, "zeros"),
    ("special", 5, 16, 128, 4, 300, "special"),
]


def _make(n, ni, di, kp, first, special, seed):
    rng = np.random.default_rng(seed)
    pos = sorted(int(v) for v in first + rng.integers(0, 3 * kp * 64, n))  # (rows see different pool counts)
    n_keys = (pos[-1] + 1) // kp
    q = rng.standard_normal((n, ni, di)).astype(np.float32)
    keys = rng.standard_normal((n_keys, di)).astype(np.float32)
    wts = rng.standard_normal((n, ni)).astype(np.float32)
    if special == "zeros":   # many heads exactly 0 after the relu, whole pools scoring 0, -0 inputs
        keys[::3] = 0.0
        keys[1::3, : di // 2] = -0.0
        q[:, ::2] = -np.abs(q[:, ::2])
        wts[:, ::4] = -0.0
    elif special == "special":
        for a in (q, keys, wts):
            flat = a.reshape(-1)
            idx = rng.choice(flat.size, max(3, flat.size // 500), replace=False)
            flat[idx] = rng.choice(np.array([np.inf, -np.inf, np.nan, -0.0, 1e30, -1e-40], np.float32), idx.size)
    return q, wts, keys, pos


@pytest.mark.parametrize("tiled", [False, True], ids=["per-row", "tiled"])
@pytest.mark.parametrize("name,n,ni,di,kp,first,special", CASES, ids=[c[0] for c in CASES])
def test_scores_are_the_oracles(name, n, ni, di, kp, first, special, tiled):
    cu = _cuda()
    q, wts, keys, pos = _make(n, ni, di, kp, first, special, seed=len(name))
    want = oracle_scores(q, wts, keys, pos, kp)
    got = cu.index_scores(q, wts, keys, pos, kp, 64, tiled)["scores"]
    assert got.shape == want.shape
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), name      # (a NaN's payload is the platform's: not compared)
    bad = np.flatnonzero((got.view(np.uint32) != want.view(np.uint32)) & ~nan)
    assert bad.size == 0, f"{name}: {bad.size} of {want.size} scores differ, first at {bad[:5]}"


@pytest.mark.skipif(EMU, reason="the emulation runs a block's threads one after another: the long rows only on a GPU")
def test_tiled_equals_per_row_at_long_context():
    """A prefill chunk's worth at 128K (64 queries of 8,192 pools; the real widths): the two kernels'
    bits over 524,288 scores (the per-row kernel is held against the oracle above)."""
    cu = _cuda()
    q, wts, keys, pos = _make(64, 32, 128, 16, 131000, None, seed=3)
    a = cu.index_scores(q, wts, keys, pos, 16, 128, False)["scores"]
    b = cu.index_scores(q, wts, keys, pos, 16, 128, True)["scores"]
    assert a.size == sum((p + 1) // 16 for p in pos)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_bad_arguments():
    cu = _cuda()
    q, w, k = np.zeros((2, 4, 8), np.float32), np.zeros((2, 4), np.float32), np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match="ascending"):
        cu.index_scores(q, w, k, [9, 5], 4, 2, False)
    with pytest.raises(ValueError, match="sees 3 pools, got 2 keys"):
        cu.index_scores(q, w, k[:2], [5, 11], 4, 2, False)
    with pytest.raises(ValueError, match="tiled kernel needs"):
        cu.index_scores(np.zeros((2, 3, 6), np.float32), np.zeros((2, 3), np.float32), np.zeros((3, 6), np.float32),
                        [5, 11], 4, 2, True)
    with pytest.raises(ValueError, match="one position per query"):
        cu.index_scores(q, w, k, [5], 4, 2, False)
