"""`python -m tools.serve bench`: a load generator for `oracle serve`, and the same work offline.

    python -m tools.serve bench --checkpoint golden/tiny-fp8 --engine cpu --concurrency 1,4,16 \
        --requests 32 --prompt 32 --new 32 [--shared-prefix 0] [--prefix-cache-mb 0] \
        [--repeats 1] [--server-cpus 0-7] [--url http://127.0.0.1:8000] [--json]

Without --url it starts the server in a subprocess (`python -m tools.serve`, max-batch = the largest
concurrency) and stops it at the end. At each concurrency c, c clients send greedy streamed requests
back to back until --requests are done: throughput (generated tokens/s over the wall time), TTFT and
TPOT p50/p99 from the client's clock. Then the same prompts go through the engine's offline
`generate(prompts, new, max_batch=c)` in this process, and the two token lists are compared. Both
sides are warmed first; with --repeats N the two are timed N times by turns and the figures are the
medians. --server-cpus pins the server started here; pin this process with `taskset -c` (the server
overhead measurement: docs/perf.md, "Server overhead").
--shared-prefix N puts the same N tokens before every prompt; with --prefix-cache-mb the server
started here keeps snapshots of it (docs/serve.md, "Prefix cache"), which the warm-up fills: TTFT is
then that of a cached prefix.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _prompts(n: int, length: int, vocab: int, shared: int = 0) -> list[list[int]]:
    prefix = [(13 * i + 7) % vocab for i in range(shared)]
    return [prefix + [(37 * i + 11 * r + 5) % vocab for i in range(length)] for r in range(n)]


async def _one(client, model: str, ids: list[int], new: int) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": new, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    times, toks = [], []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"][0]
            if ch["token_ids"]:
                times.append(time.perf_counter())
                toks += ch["token_ids"]
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return {"ttft": ttft, "tpot": tpot, "tokens": toks}


async def _load(url: str, model: str, prompts, new: int, concurrency: int) -> dict:
    import httpx
    results = [None] * len(prompts)
    nxt = iter(range(len(prompts)))

    async def client_loop():
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            for i in nxt:
                results[i] = await _one(client, model, prompts[i], new)

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"wall": wall, "results": results}


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_cpus(text: str) -> set[int]:
    """'0-7,12' -> {0, ..., 7, 12}: the cores a process is pinned to (as taskset -c takes them)."""
    cpus = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"--server-cpus: a list like 0-7,12, got {text!r}") from None
    if not cpus or not cpus <= set(range(os.cpu_count() or 1)):
        raise ValueError(f"--server-cpus {text!r}: not cores of this machine (0-{(os.cpu_count() or 1) - 1})")
    return cpus


def start_server_process(checkpoint: str, engine: str, *extra: str, cpus: set[int] | None = None):
    """`python -m tools.serve --checkpoint CHECKPOINT --engine ENGINE EXTRA...` in a subprocess on a free
    port, pinned to `cpus` (with every thread it starts) when given -> (process, url) once /health answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "tools.serve", "--checkpoint", checkpoint, "--engine", engine,
           "--port", str(port), "--log-level", "warning", *extra]
    root = Path(__file__).resolve().parents[2]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen(cmd, cwd=root, env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])), preexec_fn=pin)
    url = f"http://127.0.0.1:{port}"
    import httpx
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the server did not start")
        time.sleep(0.2)


def stop_server_process(proc) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


