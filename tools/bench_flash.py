#!/usr/bin/env python3
"""The `flash` zoo checkpoint on the GPU machine (issue 18): the real model's 45 layers at real widths
with 32 routed experts, so one token reads what a token of the real model reads.

    python tools/bench_flash.py --dir /tmp/flash [--make] [--steps 64] [--cpu-threads 16] [--json OUT]

1. --make: writes flash-fp8 (41.2 GiB) with tools.zoo, unless it is there.
2. Decode at batch 1 on the CUDA engine (tools/bench_cuda.py's measurement: the device greedy loop and
   the host loop, median step, % of the HBM roofline = weight bytes per token / the device-to-device
   copy bandwidth measured in this run).
3. CUDA = CPU at full depth: an 8-token prompt and 3 greedy tokens through both engines, every stage of
   every layer captured (hashes of the bits), the logits of every position and the tokens compared.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))


def log(*a):
    print(*a, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/flash")
    p.add_argument("--make", action="store_true")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--cpu-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from bench_cuda import bench_engine, copy_bandwidth
    path = os.path.join(a.dir, "flash-fp8")
    doc = {}
    if a.make and not os.path.exists(os.path.join(path, "config.json")):
        from tools.zoo import make_checkpoint
        t0 = time.perf_counter()
        make_checkpoint("flash", "fp8", path, workers=a.workers)
        doc["made_seconds"] = round(time.perf_counter() - t0, 1)
        log(f"made {path} in {doc['made_seconds']} s")
    doc["bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    bw = copy_bandwidth()
    doc["copy_bandwidth_Bps"] = bw
    log(f"{path}: {doc['bytes'] / 2**30:.1f} GiB; device-to-device copy {bw / 1e12:.2f} TB/s")
    doc["decode"] = bench_engine(path, bw, a.steps, [], [8])

    # CUDA = CPU engine at full depth
    import fast
    from fast.cuda import CudaEngine
    from oracle.capture import Capture
    from oracle.checkpoint import open_checkpoint
    ck = open_checkpoint(path, verify=False)
    prompt = [int(v) for v in (np.arange(8) * 7919 + 11) % ck.config.vocab_size]
    res = {}
    for side in ("cuda", "cpu"):
        t0 = time.perf_counter()
        eng = CudaEngine(ck) if side == "cuda" else fast.Engine(ck, device="cpu", threads=a.cpu_threads)
        cap = Capture(keep_values=False)
        toks, logits = eng.generate(prompt, 3, capture=cap, return_logits=True)
        res[side] = (toks, logits, cap.hashes)
        log(f"  {side}: tokens {toks}, {len(cap.hashes)} captured rows, {time.perf_counter() - t0:.1f} s")
        eng.close()
        del eng
    (ta, la, ha), (tb, lb, hb) = res["cuda"], res["cpu"]
    same_logits = la.shape == lb.shape and np.array_equal(la.view(np.uint32), lb.view(np.uint32))
    differ = sorted(k for k in set(ha) | set(hb) if ha.get(k) != hb.get(k))
    doc["cuda_equals_cpu"] = {"tokens": ta == tb, "logits": bool(same_logits), "captured_rows": len(ha),
                              "rows_differing": len(differ), "first_differing": [list(map(str, k)) for k in differ[:5]]}
    log(f"  CUDA = CPU at {ck.config.num_hidden_layers} layers: tokens {ta == tb}, logits {same_logits}, "
        f"{len(ha) - len(differ)} of {len(ha)} captured rows equal" + (f"; first differing {differ[:3]}" if differ else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return 0 if (ta == tb and same_logits and not differ) else 1


if __name__ == "__main__":
    sys.exit(main())
