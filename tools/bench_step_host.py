#!/usr/bin/env python3
"""The host-side cost of Engine.step (Python validation and assembly around the one C++ call), per step.

    python tools/bench_step_host.py [--batch 128] [--steps 50]
    python tools/bench_step_host.py --checkpoint /tmp/slice/slice-fp8 [--device cuda|cpu] [--batches 32,128]
        [--rounds 5] [--steps 3]

Without --checkpoint: a decode step of `--batch` one-token segments over the tiny checkpoint (CPU engine):
the engine's core is run once for real, then replaced by its recorded reply, so the timed steps are the
Python side alone (median of --steps after 5 untimed). On the GPU every microsecond of it is a
microsecond the device waits between steps (bench_throughput's decode loop feeds each step the previous
step's tokens).

With --checkpoint: that engine for real, Engine.step's greedy decode path against its general path in one
process. Each batch: B sequences prefilled with 8 tokens (room reserved for every step after, so no step
grows a cache); then rounds of `steps` greedy steps, (cache, [token], None, "argmax") as the serving loop
writes them, through the greedy path, and `steps` of the same segments with that path turned off (the
general path: the same tokens, the same call into C++). Both kinds are warmed first (two untimed steps
each). Per kind: the median step, the median time inside the C++ call (the device's work and the host's
around it) and the median rest (Python) of a step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

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


class _Replay:
    """The core, its step answered by the reply it gave first."""

    def __init__(self, core):
        self._core, self._reply = core, None

    def __getattr__(self, name):
        return getattr(self._core, name)

    def step(self, *args):
        if self._reply is None:
            self._reply = self._core.step(*args)
        return self._reply


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=None, help="timed steps (50; with --checkpoint: a kind's per round, 3)")
    p.add_argument("--checkpoint", default=None, help="time this checkpoint's engine for real, greedy against general path")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--batches", default="32,128")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)

    import numpy as np

    import fast
    if a.checkpoint:
        if a.device == "cuda":
            from fast.cuda import CudaEngine
            eng = CudaEngine(a.checkpoint)
        else:
            eng = fast.Engine(a.checkpoint)
        rng = np.random.default_rng(0)
        for B in [int(b) for b in a.batches.split(",") if b]:
            r = bench_batch(eng, B, a.rounds, a.steps or 3, rng)
            cells = [f"{k} {v['step'] * 1e6:.0f} us a step ({B / v['step']:.0f} tok/s; in the C++ call "
                     f"{v['in_call'] * 1e6:.0f}, Python {v['python'] * 1e6:.0f})" for k, v in r.items()]
            print(f"b{B}: " + "; ".join(cells) + f" ({r[KINDS[0]]['steps']} steps each)", flush=True)
        return 0
    steps = a.steps or 50
    from tools.zoo import make_checkpoint
    path = make_checkpoint("tiny", "fp8", os.path.join(tempfile.mkdtemp(), "tiny-fp8"))
    eng = fast.Engine(path, device="cpu")
    V = eng.config.vocab_size
    caches = [eng.new_cache() for _ in range(a.batch)]
    toks = eng.step([(c, [int(v)], None, "argmax") for c, v in zip(caches, np.arange(a.batch) % V)])
    eng._core = _Replay(eng._core)
    ts = []
    for i in range(5 + steps):
        t0 = time.perf_counter()
        eng.step([(c, [t], None, "argmax") for c, t in zip(caches, toks)])
        if i >= 5:
            ts.append(time.perf_counter() - t0)
    print(f"Engine.step host side, {a.batch} one-token segments: {statistics.median(ts) * 1e3:.3f} ms a step "
          f"(median of {steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
