"""The indexer's selection (docs/numerics.md, "Ties at the indexer's selection boundary") on made-up
scores: the CUDA engine's kernel (a radix select + block scan, O(pools)) against the oracle's rule
(oracle/layers/indexer.py `_choose`: a stable argsort of -scores), on the adversarial cases: all equal,
ties exactly at the boundary, -0/+0, infinities and NaN, a few distinct values over many pools, and
long contexts (the 128K decode's 32,768 pools of 4 positions). Positions compared as int32 arrays.
The CPU engine's selection is the same rule on the same key (num::select_key) and is held against the
oracle on whole models (tests/test_deep.py, tests/test_engines.py)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from oracle.layers.indexer import Indexer

pytestmark = pytest.mark.gpu


def _cuda():
    from fast.cuda import cuda_available, cuda_module
    if not cuda_available():
        pytest.skip("no CUDA engine (fast._cuda not built or no device)")
    return cuda_module()


def oracle_choose(scores: np.ndarray, pos: int, kp: int, budget: int) -> np.ndarray:
    """The oracle's own selection function, on these scores."""
    ix = Indexer.__new__(Indexer)             # (only _choose's fields: kp and the config's index_topk)
    ix.kp, ix.c = kp, SimpleNamespace(index_topk=budget * kp)
    return ix._choose(scores.astype(np.float32), pos)


EMU = os.environ.get("GLM_CUDA_EMU", "") not in ("", "0")


def _cases():
    rng = np.random.default_rng(7)
    f = np.float32
    n = 300
    yield "all-equal", np.zeros(n, f), 4, 16
    yield "all-negzero", np.full(n, -0.0, f), 4, 16
    z = np.zeros(n, f)
    z[::2] = -0.0
    yield "mixed-zeros", z, 4, 16
    b = np.zeros(n, f)
    b[rng.choice(n, 15, replace=False)] = 1.0      # 15 above, the 16th pool a tie among 285 zeros
    yield "tie-at-boundary", b, 4, 16
    yield "few-values", rng.integers(0, 3, n).astype(f), 4, 64
    sp = rng.standard_normal(n).astype(f)
    sp[rng.choice(n, 40, replace=False)] = np.nan
    sp[rng.choice(n, 10, replace=False)] = -np.inf
    sp[rng.choice(n, 10, replace=False)] = np.inf
    yield "nan-inf", sp, 4, 100
    nn = np.full(n, np.nan, f)
    nn[5] = -np.inf
    yield "nan-below-neg-inf", nn, 4, 3
    yield "random", rng.standard_normal(n).astype(f), 4, 16
    yield "relu-sums", np.maximum(rng.standard_normal(n), 0).astype(f), 16, 8
    yield "kp1", rng.integers(0, 5, n).astype(f), 1, 40
    yield "dense", rng.standard_normal(10).astype(f), 4, 16   # fewer pools than the budget: all positions
    if not EMU:   # (the emulation runs a block's threads one after another: the long rows only on a GPU)
        yield "128k", np.maximum(rng.standard_normal(32768), 0).astype(f), 4, 512
        big = rng.integers(0, 4, 65536).astype(f)
        yield "256k-few-values", big, 4, 512


@pytest.mark.parametrize("name,scores,kp,budget", list(_cases()), ids=[c[0] for c in _cases()])
@pytest.mark.parametrize("tail", [0, 1])
def test_cuda_selection_is_the_oracles(name, scores, kp, budget, tail):
    cu = _cuda()
    pos = len(scores) * kp - 1 + min(tail, kp - 1)
    want = oracle_choose(scores, pos, kp, budget)
    got = cu.index_select(scores, pos, kp, budget)
    assert got.dtype == np.int32 and np.array_equal(got, want), name


def test_bad_arguments():
    cu = _cuda()
    with pytest.raises(ValueError, match="sees 3 pools, got 2 scores"):
        cu.index_select(np.zeros(2, np.float32), 11, 4, 2)
    with pytest.raises(ValueError, match="kp, budget >= 1"):
        cu.index_select(np.zeros(2, np.float32), 7, 0, 2)
