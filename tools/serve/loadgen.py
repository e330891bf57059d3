"""`python -m tools.serve bench`: a load generator for `oracle serve`, and the same work offline.

    python -m tools.serve bench --checkpoint golden/tiny-fp8 --engine cpu --concurrency 1,4,16 \
        --requests 32 --prompt 32 --new 32 [--shared-prefix 0] [--prefix-cache-mb 0] \
        [--repeats 1] [--server-cpus 0-7] [--client-procs 0] [--url http://127.0.0.1:8000] [--json]

Without --url it starts the server in a subprocess (`python -m tools.serve`, max-batch = the largest
concurrency) and stops it at the end. At each concurrency c, c clients send greedy streamed requests
back to back (client k: prompts k, k + c, ...) until --requests are done, spread over --client-procs
processes (default: one per core this process may run on), their connections open before the clock
starts: throughput (generated tokens/s over the wall time), TTFT and
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
import queue
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
    return {"ttft": ttft, "tpot": tpot, "tokens": toks, "t0": t0, "t_end": time.perf_counter()}


async def _clients(url: str, model: str, work: list[list[tuple[int, list[int]]]], new: int, go=None) -> dict:
    """One client per list in `work`, each sending its (index, prompt) requests back to back -> the
    results by index, and when the clock started. `go` (a callable, run in a thread): wait for the
    other processes' clients before starting it."""
    import httpx

    results = {}

    async def client_loop(client, items):
        for i, ids in items:
            results[i] = await _one(client, model, ids, new)

    # the clients and their connections are made before the clock starts: an httpx client costs tens of
    # milliseconds to make (its SSL context), which is the load generator's, not the server's
    clients = [httpx.AsyncClient(base_url=url, timeout=600) for _ in work]
    try:
        await asyncio.gather(*(c.get("/health") for c in clients))
        if go is not None:
            await asyncio.to_thread(go)
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(c, items) for c, items in zip(clients, work)))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return {"t0": t0, "results": results}


