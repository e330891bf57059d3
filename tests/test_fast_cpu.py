"""The CPU engine (fast.Engine) is bit-identical to the oracle: every captured stage, every position,
the logits and the generated tokens, for tiny (golden/) and small (generated here) in every release,
in prefill and decode.

Exactness is compared on bits: stage rows by the sha256 of their canonical bytes (oracle.capture),
logits by their uint32 view. No tolerances anywhere. The oracle runs once per case (session cache).
"""
from __future__ import annotations

import numpy as np
import pytest

import fast
import oracle
from oracle.capture import Capture
from oracle.inject import Injection
from tests.engine_checks import assert_same_capture, bits, case_id, first_divergence, greedy_case, prompt

TINY = ("tiny-bf16", "tiny-fp8", "tiny-mxfp4")
SMALL = ("small-bf16", "small-fp8", "small-mxfp4")

# (checkpoint, prompt length, prompt seed, new tokens). tiny: index_topk 8, kpool 4, so a 40-token
# prompt makes the indexer choose 2 of up to 10 pools; small: index_topk 16, kpool 4, 24 tokens -> 4 of 6.
CASES = [
    ("tiny-bf16", 5, 1, 4),
    ("tiny-bf16", 40, 2, 3),
    ("tiny-bf16", 13, 3, 6),
    ("tiny-fp8", 5, 4, 4),
    ("tiny-fp8", 40, 5, 3),
    ("tiny-mxfp4", 5, 6, 4),
    ("tiny-mxfp4", 40, 7, 3),
    ("small-bf16", 24, 8, 3),
    ("small-fp8", 24, 9, 3),
    ("small-mxfp4", 24, 10, 3),
]


@pytest.fixture(scope="session")
def engines(ckpt_path):
    cache = {}

    def get(name: str, **kw) -> fast.Engine:
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            # two threads splitting every job (parallel_work=0), even on these small models
            cache[key] = fast.Engine(ckpt_path(name), device="cpu", threads=2, parallel_work=0, **kw)
        return cache[key]
    return get


@pytest.fixture(scope="session")
def models(ckpt_path):
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = oracle.load(ckpt_path(name))
        return cache[name]
    return get


@pytest.fixture(scope="session")
def oracle_runs(models):
    """case -> (ids, tokens, logits, capture) of the oracle's greedy generate, every stage captured."""
    cache = {}

    def get(case):
        if case not in cache:
            cache[case] = greedy_case(models(case[0]), case)
        return cache[case]
    return get





# ---------------------------------------------------------------------------------------------
# every stage, prefill (one chunk) then decode, via generate


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_generate_bit_identical(case, engines, oracle_runs, models):
    ids, toks, logits, cap = oracle_runs(case)
    eng = engines(case[0])
    got_cap = Capture()
    got_toks, got_logits = eng.generate(ids, case[3], capture=got_cap, return_logits=True)
    assert got_toks == toks
    npos = len(ids) + case[3] - 1
    assert_same_capture(models(case[0]).config, cap, got_cap, range(npos))
    assert got_logits.shape == logits.shape
    assert np.array_equal(bits(got_logits), bits(logits))


# ---------------------------------------------------------------------------------------------
# forward / prefill in chunks / decode through the low-level API, against the same oracle run


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("tiny-fp8", "small-mxfp4")], ids=case_id)
@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_prefill_and_decode(case, chunk, engines, oracle_runs, models):
    ids, toks, logits, cap = oracle_runs(case)
    eng = engines(case[0])
    got = Capture()
    cache = eng.new_cache()
    pre = eng.prefill(ids, cache, chunk=chunk, capture=got)
    outs = [pre]
    for tok in toks[:-1]:
        outs.append(eng.decode([cache], [tok], capture=got))
    assert cache.length == len(ids) + len(toks) - 1
    assert np.array_equal(bits(np.concatenate(outs)), bits(logits))
    assert_same_capture(models(case[0]).config, cap, got, range(len(ids) + len(toks) - 1))


# ---------------------------------------------------------------------------------------------
# several requests in one generate call (continuous batching) against the oracle's single runs


@pytest.mark.parametrize("name", ["tiny-bf16", "tiny-mxfp4", "small-fp8"])
def test_batched_generate_matches_oracle(name, engines, oracle_runs, models):
    cases = [c for c in CASES if c[0] == name]
    runs = [oracle_runs(c) for c in cases]
    eng = engines(name)
    caps = [Capture(keep_values=False) for _ in cases]
    new = max(c[3] for c in cases)
    outs = eng.generate([r[0] for r in runs], new, capture=caps, chunk=6, arrivals=[0, 2, 3][:len(cases)])
    for c, r, out, got in zip(cases, runs, outs, caps):
        assert out[:c[3]] == r[1]
        npos = len(r[0]) + c[3] - 1
        keys = {k for k in r[3].hashes if k[2] < npos}
        assert {k: got.hashes[k] for k in keys} == {k: r[3].hashes[k] for k in keys}


# ---------------------------------------------------------------------------------------------
# fault injection: the engine perturbs the same value as the oracle, and it propagates the same way

