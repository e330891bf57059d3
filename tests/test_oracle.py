"""The oracle's own invariances and errors: chunked prefill = decode, bit for bit; clean errors."""
from __future__ import annotations

import numpy as np
import pytest

import oracle
from oracle.capture import Capture
from tools.golden import canonical_prompts
from oracle.model import PromptError

RELEASES = ("bf16", "fp8", "mxfp4")


@pytest.fixture(scope="module", params=RELEASES)
def tiny(request, golden_dir):
    return oracle.load(golden_dir / f"tiny-{request.param}")


def run_schedule(model, ids, chunks):
    """Prefill `ids` in the given chunk sizes (cycled); capture every stage -> (logits, capture)."""
    cache, cap, logits, i, k = model.new_cache(), Capture(keep_values=False), [], 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)]
        logits.append(model.forward(ids[i:i + n], cache, cap))
        i, k = i + n, k + 1
    return np.concatenate(logits), cap


def test_chunked_prefill_and_decode_are_bit_identical(tiny):
    ids, _ = canonical_prompts(tiny.config.vocab_size)["long"]
    ref_logits, ref = run_schedule(tiny, ids, [len(ids)])
    for chunks in ([1], [3], [64], [5, 1, 7]):
        logits, cap = run_schedule(tiny, ids, chunks)
        assert np.array_equal(logits.view(np.uint32), ref_logits.view(np.uint32)), f"logits differ for chunks {chunks}"
        diff = [k for k in ref.hashes if ref.hashes[k] != cap.hashes.get(k)]
        assert not diff, f"chunks {chunks}: first differing (layer, stage, pos) {sorted(diff)[:3]}"
        assert len(cap.hashes) == len(ref.hashes)


def test_every_stage_is_captured(tiny):
    from oracle.stages import model_stages
    ids = [3, 1, 4, 1, 5]
    cap = Capture(keep_values=True)
    tiny.forward(ids, capture=cap)
    expected = {(l, s) for l, s, _ in model_stages(tiny.config)}
    assert set(cap.values) == expected
    for (l, s), rows in cap.values.items():
        assert sorted(rows) == list(range(len(ids))), (l, s)


def test_indexer_selects_on_the_long_prompt(tiny):
    ids, _ = canonical_prompts(tiny.config.vocab_size)["long"]
    cap = Capture(stages={"mla.selected"})
    tiny.forward(ids, capture=cap)
    layer = tiny.config.mla_layers[0]
    last = cap.get(layer, "mla.selected", len(ids) - 1)
    assert len(last) < len(ids) and len(last) >= tiny.config.index_topk
    early = cap.get(layer, "mla.selected", tiny.config.index_topk - 1)
    assert list(early) == list(range(tiny.config.index_topk))        # dense while everything fits


def test_greedy_ties_go_to_the_lowest_id():
    from oracle.model import greedy
    assert greedy(np.array([0.5, 2.0, 2.0, -1.0], np.float32)) == 1


@pytest.mark.parametrize("ids, message", [
    ([1, 2, 300], "outside the vocabulary"),
    ([-1], "outside the vocabulary"),
    ([], "non-empty"),
    ([[1, 2]], "1-D"),
])
def test_bad_prompts_give_one_clear_error(golden_dir, ids, message):
    model = oracle.load(golden_dir / "tiny-bf16")
    with pytest.raises(PromptError, match=message):
        model.forward(ids)


def test_context_overflow_is_refused(golden_dir):
    model = oracle.load(golden_dir / "tiny-bf16")
    cache = model.new_cache()
    cache.length = model.max_context - 1
    with pytest.raises(PromptError, match="maximum context"):
        model.forward([1, 2], cache)


def test_float64_mode_is_close_to_canonical_before_routing(golden_dir):
    """Before the first router, canonical and float64 differ by the cost of BF16 only (~1e-2).

    After it, a routing flip at one position changes that position's output by O(1); the numbers
    for the whole model are reported in docs/oracle.md.
    """
    ids, _ = canonical_prompts(300)["mixed"]
    ca, cb = Capture(stages={"attn_hc.streams"}, layers={0}), Capture(stages={"attn_hc.streams"}, layers={0})
    oracle.load(golden_dir / "tiny-bf16").forward(ids, capture=ca)
    oracle.load(golden_dir / "tiny-bf16", precision="float64").forward(ids, capture=cb)
    a = np.stack([ca.get(0, "attn_hc.streams", t) for t in range(len(ids))])
    b = np.stack([cb.get(0, "attn_hc.streams", t) for t in range(len(ids))])
    assert a.dtype == np.float32 and b.dtype == np.float64
    rel = np.max(np.abs(a - b)) / np.max(np.abs(b))
    assert 0 < rel < 0.02, rel


def test_fork_gives_independent_branches(golden_dir):
    """Two continuations of one forked prefix equal two runs from scratch, bit for bit, whichever runs first."""
    model = oracle.load(golden_dir / "tiny-bf16")
    prefix, a, b = [5, 17, 42, 7], [9, 100], [250]
    cache = model.new_cache()
    model.forward(prefix, cache)
    branch = cache.fork()
    got_b = model.forward(b, branch)
    got_a = model.forward(a, cache)
    want_a = model.forward(prefix + a)[len(prefix):]
    want_b = model.forward(prefix + b)[len(prefix):]
    assert np.array_equal(got_a.view(np.uint32), want_a.view(np.uint32))
    assert np.array_equal(got_b.view(np.uint32), want_b.view(np.uint32))
    assert (cache.length, branch.length) == (len(prefix) + len(a), len(prefix) + len(b))
    assert cache.copy is not None and type(cache.copy()) is type(cache)


def test_cache_repr_names_model_layers_and_positions(golden_dir):
    model = oracle.load(golden_dir / "tiny-bf16")
    cache = model.new_cache()
    model.forward([1, 2, 3], cache)
    r = repr(cache)
    c = model.config
    kinds = "".join("K" if c.is_kda(l) else "M" for l in range(c.num_hidden_layers))
    assert "tiny-bf16" in r and "positions=3" in r and f"layers={c.num_hidden_layers} ({kinds})" in r
    assert "positions=3" in repr(cache.layers[c.mla_layers[0]])


def test_a_cache_of_another_model_is_refused(golden_dir):
    bf16 = oracle.load(golden_dir / "tiny-bf16")
    cache = bf16.new_cache()
    bf16.forward([1, 2], cache)
    oracle.load(golden_dir / "tiny-bf16").forward([3], cache)   # the same checkpoint loaded again is the same model
    assert cache.length == 3
    for other, what in ((oracle.load(golden_dir / "tiny-fp8"), "tiny-fp8"),
                        (oracle.load(golden_dir / "tiny-bf16", precision="float64"), "float64")):
        with pytest.raises(ValueError, match=f"cache of another model.*{what}"):
            other.forward([4], cache)
    assert cache.length == 3
    with pytest.raises(TypeError, match="new_cache"):
        bf16.forward([4], object())


def test_a_cache_of_another_config_names_the_fields(golden_dir):
    from oracle.model import _cache_mismatch, _owner
    model = oracle.load(golden_dir / "tiny-bf16")
    path, precision, config = _owner(model)
    why = _cache_mismatch((path, precision, config.replace(n_group=1)), _owner(model))
    assert why is not None and "n_group: cache 1, model 2" in why
