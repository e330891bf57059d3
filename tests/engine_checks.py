"""Helpers shared by the engine tests (CPU, CUDA, expert parallelism): prompts, bit views, and the
first divergence between two captures in causal order (position, then the model's stage order)."""
from __future__ import annotations

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
