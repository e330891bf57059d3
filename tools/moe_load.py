#!/usr/bin/env python3
"""Expert load of one prompt: how many pairs each routed expert gets, and how the engine's item plan splits
them between lane-pass items of 64 and items of 16 for a range of `lanes_items` thresholds.

    python tools/moe_load.py --checkpoint /tmp/slice/slice-fp8 --tokens 2048 [--device cuda]

Why: a prefill's routed experts run as lane items (an expert's whole 64s of pairs, and its remainder when it
holds lanes_items pairs or more: weights.cuh, big_item_pairs) and items of 16 (the rest, register-tiled), and
the two kernels' shares of a profile follow the routing's spread, not its mean (T k / E). The prompt is
bench_throughput's kind: uniform random ids, seed 0.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

BIG = 64    # a lane item's pair slots (kLanesItem)
SMALL = 16  # the register-tiled kernel's items


def split(counts: np.ndarray, threshold: int) -> dict[str, int]:
    """The plan's split of each expert's pairs (big_item_pairs: whole 64s, plus a remainder >= threshold)."""
    rem = counts % BIG
    big = np.where(rem >= threshold, counts, counts - rem)
    small = counts - big
    return {"lane pairs": int(big.sum()), "lane slots": int((-(-big // BIG) * BIG).sum()),
            "small pairs": int(small.sum()), "small slots": int((-(-small // SMALL) * SMALL).sum())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--device", default="cuda")
    p.add_argument("--thresholds", default="8,16,24,32,40,48,64")
    a = p.parse_args(argv)

    from fast.engine import Engine
    from oracle.capture import Capture
    from oracle.checkpoint import open_checkpoint

    eng = Engine(open_checkpoint(a.checkpoint, verify=False), device=a.device)
    c = eng.config
    ids = [int(v) for v in np.random.default_rng(0).integers(0, c.vocab_size, a.tokens)]
    cap = Capture(stages={"moe.selected"})
    eng.prefill(ids, eng.new_cache(), capture=cap)
    E, k = c.n_routed_experts, c.num_experts_per_tok
    print(f"{a.checkpoint}: {a.tokens} tokens, {E} routed experts, top {k}: {a.tokens * k / E:.1f} pairs an expert on average")
    for (layer, _), rows in sorted(cap.values.items()):
        sel = np.concatenate([np.asarray(rows[t]).reshape(-1) for t in sorted(rows)]).astype(np.int64)
        counts = np.bincount(sel, minlength=E)
        q = np.percentile(counts, [0, 10, 25, 50, 75, 90, 100]).astype(int)
        print(f"layer {layer}: pairs an expert min/p10/p25/median/p75/p90/max {'/'.join(map(str, q))}; "
              f"experts with none {int((counts == 0).sum())}, under 16 {int((counts < 16).sum())}, 64 or more {int((counts >= BIG).sum())}")
        for t in (int(v) for v in a.thresholds.split(",")):
            s = split(counts, t)
            print(f"  lanes_items {t:3d}: lane items {s['lane pairs']:6d} pairs in {s['lane slots']:6d} slots; "
                  f"items of 16 {s['small pairs']:6d} pairs in {s['small slots']:6d} slots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
