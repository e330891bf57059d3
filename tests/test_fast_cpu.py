"""The CPU engine's own parts (fast.Engine): its primitives equal their oracle twins (exp64, the closed
forms of short reductions, the row decoders), and how it splits work over threads changes no bit.

That the engine is bit-identical to the oracle (every stage, every position, logits and tokens; generate,
chunked prefill, batches, injections, config corners, F32 weights) is tests/test_engines.py's cpu side,
over the cases of tests/cases.py. Exactness is compared on bits, never with a tolerance.
"""
from __future__ import annotations

import numpy as np
import pytest

import fast
from oracle.capture import Capture
from tests.cases import CONFIG_VARIANTS, VARIANT_PROMPT
from tests.engine_checks import bits, prompt

# ---------------------------------------------------------------------------------------------
# primitives of the engine that the oracle has twins of


def test_exp64_matches_oracle():
    from fast import _core
    from oracle.numerics.exp_f64 import exp64_array
    rng = np.random.default_rng(64)
    x = np.concatenate([
        rng.uniform(-750, 710, 400_000), rng.uniform(-40, 40, 400_000), rng.uniform(-1, 1, 200_000),
        rng.integers(0, 2**64, 200_000, dtype=np.uint64).view(np.float64),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-300, -1e-300, 5e-324, 709.782712893384,
                  709.79, -745.1332191019411, -745.14, -708.39, 512.0, -512.0, 1024.0, -1024.0]),
    ])
    a = _core.engine_exp64(x)
    b = exp64_array(x)
    same = (a.view(np.uint64) == b.view(np.uint64)) | (np.isnan(a) & np.isnan(b))
    assert same.all(), f"{int((~same).sum())} differ, first x = {x[~same][0]!r}"


def _adversarial(rng, shape, dtype):
    """Values that stress the order and the signed zeros: +-0, underflowing products, subnormals,
    huge and tiny magnitudes, infinities and NaNs mixed with ordinary numbers."""
    fi = np.finfo(dtype)
    pool = np.array([0.0, -0.0, 1.0, -1.0, fi.tiny, -fi.tiny, fi.smallest_subnormal, -fi.smallest_subnormal,
                     fi.max, -fi.max, np.inf, -np.inf, np.nan, 1e-30, -1e-30, 3.0, 1 + fi.eps, -(1 + fi.eps)],
                    dtype=dtype)
    x = rng.standard_normal(shape).astype(dtype) * dtype(10.0) ** rng.integers(-40, 40, shape).astype(dtype)
    pick = rng.random(shape) < 0.3
    x[pick] = rng.choice(pool, int(pick.sum()))
    return x