def _client_process(url, model, work, new, barrier, out) -> None:
    try:
        out.put(asyncio.run(_clients(url, model, work, new, barrier.wait)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent, which must not wait forever
        barrier.abort()
        out.put({"error": f"{type(e).__name__}: {e}"})


def _load(url: str, model: str, prompts, new: int, concurrency: int, procs: int = 1) -> dict:
    """`concurrency` clients, client k sending prompts k, k + concurrency, ... back to back, spread over
    `procs` processes (one event loop cannot read many streams without delaying some: its own latency
    would count as the server's). The wall: from the first client's start to the last response."""
    work = [[(i, prompts[i]) for i in range(k, len(prompts), concurrency)] for k in range(concurrency)]
    procs = max(1, min(procs, concurrency))
    if procs == 1:
        parts = [asyncio.run(_clients(url, model, work, new))]
    else:
        import multiprocessing as mp
        ctx = mp.get_context("spawn")   # (this process may hold a GPU context: no fork)
        barrier, out = ctx.Barrier(procs), ctx.Queue()
        ps = [ctx.Process(target=_client_process, args=(url, model, work[j::procs], new, barrier, out), daemon=True)
              for j in range(procs)]
        for p in ps:
            p.start()
        parts = []
        while len(parts) < len(ps):
            try:
                parts.append(out.get(timeout=1))
            except queue.Empty:
                dead = [p.exitcode for p in ps if p.exitcode not in (None, 0)]
                if dead and out.empty():
                    for p in ps:
                        p.kill()
                    raise RuntimeError(f"a client process died (exit code {dead[0]})") from None
        for p in ps:
            p.join()
        errors = [x["error"] for x in parts if "error" in x]
        if errors:
            raise RuntimeError(f"a client process failed: {errors[0]}")
    results = [None] * len(prompts)
    for x in parts:
        for i, r in x["results"].items():
            results[i] = r
    t0 = min(x["t0"] for x in parts)
    wall = max(r["t_end"] for r in results) - t0
    # a client's time without a request in flight (the load's ramp-down included: clients that are done
    # wait for the last ones): what offline generate does not have
    busy = sum(r["t_end"] - r["t0"] for r in results) / concurrency
    return {"wall": wall, "results": results, "client_idle": 1 - busy / wall}


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


def _engine_counters(url: str) -> dict:
    """The server's engine steps so far: steps, rows, mixed steps, seconds inside engine.step (/metrics)."""
    import httpx
    want = {"glm_engine_steps_total": "steps", "glm_engine_step_rows_total": "rows",
            "glm_engine_mixed_steps_total": "mixed", "glm_engine_step_seconds_sum": "seconds"}
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in want:
            out[want[name]] = float(value)
    return out


class _StepTimer:
    """Counts an engine's step calls and the seconds inside them (the offline side's breakdown)."""

    def __init__(self, engine):
        self.step = engine.step
        self.counts = {"steps": 0, "rows": 0, "mixed": 0, "seconds": 0.0}

    def __call__(self, segs):
        t0 = time.perf_counter()
        try:
            return self.step(segs)
        finally:
            c = self.counts
            c["seconds"] += time.perf_counter() - t0
            c["steps"] += 1
            c["rows"] += sum(len(s[1]) for s in segs)
            kinds = {len(s[1]) == 1 and s[3] is not None for s in segs}
            c["mixed"] += int(len(kinds) == 2)


def _breakdown(counts: dict, wall: float, tokens: int) -> dict:
    """Where one side's wall time went: engine steps (count, rows a step, share of the wall)."""
    steps = max(counts["steps"], 1)
    return {"steps": int(counts["steps"]), "rows_per_step": counts["rows"] / steps, "mixed": int(counts["mixed"]),
            "engine_s": counts["seconds"], "engine_share": counts["seconds"] / wall, "wall_s": wall,
            "ms_per_step": 1e3 * counts["seconds"] / steps, "tokens": tokens}


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
        procs = args.client_procs or len(os.sched_getaffinity(0))
        for c in levels:
            n = max(args.requests, c)
            prompts = _prompts(n, args.prompt, V, args.shared_prefix)
            _load(url, model, prompts[:c], 2, c, procs)                 # warm up
            engine.generate(prompts[:c], 2, max_batch=c)                # warm up the offline side too
            runs, res, same = [], [], True
            for _ in range(args.repeats):                               # server and offline by turns
                before = _engine_counters(url)
                load = _load(url, model, prompts, args.new, c, procs)
                after = _engine_counters(url)
                timer = _StepTimer(engine)
                engine.step = timer
                try:
                    t0 = time.perf_counter()
                    offline = engine.generate(prompts, args.new, max_batch=c)
                    t_off = time.perf_counter() - t0
                finally:
                    del engine.step
                n_server, n_off = sum(len(r["tokens"]) for r in load["results"]), sum(len(o) for o in offline)
                server, off = n_server / load["wall"], n_off / t_off
                runs.append({"server_tok_s": server, "offline_tok_s": off, "ratio": server / off,
                             "server_steps": _breakdown({k: after.get(k, 0) - before.get(k, 0) for k in timer.counts},
                                                        load["wall"], n_server),
                             "offline_steps": _breakdown(timer.counts, t_off, n_off),
                             "client_idle": load["client_idle"]})
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
                "client_procs": procs,
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
    p.add_argument("--client-procs", type=int, default=0, metavar="N",
                   help="processes the clients are spread over (default 0: one per core this process may run on, "
                        "at most one per client)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if (args.new < 2 or args.prompt < 1 or args.requests < 1 or args.repeats < 1 or args.shared_prefix < 0
            or args.prefix_cache_mb < 0 or args.client_procs < 0):
        print("error: --new must be >= 2, --prompt, --requests and --repeats >= 1, --shared-prefix, "
              "--prefix-cache-mb and --client-procs >= 0", file=sys.stderr)
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
                  f"{each}; server cpus {r['server_cpus'] or 'any'}, client cpus {r['client_cpus']} in "
                  f"{min(r['client_procs'], c)} processes)")
            for side in ("server", "offline"):   # where each side's wall went (the first timed run)
                b = x["runs"][0][f"{side}_steps"]
                idle = f"; clients without a request in flight {100 * x['runs'][0]['client_idle']:.1f} % of it" \
                    if side == "server" else ""
                print(f"  c{c} {side:>7}: {b['steps']} engine steps ({b['mixed']} mixed), {b['rows_per_step']:.1f} rows "
                      f"a step, {b['ms_per_step']:.2f} ms a step; engine {b['engine_s']:.2f} s of {b['wall_s']:.2f} s "
                      f"wall ({100 * b['engine_share']:.0f} %){idle}")
    return 0 if all(x["same_tokens_as_offline"] for x in r["levels"]) else 1
