#!/usr/bin/env python3
"""What the best FFMA-only GEMM reaches on this GPU: cuBLAS SGEMM (through torch, TF32 off) against the FFMA
peak measured in the same process (`fast._cuda.bench_ffma`).

    python tools/bench_sgemm_ceiling.py [--shapes 2048x4096x4096,8192x4096x4096,...] [--warm 3] [--reps 10]

Why: within the canonical numerics (SPEC 4.2) every multiply-add is an FP32 FMA in a fixed chain, so tensor
cores, whose sums do not round after each product, cannot compute them; issue 19's prefill and GEMM goals are
shares of the FFMA peak. This says how high a share the vendor's own FP32 GEMM, on plain dense operands with no
decode and no fixed fold, reaches here: the ceiling for ours. A shape is TxKxN: x [T, K] @ w [K, N].
Each figure is the median of --reps timed launches after --warm untimed ones (CUDA events).
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def time_matmul(t: int, k: int, n: int, warm: int, reps: int) -> float:
    import torch
    from tools.bench_cuda import median_device_s
    a = torch.randn(t, k, device="cuda", dtype=torch.float32)
    b = torch.randn(k, n, device="cuda", dtype=torch.float32)
    out = torch.empty(t, n, device="cuda", dtype=torch.float32)
    return median_device_s(lambda: torch.matmul(a, b, out=out), warm, reps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="512x4096x4096,2048x4096x4096,8192x4096x4096,2048x4096x12288,2048x2048x4096")
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args(argv)
    import torch
    import fast._cuda as cu
    torch.backends.cuda.matmul.allow_tf32 = False  # FP32 FMA, not TF32 tensor cores
    peak = cu.bench_ffma(5)
    print(f"{torch.cuda.get_device_name()}: FFMA peak {peak / 1e12:.1f} TFLOP/s (fast._cuda.bench_ffma); "
          f"torch {torch.__version__}, TF32 off", flush=True)
    for shape in a.shapes.split(","):
        t, k, n = (int(v) for v in shape.lower().split("x"))
        dt = time_matmul(t, k, n, a.warm, a.reps)
        flops = 2.0 * t * k * n / dt
        print(f"  sgemm {t}x{k}x{n}: {dt * 1e6:9.1f} us  {flops / 1e12:5.1f} TFLOP/s  {100 * flops / peak:5.1f} % of the FFMA peak",
              flush=True)
    print(f"FFMA peak again {cu.bench_ffma(5) / 1e12:.1f} TFLOP/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
