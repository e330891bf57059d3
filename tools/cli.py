"""The `oracle` command: demo, run, golden, make-checkpoint (and the debugging tools as they land).

Exit codes: 0 identical / passed, 1 differ / failed, 2 error (bad input, bad checkpoint).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .prompts import load_tokenizer, parse_ids
from .sides import make_engine

console = Console(stderr=False)


def golden_root() -> Path:
    """The bundled golden/ folder: $GLM_GOLDEN, ./golden of a checkout, or the copy installed with the package."""
    candidates = [os.environ.get("GLM_GOLDEN"), Path.cwd() / "golden",
                  Path(__file__).resolve().parent.parent / "golden", Path(__file__).resolve().parent / "_golden"]
    for c in candidates:
        if c and (Path(c) / "tiny-bf16" / "config.json").exists():
            return Path(c)
    raise FileNotFoundError("no golden/ folder with tiny-bf16 found (set GLM_GOLDEN or run from the repository)")


# -- commands --------------------------------------------------------------------------------------

def cmd_run(args) -> int:
    from .golden import hash12
    engine = make_engine(args.engine, args.checkpoint, args.precision)
    tokenizer = load_tokenizer(args.checkpoint)
    if args.ids is not None:
        ids = parse_ids(args.ids)
    elif args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"{args.checkpoint} has no tokenizer.json: use --ids")
        ids = tokenizer.encode(args.prompt).ids
    else:
        raise ValueError("give --prompt TEXT or --ids 1,2,3")
    t0 = time.perf_counter()
    tokens, logits = engine.generate(ids, args.max_new, return_logits=True)
    dt = time.perf_counter() - t0
    import numpy as np
    result = {"engine": args.engine, "prompt_ids": ids, "tokens": tokens,
              "output_hash": hash12(np.array(tokens), "<i4"), "logits_hash": hash12(logits, "<f4"),
              "seconds": round(dt, 3)}
    if tokenizer is not None:
        result["text"] = tokenizer.decode(tokens)
    if args.json:
        print(json.dumps(result))
    else:
        t = Table(title=f"oracle run: {args.checkpoint} ({args.engine})")
        t.add_column("field"), t.add_column("value")
        for k, v in result.items():
            t.add_row(k, str(v))
        console.print(t)
    return 0


def cmd_golden(args) -> int:
    from . import golden
    root = golden_root()
    golden.GOLDEN_DIR, golden.HASHES = root, root / "hashes.json"
    got = golden.compute_all(lambda p: make_engine(args.engine, p), progress=lambda k: console.print(f"  ran {k}"))
    if args.action == "update":
        old = golden.load_hashes() if golden.HASHES.exists() else {}
        changes = golden.compare(old, got)
        golden.save_hashes(got)
        console.print(f"wrote {golden.HASHES}")
        for line in changes:
            console.print(f"  changed: {line}")
        if changes:
            console.print("[yellow]Golden hashes changed: the commit must say which numerics changed and why "
                          "the new values are the canonical ones.[/yellow]")
        return 0
    diffs = golden.compare(golden.load_hashes(), got)
    if diffs:
        for line in diffs:
            console.print(f"[red]MISMATCH[/red] {line}")
        return 1
    console.print(f"[green]golden check passed[/green]: {len(got)} cases identical ({args.engine})")
    return 0


def cmd_demo(args) -> int:
    from .demo import demo
    return demo(console, golden_root())


def cmd_make_checkpoint(args) -> int:
    from .zoo import main_make_checkpoint
    return main_make_checkpoint(args.rest) or 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oracle", description="GLM-5.3-Flash exact inference: oracle, engines, tools")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run the bundled tiny checkpoint through the oracle and the CPU engine")
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("run", help="generate greedily from a prompt")
    r.add_argument("--checkpoint", required=True)
    r.add_argument("--prompt")
    r.add_argument("--ids")
    r.add_argument("--max-new", type=int, default=16)
    r.add_argument("--engine", default="oracle", help="oracle | cpu | cuda (with :options)")
    r.add_argument("--precision", default="canonical", choices=["canonical", "float64"])
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_run)

    g = sub.add_parser("golden", help="check or update golden/hashes.json")
    g.add_argument("action", choices=["check", "update"])
    g.add_argument("--engine", default="oracle")
    g.set_defaults(func=cmd_golden)

    m = sub.add_parser("make-checkpoint", help="write a synthetic zoo checkpoint", add_help=False)
    m.add_argument("rest", nargs=argparse.REMAINDER)
    m.set_defaults(func=cmd_make_checkpoint)

    from . import bench, census, diff, trace  # the tools register their own parsers
    for tool in (diff, trace, census, bench):
        tool.register(sub, console)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["make-checkpoint"]:              # its own parser, --help included
        from .zoo import main_make_checkpoint
        return main_make_checkpoint(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError, ImportError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
