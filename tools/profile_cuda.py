#!/usr/bin/env python3
"""Kernel timeline of CUDA-engine decode steps (torch.profiler / CUPTI sees every kernel of the process).

    python tools/profile_cuda.py --checkpoint /tmp/slice/slice-fp8 [--steps 5] [--batch 1] [--trace OUT.json]
    python tools/profile_cuda.py --checkpoint /tmp/slice/slice-fp8 --plain   # for ncu to wrap (gpu_check NCU_KERNELS)

Prints, per decode step: wall time, summed kernel time, the idle gaps between kernels on the device,
and a table of kernels (launches per step, device us per step, mean us) sorted by time. Says where a
step's wall time goes: device busy, device idle between kernels (launch gaps or host stalls), and
host-only time before the first and after the last kernel.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import defaultdict

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def short(name: str) -> str:
    name = name.replace("(anonymous namespace)::", "").replace("glm::cuda::", "")
    name = re.sub(r"\(.*", "", name)           # drop the argument list
    name = re.sub(r"^void ", "", name)
    return name[:90]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--trace", default=None, help="write a chrome trace here")
    p.add_argument("--prefill", type=int, default=0,
                   help="profile --steps prefills of this many tokens (each into a new cache) instead of decode steps")
    p.add_argument("--logits", choices=("argmax", "all"), default="argmax",
                   help="what a decode step returns: the greedy token chosen on the device (bench_throughput's "
                        "steps) or every row's logits copied to the host")
    p.add_argument("--plain", action="store_true",
                   help="no profiler: prefill, then --steps decode steps (a process for ncu to wrap)")
    a = p.parse_args(argv)

    from fast.cuda import CudaEngine
    from oracle.checkpoint import open_checkpoint

    eng = CudaEngine(open_checkpoint(a.checkpoint, verify=False))
    V = eng.config.vocab_size
    rng = np.random.default_rng(0)
    caches = [eng.new_cache() for _ in range(a.batch)]
    for c in caches:
        eng.prefill([int(v) for v in rng.integers(0, V, 16)], c)
    toks = [1] * a.batch

    def decode_step(toks):
        if a.logits == "all":
            return [int(np.argmax(r)) for r in eng.decode(caches, toks)]
        return eng.step([(c, [t], None, "argmax") for c, t in zip(caches, toks)])

    for _ in range(5 if not a.plain else a.steps):
        toks = decode_step(toks)
    if a.prefill and not a.plain:  # warm the prefill's shape too (its scratch grown) before profiling, as the benchmark does
        for _ in range(2):
            c = eng.new_cache()
            eng.step([(c, [int(v) for v in rng.integers(0, V, a.prefill)], None, "argmax")])
            c.close()
    if a.plain:
        print(f"prefill of 16 tokens, then {a.steps} decode steps at batch {a.batch}: tokens {toks}")
        return 0

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()

    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            t0 = time.perf_counter()
            if a.prefill:
                c = eng.new_cache()
                # as tools/bench_throughput.py times it: the greedy token of the last row on the device
                # (eng.prefill returns every row's logits: a 154880-wide head over all rows and its copy)
                eng.step([(c, [int(v) for v in rng.integers(0, V, a.prefill)], None, "argmax")])
                c.close()
            else:
                toks = decode_step(toks)
            walls.append(time.perf_counter() - t0)
    if a.trace:
        prof.export_chrome_trace(a.trace)

    kern = []
    calls = defaultdict(lambda: [0, 0.0, 0.0])  # host side: CUDA runtime and driver calls, [count, us, longest us]
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            start = ev.time_range.start
            end = ev.time_range.end
            kern.append((start, end, ev.name))
        elif ev.name.startswith(("cuda", "cu")) and not ev.name.startswith("cudaGetDevice"):
            d = ev.time_range.end - ev.time_range.start
            c = calls[ev.name]
            c[0], c[1], c[2] = c[0] + 1, c[1] + d, max(c[2], d)
    kern.sort()
    if not kern:
        print("no device events recorded")
        return 1
    busy = sum(e - s for s, e, _ in kern)
    # idle time on the device inside the profiled span, split per step by the big host gaps
    gaps = []
    for (s0, e0, _), (s1, e1, _) in zip(kern, kern[1:]):
        gaps.append(max(0.0, s1 - e0))
    gaps_sorted = sorted(gaps, reverse=True)
    step_gaps = gaps_sorted[: a.steps - 1]  # the gaps between steps (host: argmax, Python)
    inner_idle = sum(gaps) - sum(step_gaps)
    n = a.steps
    wall_us = float(np.median(walls)) * 1e6
    what = f"prefills of {a.prefill} tokens" if a.prefill else f"decode steps at batch {a.batch}"
    print(f"checkpoint {a.checkpoint}, {n} {what}")
    print(f"  wall per step (median): {wall_us:.1f} us")
    print(f"  kernels per step: {len(kern) / n:.1f}; device busy per step: {busy / n:.1f} us")
    print(f"  device idle between kernels inside steps, per step: {inner_idle / n:.1f} us "
          f"(median gap {np.median(gaps):.2f} us, gaps > 5 us: {sum(g > 5 for g in gaps) / n:.1f} per step)")
    print(f"  between steps (host, Python, logits): {np.mean(step_gaps) if step_gaps else 0:.1f} us")
    agg = defaultdict(lambda: [0, 0.0])
    for s, e, nm in kern:
        k = short(nm)
        agg[k][0] += 1
        agg[k][1] += e - s
    print(f"  {'kernel':90s} {'n/step':>7s} {'us/step':>9s} {'mean us':>8s}")
    for k, (cnt, tot) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"  {k:90s} {cnt / n:7.1f} {tot / n:9.1f} {tot / cnt:8.2f}")
    # where the host's time inside a step goes: the runtime calls that block or take long (an allocation,
    # a free, which waits for the device, a synchronization) explain the device's idle gaps
    print(f"  host CUDA calls, per step: {'call':40s} {'n/step':>7s} {'us/step':>9s} {'longest us':>10s}")
    for k, (cnt, tot, top) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:10]:
        print(f"    {k[:60]:60s} {cnt / n:7.1f} {tot / n:9.1f} {top:10.1f}")
    # the big gaps inside steps, with the kernels around them
    print("  largest idle gaps inside steps (us, after -> before):")
    idx = sorted(range(len(gaps)), key=lambda i: -gaps[i])[a.steps - 1: a.steps - 1 + 12]
    for i in idx:
        print(f"    {gaps[i]:7.1f}  {short(kern[i][2])[:50]} -> {short(kern[i + 1][2])[:50]}")
    for c in caches:
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
