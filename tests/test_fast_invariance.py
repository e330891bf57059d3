"""The CPU engine's results do not depend on how the work is scheduled: batch size, requests joining
and leaving mid-run (continuous batching), prefill chunk size, thread count, prefix reuse (forked
caches). Property tests over random prompts and schedules; every comparison is on bits (stage
traces: sha256 per (layer, stage, position) row; logits: uint32 view), never a tolerance.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fast
from oracle.capture import Capture
from tests.cases import INVARIANCE_CHECKPOINT, INVARIANCE_CHUNKS, MAX_BATCHES, TINY

CKPT = INVARIANCE_CHECKPOINT
VOCAB = 300  # tiny's vocabulary


@pytest.fixture(scope="module")
def engine1(golden_dir):
    return fast.Engine(str(golden_dir / CKPT), threads=1)


@pytest.fixture(scope="module")
def engine2(golden_dir):
    # parallel_work=0: every job is split over both threads, even on this tiny model
    return fast.Engine(str(golden_dir / CKPT), threads=2, parallel_work=0)


@pytest.fixture(scope="module")
def reference(engine1):
    """(prompt, new) -> (tokens, logits bits, trace) of the request run alone, one chunk, one thread."""
    cache = {}

    def get(prompt: tuple, new: int):
        key = (prompt, new)
        if key not in cache:
            cap = Capture(keep_values=False)
            toks, logits = engine1.generate(list(prompt), new, capture=cap, return_logits=True)
            cache[key] = (toks, logits.view(np.uint32).copy(), cap.hashes)
        return cache[key]
    return get


prompts_st = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=45), min_size=1, max_size=8)


def check_against_reference(reference, prompts, new, outs, logits, caps):
    for p, out, lg, cap in zip(prompts, outs, logits, caps):
        toks, ref_bits, ref_trace = reference(tuple(p), new)
        assert out == toks
        assert np.array_equal(lg.view(np.uint32), ref_bits)
        assert cap.hashes == ref_trace


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=prompts_st, new=st.integers(1, 4), chunk=st.sampled_from((*INVARIANCE_CHUNKS, None)),
       max_batch=st.sampled_from(MAX_BATCHES), data=st.data())
def test_schedule_invariance(engine2, reference, prompts, new, chunk, max_batch, data):
    """batch 1 = batch 3 = batch 8 = unlimited, with requests arriving mid-run, any chunk size, 2 threads."""
    arrivals = data.draw(st.lists(st.integers(0, 6), min_size=len(prompts), max_size=len(prompts)))
    caps = [Capture(keep_values=False) for _ in prompts]
    outs, logits = engine2.generate(prompts, new, capture=caps, chunk=chunk, max_batch=max_batch,
                                    arrivals=arrivals, return_logits=True)
    check_against_reference(reference, prompts, new, outs, logits, caps)


@pytest.mark.parametrize("chunk", INVARIANCE_CHUNKS)
def test_prefill_chunk_sizes(engine1, engine2, chunk):
    """prefill in chunks of 1, 5, 64 = one chunk, stage by stage (threads 1 and 2)."""
    ids = [int(v) for v in np.random.default_rng(11).integers(0, VOCAB, 45)]
    want = Capture(keep_values=False)
    ref = engine1.prefill(ids, engine1.new_cache(), capture=want)
    for eng in (engine1, engine2):  # one thread; two threads splitting every job
        got = Capture(keep_values=False)
        out = eng.prefill(ids, eng.new_cache(), chunk=chunk, capture=got)
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
        assert got.hashes == want.hashes


@pytest.mark.parametrize("name", TINY)
def test_threads_and_batch_per_release(golden_dir, name):
    """Every release: threads 1 vs 2 and batch 1 vs 8 (mixed lengths) give the same bits."""
    path = str(golden_dir / name)
    e1, e2 = fast.Engine(path, threads=1), fast.Engine(path, threads=2, parallel_work=0)
    rng = np.random.default_rng(7)
    prompts = [[int(v) for v in rng.integers(0, VOCAB, n)] for n in (1, 3, 9, 17, 30, 40, 2, 12)]
    ref = []
    for p in prompts:
        cap = Capture(keep_values=False)
        toks, lg = e1.generate(p, 3, capture=cap, return_logits=True)
        ref.append((toks, lg, cap.hashes))
    caps = [Capture(keep_values=False) for _ in prompts]
    outs, lgs = e2.generate(prompts, 3, capture=caps, chunk=5, arrivals=[0, 0, 1, 1, 2, 3, 5, 8],
                            return_logits=True)
    for (toks, lg, trace), out, got_lg, cap in zip(ref, outs, lgs, caps):
        assert out == toks
        assert np.array_equal(got_lg.view(np.uint32), lg.view(np.uint32))
        assert cap.hashes == trace


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefix=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30),
       suffixes=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), min_size=1, max_size=3))
def test_prefix_reuse(engine2, prefix, suffixes):
    """A forked cache continued with a suffix = the whole prompt run from scratch (KDA state, latents, pools)."""
    base = engine2.new_cache()
    engine2.prefill(prefix, base)
    batch, reqs = [], []
    for suf in suffixes:
        c = base.fork()
        cap = Capture(keep_values=False)
        batch.append((c, suf, cap, "all"))
        reqs.append((suf, cap))
    outs = engine2.step(batch)  # all forks in one step
    for (suf, cap), lg in zip(reqs, outs):
        want = Capture(keep_values=False)
        full = engine2.forward(prefix + suf, engine2.new_cache(), want)
        assert np.array_equal(lg.view(np.uint32), full[len(prefix):].view(np.uint32))
        assert cap.hashes == {k: v for k, v in want.hashes.items() if k[2] >= len(prefix)}


def test_decode_batch_of_many(engine2, reference):
    """decode() of 8 sequences in one step = each alone."""
    rng = np.random.default_rng(3)
    prompts = [tuple(int(v) for v in rng.integers(0, VOCAB, n)) for n in (4, 8, 12, 16, 20, 24, 28, 41)]
    caches = [engine2.new_cache() for _ in prompts]
    firsts = []
    for c, p in zip(caches, prompts):
        firsts.append(int(np.argmax(engine2.prefill(list(p), c)[-1])))
    logits = engine2.decode(caches, firsts)
    for p, lg in zip(prompts, logits):
        toks, ref_bits, _ = reference(p, 2)
        assert toks[0] == firsts[prompts.index(p)]
        assert np.array_equal(lg.view(np.uint32), ref_bits[-1])
