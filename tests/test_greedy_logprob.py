"""The greedy token's log-probability computed where the logits are (Engine.step's "argmax_logprob",
want_head 3): the token is np.argmax's and the log-probability's bits are those of
oracle.sampling.log_softmax(row)[token], in the CPU engine and the CUDA engine (or its emulation,
GLM_CUDA_EMU=1), on made-up rows through the engines' hooks (fast._core.argmax_logprob,
fast._cuda.argmax_logprob: ties, -0 and +0, exp underflow, a NaN or an infinity, the real vocabulary's
width) and on the rows of real steps; and the server's use of it (tools/serve/scheduler.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from fast import _core
from fast import distributed as D
from oracle.capture import Capture
from oracle.sampling import SamplingError, SamplingParams, log_softmax
from tests.cases import TINY
from tests.engine_checks import NO_CUDA, cuda_state, make_engine, prompt, side_param


def _u32(x) -> int:
    return int(np.asarray(x, np.float32).view(np.uint32))


def _f32(*v) -> np.ndarray:
    return np.array(v, np.float32)


def _with(x: np.ndarray, at: int, v: float) -> np.ndarray:
    x = x.copy()
    x[at] = v
    return x


_rng = np.random.default_rng(11)


def _normal(n: int, scale: float = 3.0) -> np.ndarray:
    return (_rng.standard_normal(n) * scale).astype(np.float32)


# (name, row): the made-up rows every side's hook is held to
ROWS = [
    ("one", _f32(0.5)),
    ("n63", _normal(63)), ("n64", _normal(64)), ("n65", _normal(65)), ("n1000", _normal(1000)),
    ("n4097-wide", _normal(4097, 40.0)),               # most expf(d) underflow to 0
    ("vocab", _normal(154880)),                         # the real vocabulary's width
    ("vocab-ties", _rng.integers(-3, 2, 154880).astype(np.float32)),
    ("ties", _rng.integers(-2, 3, 5000).astype(np.float32)),
    ("all-equal", np.full(300, 1.25, np.float32)),
    ("-0-first", _f32(-0.0, 0.0, -1.0)), ("+0-first", _f32(0.0, -0.0, -3.0)),
    ("all-minus-0", np.full(70, -0.0, np.float32)),
    ("d-overflows", _f32(-3e38, 3e38, 1.0)),            # x - max rounds to -inf: expf gives 0
    ("subnormal", _f32(1e-45, -1e-45, 0.0, 2e-45)),
    ("-inf", _with(_normal(100), 3, -np.inf)),
    ("+inf", _with(_normal(100), 40, np.inf)),
    ("nan", _with(_normal(100), 7, np.nan)),
    ("nan-in-vocab", _with(_normal(154880), 150000, np.nan)),
    ("all--inf", np.full(65, -np.inf, np.float32)),
]

CUDA_OK = cuda_state()[0]


def _hook(side: str):
    if side == "cpu":
        return _core.argmax_logprob
    from fast.cuda import cuda_module
    return cuda_module().argmax_logprob


@pytest.mark.parametrize("side", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not CUDA_OK, reason=NO_CUDA)])])
@pytest.mark.parametrize("row", [r for _, r in ROWS], ids=[n for n, _ in ROWS])
def test_hook_matches_the_oracle(side, row):
    """(token, logprob) of one row: np.argmax's token; the oracle's log_softmax at it, bit for bit; NaN
    for the rows the oracle refuses (a NaN or an infinity)."""
    t, lp = _hook(side)(row)
    assert t == int(np.argmax(row))
    assert isinstance(lp, np.float32)
    if np.isfinite(row).all():
        assert _u32(lp) == _u32(log_softmax(row)[t])
    else:
        with pytest.raises(SamplingError):
            log_softmax(row)
        assert np.isnan(lp)


def test_hook_refuses_bad_input():
    for bad in (np.zeros(0, np.float32), np.zeros((2, 3), np.float32), np.zeros(4, np.float64), [1.0, 2.0]):
        with pytest.raises((ValueError, TypeError)):
            _core.argmax_logprob(bad)


STEP_CASES = ([side_param(side, name, checkpoint=name) for side in ("cpu", "cuda") for name in TINY + ("small-fp8",)]
              + [side_param("cpu-ranks", "tiny-mxfp4", checkpoint="tiny-mxfp4", ranks=2)])


@pytest.fixture(scope="module", autouse=True)
def _stop_workers():
    yield
    D.shutdown()


@pytest.mark.parametrize("side,name", STEP_CASES)
def test_step_rows_match_the_oracle(side, name, engines, cuda_engines, ckpt_path):
    """Five copies of one sequence in every step, in a rotating order: three ask for "argmax_logprob"
    (one of them with its logits captured: the host's path), one for its logits ("last"), one for its
    token ("argmax"). Each pair is np.argmax of those logits and log_softmax's value there. On the rank
    side every rank's tokens and log-probabilities are compared with rank 0's after each step."""
    eng = (engines if side == "cpu" else cuda_engines if side == "cuda" else
           lambda n: make_engine(side, ckpt_path(n), ranks=2))(name)
    p = prompt(eng.config.vocab_size, 9, 31)
    modes = ["argmax_logprob", "last", "argmax", "argmax_logprob", "argmax_logprob"]
    caps = [None, None, None, Capture(stages={"logits"}), None]
    caches = [eng.new_cache() for _ in modes]
    feed = [p] * len(modes)
    for step in range(4):
        order = [(i + step) % len(modes) for i in range(len(modes))]
        res = eng.step([(caches[i], feed[i], caps[i], modes[i]) for i in order])
        out = {i: r for i, r in zip(order, res)}
        row = out[1][-1]
        t = int(np.argmax(row))
        assert out[2] == t
        for i in (0, 3, 4):
            tok, lp = out[i]
            assert tok == t and isinstance(lp, np.float32), (step, i)
            assert _u32(lp) == _u32(log_softmax(row)[t]), (step, i)
        feed = [[t]] * len(modes)
    for c in caches:
        c.close()


def test_step_refuses_an_unknown_mode(engines):
    eng = engines("tiny-bf16")
    c = eng.new_cache()
    with pytest.raises(ValueError, match="argmax_logprob"):
        eng.step([(c, [1], None, "logprob")])
    c.close()


# -- the server: which rows ask for it, and a row the oracle refuses -----------------------------------

class _Cache:
    length = 0

    def close(self):
        pass


class _Engine:
    """Every step's logits requests recorded; "last" rows get the logits 0, 1, ..., 7 (token 7), the
    "argmax_logprob" rows token 7 with a NaN log-probability (a row with a NaN or an infinity)."""

    def __init__(self):
        self.wants = []

    def new_cache(self):
        return _Cache()

    def step(self, segs):
        self.wants.append([want for *_, want in segs])
        return [np.arange(8, dtype=np.float32)[None] if want == "last" else
                (7, np.float32(np.nan)) if want == "argmax_logprob" else None for *_, want in segs]


class _Loop:
    """An event loop's call_soon_threadsafe, run at once (the scheduler's events reach their sinks)."""

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


def test_scheduler_asks_greedy_rows_for_their_logprob_and_fails_a_refused_row():
    from tools.serve.scheduler import Request, Scheduler
    eng = _Engine()
    sched = Scheduler(eng, max_batch=4)
    events, loop = {}, _Loop()
    reqs = [Request(np.array([1, 2], np.int32), 3, params, top_logprobs=top, sink=(loop, events.setdefault(k, []).append))
            for k, (params, top) in enumerate([(SamplingParams(), 0), (SamplingParams(), 2),
                                               (SamplingParams(temperature=1.0, seed=3), 0)])]
    sched._step(reqs)   # the prompts: their logits rows
    sched._step(reqs)   # decode: only the greedy request without top_logprobs asks the engine
    sched._flush()
    assert eng.wants == [["last"] * 3, ["argmax_logprob", "last", "last"]]
    with pytest.raises(SamplingError) as refused:
        log_softmax(_f32(1.0, np.nan))
    assert events[0][-1] == {"type": "done", "reason": "error", "text_end": None, "error": str(refused.value)}
    assert [e["type"] for e in events[1]] == [e["type"] for e in events[2]] == ["token", "token"]
    assert reqs[0].tokens == [7] and reqs[1].tokens == [7, 7]
