"""mla.probs on the device, kernel by kernel, on made-up scores: p = bf16(e / csum(e)), e = expf(s - max)
(docs/numerics.md). The general kernel (a row's e written, then summed from memory by eight threads) and
the row kernels (the warp's lanes hold cdot's 64 partial sums themselves: registers for rows of up to 128,
512 or 2048 positions, or streamed for any length) against the oracle's own formula (oracle/layers/mla.py:
P.exp, P.rowsum, P.rnd) for finite rows, and against the general kernel (held to the CPU engine by the
engine tests) for rows with NaN or infinite scores; each row's csum(e) as well, since a sum in another order
mostly hides under the probabilities' BF16 rounding. Row lengths at and around every boundary of a chunk
(64 positions) and of each kernel's capacity; compared as bits."""
from __future__ import annotations

import numpy as np
import pytest

from oracle.layers.ops import Precision

pytestmark = pytest.mark.gpu

LENS = [1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 200, 511, 512, 513, 1000, 2047, 2048, 2049, 3001]
KERNELS = {"general": None, "rows4": 128, "rows16": 512, "rows64": 2048, "stream": None, "auto": None}


def _cuda():
    from fast.cuda import cuda_available, cuda_module
    if not cuda_available():
        pytest.skip("no CUDA engine (fast._cuda not built or no device)")
    return cuda_module()


def oracle_probs(s: np.ndarray):
    """[nh, n] scores -> the oracle's mla.probs (its own code path: oracle/layers/mla.py), and csum(e)."""
    P = Precision("canonical")
    e = P.exp(s - s.max(axis=1)[:, None])
    sums = P.rowsum(e)
    return P.rnd(e / sums[:, None]), sums


def rows(nh: int, special: bool):
    rng = np.random.default_rng(11 + special)
    out = []
    for n in LENS:
        s = (rng.standard_normal((nh, n)) * 4).astype(np.float32)
        if special:
            s[0, 0] = np.nan                              # a NaN first: it is the max
            if n > 3:
                s[1, 1] = np.nan                          # a later NaN: ignored by the max
                s[1, 2] = -np.inf
                s[2, :] = -np.inf                         # every score -inf
                s[2, n // 2] = np.inf
        out.append(s)
    return out


def run(cu, scores, kernel, nh):
    """[(probs [nh, n], sums [nh])] of each row group through one kernel."""
    lens = [s.shape[1] for s in scores]
    flat = np.concatenate([s.reshape(-1) for s in scores])
    p, sums = cu.mla_softmax(flat, lens, nh, kernel)
    res, o = [], 0
    for t, n in enumerate(lens):
        res.append((p[o:o + nh * n].reshape(nh, n), sums[t * nh:(t + 1) * nh]))
        o += nh * n
    return res


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_softmax_kernels_are_the_oracles(kernel):
    cu = _cuda()
    nh, cap = 3, KERNELS[kernel]
    scores = [s for s in rows(nh, False) if cap is None or s.shape[1] <= cap]
    for s, (got, sums) in zip(scores, run(cu, scores, kernel, nh)):
        want, want_sums = oracle_probs(s)
        # (the sums too: a sum in another order is mostly hidden by the BF16 rounding of the probabilities)
        assert np.array_equal(sums.view(np.uint32), want_sums.view(np.uint32)), (kernel, s.shape)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (kernel, s.shape)


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k != "general"])
def test_softmax_kernels_agree_on_nan_and_inf(kernel):
    cu = _cuda()
    nh, cap = 3, KERNELS[kernel]
    scores = [s for s in rows(nh, True) if cap is None or s.shape[1] <= cap]
    want = run(cu, scores, "general", nh)
    for s, w, got in zip(scores, want, run(cu, scores, kernel, nh)):
        for a, b in zip(got, w):   # probabilities, then sums
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (kernel, s.shape)


def test_bad_arguments():
    cu = _cuda()
    with pytest.raises(ValueError, match="holds rows of up to 128 positions, got 129"):
        cu.mla_softmax(np.zeros(129, np.float32), [129], 1, "rows4")
    with pytest.raises(ValueError, match="kernel must be auto, general"):
        cu.mla_softmax(np.zeros(4, np.float32), [4], 1, "fast")
    with pytest.raises(ValueError, match="nh \\* sum\\(lens\\)"):
        cu.mla_softmax(np.zeros(5, np.float32), [4], 1)
