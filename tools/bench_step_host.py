#!/usr/bin/env python3
"""The host-side cost of Engine.step (Python validation and assembly around the one C++ call), per step.

    python tools/bench_step_host.py [--batch 128] [--steps 50]

A decode step of `--batch` one-token segments over the tiny checkpoint (CPU engine): the engine's core is
run once for real, then replaced by its recorded reply, so the timed steps are the Python side alone
(median of --steps after 5 untimed). On the GPU every microsecond of it is a microsecond the device
waits between steps (bench_throughput's decode loop feeds each step the previous step's tokens).
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
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args(argv)

    import numpy as np

    import fast
    from tools.zoo import make_checkpoint
    path = make_checkpoint("tiny", "fp8", os.path.join(tempfile.mkdtemp(), "tiny-fp8"))
    eng = fast.Engine(path, device="cpu")
    V = eng.config.vocab_size
    caches = [eng.new_cache() for _ in range(a.batch)]
    toks = eng.step([(c, [int(v)], None, "argmax") for c, v in zip(caches, np.arange(a.batch) % V)])
    eng._core = _Replay(eng._core)
    ts = []
    for i in range(5 + a.steps):
        t0 = time.perf_counter()
        eng.step([(c, [t], None, "argmax") for c, t in zip(caches, toks)])
        if i >= 5:
            ts.append(time.perf_counter() - t0)
    print(f"Engine.step host side, {a.batch} one-token segments: {statistics.median(ts) * 1e3:.3f} ms a step "
          f"(median of {a.steps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
