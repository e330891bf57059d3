"""`oracle serve --prefix-cache-mb`: a request that resumes from a cached snapshot of its prompt's
prefix gets the bits of a cold run (token ids, logprob bits, output_hash, logprobs_hash), for shared
prefixes of lengths that are multiples of nothing, snapshots at block boundaries that fall inside an
indexer pool (block 5 against tiny's index_kpool 4) or on one (block 16), prefill chunks of any size
before and after the restore, greedy and seeded, on tiny-fp8, tiny-bf16 and tiny-mxfp4 (KDA and MLA
layers, the indexer selecting: prompts longer than index_topk); under concurrent traffic (against a
cold server with the cache off) and under a budget so small that snapshots are evicted all the time.
"""
from __future__ import annotations

import argparse
import itertools
import random
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fast._core")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from oracle.sampling import SamplingParams, sample_loop
from tests.serving import engine_spec, metric, start_server, stop_server
from tools.serve import add_arguments, build_server
from tools.serve.app import _hash12
from tools.serve.prefix import cache_bytes

ENGINE = engine_spec(4096)   # GLM_SERVE_ENGINE (tests/serving.py); the references stay CPU engines
SHARED = [1, 7, 13, 17, 31, 33, 40]   # shared prefix lengths

# every prompt of this module starts with its own token (the servers live for the whole module): a
# prompt shares a prefix only with the prompts a test built to share one
_first = itertools.count(1)


def _start(golden_dir, model, *extra):
    return start_server(golden_dir / model, ENGINE, *extra)


_stop = stop_server
_metric = metric


@pytest.fixture(scope="module")
def servers(golden_dir):
    """(model, block) -> (Server, url), started on first use."""
    live = {}

    def get(model, block, *extra):
        key = (model, block, extra)
        if key not in live:
            live[key] = _start(golden_dir, model, "--prefix-cache-mb", "64", "--prefix-block", str(block), *extra)
        srv, _, url = live[key]
        return srv, url
    yield get
    for srv, uv, _ in live.values():
        _stop(srv, uv)


@pytest.fixture(scope="module")
def reference(golden_dir):
    """(model, ids, n, params) -> (tokens, logprobs): the batch-1 loop on an engine of its own."""
    import fast
    engines, memo = {}, {}

    def ref(model, ids, n, params):
        if model not in engines:
            engines[model] = fast.Engine(str(golden_dir / model), threads=1)
        key = (model, tuple(ids), n, params)
        if key not in memo:
            memo[key] = sample_loop(engines[model], ids, n, params)
        return memo[key]
    yield ref
    for e in engines.values():
        e.close()


def _bits(lps) -> list[int]:
    return np.array(lps, np.float32).view(np.uint32).tolist()


def _body(model, ids, i):
    """Greedy for even i, seeded sampling for odd i."""
    b = {"model": model, "prompt": list(ids), "max_tokens": 5, "logprobs": 0}
    return dict(b, temperature=0) if i % 2 == 0 else dict(b, temperature=0.9, top_k=50, seed=1000 + i)


def _ask(client, body) -> dict:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return {"token_ids": c["token_ids"], "logprobs": _bits(c["logprobs"]["token_logprobs"]),
            "output_hash": c["output_hash"], "logprobs_hash": c["logprobs_hash"]}


def _expected(model, body, reference) -> dict:
    params = SamplingParams(float(body["temperature"]), int(body.get("top_k") or 0), 1.0, int(body.get("seed", 0)))
    tokens, lps = reference(model, body["prompt"], body["max_tokens"], params)
    return {"token_ids": tokens, "logprobs": _bits(lps), "output_hash": _hash12(np.array(tokens), "<i4"),
            "logprobs_hash": _hash12(np.array(lps, np.float32), "<f4")}


def _snapshot_depths(total, block, chunk):
    """Where a lone request's prefill (chunks of `chunk` tokens, cut at the last block boundary in
    each) leaves snapshots: the scheduler's policy, written out independently."""
    fed, out = 0, set()
    while fed < total:
        end = min(fed + chunk, total)
        if end // block * block > fed:
            end = end // block * block
            out.add(end)
        fed = end
    return out


