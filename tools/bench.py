"""`oracle bench`: prefill and decode tokens/s of each engine on one checkpoint, as ratios to the
oracle measured in the same run, and the weight bytes a decode token streams per second.

Active weight bytes of one decode token: every tensor a token reads in its release format (all
non-expert weights except the embedding table, of which it reads one row, plus the k selected of
E routed experts per MoE layer, counted as k/E of the experts' bytes).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

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


# the SPEC options a benchmark honours: the engine's configuration and how the prompt is fed; batch,
# prefix-cache and inject change what one request runs and are refused rather than silently dropped
BENCH_OPTIONS = ("threads", "dot", "expf", "precision", "chunk", "ranks", "memory-limit", "verify-ranks", "max-context")


def measure(engine, ids: list[int], new: int, chunk: int | None = None) -> tuple[float, float, list[int]]:
    """-> (prefill tok/s, decode tok/s, generated tokens): one prefill of `ids`, then `new` decode steps."""
    engine.generate(ids[:3], 2)                                     # warm up (Numba compile, threads)
    cache = engine.new_cache()
    t0 = time.perf_counter()
    logits = engine.prefill(ids, cache, chunk=chunk)
    t1 = time.perf_counter()
    out = [int(logits[-1].argmax())]
    for _ in range(new - 1):
        out.append(int(engine.forward([out[-1]], cache)[-1].argmax()))
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), (new - 1) / max(t2 - t1, 1e-9), out


def open_engines(checkpoint: str, specs: list[str]) -> list:
    """Each SPEC parsed (all of them before any engine loads, so a typo fails at once) and opened as a Side."""
    from .sides import open_side, parse_spec, refuse_options
    parsed = [parse_spec(s) for s in specs]
    for spec in parsed:
        refuse_options(spec, BENCH_OPTIONS, "bench")
    return [open_side(spec, checkpoint) for spec in parsed]


def run(checkpoint: str, engines: list[str], prompt: int, new: int) -> dict:
    from oracle.checkpoint import open_checkpoint
    sides = open_engines(checkpoint, engines)
    ckpt = open_checkpoint(checkpoint)
    wbytes = active_weight_bytes(ckpt)
    ids = [(37 * i + 11) % ckpt.config.vocab_size for i in range(prompt)]
    rows = []
    for side in sides:
        pre, dec, toks = measure(side.engine, ids, new, chunk=side.options.get("chunk"))
        rows.append({"engine": str(side.spec), "prefill_tok_s": pre, "decode_tok_s": dec, "tokens": toks,
                     "decode_weight_GB_s": dec * wbytes / 1e9})
    base = rows[0]
    for r in rows:
        r["prefill_x"] = r["prefill_tok_s"] / base["prefill_tok_s"]
        r["decode_x"] = r["decode_tok_s"] / base["decode_tok_s"]
        r["same_tokens_as_first"] = r["tokens"] == base["tokens"]
    return {"checkpoint": checkpoint, "prompt": prompt, "new": new, "active_weight_bytes_per_token": wbytes,
            "machine": f"{platform.machine()}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}",
            "engines": rows}


SERVE_ONLY = ("--concurrency", "--requests", "--url", "--shared-prefix", "--prefix-cache-mb")


def serve_bench(args) -> int:
    """`bench --serve`: tools/serve/loadgen.py with bench's options passed through; its exit code (0 when
    the server's tokens equal the offline generate's at every concurrency, 1 when not)."""
    from .serve import loadgen
    from .sides import parse_spec, split_specs
    specs = split_specs(args.engines) if args.engines else ["cpu"]
    if len(specs) != 1:
        raise ValueError(f"bench --serve: one engine SPEC (the server's), got {len(specs)}: {' '.join(specs)}")
    spec = parse_spec(specs[0])
    if spec.engine not in ("cpu", "cuda"):
        raise ValueError(f"bench --serve: the server runs the cpu or cuda engine, not {spec.engine!r}")
    if args.concurrency is not None:
        levels = args.concurrency.split(",")
        if not all(c.strip().isdigit() and int(c) >= 1 for c in levels):
            raise ValueError(f"bench --concurrency: comma-separated ints >= 1, got {args.concurrency!r}")
    argv = ["--checkpoint", args.checkpoint, "--engine", str(spec), "--prompt", str(args.prompt_len),
            "--new", str(args.new)]
    for opt in SERVE_ONLY:
        v = getattr(args, opt.lstrip("-").replace("-", "_"))
        if v is not None:
            argv += [opt, str(v)]
    return loadgen.main(argv + (["--json"] if args.json else []))


def register(sub, console) -> None:
    p = sub.add_parser(
        "bench", help="tokens/s of engines on one checkpoint, as ratios to the first",
        description="Prefill and decode tokens/s of each engine on a synthetic prompt, as ratios to the first "
                    "engine, and whether every engine generated the first one's tokens (exit 0 all the same, "
                    "1 some differ, 2 error). SPECs as in `oracle run`; bench takes the options "
                    f"{', '.join(BENCH_OPTIONS)}. With --serve: a load generator against `oracle serve` "
                    "(throughput, TTFT, TPOT at each concurrency; exit 0 when the server's tokens equal the "
                    "offline generate's, 1 when not; docs/serve.md).")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--engines", nargs="+", default=None, metavar="SPEC",
                   help="the engines, separated by spaces or by commas directly before an engine name "
                        "(oracle,cpu:threads=2,chunk=8 cuda is three); ratios are to the first (default: "
                        "oracle,cpu; with --serve: cpu)")
    p.add_argument("--prompt-len", type=int, default=64, metavar="N", help="prompt length in tokens, >= 3")
    p.add_argument("--prompt", help=argparse.SUPPRESS)   # kept only to point old uses to --prompt-len
    p.add_argument("--new", type=int, default=16, metavar="N",
                   help="new tokens to generate, >= 2 (the first comes from the prefill, the rest are timed)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    s = p.add_argument_group("against a server (--serve)")
    s.add_argument("--serve", action="store_true",
                   help="load an `oracle serve` (started here on one cpu or cuda SPEC of --engines, default cpu, "
                        "unless --url names one): throughput, TTFT and TPOT p50/p99 at each concurrency, and "
                        "the same prompts through the engine's offline generate")
    s.add_argument("--concurrency", default=None, metavar="C,C,...",
                   help="client counts, comma-separated (default: 1,4,16)")
    s.add_argument("--requests", type=int, default=None, metavar="N",
                   help="requests per concurrency (fewer are raised to the concurrency) (default: 32)")
    s.add_argument("--url", default=None, help="a running server to load instead of starting one")
    s.add_argument("--shared-prefix", type=int, default=None, metavar="N",
                   help="tokens every prompt starts with (default: 0)")
    s.add_argument("--prefix-cache-mb", type=float, default=None, metavar="MB",
                   help="the started server's prefix cache (default: 0, none)")

    def cmd(args) -> int:
        from .sides import split_specs
        from .term import out, table
        if args.prompt is not None:
            raise ValueError("bench --prompt: bench measures a synthetic prompt of a given length; use "
                             f"--prompt-len N (got --prompt {args.prompt!r})")
        if args.new < 2 or args.prompt_len < 3:
            raise ValueError(f"--prompt-len must be >= 3 and --new >= 2 (got {args.prompt_len} and {args.new})")
        if args.serve:
            return serve_bench(args)
        given = [o for o in SERVE_ONLY if getattr(args, o.lstrip("-").replace("-", "_")) is not None]
        if given:
            raise ValueError(f"bench {given[0]}: only with --serve (it configures the load on a server)")
        r = run(args.checkpoint, split_specs(args.engines or ["oracle", "cpu"]), args.prompt_len, args.new)
        if args.json:
            print(json.dumps(r))
            return 0 if all(e["same_tokens_as_first"] for e in r["engines"]) else 1
        t = table("engine", "prefill tok/s", "x", "decode tok/s", "x", "weights GB/s", "same tokens",
                  title=f"oracle bench: {args.checkpoint}, {args.prompt_len} prompt + {args.new} new tokens "
                        f"({r['machine']}; {r['active_weight_bytes_per_token'] / 1e6:.1f} MB weights/token)")
        for e in r["engines"]:
            t.add_row(e["engine"], f"{e['prefill_tok_s']:.1f}", f"{e['prefill_x']:.1f}", f"{e['decode_tok_s']:.1f}",
                      f"{e['decode_x']:.1f}", f"{e['decode_weight_GB_s']:.2f}", str(e["same_tokens_as_first"]))
        out().print(t)
        return 0 if all(e["same_tokens_as_first"] for e in r["engines"]) else 1

    p.set_defaults(func=cmd)
