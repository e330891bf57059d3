"""The bounded head (docs/engine_cuda.md, "The bounded head"): a greedy step's token from integer bounds
on the canonical logits and the exact logits of the rows those bounds cannot rule out.

The kernel beside its naive reference: `intervals` below computes every (token, row) interval in NumPy by
the kernel's formula (integer products, the same double operations in the same order), and the device's
must equal it bit for bit; the canonical logits (the oracle's matmat) must lie inside every interval; the
tokens must be np.argmax's of the canonical logits unless the flag says the full head must decide. Cases
in a table, the real head's width (4096 columns) among them; the engine-level tests hold the step's
tokens to the full head's. GPU, or GLM_CUDA_EMU=1 for the small cases; skips cleanly without either.
"""
from __future__ import annotations

import numpy as np
import pytest

from oracle.numerics.bf16 import bf16_bits_to_f32
from oracle.numerics.reduction import matmat
from tests.engine_checks import EMU_SLOW, NO_CUDA, cuda_state

AVAILABLE, EMU, _ = cuda_state()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not AVAILABLE, reason=NO_CUDA)]


def _limits():
    from fast.cuda import cuda_module
    return cuda_module().head_bound_limits() if AVAILABLE else {"q_bits": 0, "cap": 0, "min_rows": 0}


LIMITS = _limits()
Q = LIMITS["q_bits"]  # |q| <= 2^Q (head_bound.cu: kHbQ)
CAP = LIMITS["cap"]  # candidates a token keeps (kHbCap)


W = 127  # lm_head: |h| <= 127 (head_bound.cu: kHbW)


def lane_sum(sq: np.ndarray, lanes: int = 32, order=(16, 8, 4, 2, 1)) -> np.ndarray:
    """Per row, the sum of sq as the kernels make it: thread l of `lanes` takes columns l, l + lanes, ... in
    order, then a butterfly over the threads (xor each of `order` in turn)."""
    n, C = sq.shape
    sq = np.pad(sq, ((0, 0), (0, (-C) % lanes))).reshape(n, -1, lanes)
    part = np.zeros((n, lanes))
    for c in range(sq.shape[1]):
        part = part + sq[:, c, :]
    for o in order:
        part = part + part[:, np.arange(lanes) ^ o]
    return part[:, 0]


def quantize_x(v: np.ndarray):
    """Per row of x: exponent E (2^E > max|v|), integers q = rint(v 2^(13 - E)) and ||v||_2."""
    v = v.astype(np.float64)
    mx = np.abs(v).max(axis=1)
    E = np.where(mx > 0, np.frexp(mx)[1], -140).astype(np.int64)
    q = np.rint(np.ldexp(v, (Q - E)[:, None])).astype(np.int64)
    # (k_hb_quant_x: 256 threads a row, the butterfly within each warp, then over the warps)
    return E, q, np.sqrt(lane_sum(v * v, 256, (16, 8, 4, 2, 1, 128, 64, 32)))


def quantize_w(w: np.ndarray):
    """Per row of lm_head: s = max|w| / 127, h = rint(w / s), ||w||_2, ||e||_2 of e = w - h s (each
    operation a double rounding, as the kernel makes it) and ||w^||_1 = s sum|h|."""
    w = w.astype(np.float64)
    s = np.abs(w).max(axis=1) / W
    safe = np.where(s > 0, s, 1.0)[:, None]
    h = np.where(s[:, None] > 0, np.clip(np.rint(w / safe), -W, W), 0.0)
    e = np.where(s[:, None] > 0, w - h * s[:, None], 0.0)
    l1 = np.abs(h).sum(axis=1) * s
    return s, h.astype(np.int64), np.sqrt(lane_sum(w * w)), np.sqrt(lane_sum(e * e)), l1


