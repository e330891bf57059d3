#!/usr/bin/env python3
"""What a greedy decode step's host side costs: Engine.step's greedy decode path against its general path,
in one process, on the same engine and batch.

    python tools/bench_host_step.py --checkpoint /tmp/slice/slice-fp8 [--device cuda|cpu] [--batches 32,128]
        [--rounds 5] [--steps 3]

Each batch: B sequences prefilled with 8 tokens (room reserved for every step after, so no step grows a
cache); then rounds of `steps` greedy steps, (cache, [token], None, "argmax") as the serving loop writes
them, through the greedy path, and `steps` of the same segments with that path turned off (the general
path: the same tokens, the same call into C++). Both kinds are warmed first (two untimed steps each). Per
kind: the median step, the median time inside the C++ call (fast._core / fast._cuda step: the device's
work and the host's around it) and the median rest (Python) of a step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

KINDS = ("greedy path", "general path")


class _TimedCore:
    """The engine's executor with the duration of each step call recorded."""

    def __init__(self, core):
        self.core, self.last = core, 0.0

    def __getattr__(self, name):
        return getattr(self.core, name)

    def step(self, *args):
        t0 = time.perf_counter()
        out = self.core.step(*args)
        self.last = time.perf_counter() - t0
        return out


def bench_batch(eng, B: int, rounds: int, steps: int, rng) -> dict:
    V = eng.config.vocab_size
    caches = [eng.new_cache() for _ in range(B)]
    for c in caches:
        c.reserve(8 + 2 * len(KINDS) + len(KINDS) * rounds * steps)
    toks = eng.step([(c, rng.integers(0, V, 8).tolist(), None, "argmax") for c in caches])
    core, greedy = eng._core, eng._decode_greedy
    timed = _TimedCore(core)
    eng._core = timed
    wall = {k: [] for k in KINDS}
    inner = {k: [] for k in KINDS}
    try:
        def run(kind, n, keep):
            nonlocal toks
            eng._decode_greedy = greedy if kind == "greedy path" else (lambda segments: None)
            for _ in range(n):
                t0 = time.perf_counter()
                toks = eng.step([(c, [t], None, "argmax") for c, t in zip(caches, toks)])
                if keep:
                    wall[kind].append(time.perf_counter() - t0)
                    inner[kind].append(timed.last)
        for kind in KINDS:
            run(kind, 2, False)
        for _ in range(rounds):
            for kind in KINDS:
                run(kind, steps, True)
    finally:
        eng._decode_greedy, eng._core = greedy, core
        for c in caches:
            c.close()
    med = statistics.median
    return {k: {"step": med(wall[k]), "in_call": med(inner[k]), "python": med([w - i for w, i in zip(wall[k], inner[k])]),
                "steps": len(wall[k])} for k in KINDS}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--batches", default="32,128")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    import fast
    if a.device == "cuda":
        from fast.cuda import CudaEngine
        eng = CudaEngine(a.checkpoint)
    else:
        eng = fast.Engine(a.checkpoint)
    rng = np.random.default_rng(0)
    for B in [int(b) for b in a.batches.split(",") if b]:
        r = bench_batch(eng, B, a.rounds, a.steps, rng)
        cells = [f"{k} {v['step'] * 1e6:.0f} us a step ({B / v['step']:.0f} tok/s; in the C++ call "
                 f"{v['in_call'] * 1e6:.0f}, Python {v['python'] * 1e6:.0f})" for k, v in r.items()]
        print(f"b{B}: " + "; ".join(cells) + f" ({r[KINDS[0]]['steps']} steps each)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