def run(args) -> dict:
    import httpx

    from ..sides import open_side, parse_spec
    levels = [int(c) for c in args.concurrency.split(",")]
    cpus = parse_cpus(args.server_cpus) if args.server_cpus else None
    if args.url:
        proc, url = None, args.url
    else:
        proc, url = start_server_process(args.checkpoint, args.engine, "--max-batch", str(max(levels)),
                                         "--max-queue", str(4 * max(levels)),
                                         "--prefix-cache-mb", repr(args.prefix_cache_mb), cpus=cpus)
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        engine = open_side(parse_spec(args.engine), args.checkpoint).engine
        V = engine.config.vocab_size
        rows = []
        for c in levels:
            n = max(args.requests, c)
            prompts = _prompts(n, args.prompt, V, args.shared_prefix)
            asyncio.run(_load(url, model, prompts[:c], 2, c))          # warm up
            engine.generate(prompts[:c], 2, max_batch=c)                # warm up the offline side too
            runs, res, same = [], [], True
            for _ in range(args.repeats):                               # server and offline by turns
                load = asyncio.run(_load(url, model, prompts, args.new, c))
                t0 = time.perf_counter()
                offline = engine.generate(prompts, args.new, max_batch=c)
                t_off = time.perf_counter() - t0
                server = sum(len(r["tokens"]) for r in load["results"]) / load["wall"]
                off = sum(len(o) for o in offline) / t_off
                runs.append({"server_tok_s": server, "offline_tok_s": off, "ratio": server / off})
                res += load["results"]
                same = same and [r["tokens"] for r in load["results"]] == [list(o) for o in offline]
            rows.append({
                "concurrency": c, "requests": n,
                # medians over the repeats (each run's own figures in "runs")
                **{k: statistics.median(r[k] for r in runs) for k in ("server_tok_s", "offline_tok_s", "ratio")},
                "runs": runs,
                "ttft_p50_ms": 1e3 * _pct([r["ttft"] for r in res], 50),
                "ttft_p99_ms": 1e3 * _pct([r["ttft"] for r in res], 99),
                "tpot_p50_ms": 1e3 * _pct([r["tpot"] for r in res], 50),
                "tpot_p99_ms": 1e3 * _pct([r["tpot"] for r in res], 99),
                "same_tokens_as_offline": same})
        saved = [int(float(line.split()[1])) for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                 if line.startswith("glm_prefix_cache_saved_tokens_total ")]
        return {"checkpoint": args.checkpoint, "engine": args.engine, "prompt": args.prompt, "new": args.new,
                "shared_prefix": args.shared_prefix, "prefix_cache_mb": args.prefix_cache_mb,
                "prefix_saved_tokens": saved[0] if saved else None, "repeats": args.repeats,
                "server_cpus": args.server_cpus, "client_cpus": _ranges(sorted(os.sched_getaffinity(0))),
                "machine": f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}", "levels": rows}
    finally:
        if proc is not None:
            stop_server_process(proc)


def _ranges(cpus) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.serve bench", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--engine", default="cpu")
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    p.add_argument("--prefix-cache-mb", type=float, default=0, help="the started server's prefix cache")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per concurrency, server and offline by turns; the figures are their medians")
    p.add_argument("--server-cpus", default=None, metavar="LIST",
                   help="pin the server started here to these cores (0-7); pin the load generator (and its "
                        "offline engine) with taskset -c, so neither side's engine shares cores with the HTTP work")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if (args.new < 2 or args.prompt < 1 or args.requests < 1 or args.repeats < 1 or args.shared_prefix < 0
            or args.prefix_cache_mb < 0):
        print("error: --new must be >= 2, --prompt, --requests and --repeats >= 1, --shared-prefix and "
              "--prefix-cache-mb >= 0", file=sys.stderr)
        return 2
    try:
        r = run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r))
    else:
        shared = f"{r['shared_prefix']} shared + " if r["shared_prefix"] else ""
        cache = f", prefix cache {r['prefix_cache_mb']} MB" if r["prefix_cache_mb"] else ""
        print(f"{r['checkpoint']} on {r['engine']}: {shared}{r['prompt']} prompt + {r['new']} new tokens{cache} "
              f"({r['machine']})")
        print(f"{'conc':>5} {'reqs':>5} {'server tok/s':>13} {'offline tok/s':>14} {'ratio':>6} "
              f"{'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17} same")
        if r["prefix_saved_tokens"] is not None:
            print(f"prefix cache: {r['prefix_saved_tokens']} prompt tokens restored instead of prefilled")
        for x in r["levels"]:
            print(f"{x['concurrency']:>5} {x['requests']:>5} {x['server_tok_s']:>13.1f} {x['offline_tok_s']:>14.1f} "
                  f"{x['ratio']:>6.2f} {x['ttft_p50_ms']:>8.1f}/{x['ttft_p99_ms']:<8.1f} "
                  f"{x['tpot_p50_ms']:>8.2f}/{x['tpot_p99_ms']:<8.2f} {x['same_tokens_as_offline']}")
        name = Path(r["checkpoint"]).name
        for x in r["levels"]:   # one line per figure (docs/perf.md, "Server overhead")
            c, each = x["concurrency"], " ".join(f"{y['ratio']:.3f}" for y in x["runs"])
            print(f"serve c{c} / offline b{c} = {x['ratio']:.2f} ({r['engine']}, {name}; median of {r['repeats']}: "
                  f"{each}; server cpus {r['server_cpus'] or 'any'}, client cpus {r['client_cpus']})")
    return 0 if all(x["same_tokens_as_offline"] for x in r["levels"]) else 1