def _prompt(rng, n):
    return [next(_first)] + [rng.randrange(300) for _ in range(n - 1)]


@pytest.mark.parametrize("model", ["tiny-fp8", "tiny-bf16", "tiny-mxfp4"])
@pytest.mark.parametrize("block", [5, 16])
@pytest.mark.parametrize("chunks", [(3, 64), (64, 7), (16, 1)])
def test_a_restored_prefix_gives_the_bits_of_a_cold_run(servers, reference, model, block, chunks):
    srv, url = servers(model, block)
    before, after = chunks
    rng = random.Random(repr((model, block, chunks)))   # (str seeds are stable across processes)
    with httpx.Client(base_url=url, timeout=120) as c:
        for i, P in enumerate(SHARED):
            shared = _prompt(rng, P)
            a0, b0 = rng.sample(range(300), 2)   # the suffixes differ at their first token
            warm = shared + [a0] + [rng.randrange(300) for _ in range(8 + P % 5)]
            probe = shared + [b0] + [rng.randrange(300) for _ in range(11 + P % 7)]
            srv.scheduler.max_step_tokens = before   # (read by the scheduler at every step)
            w = _body(model, warm, i)
            assert _ask(c, w) == _expected(model, w, reference)
            srv.scheduler.max_step_tokens = after
            saved0, hits0 = _metric(c, "glm_prefix_cache_saved_tokens_total"), _metric(c, "glm_prefix_cache_hits_total")
            b = _body(model, probe, i + 1)
            assert _ask(c, b) == _expected(model, b, reference), (P, block, chunks)
            # it resumed where it should have: the deepest snapshot the warm prompt left within the shared part
            depth = max([d for d in _snapshot_depths(len(warm), block, before) if d <= P] + [0])
            assert _metric(c, "glm_prefix_cache_saved_tokens_total") - saved0 == depth
            assert _metric(c, "glm_prefix_cache_hits_total") - hits0 == int(depth > 0)


def test_the_same_prompt_again_resumes_below_its_end_and_gives_the_same_bits(servers, reference):
    srv, url = servers("tiny-fp8", 5)
    srv.scheduler.max_step_tokens = 4
    rng = random.Random(7)
    with httpx.Client(base_url=url, timeout=120) as c:
        for n in (20, 21, 24):   # a multiple of the block, one more, one less
            body = _body("tiny-fp8", _prompt(rng, n), 1)
            first = _ask(c, body)
            saved0 = _metric(c, "glm_prefix_cache_saved_tokens_total")
            assert _ask(c, body) == first == _expected("tiny-fp8", body, reference)
            # the last prompt token always runs (it gives the first token's logits)
            assert _metric(c, "glm_prefix_cache_saved_tokens_total") - saved0 == (n - 1) // 5 * 5


