"""Expert parallelism on the CUDA engine (docs/ep.md, "GPU"): with the routed experts split over 2 or
3 ranks, one GPU each (rows gathered through NCCL), every stage of every position, the logits and the
tokens are bit-identical to the single-process CPU engine (itself equal to the oracle), prefill in one
chunk or several, decode, and the device-resident greedy loop; each rank reads only its own experts;
each step makes one exchange per MoE layer; the memory plan refuses what cannot fit before anything
is allocated; another rank's expert is refused at registration. On `slice` (GLM_SLICE_DIR, real
widths) two GPUs give the one-GPU logits.

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
from fast.cuda import CudaEngine, cuda_available, cuda_module
from fast.engine import EngineInputError
from oracle.capture import Capture
from tests.engine_checks import assert_same_capture, bits, greedy_case, prompt

try:
    import torch.distributed as _dist
    HAVE_GLOO = _dist.is_available() and _dist.is_gloo_available()
except ImportError:  # pragma: no cover - torch is a test dependency
    HAVE_GLOO = False

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="no CUDA device, or fast._cuda is not built"),
              pytest.mark.skipif(not HAVE_GLOO, reason="torch.distributed with gloo is not installed")]

EMU = cuda_available() and bool(getattr(cuda_module(), "EMULATED", False))
DEVICES = cuda_module().device_count() if cuda_available() else 0


def ranks_param(ranks: int, *values, slow: bool = False):
    """A case that needs `ranks` GPUs (the emulation shares one; `slow`: too slow there)."""
    marks = []
    if not EMU and DEVICES < ranks:
        marks.append(pytest.mark.skip(reason=f"needs {ranks} GPUs, this host has {DEVICES}"))
    if EMU and slow:
        marks.append(pytest.mark.skip(reason="too slow in the CPU emulation"))
    return pytest.param(ranks, *values, marks=marks)


# (ranks, checkpoint, expert ranges or None for the even split, (prompt length, seed, new tokens)),
# ordered by rank count (the driver's workers are started once per count). tiny's 30 tokens make the
# indexer choose pools (index_topk 8) and cross its dense threshold.
CASES = [
    ranks_param(2, "tiny-fp8", None, (30, 3, 4)),
    ranks_param(2, "tiny-mxfp4", [(0, 3), (3, 8)], (12, 4, 3)),
    ranks_param(2, "small-fp8", None, (20, 5, 3), slow=True),
    ranks_param(2, "small-mxfp4", [(0, 11), (11, 16)], (20, 6, 3), slow=True),
    ranks_param(3, "tiny-bf16", [(0, 0), (0, 5), (5, 8)], (12, 7, 3)),  # rank 0 owns no expert
    ranks_param(3, "small-bf16", None, (20, 8, 3), slow=True),
]


def case_id(ranks, name, ranges, shape) -> str:
    return f"r{ranks}-{name}" + ("" if ranges is None else "-" + "_".join(f"{a}:{b}" for a, b in ranges))


@pytest.fixture(scope="module")
def cpu_reference(ckpt_path):
    cache = {}

    def get(name, shape):
        if (name, shape) not in cache:
            cache[(name, shape)] = greedy_case(fast.Engine(ckpt_path(name), device="cpu"), (name, *shape))
        return cache[(name, shape)]
    return get


def moe_layers(cfg) -> int:
    from oracle.config import DENSE
    return sum(1 for t in cfg.mlp_layer_types if t != DENSE)


@pytest.mark.parametrize("ranks,name,ranges,shape", CASES,
                         ids=[case_id(*c.values) for c in CASES])
def test_ranks_bit_identical(ranks, name, ranges, shape, ckpt_path, cpu_reference):
    ids, toks, logits, cap = cpu_reference(name, shape)
    eng = CudaEngine(ckpt_path(name), ranks=ranks, expert_ranges=ranges, verify_ranks=True)
    assert eng.ranks == ranks
    # generate: prefill in one chunk, then decode on the host loop; every stage captured
    got = Capture()
    got_toks, got_logits = eng.generate(ids, shape[2], capture=got, return_logits=True)
    assert_same_capture(eng.config, cap, got, range(len(ids) + shape[2] - 1))
    assert got_toks == toks
    assert np.array_equal(bits(got_logits), bits(logits))
    # prefill in chunks of 5, then decode, through the low-level API
    cache = eng.new_cache()
    outs = [eng.prefill(ids, cache, chunk=5)]
    for tok in toks[:-1]:
        outs.append(eng.decode([cache], [tok]))
    assert np.array_equal(bits(np.concatenate(outs)), bits(logits))
    # the device-resident greedy loop, from the prompt's first token on
    c2 = eng.new_cache()
    first = int(np.argmax(eng.prefill(ids, c2)[-1]))
    assert [first] + eng.greedy(c2, first, len(toks) - 1) == toks
    # each rank read its own experts, and one exchange per MoE layer per step
    bounds = eng.expert_ranges
    for info in eng.ep_info():
        a, b = bounds[info["rank"]]
        assert info["experts_read"] == list(range(a, b)) and info["experts_touched"] == list(range(a, b))
    stats = eng.ep_stats()
    assert len(stats) == ranks and all(s["exchanges"] > 0 for s in stats)
    eng.reset_ep_stats()
    c3 = eng.new_cache()
    eng.prefill(ids[:4], c3)
    eng.decode([c3], [toks[0]])
    assert [s["exchanges"] for s in eng.ep_stats()] == [2 * moe_layers(eng.config)] * ranks


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
