"""Expert parallelism (fast/distributed.py, bindings/cpu/ep.*; docs/ep.md): 1, 2 and 3 CPU ranks give
bit-identical stages and logits to the single-process engine, on tiny (golden) and small (generated
here) in every release, with even and uneven expert ranges (one rank owning no expert, too), prefill
in chunks and decode, batching, fault injection; each rank reads only its own experts; the memory
plan refuses what does not fit before anything is allocated; the launcher runs the same command as
N ranks.

The reference is the single-process CPU engine (tests/test_fast_cpu.py holds it equal to the oracle).
Ranks > 1 run in driver mode (this process is rank 0, workers are spawned once per rank count and
reused: the cases are ordered by rank count) with verify_ranks=True: after every step each rank's
digest of its logits and captured rows is compared with rank 0's, so every rank's capture is checked.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import fast
from fast import distributed as D
from fast.engine import EngineInputError
from oracle.capture import Capture
from tests.engine_checks import bits, prompt

try:
    import torch.distributed as _dist
    HAVE_TORCH = _dist.is_available() and _dist.is_gloo_available()
except ImportError:  # pragma: no cover - torch is a test dependency
    HAVE_TORCH = False

needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch.distributed with gloo is not installed")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("tiny-bf16", "tiny-fp8", "tiny-mxfp4")
SMALL = ("small-bf16", "small-fp8", "small-mxfp4")

# (ranks, checkpoint, expert ranges or None for the even split). Ordered by rank count: the driver's
# worker processes are started once per count.
CASES = (
    [(1, n, None) for n in TINY + SMALL]
    + [(2, n, None) for n in ("tiny-bf16", "tiny-mxfp4", "small-bf16", "small-mxfp4")]
    + [(2, "tiny-fp8", [(0, 3), (3, 8)]), (2, "small-fp8", [(0, 11), (11, 16)])]
    + [(3, n, None) for n in ("tiny-fp8", "small-mxfp4", "small-fp8")]
    + [(3, "tiny-bf16", [(0, 0), (0, 5), (5, 8)]),  # rank 0 owns no expert
       (3, "tiny-mxfp4", [(0, 1), (1, 2), (2, 8)]), (3, "small-bf16", [(0, 2), (2, 3), (3, 16)])]
)
# (prompt length, new tokens, prefill chunk): tiny's 30 tokens make the indexer choose pools (index_topk 8)
SHAPE = {"tiny": (30, 4, 7), "small": (20, 3, 6)}


def case_id(c) -> str:
    return f"r{c[0]}-{c[1]}" + ("" if c[2] is None else "-" + "_".join(f"{a}:{b}" for a, b in c[2]))


@pytest.fixture(scope="session")
def reference(ckpt_path):
    """name -> (ids, tokens, logits, capture hashes) of the single-process engine's greedy generate."""
    cache = {}

    def get(name: str):
        if name not in cache:
            eng = fast.Engine(ckpt_path(name), threads=1)
            n, new, _ = SHAPE[name.split("-")[0]]
            ids = prompt(eng.config.vocab_size, n, 17)
            cap = Capture(keep_values=False)
            toks, logits = eng.generate(ids, new, capture=cap, return_logits=True)
            cache[name] = (ids, toks, logits, dict(cap.hashes))
        return cache[name]
    return get


@pytest.fixture(scope="module", autouse=True)
def _stop_workers():
    yield
    D.shutdown()


def first_difference(want: dict, got: dict) -> str | None:
    if set(want) != set(got):
        return f"captured rows differ: only single {sorted(set(want) - set(got))[:3]}, " \
               f"only EP {sorted(set(got) - set(want))[:3]}"
    bad = sorted((k[2], k[0], k[1]) for k in want if want[k] != got[k])
    return None if not bad else f"{len(bad)} rows differ, first (pos, layer, stage) {bad[0]}"


