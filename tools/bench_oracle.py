"""Oracle speed: prefill and decode tokens/s on a zoo checkpoint (docs/perf.md).

    python tools/bench_oracle.py golden/tiny-bf16 --prompt 64 --new 32
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import oracle


def bench(path: str, prompt: int, new: int, precision: str = "canonical") -> dict:
    model = oracle.load(path, precision)
    V = model.config.vocab_size
    ids = [(37 * i + 11) % V for i in range(prompt)]
    model.generate(ids[:3], 2)                          # compile every Numba kernel first
    cache = model.new_cache()
    t0 = time.perf_counter()
    logits = model.forward(ids, cache)
    t1 = time.perf_counter()
    tok = int(logits[-1].argmax())
    for _ in range(new):
        tok = int(model.forward([tok], cache)[-1].argmax())
    t2 = time.perf_counter()
    return {"checkpoint": path, "precision": precision, "prompt": prompt, "new": new,
            "prefill_tok_s": round(prompt / (t1 - t0), 1), "decode_tok_s": round(new / (t2 - t1), 1),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint", nargs="+")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--precision", default="canonical")
    a = p.parse_args()
    for path in a.checkpoint:
        print(json.dumps(bench(path, a.prompt, a.new, a.precision)))


if __name__ == "__main__":
    main()
