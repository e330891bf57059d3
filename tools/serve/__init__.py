"""`oracle serve`: an OpenAI-compatible server whose answers do not depend on concurrency (docs/serve.md).

    oracle serve --checkpoint DIR [--engine cpu|cuda[:options]] [--host 127.0.0.1] [--port 8000]
                 [--max-batch N] [--max-queue N] [--max-step-tokens N] [--prefix-cache-mb N] [--prefix-block N]
                 [--prefix-cache-dir DIR] [--prefix-cache-disk-mb N]
                 [--speculate ngram:K|model:DIR:K]
    python -m tools.serve ...            the same without the `oracle` command

app.py: routes and request checking; scheduler.py: the continuous-batching loop that owns the engine;
metrics.py: GET /metrics; loadgen.py: the load generator (`python -m tools.serve bench`).
"""
from __future__ import annotations

import argparse
import threading
import time

from fast.core import human_bytes

__all__ = ["register", "add_arguments", "build_server", "serve_in_thread", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--engine", default="cpu", help="cpu | cuda, options after a colon (cpu:threads=4,max-context=4096)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences in the running batch")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot; more get 429")
    p.add_argument("--max-step-tokens", type=int, default=512, help="prompt + decode tokens in one engine step")
    p.add_argument("--prefix-cache-mb", type=float, default=0,
                   help="memory for snapshots of prompt prefixes, reused by later prompts that start the same (0: off)")
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="also keep the prefix cache's snapshots as files in DIR, found again after a restart")
    p.add_argument("--prefix-cache-disk-mb", type=float, default=1024,
                   help="disk for those files; the least recently used are deleted beyond it")
    p.add_argument("--prefix-block", type=int, default=16,
                   help="prefix cache granularity: snapshots are taken at multiples of this many prompt tokens")
    p.add_argument("--speculate", default=None, metavar="ngram:K|model:DIR:K",
                   help="speculative decoding (same answers): up to K drafts per step, from the sequence's own "
                        "n-grams or a smaller checkpoint with the same vocabulary")
    p.add_argument("--model-name", default=None, help="the model id clients use (default: the checkpoint's folder name)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (default: the checkpoint's)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level")


def build_server(args):
    """The Server (engine loaded, scheduler not yet started) from parsed arguments."""
    from ..sides import open_side, parse_spec, refuse_options
    from .app import Server
    spec = parse_spec(args.engine)                 # the one SPEC parser of every command
    if spec.engine not in ("cpu", "cuda"):
        raise ValueError(f"--engine {args.engine!r}: the server drives a fast engine (cpu or cuda)")
    # what a server can honour: how the engine runs, not per-request schedules or fault injection
    refuse_options(spec, ("threads", "dot", "expf", "ranks", "memory-limit", "verify-ranks", "max-context"),
                   "oracle serve")
    for flag, v, low in (("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 0),
                         ("--max-step-tokens", args.max_step_tokens, 1), ("--prefix-cache-mb", args.prefix_cache_mb, 0),
                         ("--prefix-block", args.prefix_block, 1)):
        if v < low:
            raise ValueError(f"{flag} must be >= {low}, got {v}")
    if args.prefix_cache_dir is not None and (not args.prefix_cache_mb or args.prefix_cache_disk_mb <= 0):
        raise ValueError("--prefix-cache-dir needs --prefix-cache-mb > 0 and --prefix-cache-disk-mb > 0")
    if args.speculate is not None:
        from fast.speculate import parse_speculate
        parse_speculate(args.speculate)            # refused before the engine is loaded
    engine = open_side(spec, args.checkpoint).engine
    return Server(engine, args.checkpoint, args.engine, model_name=args.model_name, max_batch=args.max_batch,
                  max_queue=args.max_queue, max_step_tokens=args.max_step_tokens, chat_template=args.chat_template,
                  prefix_cache_mb=args.prefix_cache_mb, prefix_block=args.prefix_block,
                  prefix_cache_dir=args.prefix_cache_dir, prefix_cache_disk_mb=args.prefix_cache_disk_mb,
                  speculate=getattr(args, "speculate", None))


def serve_in_thread(server, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
    """Start `server` (scheduler + uvicorn) on a thread of this process -> (uvicorn.Server, base_url).
    port 0: a free port. Stop with `uv.should_exit = True` and then server.close()."""
    import uvicorn
    server.start()
    uv = uvicorn.Server(uvicorn.Config(server.app, host=host, port=port, log_level=log_level, lifespan="off"))
    t = threading.Thread(target=uv.run, name="glm-serve-http", daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if not t.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.01)
    bound = uv.servers[0].sockets[0].getsockname()[1]
    uv.thread = t
    return uv, f"http://{host}:{bound}"


def run(args, console=None) -> int:
    import uvicorn
    server = build_server(args)
    server.start()
    if console is not None:
        console.print(f"serving {server.model_name} ({server.fingerprint}) on http://{args.host}:{args.port}")
        eng, n = server.engine, server.max_context
        console.print(f"state per sequence at {n} positions: {human_bytes(eng.sequence_bytes(n))}, "
                      f"{human_bytes(eng.available_memory())} free", markup=False)
    try:
        uvicorn.run(server.app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        server.close()
    return 0


def register(sub, console) -> None:
    """Adds `oracle serve` to the `oracle` command (tools/cli.py)."""
    p = sub.add_parser("serve", help="an OpenAI-compatible server whose answers do not depend on concurrency")
    add_arguments(p)
    p.set_defaults(func=lambda args: run(args, console))


def main(argv=None) -> int:
    import sys
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from .loadgen import main as bench_main
        return bench_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m tools.serve", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