def intervals(w: np.ndarray, x: np.ndarray):
    """[lo, hi] of every (token, row): A = the rounded vectors' exact dot, B = the canonical cdot's error
    bound plus the rounding's, as head_bound.cu's k_hb_product computes them."""
    sw, h, n2w, e2w, l1w = quantize_w(w)
    Ex, qx, n2x = quantize_x(x)
    S = qx @ h.T  # exact (int64): the two limb products
    A = np.ldexp(S.astype(np.float64) * sw[None, :], Ex[:, None] - Q)
    m, u = float((w.shape[1] + 63) // 64 + 6), 2.0 ** -24
    gamma = m * u / (1.0 - m * u)
    B = (gamma * n2w[None, :]) * n2x[:, None]
    B = B + e2w[None, :] * n2x[:, None]  # (w - w^) x
    B = B + np.ldexp(l1w[None, :], Ex[:, None] - Q - 1)  # w^ (x - x^)
    B = B + np.ldexp(np.abs(A), -50)  # the rounding of S s_w
    B = B * (1.0 + 2.0 ** -30) + 2.0 ** -120
    lo = np.nextafter((A - B).astype(np.float32), np.float32(-np.inf))
    hi = np.nextafter((A + B).astype(np.float32), np.float32(np.inf))
    return lo, hi


def bf16(a: np.ndarray) -> np.ndarray:
    """BF16 bits (round to nearest even) of float32 values."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def make(case: str, R: int, C: int, T: int, seed: int):
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.02, (R, C)).astype(np.float32)
    x = rng.normal(0, 1.0, (T, C)).astype(np.float32)
    if case == "outliers":  # a few columns of x far larger, as real activations have
        x[:, rng.integers(0, C, 4)] *= 60.0
    elif case == "ties":  # rows repeat with period 7: every logit is tied with R / 7 others
        w = w[np.arange(R) % 7]
    elif case == "crowd":  # rows repeat with period 2: more than CAP candidates, the flag
        w = w[np.arange(R) % 2]
    elif case == "extremes":  # zero rows, tiny rows, a zero token
        w[3] = 0.0
        w[5] *= 1e-30
        x[1] = 0.0
    elif case == "huge":  # logits that could leave float's range: the flag
        w *= 1e30
        x *= 1e8
    elif case == "nonfinite_x":
        x[0, 7] = np.inf
    elif case == "cross":  # one large element a vector, the rest small: w's small elements round to h = 0
        # (each is all residual) and x's lie exactly half a rounding step from 0 (rint: to 0), so what moves
        # the logit from A is the rounding of both vectors (before session 22 the bound missed a term here)
        w[:] = 2.0 ** -15
        w[:, 0] = (1 + np.arange(R) / 64) * 0.25
        x[:] = 2.0 ** -14  # E_x = 0
        x[:, 0] = 0.75
    wb = bf16(w)
    xb = bf16_bits_to_f32(bf16(x))
    return wb, np.ascontiguousarray(xb, np.float32)


# (case, rows, columns, tokens, the flag expected, runs in the emulation)
CASES = [
    ("random", 300, 96, 5, False, True),
    ("random", 37, 100, 3, False, True),
    ("random", 150, 64, 12, False, True),   # the token-tile shapes of the product kernel: one warp a row tile
    ("random", 150, 64, 30, False, True),   # up to 8 tokens, then two warps with 1, 2, 4 or 8 tiles each
    ("random", 150, 64, 50, False, True),
    ("random", 140, 160, 70, False, True),  # (160 columns: a partial pipeline stage)
    ("extremes", 200, 64, 4, False, True),
    ("ties", 1100, 64, 3, False, True),
    ("crowd", 2100, 32, 2, True, True),
    ("huge", 64, 64, 2, True, True),
    ("nonfinite_x", 64, 64, 2, True, True),
    ("cross", 16, 32768, 2, False, True),
    ("random", 3000, 4096, 9, False, False),
    ("outliers", 2000, 4096, 70, False, False),
]


@pytest.mark.parametrize("case,R,C,T,flag,emu_ok", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-t{c[3]}" for c in CASES])
def test_bounded_head_equals_its_reference_and_brackets_the_canonical_logits(case, R, C, T, flag, emu_ok):
    if EMU and not emu_ok:
        pytest.skip(EMU_SLOW)
    from fast.cuda import cuda_module
    wb, x = make(case, R, C, T, seed=R + C + T)
    got = cuda_module().head_bound(wb, x)
    assert got["usable"]
    assert got["flag"] == int(flag)
    w = bf16_bits_to_f32(wb)
    if not np.isfinite(x).all():
        return  # (the flag; the intervals of a non-finite x mean nothing)
    lo, hi = intervals(w, x)
    assert np.array_equal(got["lo"].view(np.uint32), lo.view(np.uint32))
    assert np.array_equal(got["hi"].view(np.uint32), hi.view(np.uint32))
    logits = matmat(np.ascontiguousarray(w, np.float32), x)
    if case != "huge":
        assert (lo <= logits).all() and (logits <= hi).all()
    if not flag:
        assert got["tokens"].tolist() == np.argmax(logits, axis=1).tolist()
        # every candidate's upper end reaches the largest lower end, and only those
        want = (hi >= lo.max(axis=1, keepdims=True)).sum(axis=1)
        assert got["counts"].tolist() == want.tolist()
        assert (want <= CAP).all()
    if case == "ties":
        assert (got["counts"] >= R // 7).all()


def test_a_weight_that_is_not_finite_leaves_the_full_head():
    from fast.cuda import cuda_module
    wb, x = make("random", 64, 64, 2, seed=1)
    wb[10, 3] = 0x7F80  # +inf
    assert cuda_module().head_bound(wb, x) == {"usable": False}


@pytest.mark.parametrize("name", ["tiny-bf16", "tiny-fp8"])
def test_greedy_steps_through_the_bounded_head_equal_the_full_heads(name, ckpt_path):
    """Decode steps that ask only for tokens (logits "argmax") take the bounded head; their tokens are
    the full head's (the same engine with the option off) and the logits' np.argmax, over batches."""
    from fast.cuda import CudaEngine
    eng = CudaEngine(ckpt_path(name))
    full = CudaEngine(ckpt_path(name), cuda_options={"head_bound": False})
    V = eng.config.vocab_size
    rng = np.random.default_rng(3)
    lo = LIMITS["min_rows"]
    for B in (lo, lo + 3):  # (fewer greedy rows keep the full head)
        a, b = [eng.new_cache() for _ in range(B)], [full.new_cache() for _ in range(B)]
        prompts = [rng.integers(0, V, 3 + i).tolist() for i in range(B)]
        eng.reset_head_bound_stats()
        ta = eng.step([(c, p, None, "argmax") for c, p in zip(a, prompts)])
        tb = full.step([(c, p, None, "argmax") for c, p in zip(b, prompts)])
        assert ta == tb
        for _ in range(3):
            lg = full.step([(c, [t], None, "last") for c, t in zip(b, tb)])
            ta = eng.step([(c, [t], None, "argmax") for c, t in zip(a, ta)])
            tb = [int(np.argmax(r[-1])) for r in lg]
            assert ta == tb
        st = eng.head_bound_stats()
        assert st["rows"] == 4 * B and st["full_steps"] == 0 and st["candidates"] >= st["rows"]
        eng.reset_head_bound_stats()
        assert eng.step([(a[0], [ta[0]], None, "argmax")]) == full.step([(b[0], [tb[0]], None, "argmax")])
        # one row: the bounded head from min_rows 1, the full head below min_rows
        assert eng.head_bound_stats()["rows"] == (1 if lo <= 1 else 0)
        assert full.head_bound_stats()["rows"] == 0
        for c in a + b:
            c.close()


def test_steps_the_bounds_cannot_decide_take_the_full_head(tmp_path):
    """lm_head rows that repeat with period 2 over 2100 rows: every logit ties with 1049 others, more
    candidates than the cap, so each step's flag sends it to the full head: the same tokens as the engine
    with the option off, and head_bound_stats counts those steps."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    from fast.cuda import CudaEngine
    from tools.zoo import make_checkpoint
    path = make_checkpoint("tiny", "bf16", tmp_path / "crowd", vocab_size=2100)
    f = tmp_path / "crowd" / "model.safetensors"
    sd = load_file(str(f))
    w = sd["lm_head.weight"]
    sd["lm_head.weight"] = w[torch.arange(w.shape[0]) % 2].contiguous()
    save_file(sd, str(f), metadata={"format": "pt"})
    eng, full = CudaEngine(str(path)), CudaEngine(str(path), cuda_options={"head_bound": False})
    V = eng.config.vocab_size
    rng = np.random.default_rng(9)
    B = LIMITS["min_rows"]
    a, b = [eng.new_cache() for _ in range(B)], [full.new_cache() for _ in range(B)]
    prompts = [rng.integers(0, V, 2 + i).tolist() for i in range(B)]
    ta = eng.step([(c, p, None, "argmax") for c, p in zip(a, prompts)])
    tb = full.step([(c, p, None, "argmax") for c, p in zip(b, prompts)])
    assert ta == tb and set(ta) <= {0, 1}
    eng.reset_head_bound_stats()
    for _ in range(2):
        ta = eng.step([(c, [t], None, "argmax") for c, t in zip(a, ta)])
        tb = full.step([(c, [t], None, "argmax") for c, t in zip(b, tb)])
        assert ta == tb
    st = eng.head_bound_stats()
    assert st["rows"] == 2 * B and st["full_steps"] == 2 and st["max_candidates"] > CAP