INJECTIONS = [
    "0,0,embed,3,1",
    "1,3,attn_hc.comb,5,1000",
    "0,4,kda.state,100,-2",
    "5,11,kda.o,3,5",
    "2,7,moe.selected,1,-1",
    "3,10,mla.scores,5,3",
    "3,15,indexer.scores,1,1",
    "4,12,mla.selected,2,-1",
    "1,6,moe.weights,0,1",
    "6,9,logits,7,1",
]


@pytest.mark.parametrize("spec", INJECTIONS)
def test_injection_matches_oracle(spec, models, ckpt_path, engines, oracle_runs):
    case = ("tiny-fp8", 40, 5, 3)
    ids, _, _, clean = oracle_runs(case)
    m = models(case[0])
    ids = ids[:20]
    want = Capture(keep_values=False)
    m.prefill(ids, m.new_cache(), 7, want, Injection.parse(spec))
    eng = fast.Engine(ckpt_path(case[0]), inject=spec)
    got = Capture(keep_values=False)
    eng.prefill(ids, eng.new_cache(), chunk=7, capture=got)
    assert eng.injected >= 1
    assert got.hashes == want.hashes
    # and the injection did change something
    assert any(want.hashes[k] != clean.hashes[k] for k in want.hashes)


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


def test_noncanonical_switches_diverge(ckpt_path, oracle_runs, models):
    """dot='sequential' and expf='native' are real departures, localized by a capture diff."""
    case = ("tiny-bf16", 13, 3, 6)
    ids, _, _, clean = oracle_runs(case)
    cfg = models(case[0]).config
    for opts in ({"dot": "sequential"}, {"expf": "native"}):
        eng = fast.Engine(ckpt_path(case[0]), **opts)
        got = Capture()
        eng.forward(ids, eng.new_cache(), got)
        assert any(got.hashes[k] != clean.hashes[k] for k in got.hashes), opts
        assert first_divergence(cfg, clean, got, range(len(ids))) is not None


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


def test_f32_stored_checkpoint(tmp_path, golden_dir):
    """Weights stored as F32 (what transformers' save_pretrained writes) take the engine's F32 path."""
    import shutil

    from safetensors.numpy import save_file

    from oracle import names as N
    from oracle.checkpoint import open_checkpoint

    src = golden_dir / "tiny-bf16"
    ck = open_checkpoint(str(src))
    tensors = {}
    for entry in N.expected(ck.config):
        raw = ck.raw(entry.spec.role, entry.layer, entry.expert)
        a = np.asarray(raw.data)
        tensors[raw.stored_key] = (a.astype(np.uint32) << 16).view(np.float32) if raw.release == "bf16" else a
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    eng = fast.Engine(str(tmp_path), threads=2, parallel_work=0)
    assert set(eng.release) == {"f32"}
    m = oracle.load(str(tmp_path))
    ids = prompt(m.config.vocab_size, 21, 12)
    want, got = Capture(keep_values=False), Capture(keep_values=False)
    toks, logits = m.generate(ids, 3, capture=want, return_logits=True)
    got_toks, got_logits = eng.generate(ids, 3, capture=got, return_logits=True)
    assert got_toks == toks
    assert np.array_equal(bits(got_logits), bits(logits))
    assert got.hashes == want.hashes


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


CONFIG_VARIANTS = [
    ("no-norm-topk", "bf16", dict(norm_topk_prob=False)),
    ("tied-head", "fp8", dict(tie_word_embeddings=True)),
    ("one-group", "mxfp4", dict(n_group=1, topk_group=1)),
    ("kpool-1", "bf16", dict(index_kpool=1, index_topk=5)),
    ("conv-1-hc-2", "fp8", dict(linear_conv_kernel_dim=1, hc_mult=2, hc_sinkhorn_iters=3)),
    ("groups-4-top-2", "bf16", dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3)),
    ("hc-8", "fp8", dict(hc_mult=8)),
    ("width-90", "bf16", dict(hidden_size=90)),          # channel tails in every vectorized loop
    ("width-90-fp8", "fp8", dict(hidden_size=90, linear_head_dim=13, index_head_dim=11, kv_lora_rank=37)),
    ("hc-7-shared-chain", "bf16", dict(hc_mult=7, layer_types=["linear_attention", "indexed_attention",
                                                               "indexed_attention", "indexed_attention",
                                                               "linear_attention", "linear_attention"],
                                       indexer_types=["full", "full", "shared", "full", "full", "full"])),
]


@pytest.mark.parametrize("name,release,overrides", CONFIG_VARIANTS, ids=[v[0] for v in CONFIG_VARIANTS])
def test_config_variants(tmp_path, name, release, overrides):
    """Config corners the zoo does not ship (generated here from the tiny recipe): still bit-identical."""
    from tools.zoo import make_checkpoint
    path = str(tmp_path / name)
    make_checkpoint("tiny", release, path, **overrides)
    m = oracle.load(path)
    eng = fast.Engine(path, threads=2, parallel_work=0)
    ids = prompt(m.config.vocab_size, 26, 13)
    want, got = Capture(keep_values=False), Capture(keep_values=False)
    toks, logits = m.generate(ids, 3, capture=want, return_logits=True)
    got_toks, got_logits = eng.generate(ids, 3, capture=got, chunk=9, return_logits=True)
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
