"""Canonical (BF16 between modules) vs float64 mode: what BF16 costs, measured on a zoo checkpoint.

    python tools/precision_report.py golden/tiny-bf16 --prompt 40
"""
from __future__ import annotations

import argparse
import json

import numpy as np

import oracle
from oracle.capture import Capture


def report(path: str, prompt: int) -> dict:
    a_model, b_model = oracle.load(path), oracle.load(path, precision="float64")
    V = a_model.config.vocab_size
    ids = [(37 * i + 11) % V for i in range(prompt)]
    ca, cb = Capture(stages={"moe.selected", "attn_hc.streams"}), Capture(stages={"moe.selected", "attn_hc.streams"})
    a, b = a_model.forward(ids, capture=ca), b_model.forward(ids, capture=cb)
    per_pos = np.max(np.abs(a - b), axis=1) / np.max(np.abs(b), axis=1)
    flips = sum(not np.array_equal(ca.get(l, "moe.selected", t), cb.get(l, "moe.selected", t))
                for (l, s) in ca.values if s == "moe.selected" for t in range(prompt))
    routed = sum(1 for (l, s) in ca.values if s == "moe.selected") * prompt
    s0a = np.stack([ca.get(0, "attn_hc.streams", t) for t in range(prompt)])
    s0b = np.stack([cb.get(0, "attn_hc.streams", t) for t in range(prompt)])
    return {"checkpoint": path, "prompt": prompt,
            "layer0_streams_rel": float(np.max(np.abs(s0a - s0b)) / np.max(np.abs(s0b))),
            "logits_rel_max": float(per_pos.max()), "logits_rel_median": float(np.median(per_pos)),
            "argmax_agree": f"{int((a.argmax(1) == b.argmax(1)).sum())}/{prompt}",
            "routing_flips": f"{flips}/{routed}"}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint", nargs="+")
    p.add_argument("--prompt", type=int, default=40)
    a = p.parse_args()
    for path in a.checkpoint:
        print(json.dumps(report(path, a.prompt)))
