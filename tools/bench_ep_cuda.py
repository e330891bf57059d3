#!/usr/bin/env python3
"""Expert parallelism on GPUs (docs/ep.md, "GPU"): decode on `slice` with the routed experts over N
GPUs against one GPU, in one run.

    python tools/bench_ep_cuda.py --checkpoint /tmp/slice/slice-fp8 [--ranks 2] [--steps 64] [--json OUT]
    python -m fast.launch --ranks 2 -- python tools/bench_ep_cuda.py --checkpoint ...   # SPMD: the ranks only

Prints, for 1 GPU and for N ranks (driver mode: this process is rank 0 on GPU 0): decode at batch 1
(host loop, one decode() per token; and the device-resident greedy loop), decode at batch 8, each
as ms per step and tokens/s; the ranks' tokens against the one-GPU tokens (must be equal); and the
exchange's share of a step: the collectives' device time (CUDA events around each all-gather on the
engine's stream, rank 0) over the step's wall time, with the bytes each rank sent per step.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))
from bench_cuda import time_batch_decode  # noqa: E402 - (tools/ is not a package)


def measure(eng, steps: int, label: str) -> dict:
    V = eng.config.vocab_size
    rng = np.random.default_rng(0)
    prompt = [int(v) for v in rng.integers(0, V, 16)]
    res = {}
    cache = eng.new_cache()
    tok = int(np.argmax(eng.prefill(prompt, cache)[-1]))
    for _ in range(3):
        tok = int(np.argmax(eng.decode([cache], [tok])[0]))
    eng.reset_ep_stats()
    eng.set_exchange_timing(True)  # (ranks: events around the collectives on rank 0's stream)
    t0 = time.perf_counter()
    toks = []
    for _ in range(steps):
        tok = int(np.argmax(eng.decode([cache], [tok])[0]))
        toks.append(tok)
    dt = (time.perf_counter() - t0) / steps
    eng.set_exchange_timing(False)
    res["b1"] = {"ms": round(dt * 1e3, 3), "tok_s": round(1 / dt, 1), "tokens": toks}
    stats = eng.ep_stats()
    if stats:
        s0 = stats[0]
        coll = s0.get("collective_device_seconds", 0.0) / steps
        res["b1"]["exchange_ms"] = round(coll * 1e3, 3)
        res["b1"]["exchange_share"] = round(coll / dt, 4)
        res["b1"]["bytes_sent_per_step"] = int(s0["bytes_sent"] // max(1, steps))
    # the device-resident greedy loop
    c2 = eng.new_cache()
    first = int(np.argmax(eng.prefill(prompt, c2)[-1]))
    eng.greedy(c2, first, 4)
    t0 = time.perf_counter()
    g = eng.greedy(c2, first, steps)
    dg = (time.perf_counter() - t0) / steps
    res["greedy"] = {"ms": round(dg * 1e3, 3), "tok_s": round(1 / dg, 1), "tokens": g}
    # batch 8
    d8, caches, _ = time_batch_decode(eng, 8, max(8, steps // 4), rng)
    res["b8"] = {"ms": round(d8 * 1e3, 3), "tok_s": round(8 / d8, 1)}
    line = (f"{label:8s} decode b1 {res['b1']['ms']:.3f} ms ({res['b1']['tok_s']:.1f} tok/s) | greedy loop "
            f"{res['greedy']['ms']:.3f} ms ({res['greedy']['tok_s']:.1f} tok/s) | b8 {res['b8']['ms']:.3f} ms "
            f"({res['b8']['tok_s']:.1f} tok/s)")
    if "exchange_ms" in res["b1"]:
        line += (f" | exchange {res['b1']['exchange_ms']:.3f} ms per b1 step ({res['b1']['exchange_share']:.1%} of "
                 f"it, {res['b1']['bytes_sent_per_step']} B sent per rank)")
    print(line, flush=True)
    for c in [cache, c2] + caches:
        c.close()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from fast.cuda import CudaEngine
    from fast.distributed import launched
    from oracle.checkpoint import open_checkpoint
    out = {"checkpoint": a.checkpoint, "ranks": a.ranks, "steps": a.steps}
    if launched():  # under python -m fast.launch: every rank runs this; the ranked engine only (no command broadcast)
        eng = CudaEngine(a.checkpoint)
        out["ranks"] = eng.ranks
        out["ep_spmd"] = measure(eng, a.steps, f"{eng.ranks} GPUs, launched (SPMD)")
        if eng.rank == 0 and a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    t0 = time.perf_counter()
    one = CudaEngine(open_checkpoint(a.checkpoint, verify=False))
    print(f"1 GPU: loaded in {time.perf_counter() - t0:.1f} s, {one.device_bytes / 1e9:.2f} GB on the device", flush=True)
    out["one"] = measure(one, a.steps, "1 GPU")
    del one
    gc.collect()
    t0 = time.perf_counter()
    eng = CudaEngine(a.checkpoint, ranks=a.ranks)
    print(f"{a.ranks} ranks: loaded in {time.perf_counter() - t0:.1f} s, rank 0 holds {eng.device_bytes / 1e9:.2f} GB",
          flush=True)
    out["ep"] = measure(eng, a.steps, f"{a.ranks} GPUs")
    same = out["ep"]["b1"]["tokens"] == out["one"]["b1"]["tokens"] and \
        out["ep"]["greedy"]["tokens"] == out["one"]["greedy"]["tokens"]
    out["tokens_equal"] = same
    print(f"tokens of {a.ranks} GPUs = tokens of 1 GPU (host loop and greedy loop): {same}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