# ------------------------------------------------------------------------------------------------
# 1, 2, 3 ranks = one process, bit for bit


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ep_bit_identical(case, ckpt_path, reference):
    ranks, name, ranges = case
    if ranks > 1 and not HAVE_TORCH:
        pytest.skip("torch.distributed with gloo is not installed")
    ids, toks, logits, hashes = reference(name)
    _, new, chunk = SHAPE[name.split("-")[0]]
    eng = fast.Engine(ckpt_path(name), ranks=ranks, expert_ranges=ranges, threads=1, verify_ranks=True)
    assert eng.ranks == ranks
    E = eng.config.n_routed_experts
    want_ranges = ranges or D.even_ranges(E, ranks)
    assert eng.expert_ranges == [tuple(r) for r in want_ranges]

    # prefill in one chunk then decode (generate), every stage captured
    cap = Capture(keep_values=False)
    got_toks, got_logits = eng.generate(ids, new, capture=cap, return_logits=True)
    assert got_toks == toks
    assert np.array_equal(bits(got_logits), bits(logits))
    assert first_difference(hashes, cap.hashes) is None, first_difference(hashes, cap.hashes)

    # prefill in chunks, then decode token by token through the low-level API
    cap2 = Capture(keep_values=False)
    cache = eng.new_cache()
    outs = [eng.prefill(ids, cache, chunk=chunk, capture=cap2)]
    for t in toks[:-1]:
        outs.append(eng.decode([cache], [t], capture=cap2))
    assert np.array_equal(bits(np.concatenate(outs)), bits(logits))
    assert first_difference(hashes, cap2.hashes) is None, first_difference(hashes, cap2.hashes)

    # every rank read exactly its own routed experts (the engine's count and the loader's record)
    info = eng.ep_info()
    assert [i["rank"] for i in info] == list(range(ranks))
    for i, (a, b) in zip(info, want_ranges):
        assert tuple(i["experts"]) == (a, b)
        assert i["experts_read"] == list(range(a, b)), i
        assert i["experts_touched"] == list(range(a, b)), i
        assert i["verify_at_open"] is False
    stats = eng.ep_stats()
    assert len(stats) == ranks
    n_moe = sum(eng.config.is_moe(l) for l in range(eng.config.num_hidden_layers))
    for s in stats:
        assert s["exchanges"] == (0 if ranks == 1 else s["steps"] * n_moe)
        assert s.get("desync", []) == []


# ------------------------------------------------------------------------------------------------
# continuous batching, threads inside a rank, fault injection


@needs_torch
def test_ep_batched_generate(ckpt_path):
    name = "tiny-mxfp4"
    single = fast.Engine(ckpt_path(name), threads=1)
    eng = fast.Engine(ckpt_path(name), ranks=3, threads=1, verify_ranks=True)
    prompts = [prompt(300, n, s) for n, s in ((9, 1), (17, 2), (4, 3), (12, 4))]
    caps_a = [Capture(keep_values=False) for _ in prompts]
    caps_b = [Capture(keep_values=False) for _ in prompts]
    want = single.generate(prompts, 5, capture=caps_a, chunk=5, max_batch=3, arrivals=[0, 1, 1, 4])
    got = eng.generate(prompts, 5, capture=caps_b, chunk=5, max_batch=3, arrivals=[0, 1, 1, 4])
    assert got == want
    for a, b in zip(caps_a, caps_b):
        assert a.hashes == b.hashes


@needs_torch
@pytest.mark.parametrize("spec", ["2,7,moe.selected,1,-1", "1,6,moe.experts,100,1", "3,9,moe.weights,0,3"])
def test_ep_injection_equals_single(spec, ckpt_path):
    """A fault injected before, into or after the exchange propagates exactly as in one process."""
    name = "tiny-fp8"
    ids = prompt(300, 14, 5)
    single = fast.Engine(ckpt_path(name), threads=1, inject=spec)
    eng = fast.Engine(ckpt_path(name), ranks=3, threads=1, inject=spec, verify_ranks=True)
    a, b = Capture(keep_values=False), Capture(keep_values=False)
    la = single.prefill(ids, single.new_cache(), chunk=5, capture=a)
    lb = eng.prefill(ids, eng.new_cache(), chunk=5, capture=b)
    assert single.injected >= 1 and eng.injected == single.injected
    assert np.array_equal(bits(la), bits(lb))
    assert a.hashes == b.hashes


