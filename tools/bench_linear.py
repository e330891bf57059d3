#!/usr/bin/env python3
"""The CUDA engine's linear kernels one by one, in the shapes of a decode step at batch 1.

    python tools/bench_linear.py [--reps 30] [--json OUT] [--only experts] [--variants register,staged:8:1]

For each matrix shape of a real-width layer (KDA, MLA, MoE: FP8, BF16, MXFP4 as the releases store
them) and each kernel variant (the register kernel, also bounded to 5 blocks per SM; the
streaming kernel at 1, 2 or 3 blocks per SM; the staged kernel with 8, 4 or 2 lanes per thread, x read
through L1 or staged, a few block/stage sizes; FP8 with both E4M3 decode paths), the
median device time of one launch with L2 evicted before each (decode reads every weight from HBM), and
the weight bytes streamed per second, against the copy bandwidth measured in the same run.
Every variant computes the same bits (tests/test_fast_cuda.py::test_linear_kernels_match_cpu).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# (what, release, R, C, experts)
SHAPES = [
    ("kda.q/k/v_proj", "fp8", 8192, 4096, 0),
    ("kda.o_proj", "fp8", 4096, 8192, 0),
    ("mla.o_proj", "fp8", 4096, 16384, 0),
    ("mla.q_b", "fp8", 16384, 1536, 0),
    ("mla.q_a", "fp8", 1536, 4096, 0),
    ("shared.gate", "fp8", 2048, 4096, 0),
    ("shared.down", "fp8", 4096, 2048, 0),
    ("experts.gate x8", "fp8", 2048, 4096, 8),
    ("experts.down x8", "fp8", 4096, 2048, 8),
    ("experts.gate x18", "fp8", 2048, 4096, 18),  # the bytes of a batch-1 gate+up launch (9 experts)
    ("lm_head", "bf16", 154880, 4096, 0),
    ("kda.b_proj", "bf16", 64, 4096, 0),
    ("kda.f_a", "bf16", 128, 4096, 0),
    ("moe.router", "bf16", 288, 4096, 0),
    ("kda.f_b", "bf16", 8192, 128, 0),
    ("experts.gate x8", "mxfp4", 2048, 4096, 8),
    ("experts.down x8", "mxfp4", 4096, 2048, 8),
    ("kda.q_proj", "mxfp4", 8192, 4096, 0),
]
VARIANTS = ["register", "register:occ5", "stream:1", "stream:2", "stream:3", "staged:8:0", "staged:8:1", "staged:4:0", "staged:4:1", "staged:2:0", "staged:2:1",
            "staged:4:1:16:8", "staged:4:1:8:16", "staged:4:1:16:24", "staged:2:1:8:16", "staged:2:1:8:48",
            "staged:8:1:32:6"]
# FP8 shapes are timed with both E4M3 decode paths: the conversion unit ("hw") and bit placement ("int")
FP8_DECODES = ("int", "hw")


def weight_bytes(release: str, R: int, C: int, experts: int) -> int:
    per = {"bf16": 2 * C, "f32": 4 * C, "fp8": C, "mxfp4": C // 2}[release] * R
    scale = {"fp8": ((R + 127) // 128) * ((C + 127) // 128) * 4, "mxfp4": R * (C // 32)}.get(release, 0)
    return (per + scale) * max(1, experts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", default=None)
    p.add_argument("--only", default="", help="shapes whose name contains this (e.g. 'experts')")
    p.add_argument("--variants", default="", help="comma-separated kernel variants (default: all)")
    a = p.parse_args(argv)
    shapes = [sh for sh in SHAPES if a.only in sh[0]]
    variants = [v for v in a.variants.split(",") if v] or VARIANTS
    import fast._cuda as cu
    from bench_cuda import copy_bandwidth
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (bytes read + written)")
    rows = []
    head = f"{'matrix':18s} {'rel':9s} {'R':>6s} {'C':>6s} {'MB':>6s} " + " ".join(f"{v.replace('staged:', 'st:').replace('register:', 'reg:'):>8s}" for v in variants)
    print("median us per launch (and TB/s of weights for the best):")
    print(head)
    for what, rel, R, C, ex in shapes:
        nb = weight_bytes(rel, R, C, ex)
        for dec in (FP8_DECODES if rel == "fp8" else ("auto",)):
            ts = {}
            for v in variants:
                try:
                    ts[v] = cu.linear_bench(rel, R, C, ex, v, a.reps, dec)
                except ValueError:
                    ts[v] = float("nan")
            best = min((t, v) for v, t in ts.items() if t == t)
            rows.append({"what": what, "release": rel, "decode": dec, "R": R, "C": C, "experts": ex, "bytes": nb,
                         "us": ts, "best": best[1], "best_tb_s": nb / (best[0] * 1e-6) / 1e12})
            cells = " ".join(f"{ts[v]:8.1f}" for v in variants)
            tag = f"{rel}/{dec}" if rel == "fp8" else rel
            print(f"{what:18s} {tag:9s} {R:6d} {C:6d} {nb / 1e6:6.1f} {cells}   best {best[1]} {best[0]:.1f} us "
                  f"= {nb / (best[0] * 1e-6) / 1e12:.2f} TB/s ({nb / (best[0] * 1e-6) / bw:.0%} of copy)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"copy_bw": bw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
