"""Time to first token through `oracle serve` on a cached prompt prefix vs uncached (docs/perf.md, "Prefix cache").

    python -m tools.bench_prefix --checkpoint DIR [--engine cuda] [--prefix 4096] [--tail 20] [--repeats 5]
                                 [--prefix-cache-mb 2048] [--url URL] [--json]

Starts the server (unless --url names one, which must have its prefix cache on) and sends pairs of
greedy streamed requests of one new token: a fresh prefix of --prefix tokens + a tail of its own (no
snapshot shares the prefix: the TTFT of a full prefill), then the same prefix + another tail (the
server resumes from its snapshot at the last block boundary of the prefix and prefills the rest). One
pair warms the server (the prefill and decode shapes of both), then --repeats pairs are timed; the
figures are the medians. TTFT is the client's time from sending the request to the chunk holding the
token. "Uncached" is a miss with the cache on (the prefill, and the snapshots it leaves). That the
resumed answers have the bits of cold ones is tests/test_prefix_cache.py's job; this
reports the prompt tokens the server restored instead of prefilling (its /metrics), so that a run in
which the cache was not used shows as such.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def _ttft(client, model: str, ids: list[int]) -> tuple[float, list[int]]:
    """One greedy streamed request of one new token -> (seconds to the chunk with the token, token ids)."""
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first, toks = None, []
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])["choices"][0]
                if ch["token_ids"] and first is None:
                    first = time.perf_counter() - t0
                toks += ch["token_ids"]
    if first is None:
        raise RuntimeError("the answer held no token")
    return first, toks


def _metric(client, name: str) -> int:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return int(float(line.split()[1]))
    return 0


def run(args) -> dict:
    import httpx

    from tools.serve.loadgen import start_server_process, stop_server_process
    proc, url = (None, args.url) if args.url else start_server_process(
        args.checkpoint, args.engine, "--prefix-cache-mb", repr(args.prefix_cache_mb),
        *(("--max-step-tokens", str(args.max_step_tokens)) if args.max_step_tokens else ()))
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            health = c.get("/health").json()
            model = c.get("/v1/models").json()["data"][0]["id"]
            if args.prefix + args.tail + 1 > health["max_context"]:
                raise ValueError(f"--prefix {args.prefix} + --tail {args.tail} exceed the server's max_context "
                                 f"{health['max_context']} (give the engine max-context=N)")
            vocab = json.loads((Path(args.checkpoint) / "config.json").read_text())["vocab_size"]
            rng = random.Random(2026)
            cold, warm = [], []
            for rep in range(args.repeats + 1):                     # pair 0 warms the server
                prefix = [rng.randrange(vocab) for _ in range(args.prefix)]
                a, b = ([rng.randrange(vocab) for _ in range(args.tail)] for _ in range(2))
                b[0] = (a[0] + 1) % vocab                            # the tails part at their first token
                saved0 = _metric(c, "glm_prefix_cache_saved_tokens_total")
                t_cold, _ = _ttft(c, model, prefix + a)
                t_warm, _ = _ttft(c, model, prefix + b)
                saved = _metric(c, "glm_prefix_cache_saved_tokens_total") - saved0
                if rep:
                    cold.append(t_cold)
                    warm.append(t_warm)
                    print(f"  pair {rep}: uncached {1e3 * t_cold:.1f} ms, cached {1e3 * t_warm:.1f} ms, "
                          f"{saved} prompt tokens restored", file=sys.stderr)
            restored = _metric(c, "glm_prefix_cache_saved_tokens_total")
    finally:
        if proc is not None:
            stop_server_process(proc)
    return {"checkpoint": args.checkpoint, "engine": args.url or args.engine,
            "prefix": args.prefix, "tail": args.tail, "repeats": args.repeats,
            "ttft_uncached_ms": [1e3 * t for t in cold], "ttft_cached_ms": [1e3 * t for t in warm],
            "ttft_uncached_p50_ms": 1e3 * statistics.median(cold), "ttft_cached_p50_ms": 1e3 * statistics.median(warm),
            "speedup": statistics.median(cold) / statistics.median(warm), "restored_tokens": restored}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench_prefix", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--engine", default="cpu", help="the started server's engine SPEC (cpu | cuda[:options])")
    p.add_argument("--url", default=None, help="a running server with its prefix cache on (default: start one)")
    p.add_argument("--prefix", type=int, default=4096, help="tokens of the shared prefix")
    p.add_argument("--tail", type=int, default=20, help="tokens after it, different in the two requests of a pair")
    p.add_argument("--repeats", type=int, default=5, help="timed pairs (after one that warms)")
    p.add_argument("--prefix-cache-mb", type=float, default=2048, help="the started server's prefix cache")
    p.add_argument("--max-step-tokens", type=int, default=None, help="the started server's step budget (default: its own)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.prefix < 1 or a.tail < 1 or a.repeats < 1 or a.prefix_cache_mb <= 0:
        print("error: --prefix, --tail and --repeats must be >= 1 and --prefix-cache-mb > 0", file=sys.stderr)
        return 2
    try:
        r = run(a)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(r))
    else:
        print(f"TTFT {r['prefix']}-token prefix + {r['tail']}: uncached {r['ttft_uncached_p50_ms']:.1f} ms, cached "
              f"{r['ttft_cached_p50_ms']:.1f} ms = {r['speedup']:.1f}x ({r['engine']}, {Path(r['checkpoint']).name}; "
              f"median of {r['repeats']}; {r['restored_tokens']} prompt tokens restored)")
    return 0 if r["restored_tokens"] > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