@pytest.mark.parametrize("n", range(0, 9))
def test_small_reductions_equal_cdot(n):
    """The engine's closed forms for n <= 8 (smalldot.hpp) give H2's cdot/cdot64 bits."""
    from fast import _core
    rng = np.random.default_rng(100 + n)
    m = 4003
    for dtype, cols, ref, red, dot_name, sum_name in (
            (np.float32, _core.engine_dot_columns, _core.cdot, np.uint32, "dot", "sum"),
            (np.float64, _core.engine_dot64_columns, _core.cdot64, np.uint64, "dot64", "sum64")):
        with np.errstate(all="ignore"):
            A, B = _adversarial(rng, (n, m), dtype), _adversarial(rng, (n, m), dtype)
        got = np.asarray(cols(A, B), dtype=dtype)
        want = np.array([ref(np.ascontiguousarray(A[:, j]), np.ascontiguousarray(B[:, j])) for j in range(m)],
                        dtype=dtype)
        same = (got.view(red) == want.view(red)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (dtype, n, np.flatnonzero(~same)[:3])
        for j in range(0, m, 97):  # the scalar dispatch (Numerics::dot / sum and their 64-bit twins)
            a, b = np.ascontiguousarray(A[:, j]), np.ascontiguousarray(B[:, j])
            for name, args, exp in ((dot_name, (a, b), ref(a, b)), (sum_name, (a,), ref(a, np.ones_like(a)))):
                v = dtype(_core.engine_reduce(name, *args))
                e = dtype(exp)
                assert np.array_equal(np.array(v).view(red), np.array(e).view(red)) or (np.isnan(v) and np.isnan(e)), \
                    (name, n, j)


@pytest.mark.parametrize("release", ["fp8", "fp8-nan", "mxfp4", "bf16"])
def test_row_decode_equals_reference(release):
    """The engine's row decode (used when several tokens share a weight row) equals H2's whole-tensor
    decoders bit for bit: every code, scales of every magnitude and sign, subnormal results, tails."""
    from fast import _core
    rng = np.random.default_rng(5)
    R, C = 300, 4 * 128 + 72  # FP8: partial last blocks in both directions
    if release.startswith("fp8"):
        q = np.tile(np.arange(256, dtype=np.uint8), R * C // 256 + 1)[:R * C]
        rng.shuffle(q)
        if release == "fp8":
            q[(q & 0x7F) == 0x7F] = 0  # NaN-free: the fast path
        q = q.reshape(R, C)
        s = (rng.choice([-1.0, 1.0], (3, 5)) * 2.0 ** rng.integers(-140, 130, (3, 5))).astype(np.float32)
        s[0, 0], s[1, 1], s[2, 2] = 1.0 / 448, np.float32(3e38), np.float32(1e-40)  # huge and subnormal scales
        got = _core.engine_decode_rows("fp8", q, s, R, C)
        want = _core.decode_fp8_weight(q, s)
    elif release == "mxfp4":
        C = 4 * 128 + 64
        p = rng.integers(0, 256, (R, C // 2), dtype=np.uint8)
        s = rng.integers(0, 255, (R, C // 32), dtype=np.uint8)
        s[0, :] = 0  # 2^-127: subnormal products
        got = _core.engine_decode_rows("mxfp4", p, s, R, C)
        want = _core.decode_mxfp4_weight(p, s)
    else:
        w = rng.integers(0, 2**16, (R, C), dtype=np.uint16)
        w[(w & 0x7F80) == 0x7F80] = 0  # no inf/NaN
        got = _core.engine_decode_rows("bf16", w, None, R, C)
        want = (w.astype(np.uint32) << 16).view(np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), np.argwhere(~same)[:3]


@pytest.mark.parametrize("name", ["width-90-fp8", "groups-4-top-2"])
def test_uneven_thread_split(tmp_path, name):
    """Three threads splitting every job (parallel_work=0: shares of 90 channels, of 16 experts, uneven)
    give one thread's bits; tests/test_engines.py holds the two-thread split to the oracle."""
    from tools.zoo import make_checkpoint
    v = next(v for v in CONFIG_VARIANTS if v.name == name)
    path = str(tmp_path / name)
    make_checkpoint("tiny", v.release, path, **v.overrides)
    one = fast.Engine(path, threads=1)
    three = fast.Engine(path, threads=3, parallel_work=0)
    ids = prompt(one.config.vocab_size, *VARIANT_PROMPT)
    want, got = Capture(keep_values=False), Capture(keep_values=False)
    toks, logits = one.generate(ids, 3, capture=want, return_logits=True)
    got_toks, got_logits = three.generate(ids, 3, capture=got, chunk=9, return_logits=True)
    assert got_toks == toks
    assert np.array_equal(bits(got_logits), bits(logits))
    assert got.hashes == want.hashes


# ---------------------------------------------------------------------------------------------
# the API's shape: what generate returns, close() and the context manager, the repr


def test_generate_return_shapes(engines):
    """One prompt (flat ids) -> one list of ids; a list of prompts (one included) -> a list of lists;
    return_logits keeps the same shape, one array of every position's logits per request."""
    eng = engines("tiny-fp8")
    V = eng.config.vocab_size
    one = eng.generate([1, 2, 3], 3)
    assert isinstance(one, list) and len(one) == 3 and all(type(t) is int for t in one)
    assert eng.generate(np.array([1, 2, 3]), 3) == one
    assert eng.generate([[1, 2, 3]], 3) == [one]
    many = eng.generate([[1, 2, 3], [4, 5]], 3)
    assert len(many) == 2 and many[0] == one and all(isinstance(m, list) and len(m) == 3 for m in many)
    toks, lg = eng.generate([1, 2, 3], 3, return_logits=True)
    assert toks == one and lg.shape == (3 + 3 - 1, V)
    assert one == [int(np.argmax(lg[i])) for i in (2, 3, 4)]  # each token is its position's greedy pick
    toks2, lgs = eng.generate([[1, 2, 3], [4, 5]], 3, return_logits=True)
    assert toks2 == many and [x.shape for x in lgs] == [(5, V), (4, V)]
    assert np.array_equal(bits(lgs[0]), bits(lg))  # batched with another request: the same bits


@pytest.mark.parametrize("want", ["argmax", "argmax_logprob"])
def test_greedy_decode_step_path(engines, monkeypatch, want):
    """step's greedy decode path (every segment (cache, [token], None, want), one want for all: generate's
    "argmax", the server's "argmax_logprob") returns what the general path returns for the same rows (ids
    as a tuple take the general path): the same tokens, the same log-probabilities bit for bit, the same
    types; it leaves steps that grow a cache, and steps of mixed wants, to the general path, and every bad
    input to its checks and errors."""
    eng = engines("tiny-fp8")
    V = eng.config.vocab_size
    real, taken = eng._decode_greedy, []

    def spy(segments):
        out = real(segments)
        taken.append(out is not None)
        return out
    monkeypatch.setattr(eng, "_decode_greedy", spy)
    tok = (lambda r: r) if want == "argmax" else (lambda r: r[0])
    a, b = [eng.new_cache() for _ in range(3)], [eng.new_cache() for _ in range(3)]
    prompts = [[1, 2, 3], [4, 5], [6]]
    ra = eng.step([(c, p, None, want) for c, p in zip(a, prompts)])
    rb = eng.step([(c, tuple(p), None, want) for c, p in zip(b, prompts)])
    assert ra == rb and taken == [False, False]
    room = []  # per step: whether every cache had room for one more position (the rooms grow by doubling)
    for _ in range(12):
        room.append(all(c.length < c._room for c in a))
        ra = eng.step([(c, [tok(r)], None, want) for c, r in zip(a, ra)])
        rb = eng.step([(c, (tok(r),), None, want) for c, r in zip(b, rb)])
        assert [tok(r) for r in ra] == [tok(r) for r in rb] and all(type(tok(r)) is int for r in ra)
        if want == "argmax_logprob":
            assert all(type(r[1]) is np.float32 for r in ra)
            assert bits(np.array([r[1] for r in ra])).tolist() == bits(np.array([r[1] for r in rb])).tolist()
    assert [c.length for c in a] == [c.length for c in b] == [15, 14, 13]
    assert taken[2::2] == room and any(room) and not all(room) and not any(taken[3::2])
    other = "argmax_logprob" if want == "argmax" else "argmax"
    n = len(taken)
    eng.step([(a[0], [1], None, want), (a[1], [1], None, other)])  # (mixed wants: the general path)
    assert taken[n:] == [False]
    closed = eng.new_cache()
    closed.close()
    for segs, msg in (([(a[0], [1], None, want), (a[0], [2], None, want)], "twice"),
                      ([(a[0], [V], None, want)], "outside the vocabulary"),
                      ([(a[0], [-1], None, want)], "outside the vocabulary"),
                      ([(closed, [1], None, want)], "closed"),
                      ([(a[0], [True], None, want)], "integers")):
        with pytest.raises(fast.EngineInputError, match=msg):
            eng.step(segs)
    assert [c.length for c in a] == [16, 15, 13]  # (refused steps change nothing)


def test_close_and_context_manager(ckpt_path):
    import gc
    import weakref

    with fast.Engine(ckpt_path("tiny-bf16"), threads=1) as eng:
        cache = eng.new_cache()
        eng.forward([1, 2], cache)
        idle = eng.new_cache()
        executor = weakref.ref(eng._core)
        assert not eng.closed and cache.length == 2
    assert eng.closed
    gc.collect()
    assert executor() is None  # the C++ executor is gone: no cache kept it alive
    assert not cache._finalizer.alive and not idle._finalizer.alive
    eng.close()  # idempotent
    for call in (eng.new_cache, lambda: eng.forward([1]), lambda: eng.generate([1], 1), lambda: cache.length,
                 lambda: eng.decode([cache], [1]), lambda: eng.threads):
        with pytest.raises(fast.EngineInputError, match="closed"):
            call()
    assert repr(eng).endswith(", closed)") and repr(cache) == f"fast.Cache(id={cache._id}, closed)"


def test_repr_names_the_engine(ckpt_path):
    path = ckpt_path("tiny-fp8")
    eng = fast.Engine(path, threads=2, dot="sequential", max_context=64)
    r = repr(eng)
    release = eng.checkpoint.release_summary()["release"]
    assert r.startswith(f"fast.Engine({eng.checkpoint.path!r}, device='cpu', release={release!r}, ")
    for part in ("threads=2", "dot='sequential'", "expf='canonical'", "max_context=64"):
        assert part in r, (part, r)
    cache = eng.new_cache()
    assert repr(cache) == f"fast.Cache(id={cache._id}, length=0)"