@needs_torch
def test_ep_threads_within_rank(ckpt_path, reference):
    """Two threads per rank splitting every job (parallel_work=0) change nothing either."""
    name = "small-mxfp4"
    ids, toks, logits, hashes = reference(name)
    eng = fast.Engine(ckpt_path(name), ranks=3, threads=2, parallel_work=0, verify_ranks=True)
    cap = Capture(keep_values=False)
    got_toks, got_logits = eng.generate(ids, len(toks), capture=cap, return_logits=True)
    assert got_toks == toks and np.array_equal(bits(got_logits), bits(logits))
    assert cap.hashes == hashes


# ------------------------------------------------------------------------------------------------
# memory plan, ranges, missing torch


def test_memory_plan_accounts_every_byte(ckpt_path):
    from oracle.checkpoint import open_checkpoint
    for name in TINY:
        ck = open_checkpoint(ckpt_path(name), verify=False)
        plans = D.memory_plans(ck, [(0, 3), (3, 5), (5, 8)], context=64)
        stored = ck.release_summary()["bytes"]
        assert plans[0].replicated + plans[0].all_experts == stored
        assert sum(p.own_experts for p in plans) == plans[0].all_experts
        assert all(p.replicated == plans[0].replicated and p.derived == plans[0].derived for p in plans)
        assert all(p.total == p.weights + p.caches + p.workspace for p in plans)
        text = D.format_plans(plans)
        assert "rank" in text and "[3, 5)" in text and str(plans[1].total) in text
        # no value was read to make the plan
        assert not any(s.scanned for s in ck._slots.values())


def test_memory_plan_refuses_before_allocating(ckpt_path, monkeypatch):
    from fast import engine as fe
    from oracle.checkpoint import Checkpoint

    def no(*a, **k):
        raise AssertionError("allocated or read before the plan refused")
    monkeypatch.setattr(Checkpoint, "raw", no)
    monkeypatch.setattr(fe, "_core", lambda: types.SimpleNamespace(_Engine=no))
    monkeypatch.setattr(D, "_cluster", no)
    with pytest.raises(EngineInputError, match=r"memory plan: rank \d .* more than memory_limit=100000 bytes"):
        fast.Engine(ckpt_path("tiny-bf16"), ranks=2, memory_limit=100_000)
    with pytest.raises(EngineInputError, match="memory plan"):
        fast.Engine(ckpt_path("tiny-bf16"), ranks=1, memory_limit=100_000, max_context=16)


def test_memory_plan_fits(ckpt_path, capsys):
    eng = fast.Engine(ckpt_path("tiny-fp8"), ranks=1, memory_limit=64 << 20, max_context=256, threads=1)
    plan = eng.memory_plan
    assert len(plan) == 1 and plan[0].fits and plan[0].limit == 64 << 20 and plan[0].context == 256
    err = capsys.readouterr().err
    assert "memory plan: 1 rank(s) on cpu" in err and str(plan[0].total) in err


@pytest.mark.parametrize("ranges,ranks,msg", [
    ([(0, 3), (4, 8)], 2, "contiguous"),
    ([(0, 3), (3, 7)], 2, "cover"),
    ([(0, 8)], 2, "one .* per rank"),
    ([(0, 5), (5, 3), (3, 8)], 3, "reversed"),
    ([(0, 1.5), (1.5, 8)], 2, "integer"),
    ("0-4,4-8", 2, "pairs"),
])
def test_bad_expert_ranges(ranges, ranks, msg, ckpt_path):
    with pytest.raises(EngineInputError, match=msg):
        fast.Engine(ckpt_path("tiny-bf16"), ranks=ranks, expert_ranges=ranges)


def test_bad_ranks_and_limit(ckpt_path):
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(EngineInputError, match="ranks"):
            fast.Engine(ckpt_path("tiny-bf16"), ranks=bad)
    with pytest.raises(EngineInputError, match="memory_limit"):
        fast.Engine(ckpt_path("tiny-bf16"), ranks=1, memory_limit=-5)