def test_the_next_turn_resumes_after_the_previous_answer(servers, reference):
    """A conversation's turn k+1 prompt = turn k's prompt + its answer + a new message: it resumes from the
    snapshot at the last block boundary of the answer's tokens, with the bits of a cold run."""
    block = 5
    srv, url = servers("tiny-fp8", block)
    srv.scheduler.max_step_tokens = 6
    rng = random.Random(3)
    ids = _prompt(rng, 19)
    previous = None   # where turn k+1 should resume: computed from turn k's prompt and answer
    with httpx.Client(base_url=url, timeout=120) as c:
        for turn, gen in enumerate((9, 12, 1, 7)):
            body = dict(_body("tiny-fp8", ids, turn), max_tokens=gen)
            saved0 = _metric(c, "glm_prefix_cache_saved_tokens_total")
            got = _ask(c, body)
            assert got == _expected("tiny-fp8", body, reference), turn
            if previous is not None:   # the previous answer's deepest fed block boundary (its last token is not fed)
                assert _metric(c, "glm_prefix_cache_saved_tokens_total") - saved0 == previous
            P, G = len(ids), len(got["token_ids"])
            depths = [d for d in _snapshot_depths(P, block, 6)] + [(P + G - 1) // block * block]
            ids = ids + got["token_ids"] + [rng.randrange(300) for _ in range(1 + turn)]
            previous = max(d for d in depths if d <= len(ids) - 1)


def test_a_shared_system_prompt_is_snapshotted_where_the_prompts_part(servers, reference):
    """Big chunks snapshot only at their last block boundary; a prompt that shares a prefix with an
    earlier one (whose snapshot lies deeper) stops a chunk where the trie says they part, so the third
    prompt with that system prompt resumes there."""
    block = 5
    srv, url = servers("tiny-fp8", block)
    srv.scheduler.max_step_tokens = 64
    rng = random.Random(4)
    system = _prompt(rng, 23)
    users = rng.sample(range(300), 3)   # the user messages differ at their first token
    with httpx.Client(base_url=url, timeout=120) as c:
        for i, expect in enumerate((0, 0, 23 // block * block)):
            body = _body("tiny-fp8", system + [users[i]] + [rng.randrange(300) for _ in range(19)], i)
            saved0 = _metric(c, "glm_prefix_cache_saved_tokens_total")
            assert _ask(c, body) == _expected("tiny-fp8", body, reference)
            assert _metric(c, "glm_prefix_cache_saved_tokens_total") - saved0 == expect, i


def _traffic(seed):
    """24 requests over three shared system prefixes (lengths 23, 37, 45) with user suffixes of 1..15."""
    rng = random.Random(seed)
    systems = [_prompt(rng, n) for n in (23, 37, 45)]
    out = []
    for i in range(24):
        ids = rng.choice(systems) + [rng.randrange(300) for _ in range(rng.randint(1, 15))]
        b = _body("tiny-fp8", ids, i)
        out.append(dict(b, max_tokens=rng.randint(1, 10)))
    return out


def _abandon(url, bodies, errors):
    """Streamed requests whose clients leave after the first chunk (their sequences are cancelled)."""
    with httpx.Client(base_url=url, timeout=120) as c:
        for b in bodies:
            try:
                with c.stream("POST", "/v1/completions", json=dict(b, stream=True, max_tokens=20)) as r:
                    next(r.iter_lines())
            except Exception as e:  # noqa: BLE001 - reported by the test
                errors.append(repr(e))


def _fire(url, bodies, threads, abandoned=()):
    results, errors = [None] * len(bodies), []

    def worker(k):
        with httpx.Client(base_url=url, timeout=120) as c:
            for j in range(k, len(bodies), threads):
                try:
                    results[j] = _ask(c, bodies[j])
                except Exception as e:  # noqa: BLE001 - reported by the test
                    errors.append(repr(e))
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    ts.append(threading.Thread(target=_abandon, args=(url, abandoned, errors)))
    for t in ts:
        t.start()
    for t in ts:
        t.join(180)
    assert not errors, errors[:3]
    return results


def test_concurrent_traffic_with_the_cache_equals_a_cold_server_without_it(golden_dir, servers):
    srv, url = servers("tiny-fp8", 4, "--max-step-tokens", "16")
    bodies = _traffic(11)
    with httpx.Client(base_url=url, timeout=60) as c:
        hits0 = _metric(c, "glm_prefix_cache_hits_total")
        saved0 = _metric(c, "glm_prefix_cache_saved_tokens_total")
    # and clients that leave mid-answer, with the same system prompts (their snapshots stay usable)
    cached = _fire(url, bodies, 6, abandoned=_traffic(11)[:8])
    cold_srv, cold_uv, cold_url = _start(golden_dir, "tiny-fp8", "--max-step-tokens", "16")
    try:
        with httpx.Client(base_url=cold_url, timeout=60) as c:
            assert "glm_prefix_cache" not in c.get("/metrics").text   # off: no prefix metrics
        cold = _fire(cold_url, bodies, 6)
    finally:
        _stop(cold_srv, cold_uv)
    for i, (a, b) in enumerate(zip(cached, cold)):
        assert a == b, i
    with httpx.Client(base_url=url, timeout=60) as c:
        assert _metric(c, "glm_prefix_cache_hits_total") > hits0
        assert _metric(c, "glm_prefix_cache_saved_tokens_total") > saved0
    # once the abandoned sequences are gone, no request pins a node any more (a sequence's pin is
    # released as it leaves, just after the load drops: poll)
    deadline, pinned = time.monotonic() + 20, None
    while time.monotonic() < deadline:
        try:
            pinned = srv.scheduler.load != (0, 0) or any(n.pins for n in srv.prefix._nodes())
        except RuntimeError:   # the scheduler thread pruned the trie while this one walked it
            continue
        if not pinned:
            break
        time.sleep(0.01)
    assert pinned is False


def test_a_tiny_budget_evicts_and_changes_no_bits(golden_dir, reference):
    import fast
    cfg = fast.Engine(str(golden_dir / "tiny-fp8"), threads=1).config
    budget = int(3 * cache_bytes(cfg, 40))   # room for about three snapshots of 40 positions
    srv, uv, url = _start(golden_dir, "tiny-fp8", "--prefix-cache-mb", repr(budget / (1 << 20)),
                          "--prefix-block", "8", "--max-step-tokens", "8")
    try:
        rng = random.Random(5)
        shared = [_prompt(rng, 41) for _ in range(4)]
        with httpx.Client(base_url=url, timeout=120) as c:
            assert _metric(c, "glm_prefix_cache_budget_bytes") == budget
            for round_ in range(2):
                for k, s in enumerate(shared):
                    for j in range(2):
                        b = _body("tiny-fp8", s + [rng.randrange(300) for _ in range(3 + j)], k + j + round_)
                        assert _ask(c, b) == _expected("tiny-fp8", b, reference)
                        assert 0 < srv.prefix.bytes <= budget
            assert _metric(c, "glm_prefix_cache_evictions_total") > 0
            assert _metric(c, "glm_prefix_cache_hits_total") > 0
            assert _metric(c, "glm_prefix_cache_bytes") == srv.prefix.bytes <= budget
            # every snapshot held is a whole block multiple, and the tree keeps no empty branch
            nodes = list(srv.prefix._nodes())
            assert all(n.depth % 8 == 0 for n in nodes)
            assert all(n.snapshot is not None or n.children or n.pins or n.parent is None for n in nodes)
            assert all(n.pins == 0 for n in nodes)   # nobody is in prefill: every pin was released
    finally:
        _stop(srv, uv)


def test_bad_prefix_options_are_refused(golden_dir):
    p = argparse.ArgumentParser()
    add_arguments(p)
    for opt, v in (("--prefix-block", "0"), ("--prefix-cache-mb", "-1")):
        args = p.parse_args(["--checkpoint", str(golden_dir / "tiny-fp8"), "--engine", ENGINE, opt, v])
        with pytest.raises(ValueError, match=opt):
            build_server(args)


def test_prefix_lengths_up_to_200_with_random_chunking(servers, reference):
    """Shared prefixes of 1..200 tokens (every third length, block 7: snapshots at 7k, across index
    pools of 4 and the indexer's top-k), each request prefilled in chunks of a size drawn at random."""
    block = 7
    srv, url = servers("tiny-fp8", block)
    rng = random.Random(200)
    with httpx.Client(base_url=url, timeout=120) as c:
        for i, P in enumerate(range(1, 201, 3)):
            shared = _prompt(rng, P)
            a0, b0 = rng.sample(range(300), 2)
            chunk = rng.choice([1, 2, 3, 5, 8, 13, 64, 512])
            srv.scheduler.max_step_tokens = chunk
            warm = shared + [a0] + [rng.randrange(300) for _ in range(rng.randint(0, 9))]
            w = dict(_body("tiny-fp8", warm, i), max_tokens=2)
            assert _ask(c, w) == _expected("tiny-fp8", w, reference), P
            srv.scheduler.max_step_tokens = rng.choice([1, 2, 3, 5, 8, 13, 64, 512])
            probe = dict(_body("tiny-fp8", shared + [b0] + [rng.randrange(300) for _ in range(rng.randint(0, 9))],
                               i + 1), max_tokens=2)
            saved0 = _metric(c, "glm_prefix_cache_saved_tokens_total")
            assert _ask(c, probe) == _expected("tiny-fp8", probe, reference), P
            depth = max([d for d in _snapshot_depths(len(warm), block, chunk) if d <= P] + [0])
            assert _metric(c, "glm_prefix_cache_saved_tokens_total") - saved0 == depth, P


def test_eviction_drops_the_least_recently_used_and_pins_keep_a_path(golden_dir):
    """The cache on its own, on an engine: snapshots of three prompts, one restored from; a fourth
    that does not fit with them evicts the least recently used of the others."""
    import fast
    from tools.serve.prefix import PrefixCache
    with fast.Engine(str(golden_dir / "tiny-fp8"), threads=1) as eng:
        B = 4
        pc = PrefixCache(eng, 3 * cache_bytes(eng.config, 8) + 1, B)
        prompts = [[k + 1] * 9 for k in range(4)]
        pinned = []

        def prefill(ids):
            cache, node, _ = pc.restore(ids)
            cache = cache or eng.new_cache()
            eng.step([(cache, ids[cache.length:8], None, None)])
            node = pc.insert(node, ids, cache)
            cache.close()
            return node
        for ids in prompts[:3]:
            pinned.append(prefill(ids))
        assert pc.entries == 3 and pc.evictions == 0
        cache, node, _ = pc.restore(prompts[0])   # prompt 0 is used again: prompt 1 is now the oldest
        assert cache.length == 8
        cache.close()
        pc.unpin(node)
        pinned.append(prefill(prompts[3]))
        assert pc.evictions == 1 and pc.entries == 3 and pc.bytes <= pc.budget
        held = {n.key for n in pc._nodes() if n.snapshot is not None}
        assert held == {(k + 1,) * B for k in (0, 2, 3)}
        # prompt 1's snapshot is gone, but the request that made it still pins its node: the path stays
        assert pinned[1].snapshot is None and pc.root.children[(2,) * B].children[(2,) * B] is pinned[1]
        pc.unpin(pinned[1])
        assert (2,) * B not in pc.root.children
        for n in pinned[:1] + pinned[2:]:
            pc.unpin(n)
        assert all(n.pins == 0 for n in pc._nodes())
        pc.clear()


def test_the_load_generator_with_a_shared_prefix_and_the_cache(golden_dir):
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "tools.serve", "bench", "--checkpoint", str(golden_dir / "tiny-fp8"),
                        "--engine", engine_spec(), "--concurrency", "2", "--requests", "4", "--prompt", "4",
                        "--new", "3", "--shared-prefix", "21", "--prefix-cache-mb", "1", "--json"],
                       cwd=root, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["shared_prefix"] == 21 and out["prefix_cache_mb"] == 1
    assert [x["same_tokens_as_offline"] for x in out["levels"]] == [True]
    # the 21 shared tokens hold one block of 16: every request after the first resumes there
    assert out["prefix_saved_tokens"] > 0


def test_a_snapshot_that_cannot_be_made_is_skipped(golden_dir):
    """A fork that fails (out of memory) leaves no snapshot and no trace in the trie; the request goes on."""
    import fast
    from tools.serve.prefix import PrefixCache

    class NoFork:
        length = 8

        def fork(self):
            raise MemoryError("no room for a fork")
    with fast.Engine(str(golden_dir / "tiny-fp8"), threads=1) as eng:
        pc = PrefixCache(eng, 1 << 20, 4)
        _, node, _ = pc.restore([1] * 9)
        node = pc.insert(node, [1] * 9, NoFork())
        assert node.depth == 8 and node.snapshot is None and pc.entries == 0 and pc.bytes == 0
        pc.unpin(node)
        assert not pc.root.children
