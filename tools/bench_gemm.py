#!/usr/bin/env python3
"""The CUDA engine's several-token linear launches against the FP32 FMA peak measured in the same run.

    python tools/bench_gemm.py [--tokens 32,128,256,512,2048] [--kernels tiled,gemm] [--reps 5] [--only NAME] [--json OUT]

For each shape of a real-width layer (slice's: FP8 projections, BF16 lm_head, the routed experts with
top-8 routing over 288 experts) and each token count, the median device time (two untimed passes,
then --reps timed launches, L2 evicted before each) of one launch through each kernel ('tiled':
k_linear_mt, 'gemm': k_linear_gemm, 'auto': the engine's choice), its FMA rate (2 R C T FLOP, experts
2 R C T k) and that as a share of the FFMA peak (fast._cuda.bench_ffma: independent FMA chains, same
process), and the weight bytes it must read (experts: those its routing touches) per second. Every kernel
computes the same bits (tests/test_fast_cuda.py::test_linear_kernels_match_cpu).
Expert launches take the engine's work items (weights.cuh's expert_tile: 16 pairs through the register-tiled
kernel where experts average 16 or more, else 8 (the same kernel), or 1 below one pair an expert); 'tiled'
forces k_linear_mt on them, 'gemm' the register-tiled kernel, 'stream:N' one-pair items through the streaming
kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# (what, release, R, C, experts, topk)
SHAPES = [
    ("kda.q|k|v", "fp8", 8192, 4096, 0, 0),
    ("mla.o_proj", "fp8", 4096, 16384, 0, 0),
    ("kda.o_proj", "fp8", 4096, 8192, 0, 0),
    ("lm_head", "bf16", 154880, 4096, 0, 0),
    ("experts.gate", "fp8", 2048, 4096, 288, 8),
    ("experts.down", "fp8", 4096, 2048, 288, 8),
    ("kda.q|k|v", "mxfp4", 8192, 4096, 0, 0),
    ("experts.gate", "mxfp4", 2048, 4096, 288, 8),
]


def weight_bytes(rel: str, R: int, C: int, T: int, experts: int, topk: int) -> int:
    """The bytes of weights a launch must read: the matrix, or every expert its routing touches (the
    routing of fast._cuda.linear_bench_tokens: token t's j-th expert (h(t) + j E/k) mod E)."""
    row = {"fp8": C, "mxfp4": C // 2, "bf16": 2 * C}[rel]
    if not experts:
        return R * row
    h = [((t * 2654435761) & 0xFFFFFFFF) >> 7 for t in range(T)]
    touched = {(h[t] + j * (experts // topk)) % experts for t in range(T) for j in range(topk)}
    return len(touched) * R * row


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="32,128,256,512,2048")
    p.add_argument("--kernels", default="tiled,gemm")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", default="", help="shapes whose name or release contains this")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import fast._cuda as cu
    peak = cu.bench_ffma(max(5, a.reps))
    print(f"FFMA peak (independent chains, this process): {peak / 1e12:.1f} TFLOP/s")
    tokens = [int(t) for t in a.tokens.split(",") if t]
    kernels = [k for k in a.kernels.split(",") if k]
    rows = []
    print(f"{'shape':14s} {'rel':6s} {'R':>6s} {'C':>6s} {'T':>5s} " +
          " ".join(f"{k + ' us':>10s} {'TF/s':>6s} {'%pk':>5s} {'GB/s':>5s}" for k in kernels))
    for what, rel, R, C, ex, k in SHAPES:
        if a.only and a.only not in what and a.only != rel:
            continue
        for T in tokens:
            flop = 2.0 * R * C * T * (k if ex else 1)
            wb = weight_bytes(rel, R, C, T, ex, k)
            cells, res = [], {}
            for kern in kernels:
                try:
                    us = cu.linear_bench_tokens(rel, R, C, T, ex, k or 8, kern, a.reps)
                except ValueError as e:
                    res[kern] = {"error": str(e)}
                    cells.append(f"{'n/a':>10s} {'':>6s} {'':>5s} {'':>5s}")
                    continue
                rate = flop / (us * 1e-6)
                res[kern] = {"us": us, "flop_s": rate, "of_peak": rate / peak, "weight_Bps": wb / (us * 1e-6)}
                cells.append(f"{us:10.1f} {rate / 1e12:6.1f} {rate / peak:5.0%} {wb / us / 1e3:5.0f}")
            rows.append({"what": what, "release": rel, "R": R, "C": C, "T": T, "experts": ex, "topk": k,
                         "flop": flop, "weight_bytes": wb, "kernels": res})
            print(f"{what:14s} {rel:6s} {R:6d} {C:6d} {T:5d} " + " ".join(cells), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ffma_peak": peak, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
