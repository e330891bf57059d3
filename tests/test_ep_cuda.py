"""Expert parallelism on the CUDA engine, its own parts (docs/ep.md, "GPU"): another rank's expert is
refused at registration; the memory plan refuses what cannot fit before anything is allocated; under
python -m fast.launch every rank's capture, logits, tokens and device greedy loop equal the CPU
engine's. On `slice` (GLM_SLICE_DIR, real widths) two GPUs give the one-GPU logits.

That 1, 2 and 3 ranks, one GPU each (rows gathered through NCCL), are bit-identical to the
single-process CPU engine (every stage of every position, logits, tokens; prefill in one chunk or
several, decode, the device-resident greedy loop, batches, fault injection, config corners; each rank
reading only its own experts; one exchange per MoE layer per step) is tests/test_engines.py's
cuda-ranks side, over the rank cases of tests/cases.py.

Ranks run in driver mode (this process is rank 0 on GPU 0, workers on GPUs 1, 2, ...), with
verify_ranks=True: every rank's digest of each step is compared with rank 0's. Under the CPU
emulation (GLM_CUDA_EMU=1) every rank shares the emulated device and the rows go through gloo: the
partition, packing and unpacking are the same code. Skips without a CUDA build, without torch's gloo,
or with fewer GPUs than ranks.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import fast
from fast.cuda import CudaEngine, cuda_module
from fast.engine import EngineInputError
from oracle.capture import Capture
from tests.engine_checks import NO_CUDA, NO_GLOO, bits, cuda_state, greedy_case, have_gloo, prompt

AVAILABLE, EMU, DEVICES = cuda_state()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not AVAILABLE, reason=NO_CUDA),
              pytest.mark.skipif(not have_gloo(), reason=NO_GLOO)]


def test_another_ranks_expert_is_refused(ckpt_path):
    from fast.engine import _engine_config
    from oracle import names as N
    from oracle.checkpoint import open_checkpoint
    ck = open_checkpoint(ckpt_path("tiny-fp8"))
    cu = cuda_module()
    core = cu._Engine(_engine_config(ck.config, 4096), 1, "canonical", "canonical")
    E = ck.config.n_routed_experts
    core.set_expert_partition(0, 2, [0, E // 2, E])
    entry = next(e for e in N.expected(ck.config) if e.expert is not None and e.expert >= E // 2)
    raw = ck.raw(entry.spec.role, entry.layer, entry.expert)
    with pytest.raises(ValueError, match="belongs to another rank"):
        core.add_tensor(entry.spec.role, entry.layer, entry.expert, raw.release, np.ascontiguousarray(raw.data),
                        None if raw.scale is None else np.ascontiguousarray(raw.scale), list(raw.shape))
    with pytest.raises(ValueError, match="ranks must be in"):
        cu._Engine(_engine_config(ck.config, 4096), 1, "canonical", "canonical").set_expert_partition(0, 9, list(range(10)))


def test_memory_plan_refuses_before_allocating(ckpt_path, monkeypatch):
    cu = cuda_module()
    made = []
    real = cu._Engine
    monkeypatch.setattr(cu, "_Engine", lambda *a, **k: made.append(1) or real(*a, **k))
    with pytest.raises(EngineInputError, match=r"memory plan: rank 0 .* more than memory_limit=1000000 bytes"):
        CudaEngine(ckpt_path("tiny-fp8"), ranks=1, memory_limit=1_000_000)
    assert made == []


_RANK_SCRIPT = r"""
import json, os, sys
import numpy as np
import fast
from oracle.capture import Capture
path, ids, out = sys.argv[1], [int(v) for v in sys.argv[2].split(",")], sys.argv[3]
eng = fast.Engine(path, device="cuda")                # ranks and this rank's GPU from the launcher
cap = Capture(keep_values=False)
toks, logits = eng.generate(ids, 3, capture=cap, return_logits=True)
cache = eng.new_cache()
first = int(np.argmax(eng.prefill(ids, cache)[-1]))
greedy = [first] + eng.greedy(cache, first, 2)       # the device loop, every rank running it
info = eng.ep_info()                                  # collectives: every rank calls them
json.dump({"rank": eng.rank, "ranks": eng.ranks, "tokens": toks, "greedy": greedy,
           "logits": np.ascontiguousarray(logits).view(np.uint32).tolist(),
           "hashes": sorted([list(k) + [v] for k, v in cap.hashes.items()]),
           "read": [i["experts_read"] for i in info]},
          open(os.path.join(out, f"rank{eng.rank}.json"), "w"))
"""


@pytest.mark.skipif(not EMU and DEVICES < 2, reason="needs 2 GPUs")
def test_launcher_two_ranks(ckpt_path, tmp_path):
    """Under python -m fast.launch (SPMD: every rank runs the script, GPU = LOCAL_RANK): each rank's own
    capture, logits, tokens and greedy loop equal the CPU engine's."""
    import json
    import subprocess
    import sys
    name, shape = "tiny-fp8", (14, 9, 3)
    ids, toks, logits, _ = greedy_case(fast.Engine(ckpt_path(name), device="cpu"), (name, *shape))
    cap = Capture(keep_values=False)
    fast.Engine(ckpt_path(name), device="cpu").generate(ids, shape[2], capture=cap)
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, GLM_EP_QUIET="1", GLM_EP_TIMEOUT="120",
               PYTHONPATH=os.pathsep.join([repo] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-m", "fast.launch", "--ranks", "2", "--", sys.executable, str(script),
                        ckpt_path(name), ",".join(map(str, ids)), str(tmp_path)],
                       capture_output=True, text=True, env=env, cwd=repo, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    want = sorted([list(k) + [v] for k, v in cap.hashes.items()])
    E = fast.Engine(ckpt_path(name), device="cpu").config.n_routed_experts
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (got["rank"], got["ranks"]) == (rank, 2)
        assert got["tokens"] == toks and got["greedy"] == toks
        assert np.array_equal(np.array(got["logits"], dtype=np.uint32), bits(logits))
        assert got["hashes"] == want, f"rank {rank}"
        assert got["read"] == [list(range(0, E // 2)), list(range(E // 2, E))]


@pytest.mark.skipif(EMU or DEVICES < 2, reason="needs 2 GPUs")
@pytest.mark.skipif(not os.environ.get("GLM_SLICE_DIR"), reason="GLM_SLICE_DIR (a slice checkpoint) not given")
def test_slice_two_gpus_equal_one():
    path = os.path.join(os.environ["GLM_SLICE_DIR"], "slice-fp8")
    one = CudaEngine(path)
    ids = prompt(one.config.vocab_size, 12, 1)
    want_toks, want = one.generate(ids, 3, return_logits=True)
    del one
    two = CudaEngine(path, ranks=2, verify_ranks=True)
    toks, got = two.generate(ids, 3, return_logits=True)
    assert toks == want_toks
    assert np.array_equal(bits(got), bits(want))