def test_without_torch(ckpt_path, monkeypatch):
    """torch is imported only for ranks > 1, with a clear message when it is missing."""
    for mod in ("torch", "torch.distributed"):
        monkeypatch.setitem(sys.modules, mod, None)
    eng = fast.Engine(ckpt_path("tiny-bf16"), ranks=1, threads=1)  # one rank needs no torch
    assert eng.generate([1, 2, 3], 2) == fast.Engine(ckpt_path("tiny-bf16"), threads=1).generate([1, 2, 3], 2)
    with pytest.raises(ImportError, match=r"ranks > 1\) needs torch"):
        fast.Engine(ckpt_path("tiny-bf16"), ranks=2)


# ------------------------------------------------------------------------------------------------
# the launcher (SPMD: every rank runs the same command)


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]), GLM_EP_QUIET="1")


@needs_torch
def test_launch_oracle_run(ckpt_path):
    args = ["run", "--checkpoint", ckpt_path("tiny-fp8"), "--ids", "5,6,7,8,9,10,11", "--max-new", "5",
            "--engine", "cpu", "--json"]
    single = subprocess.run([sys.executable, "-m", "tools", *args], capture_output=True, text=True, env=_env(),
                            cwd=REPO, timeout=120)
    assert single.returncode == 0, single.stderr
    ep = subprocess.run([sys.executable, "-m", "fast.launch", "--ranks", "2", "--", "oracle", *args],
                        capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120)
    assert ep.returncode == 0, ep.stderr
    a, b = json.loads(single.stdout), json.loads(ep.stdout)  # only rank 0 prints
    assert (a["tokens"], a["output_hash"], a["logits_hash"]) == (b["tokens"], b["output_hash"], b["logits_hash"])


_RANK_SCRIPT = r"""
import json, os, sys
import numpy as np
import fast
from oracle.capture import Capture
path, ids, out = sys.argv[1], [int(v) for v in sys.argv[2].split(",")], sys.argv[3]
eng = fast.Engine(path, threads=1, expert_ranges=[(0, 2), (2, 3), (3, 8)])  # ranks from the launcher
cap = Capture(keep_values=False)
toks, logits = eng.generate(ids, 4, capture=cap, return_logits=True)
info = eng.ep_info()                                  # collectives: every rank calls them
stats = eng.ep_stats()
json.dump({"rank": eng.rank, "ranks": eng.ranks, "tokens": toks,
           "logits": np.ascontiguousarray(logits).view(np.uint32).tolist(),
           "hashes": sorted([list(k) + [v] for k, v in cap.hashes.items()]), "info": info,
           "exchanges": [s["exchanges"] for s in stats]},
          open(os.path.join(out, f"rank{eng.rank}.json"), "w"))
"""


@needs_torch
def test_launch_every_rank_capture(ckpt_path, tmp_path):
    """Three ranks under the launcher: every rank's own capture equals the single-process one."""
    name = "tiny-mxfp4"
    ids = prompt(300, 19, 23)
    single = fast.Engine(ckpt_path(name), threads=1)
    cap = Capture(keep_values=False)
    toks, logits = single.generate(ids, 4, capture=cap, return_logits=True)
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    r = subprocess.run([sys.executable, "-m", "fast.launch", "--ranks", "3", "--", sys.executable, str(script),
                        ckpt_path(name), ",".join(map(str, ids)), str(tmp_path)],
                       capture_output=True, text=True, env=_env(), cwd=REPO, timeout=180)
    assert r.returncode == 0, r.stderr
    want_hashes = sorted([list(k) + [v] for k, v in cap.hashes.items()])
    for rank in range(3):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (got["rank"], got["ranks"]) == (rank, 3)
        assert got["tokens"] == toks
        assert np.array_equal(np.array(got["logits"], dtype=np.uint32), bits(logits))
        assert got["hashes"] == want_hashes, f"rank {rank}"
        assert [i["experts_read"] for i in got["info"]] == [[0, 1], [2], [3, 4, 5, 6, 7]]
        assert all(x > 0 for x in got["exchanges"])


@needs_torch
def test_launch_failure_stops_ranks(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)\n")
    r = subprocess.run([sys.executable, "-m", "fast.launch", "--ranks", "2", "--", sys.executable, str(script)],
                       capture_output=True, text=True, env=_env(), cwd=REPO, timeout=60)
    assert r.returncode == 3
    assert "rank 1 exited with code 3" in r.stderr
