"""Helpers shared by the engine tests (CPU, CUDA, expert parallelism): prompts, bit views, the first
divergence between two captures in causal order (position, then the model's stage order), and the sides
of tests/cases.py (whether each can run here, and its engine)."""
from __future__ import annotations

import functools

import numpy as np

from oracle.capture import Capture
from oracle.stages import model_stages


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    return [int(v) for v in np.random.default_rng(seed).integers(0, vocab, n)]


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def case_id(case) -> str:
    """(checkpoint, prompt length, prompt seed, new tokens) -> a test id."""
    return f"{case[0]}-T{case[1]}-s{case[2]}-n{case[3]}"


def greedy_case(model, case):
    """(ids, tokens, logits, capture) of model.generate on the case's prompt, every stage captured;
    case = (checkpoint, prompt length, prompt seed, new tokens). model: the oracle or an engine."""
    _, n, seed, new = case
    ids = prompt(model.config.vocab_size, n, seed)
    cap = Capture()
    toks, logits = model.generate(ids, new, capture=cap, return_logits=True)
    return ids, toks, logits, cap


def first_divergence(config, a: Capture, b: Capture, positions, names=("reference", "engine")) -> str | None:
    """The first (position, layer, stage) in causal order whose rows differ, with its first element."""
    if set(a.hashes) != set(b.hashes):
        only_a = sorted(set(a.hashes) - set(b.hashes))[:5]
        only_b = sorted(set(b.hashes) - set(a.hashes))[:5]
        return f"captured rows differ: only in {names[0]} {only_a}, only in {names[1]} {only_b}"
    order = model_stages(config)
    for pos in positions:
        for layer, stage, _ in order:
            k = (layer, stage, pos)
            if k in a.hashes and a.hashes[k] != b.hashes[k]:
                msg = f"first divergence: position {pos}, layer {layer}, stage {stage}"
                va, vb = a.values.get((layer, stage), {}).get(pos), b.values.get((layer, stage), {}).get(pos)
                if va is not None and vb is not None:
                    va, vb = np.asarray(va), np.asarray(vb)
                    if va.shape != vb.shape:
                        return msg + f": shapes {va.shape} vs {vb.shape}"
                    fa, fb = va.reshape(-1), vb.reshape(-1)
                    i = np.flatnonzero(fa.view(f"u{fa.itemsize}") != fb.view(f"u{fb.itemsize}"))
                    if i.size:
                        return (msg + f": {i.size} elements, first {int(i[0])}: {names[0]} {fa[i[0]]!r}, "
                                f"{names[1]} {fb[i[0]]!r}")
                return msg
    return None


def assert_same_capture(config, a: Capture, b: Capture, positions, names=("reference", "engine")):
    problem = first_divergence(config, a, b, positions, names)
    assert problem is None, problem
    assert a.hashes == b.hashes


# ------------------------------------------------------------------------------------------------
# the sides (tests/cases.py): which can run here, and their engines


@functools.cache
def cuda_state() -> tuple[bool, bool, int]:
    """(available, emulated, devices): fast._cuda with a device, or fast._cuda_emu under GLM_CUDA_EMU=1."""
    from fast.cuda import cuda_available, cuda_module
    if not cuda_available():
        return False, False, 0
    cu = cuda_module()
    return True, bool(getattr(cu, "EMULATED", False)), int(cu.device_count())


@functools.cache
def have_gloo() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a test dependency
        return False
    return dist.is_available() and dist.is_gloo_available()


NO_CUDA = ("no CUDA device, or fast._cuda is not built (GLM_CUDA_EMU=1 runs the CPU emulation, "
           "fast._cuda_emu, where bindings/cuda/emu is built)")
NO_GLOO = "torch.distributed with gloo is not installed"
EMU_SLOW = "too slow in the CPU emulation"


def side_skip(side: str, checkpoint: str = "", ranks: int = 1, slow_in_emulation: bool = False) -> str | None:
    """Why `side` cannot run a case here (None: it can). The emulation runs tiny checkpoints only."""
    if side.startswith("cuda"):
        ok, emu, devices = cuda_state()
        if not ok:
            return NO_CUDA
        if emu and (slow_in_emulation or not checkpoint.startswith("tiny")):
            return EMU_SLOW
        if side == "cuda-ranks" and not emu and devices < ranks:
            return f"needs {ranks} GPUs, this host has {devices}"
    if ranks > 1 and not have_gloo():
        return NO_GLOO
    return None


def side_param(side: str, *values, checkpoint: str = "", ranks: int | None = None, slow_in_emulation: bool = False,
               id: str | None = None, skip: str | None = None):
    """pytest.param(side, *values) marked gpu on the CUDA sides, skipped with the reason where the side
    cannot run here or where the case table says it does not apply (`skip`); its id: the side (with the
    rank count on the rank sides, e.g. cuda-ranks-r2; `ranks` means nothing to the others), then `id`."""
    import pytest
    marks = [pytest.mark.gpu] if side.startswith("cuda") else []
    ranks = ranks if side.endswith("-ranks") else None
    why = skip or side_skip(side, checkpoint, ranks or 1, slow_in_emulation)
    if why:
        marks.append(pytest.mark.skip(reason=why))
    name = side if ranks is None else f"{side}-r{ranks}"
    return pytest.param(side, *values, marks=marks, id=name if id is None else f"{name}-{id}")


def make_engine(side: str, path, ranks: int | None = None, ranges=None, **kw):
    """The engine of `side` over a checkpoint (path or opened Checkpoint); ranks and ranges (None: the
    even split) are the rank sides' and mean nothing to the others."""
    import fast
    if side.endswith("-ranks"):
        kw = dict(ranks=ranks, expert_ranges=ranges, verify_ranks=True, **kw)
    if side.startswith("cuda"):
        from fast.cuda import CudaEngine
        return CudaEngine(path, **kw)
    if side == "cpu":
        kw = {"threads": 2, "parallel_work": 0, **kw}  # two threads splitting every job, even on tiny models
    else:
        kw = {"threads": 1, **kw}
    return fast.Engine(path, device="cpu", **kw)
