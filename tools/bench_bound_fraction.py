#!/usr/bin/env python3
"""How often integer bounds alone decide a BF16-rounded linear output (docs/engine_cuda.md, "Open problems").

    python tools/bench_bound_fraction.py [--rows 1024] [--cols 4096] [--tokens 64] [--seed 0]

The bounded head's argument carried to y = bf16(cdot(W_r, x)): round W's rows and x's rows to integers
(wbits / xbits bits a row, a power-of-two scale each), A = their exact dot (NumPy int64), B = the
canonical cdot's worst-case error plus the rounding's; where bf16 of the interval's two ends agree,
bf16(canonical) is that value without the canonical FMAs (rounding is monotonic). The fraction left
undecided is what a kernel built on it would still compute in FP32. W: FP8 e4m3 with 128 x 128 block
scales (the release format), values N(0, 0.02); x: BF16 of N(0, 1), with and without a few outlier columns
(x 60). Two bounds of sum |w x|: Cauchy-Schwarz (||w|| ||x||, free) and the sum itself (another product).
Every interval is checked to contain the exact (float64-summed, exact here) dot.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def rounded(v: np.ndarray, bits: int):
    """Per row: q = rint(v 2^(bits - 1 - E)), 2^E > max|v|, and the largest rounding error 2^(E - bits)."""
    mx = np.abs(v).max(axis=1)
    E = np.where(mx > 0, np.frexp(mx)[1], -140).astype(np.int64)
    q = np.rint(np.ldexp(v, (bits - 1 - E)[:, None])).astype(np.int64)
    return q, E - (bits - 1), np.ldexp(1.0, E - bits)


def bf16_of(f32: np.ndarray) -> np.ndarray:
    u = f32.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def undecided(w, x, wbits, xbits, abs_sum: bool) -> tuple[float, bool]:
    qw, sw, dw = rounded(w, wbits)
    qx, sx, dx = rounded(x, xbits)
    A = np.ldexp((qx @ qw.T).astype(np.float64), sx[:, None] + sw[None, :])  # exact: |S| < 2^53 here
    K = w.shape[1]
    m, u = float((K + 63) // 64 + 6), 2.0 ** -24
    gamma = m * u / (1 - m * u)
    what = np.abs(x) @ np.abs(w).T if abs_sum else np.linalg.norm(x, axis=1)[:, None] * np.linalg.norm(w, axis=1)[None, :]
    wq = np.ldexp(qw.astype(np.float64), sw[:, None])
    B = gamma * what + dw[None, :] * np.abs(x).sum(axis=1)[:, None] + dx[:, None] * np.abs(wq).sum(axis=1)[None, :]
    B = B * (1 + 2.0 ** -30)
    exact = x @ w.T  # (float64; the products are exact and the sums far inside double's precision here)
    ok = bool(((A - B <= exact) & (exact <= A + B)).all())
    lo = np.nextafter((A - B).astype(np.float32), np.float32(-np.inf))
    hi = np.nextafter((A + B).astype(np.float32), np.float32(np.inf))
    return float((bf16_of(lo) != bf16_of(hi)).mean()), ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    from oracle.numerics.bf16 import bf16_bits_to_f32
    from oracle.numerics.formats import decode_fp8_weight, encode_e4m3
    rng = np.random.default_rng(a.seed)
    R, K, T = a.rows, a.cols, a.tokens
    w32 = rng.normal(0, 0.02, (R, K)).astype(np.float32)
    # FP8 e4m3 with a scale per 128 x 128 block (amax / 448), as the release stores them
    sc = np.abs(w32.reshape(R // 128, 128, K // 128, 128)).max(axis=(1, 3)) / 448.0
    codes = encode_e4m3(w32 / np.repeat(np.repeat(sc, 128, 0), 128, 1)).reshape(R, K)
    w = decode_fp8_weight(codes, sc.astype(np.float32)).astype(np.float64)
    for label, outliers in (("x N(0,1)", False), ("x with outlier columns", True)):
        x32 = rng.normal(0, 1, (T, K)).astype(np.float32)
        if outliers:
            x32[:, rng.integers(0, K, 4)] *= 60.0
        x = bf16_bits_to_f32(bf16_of(x32)).astype(np.float64)
        for wbits, xbits in ((14, 14), (14, 21), (21, 21)):
            for abs_sum in (False, True):
                f, ok = undecided(w, x, wbits, xbits, abs_sum)
                print(f"{label:24s} W {wbits} bits, x {xbits} bits, sum|wx| by {'the product' if abs_sum else 'Cauchy-Schwarz':15s}"
                      f": {100 * f:5.1f} % undecided{'' if ok else '  (AN INTERVAL MISSED THE EXACT DOT)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
