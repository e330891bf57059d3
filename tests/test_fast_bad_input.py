"""The CPU engine's boundary: every bad input is a clean Python exception (ValueError / TypeError /
RuntimeError for a refused hardware state), never a crash. Fuzzed with hypothesis at both layers:
fast.Engine (validated in Python) and the raw fast._core._Engine (validated again in C++).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fast
from fast import _core
from fast.engine import EngineInputError, _engine_config
from oracle.capture import Capture
from oracle.sampling import log_softmax

CKPT = "tiny-bf16"
CLEAN = (ValueError, TypeError)


@pytest.fixture(scope="module")
def eng(golden_dir):
    return fast.Engine(str(golden_dir / CKPT), threads=2, max_context=64)


def assert_usable(eng):
    """After any refused input the engine still answers, with the same bits as before."""
    a = eng.forward([1, 2, 3], eng.new_cache())
    b = eng.forward([1, 2, 3], eng.new_cache())
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---------------------------------------------------------------------------------------------- table

BAD_IDS = [
    ([], "empty"),
    ([300], "vocabulary"),
    ([-1], "vocabulary"),
    ([1, 2, 2**40], "vocabulary"),
    (np.array([[1, 2], [3, 4]]), "1-D"),
    (np.array([1.0, 2.0]), "integers"),
    ([1.5], "integers"),
    (np.array([True, False]), "integers"),
    ("abc", "1-D"),
    (None, "1-D"),
    ([[1], [2]], "integers"),
    (list(range(65)), "maximum context"),
]


@pytest.mark.parametrize("ids,msg", BAD_IDS, ids=[m + str(i) for i, (_, m) in enumerate(BAD_IDS)])
def test_bad_ids(eng, ids, msg):
    with pytest.raises(EngineInputError, match=msg):
        eng.forward(ids, eng.new_cache())
    assert_usable(eng)


def test_context_overflow_across_calls(eng):
    c = eng.new_cache()
    eng.prefill(list(range(60)), c, chunk=16)
    with pytest.raises(EngineInputError, match="maximum context"):
        eng.forward([1, 2, 3, 4, 5], c)
    assert c.length == 60  # refused before anything ran
    eng.forward([1, 2, 3, 4], c)
    with pytest.raises(EngineInputError, match="maximum context"):
        eng.decode([c], [1])
    with pytest.raises(EngineInputError, match="maximum context"):
        eng.generate([[1] * 60], 6)


@pytest.mark.parametrize("capture,msg", [
    ("not a capture", "Capture"),
    (Capture(stages={"bogus.stage"}), "unknown stage"),
    (Capture(stages={"mla.scores", 7}), "unknown stage"),
    (Capture(layers={99}), "out of range"),
    (Capture(layers={-1}), "out of range"),
])
def test_bad_capture(eng, capture, msg):
    with pytest.raises(EngineInputError, match=msg):
        eng.forward([1, 2], eng.new_cache(), capture)


@pytest.mark.parametrize("spec,msg", [
    ("1,2,3", "layer,pos,stage,element,ulps"),
    ("a,2,kda.q,0,1", "integers"),
    ("0,2,nope,0,1", "unknown stage"),
    ("0,2,mla.scores,0,1", "does not exist at layer"),   # layer 0 is KDA
    ("3,2,kda.q,0,1", "does not exist at layer"),        # layer 3 is MLA
    ("9,2,kda.q,0,1", "out of range"),
    ("0,-1,kda.q,0,1", "pos"),
    ("0,2,kda.q,100000,1", "element"),
    ("0,2,kda.q,-1,1", "element"),
    ("0,2,kda.q,0,0", "ulps"),
    ("0,2,kda.q,0,9223372036854775808", "ulps"),    # past int64 (any int64 moves in value order)
    ((0, 2, "kda.q", 0), "expected"),
    ((0, 2, "kda.q", 0, 1.5), "int"),
    ({"layer": 0}, "missing key"),
    (42, "expected"),
])
def test_bad_inject(golden_dir, eng, spec, msg):
    with pytest.raises(EngineInputError, match=msg):
        fast.Engine(str(golden_dir / CKPT), inject=spec)
    with pytest.raises(EngineInputError, match=msg):
        eng.inject = spec
    assert eng.inject is None


def test_inject_runtime_errors(golden_dir):
    """Injections whose effect is out of range are refused during the step, cleanly; the engine lives on."""
    e = fast.Engine(str(golden_dir / CKPT), threads=2)
    e.inject = "2,1,moe.selected,0,1000"
    c = e.new_cache()
    with pytest.raises(ValueError, match="moe.selected"):
        e.forward([5, 6, 7], c)
    with pytest.raises(ValueError, match="unusable"):  # the half-run sequence is refused from then on
        e.forward([1], c)
    e.inject = "3,1,mla.selected,0,-1000"
    with pytest.raises(ValueError, match="mla.selected"):
        e.forward([5, 6, 7], e.new_cache())
    e.inject = "3,1,mla.scores,500,1"  # element beyond [n_heads, n_selected] at position 1
    with pytest.raises(EngineInputError, match="no element"):
        e.forward([5, 6, 7], e.new_cache())
    e.inject = None
    assert_usable(e)


@pytest.mark.parametrize("kw,msg", [
    ({"device": "gpu"}, "device"),
    ({"threads": 0}, "threads"),
    ({"threads": 2.0}, "threads"),
    ({"threads": True}, "threads"),
    ({"dot": "fast"}, "dot"),
    ({"expf": "libm"}, "expf"),
    ({"max_context": 0}, "max_context"),
    ({"max_context": 10**9}, "max_context"),
])
def test_bad_engine_options(golden_dir, kw, msg):
    with pytest.raises(EngineInputError, match=msg):
        fast.Engine(str(golden_dir / CKPT), **kw)


def test_bad_checkpoint(tmp_path):
    with pytest.raises(ValueError):
        fast.Engine(str(tmp_path / "missing"))


def test_bad_cache_and_calls(eng, golden_dir):
    other = fast.Engine(str(golden_dir / CKPT), threads=1)
    with pytest.raises(EngineInputError, match="cache"):
        eng.forward([1], other.new_cache())
    with pytest.raises(EngineInputError, match="cache"):
        eng.forward([1], "cache")
    c = eng.new_cache()
    c.close()
    with pytest.raises(EngineInputError, match="closed"):
        eng.forward([1], c)
    c2 = eng.new_cache()
    with pytest.raises(EngineInputError, match="twice"):
        eng.step([(c2, [1], None, "all"), (c2, [2], None, "all")])
    with pytest.raises(EngineInputError):
        eng.step([])
    with pytest.raises(EngineInputError):
        eng.step([(c2, [1], None, "some")])
    with pytest.raises(EngineInputError):
        eng.step([(c2, [1])])
    with pytest.raises(EngineInputError, match="caches"):
        eng.decode([c2, eng.new_cache()], [1])
    with pytest.raises(EngineInputError, match="chunk"):
        eng.prefill([1, 2], eng.new_cache(), chunk=0)
    for kw in ({"max_new_tokens": -1}, {"max_new_tokens": 2, "chunk": 0}, {"max_new_tokens": 2, "max_batch": 0},
               {"max_new_tokens": 2, "arrivals": [0, 1]}, {"max_new_tokens": 2, "arrivals": [-1]},
               {"max_new_tokens": 2, "capture": [Capture(), Capture()]}):
        with pytest.raises(EngineInputError):
            eng.generate([[1, 2]], **kw)
    with pytest.raises(EngineInputError):
        eng.generate([], 2)
    with pytest.raises(EngineInputError):
        eng.generate([[1], []], 2)
    assert c2.length == 0
    assert_usable(eng)


def test_ftz_daz_refused(eng):
    was = _core._set_ftz_daz(True)
    try:
        with pytest.raises(RuntimeError, match="MXCSR"):
            eng.forward([1, 2], eng.new_cache())
    finally:
        _core._set_ftz_daz(was)
    assert_usable(eng)


# ---------------------------------------------------------------------------------------------- fuzz

@st.composite
def any_array(draw, dtypes, max_dims=3, max_side=5):
    """An array of any of `dtypes` and shape, values in [-3, 400] (cast, so they may wrap)."""
    dt = draw(st.sampled_from(dtypes))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=max_dims, min_side=0, max_side=max_side))
    n = int(np.prod(shape))
    vals = draw(st.lists(st.integers(-3, 400), min_size=n, max_size=n))
    with np.errstate(all="ignore"):
        return np.array(vals, dtype=np.int64).astype(dt).reshape(shape)


anything = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=5),
    st.lists(st.integers(-1000, 1000), max_size=70),
    st.lists(st.one_of(st.integers(-5, 400), st.floats(), st.none(), st.text(max_size=2)), max_size=6),
    any_array([np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint64, np.float32, np.float64, np.bool_,
               np.complex64]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=anything)
def test_fuzz_forward_ids(eng, ids):
    try:
        out = eng.forward(ids, eng.new_cache())
    except CLEAN:
        return
    assert out.dtype == np.float32 and out.shape[1] == 300


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.one_of(anything, st.tuples(st.integers(-2, 8), st.integers(-2, 70),
                                          st.sampled_from(["kda.q", "mla.scores", "logits", "embed", "x"]),
                                          st.integers(-2, 2000), st.integers(-3, 3))))
def test_fuzz_inject_spec(eng, spec):
    try:
        eng.inject = spec
        if eng.inject is not None:
            eng.forward([1, 2, 3], eng.new_cache())
    except CLEAN:
        pass
    finally:
        eng.inject = None


arr = any_array([np.int64, np.int32, np.bool_, np.uint8, np.float32], max_dims=2, max_side=6)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=arr, tok=arr, head=arr, caprow=arr, mask=arr,
       inj=st.one_of(st.none(), st.tuples(*[st.integers(-3, 60)] * 5), st.text(max_size=3), st.tuples(st.integers())))
def test_fuzz_core_step(eng, seq, tok, head, caprow, mask, inj):
    """The raw C++ step with arbitrary arrays: ValueError/TypeError, or a valid result."""
    core = eng._core
    try:
        core.step(seq, tok, head, caprow, mask, inj)
    except CLEAN:
        pass


def test_core_step_checks(eng):
    core = eng._core
    sid = core.new_sequence()
    n = (eng.config.num_hidden_layers + 1) * len(_core.ENGINE_STAGES)
    ok = dict(seq=np.array([sid], np.int64), tok=np.array([1], np.int32), head=np.ones(1, np.bool_),
              cap=np.zeros(1, np.bool_), mask=np.zeros(n, np.bool_))

    def call(**kw):
        a = dict(ok, **kw)
        return core.step(a["seq"], a["tok"], a["head"], a["cap"], a["mask"], kw.get("inj"))

    for kw, msg in (({"seq": np.array([12345], np.int64)}, "unknown sequence"),
                    ({"tok": np.array([300], np.int32)}, "vocabulary"),
                    ({"tok": np.array([-7], np.int32)}, "vocabulary"),
                    ({"mask": np.zeros(3, np.bool_)}, "cap_mask"),
                    ({"seq": np.array([sid, sid], np.int64)}, "same length"),
                    ({"inj": (99, 0, 0, 0, 1)}, "injection"),
                    ({"inj": (0, 0, 10**6, 0, 1)}, "injection"),
                    ({"inj": (0, 0, 0)}, "inject"),
                    ({"head": np.full(1, 4, np.uint8)}, "want_head must be 0, 1, 2 or 3")):
        with pytest.raises(ValueError, match=msg):
            call(**kw)
    sid2 = core.new_sequence()
    with pytest.raises(ValueError, match="consecutive"):
        core.step(np.array([sid, sid2, sid], np.int64), np.array([1, 2, 3], np.int32), np.ones(3, np.bool_),
                  np.zeros(3, np.bool_), ok["mask"], None)
    rows, logits, caps, injected, tokens, logprobs = call()
    assert rows.tolist() == [0] and logits.shape == (1, 300) and caps == [] and injected == 0 and tokens.size == 0
    assert logprobs.dtype == np.float32 and logprobs.size == 0
    assert core.sequence_length(sid) == 1
    # want_head 2: the row's greedy token only, the argmax of the logits the same step would return
    fork = core.fork_sequence(sid)
    fork3 = core.fork_sequence(sid)
    rows, logits, _, _, _, _ = call(tok=np.array([5], np.int32))
    rows2, logits2, _, _, tokens, logprobs = call(seq=np.array([fork], np.int64), tok=np.array([5], np.int32),
                                                  head=np.full(1, 2, np.uint8))
    assert rows2.size == 0 and logits2.shape == (0, 300) and tokens.dtype == np.int32 and logprobs.size == 0
    assert tokens.tolist() == [int(np.argmax(logits[0]))]
    # want_head 3: the token and its log-probability, the oracle's log_softmax of those logits at the token
    rows3, logits3, _, _, tokens3, logprobs3 = call(seq=np.array([fork3], np.int64), tok=np.array([5], np.int32),
                                                    head=np.full(1, 3, np.uint8))
    assert rows3.size == 0 and logits3.shape == (0, 300) and tokens3.tolist() == tokens.tolist()
    assert logprobs3.dtype == np.float32 and logprobs3.view(np.uint32).tolist() == [
        log_softmax(logits[0])[tokens[0]].view(np.uint32)]
    core.free_sequence(fork)
    core.free_sequence(fork3)
    with pytest.raises(ValueError, match="unknown sequence"):
        core.sequence_length(10**9)
    with pytest.raises(ValueError, match="unknown sequence"):
        core.fork_sequence(10**9)
    core.free_sequence(sid)
    core.free_sequence(sid)  # freeing twice is harmless
    core.free_sequence(sid2)


def test_core_weights_checks(golden_dir):
    """add_tensor refuses wrong shapes, dtypes, releases, roles; finalize lists every missing tensor."""
    from oracle.checkpoint import open_checkpoint
    ck = open_checkpoint(str(golden_dir / "tiny-fp8"))
    cfg = ck.config
    core = _core._Engine(_engine_config(cfg, 64), 1)
    raw = ck.raw("kda.q_proj", 0)
    with pytest.raises(ValueError, match="shape"):
        core.add_tensor("kda.q_proj", 0, -1, raw.release, raw.data, raw.scale, [1, 2])
    with pytest.raises(ValueError, match="scale"):
        core.add_tensor("kda.q_proj", 0, -1, "fp8", raw.data, None, list(raw.shape))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        core.add_tensor("kda.q_proj", 0, -1, "fp8", raw.data, np.zeros((9, 9), np.float32), list(raw.shape))
    with pytest.raises(ValueError, match="dtype"):
        core.add_tensor("kda.q_proj", 0, -1, "fp8", raw.data.astype(np.float32), raw.scale, list(raw.shape))
    with pytest.raises(ValueError, match="release"):
        core.add_tensor("kda.q_proj", 0, -1, "int4", raw.data, raw.scale, list(raw.shape))
    with pytest.raises(ValueError, match="unknown role"):
        core.add_tensor("kda.nope", 0, -1, raw.release, raw.data, raw.scale, list(raw.shape))
    with pytest.raises(ValueError, match="not a KDA layer"):
        core.add_tensor("kda.q_proj", 3, -1, raw.release, raw.data, raw.scale, list(raw.shape))
    with pytest.raises(ValueError, match="layer out of range"):
        core.add_tensor("kda.q_proj", 17, -1, raw.release, raw.data, raw.scale, list(raw.shape))
    with pytest.raises(ValueError, match="data has shape"):  # packed nibbles must be [R, C/2]
        core.add_tensor("moe.expert.gate_proj", 1, 0, "mxfp4", np.zeros((96, 40), np.uint8),
                        np.zeros((96, 3), np.uint8), [96, 96])
    with pytest.raises(ValueError, match="weight_scale has shape"):
        core.add_tensor("moe.expert.gate_proj", 1, 0, "mxfp4", np.zeros((96, 48), np.uint8),
                        np.zeros((96, 2), np.uint8), [96, 96])
    with pytest.raises(ValueError, match="expert index"):
        r = ck.raw("moe.expert.gate_proj", 1, 0)
        core.add_tensor("moe.expert.gate_proj", 1, 99, r.release, r.data, r.scale, list(r.shape))
    core.add_tensor("kda.q_proj", 0, -1, raw.release, raw.data, raw.scale, list(raw.shape))
    with pytest.raises(ValueError, match="twice"):
        core.add_tensor("kda.q_proj", 0, -1, raw.release, raw.data, raw.scale, list(raw.shape))
    with pytest.raises(ValueError, match="missing") as e:
        core.finalize()
    assert "embed" in str(e.value) and "moe.expert.down_proj (layer 5) (expert 7)" in str(e.value)
    with pytest.raises((ValueError, RuntimeError)):
        core.new_sequence()


@pytest.mark.parametrize("bad", [
    {"hidden_size": 0}, {"hc_mult": 0}, {"is_kda": [1]}, {"index_kpool": 0}, {"num_experts_per_tok": 1000},
    {"max_context": 0}, {"qk_rope_head_dim": 8}, {"vocab_size": -3},
])
def test_core_bad_config(golden_dir, bad):
    from oracle.config import Config
    cfg = Config.from_json(str(golden_dir / CKPT / "config.json"))
    d = dict(_engine_config(cfg, 64), **bad)
    with pytest.raises(ValueError, match="config field"):
        _core._Engine(d, 1)
    d = _engine_config(cfg, 64)
    del d["hc_eps"]
    with pytest.raises(ValueError, match="hc_eps"):
        _core._Engine(d, 1)
