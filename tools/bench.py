"""`oracle bench`: prefill and decode tokens/s of each engine on one checkpoint, as ratios to the
oracle measured in the same run, and the weight bytes a decode token streams per second.

Active weight bytes of one decode token: every tensor a token reads in its release format (all
non-expert weights except the embedding table, of which it reads one row, plus the k selected of
E routed experts per MoE layer, counted as k/E of the experts' bytes).
"""
from __future__ import annotations

import json
import os
import platform
import time

from rich.table import Table

from oracle import names


def active_weight_bytes(ckpt) -> int:
    c = ckpt.config
    total = 0
    for entry in names.expected(c):
        if entry.spec.role.startswith("embed"):
            continue
        raw = ckpt.raw(entry.key)
        total += raw.nbytes * (c.num_experts_per_tok / c.n_routed_experts if entry.expert is not None else 1)
    return int(total)


def measure(engine, ids: list[int], new: int) -> tuple[float, float, list[int]]:
    """-> (prefill tok/s, decode tok/s, generated tokens): one prefill of `ids`, then `new` decode steps."""
    engine.generate(ids[:3], 2)                                     # warm up (Numba compile, threads)
    cache = engine.new_cache()
    t0 = time.perf_counter()
    logits = engine.forward(ids, cache)
    t1 = time.perf_counter()
    out = [int(logits[-1].argmax())]
    for _ in range(new - 1):
        out.append(int(engine.forward([out[-1]], cache)[-1].argmax()))
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), (new - 1) / max(t2 - t1, 1e-9), out


def run(checkpoint: str, engines: list[str], prompt: int, new: int) -> dict:
    from oracle.checkpoint import open_checkpoint
    from .sides import make_engine
    ckpt = open_checkpoint(checkpoint)
    wbytes = active_weight_bytes(ckpt)
    ids = [(37 * i + 11) % ckpt.config.vocab_size for i in range(prompt)]
    rows = []
    for spec in engines:
        engine = make_engine(spec, checkpoint)
        pre, dec, toks = measure(engine, ids, new)
        rows.append({"engine": spec, "prefill_tok_s": pre, "decode_tok_s": dec, "tokens": toks,
                     "decode_weight_GB_s": dec * wbytes / 1e9})
    base = rows[0]
    for r in rows:
        r["prefill_x"] = r["prefill_tok_s"] / base["prefill_tok_s"]
        r["decode_x"] = r["decode_tok_s"] / base["decode_tok_s"]
        r["same_tokens_as_first"] = r["tokens"] == base["tokens"]
    return {"checkpoint": checkpoint, "prompt": prompt, "new": new, "active_weight_bytes_per_token": wbytes,
            "machine": f"{platform.machine()}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}",
            "engines": rows}


def register(sub, console) -> None:
    p = sub.add_parser("bench", help="tokens/s of engines on one checkpoint, as ratios to the first")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--engines", default="oracle,cpu", help="comma-separated SPECs; ratios are to the first")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--json", action="store_true")

    def cmd(args) -> int:
        if args.new < 2 or args.prompt < 3:
            raise ValueError("--prompt must be >= 3 and --new >= 2")
        r = run(args.checkpoint, args.engines.split(","), args.prompt, args.new)
        if args.json:
            print(json.dumps(r))
            return 0
        t = Table(title=f"oracle bench: {args.checkpoint}, {args.prompt} prompt + {args.new} new tokens "
                        f"({r['machine']}; {r['active_weight_bytes_per_token'] / 1e6:.1f} MB weights/token)")
        for col in ("engine", "prefill tok/s", "x", "decode tok/s", "x", "weights GB/s", "same tokens"):
            t.add_column(col)
        for e in r["engines"]:
            t.add_row(e["engine"], f"{e['prefill_tok_s']:.1f}", f"{e['prefill_x']:.1f}", f"{e['decode_tok_s']:.1f}",
                      f"{e['decode_x']:.1f}", f"{e['decode_weight_GB_s']:.2f}", str(e["same_tokens_as_first"]))
        console.print(t)
        return 0 if all(e["same_tokens_as_first"] for e in r["engines"]) else 1

    p.set_defaults(func=cmd)
