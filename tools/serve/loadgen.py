"""`python -m tools.serve bench`: a load generator for `oracle serve`, and the same work offline.

    python -m tools.serve bench --checkpoint golden/tiny-fp8 --engine cpu --concurrency 1,4,16 \
        --requests 32 --prompt 32 --new 32 [--shared-prefix 0] [--prefix-cache-mb 0] \
        [--url http://127.0.0.1:8000] [--json]

Without --url it starts the server in a subprocess (`python -m tools.serve`, max-batch = the largest
concurrency) and stops it at the end. At each concurrency c, c clients send greedy streamed requests
back to back until --requests are done: throughput (generated tokens/s over the wall time), TTFT and
TPOT p50/p99 from the client's clock. Then the same prompts go through the engine's offline
`generate(prompts, new, max_batch=c)` in this process, and the two token lists are compared.
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


def _start_server(args, max_batch: int):
    port = _free_port()
    cmd = [sys.executable, "-m", "tools.serve", "--checkpoint", args.checkpoint, "--engine", args.engine,
           "--port", str(port), "--max-batch", str(max_batch), "--max-queue", str(4 * max_batch),
           "--log-level", "warning", "--prefix-cache-mb", repr(args.prefix_cache_mb)]
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(cmd, cwd=root, env=dict(os.environ, PYTHONPATH=str(root)))
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


def run(args) -> dict:
    import httpx

    from ..sides import open_side, parse_spec
    levels = [int(c) for c in args.concurrency.split(",")]
    proc, url = (None, args.url) if args.url else _start_server(args, max(levels))
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        engine = open_side(parse_spec(args.engine), args.checkpoint).engine
        V = engine.config.vocab_size
        rows = []
        for c in levels:
            n = max(args.requests, c)
            prompts = _prompts(n, args.prompt, V, args.shared_prefix)
            asyncio.run(_load(url, model, prompts[:c], 2, c))          # warm up
            load = asyncio.run(_load(url, model, prompts, args.new, c))
            res = load["results"]
            gen = sum(len(r["tokens"]) for r in res)
            engine.generate(prompts[:c], 2, max_batch=c)                # warm up the offline side too
            t0 = time.perf_counter()
            offline = engine.generate(prompts, args.new, max_batch=c)
            t_off = time.perf_counter() - t0
            off_gen = sum(len(o) for o in offline)
            rows.append({
                "concurrency": c, "requests": n, "server_tok_s": gen / load["wall"],
                "offline_tok_s": off_gen / t_off, "ratio": (gen / load["wall"]) / (off_gen / t_off),
                "ttft_p50_ms": 1e3 * _pct([r["ttft"] for r in res], 50),
                "ttft_p99_ms": 1e3 * _pct([r["ttft"] for r in res], 99),
                "tpot_p50_ms": 1e3 * _pct([r["tpot"] for r in res], 50),
                "tpot_p99_ms": 1e3 * _pct([r["tpot"] for r in res], 99),
                "same_tokens_as_offline": [r["tokens"] for r in res] == [list(o) for o in offline]})
        saved = [int(float(line.split()[1])) for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                 if line.startswith("glm_prefix_cache_saved_tokens_total ")]
        return {"checkpoint": args.checkpoint, "engine": args.engine, "prompt": args.prompt, "new": args.new,
                "shared_prefix": args.shared_prefix, "prefix_cache_mb": args.prefix_cache_mb,
                "prefix_saved_tokens": saved[0] if saved else None,
                "machine": f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}", "levels": rows}
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


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
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.new < 2 or args.prompt < 1 or args.requests < 1 or args.shared_prefix < 0 or args.prefix_cache_mb < 0:
        print("error: --new must be >= 2, --prompt and --requests >= 1, --shared-prefix and --prefix-cache-mb >= 0",
              file=sys.stderr)
        return 2
    r = run(args)
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
    return 0 if all(x["same_tokens_as_offline"] for x in r["levels"]) else 1
