"""Expert parallelism on the CPU engine, its own parts (fast/distributed.py, bindings/cpu/ep.*;
docs/ep.md): threads inside a rank; the memory plan accounts every byte and refuses what does not fit
before anything is allocated; bad expert ranges and rank counts are refused; torch is needed only for
ranks > 1; the launcher runs the same command as N ranks, every rank's capture equal to one process's.

That 1, 2 and 3 CPU ranks are bit-identical to the single-process engine (tiny and small in every
release, even and uneven expert ranges, one rank owning no expert, prefill in chunks and decode,
batching, fault injection, config corners; each rank reading only its own experts) is
tests/test_engines.py's cpu-ranks side, over the rank cases of tests/cases.py.
Ranks > 1 run in driver mode (this process is rank 0, workers are spawned once per rank count and
reused) with verify_ranks=True: after every step each rank's digest of its logits and captured rows is
compared with rank 0's.
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
from tests.cases import RANK_CASES, TINY
from tests.engine_checks import NO_GLOO, bits, have_gloo, prompt

needs_torch = pytest.mark.skipif(not have_gloo(), reason=NO_GLOO)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def _stop_workers():
    yield
    D.shutdown()


@needs_torch
def test_ep_threads_within_rank(ckpt_path, cpu_runs):
    """Two threads per rank splitting every job (parallel_work=0) change nothing either."""
    case = next(rc.case for rc in RANK_CASES if rc.ranks == 3 and rc.checkpoint == "small-mxfp4")
    ids, toks, logits, want = cpu_runs(case)
    eng = fast.Engine(ckpt_path(case[0]), ranks=3, threads=2, parallel_work=0, verify_ranks=True)
    cap = Capture(keep_values=False)
    got_toks, got_logits = eng.generate(ids, len(toks), capture=cap, return_logits=True)
    assert got_toks == toks and np.array_equal(bits(got_logits), bits(logits))
    assert cap.hashes == want.hashes


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
