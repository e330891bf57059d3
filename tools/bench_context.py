#!/usr/bin/env python3
"""Long context on the CUDA engine (issue 18's table): decode at batch 1 and prefill as the context grows.

    python tools/bench_context.py --checkpoint /tmp/slice/slice-fp8 [--contexts 1024,4096,...,131072]
                                  [--chunk 8192] [--steps 32] [--repeats 5] [--json OUT]

One sequence is prefilled with random tokens in chunks of --chunk up to each context in turn (the
prefill rate reported for a context is that of the chunks that brought the sequence there, so the
128K figure is the rate at 64K..128K). At each context a fork of the sequence decodes --steps greedy
tokens on the device (`CudaEngine.greedy`, the generate path) after one untimed warm-up call on
another fork; the median of --repeats such calls, each on a fresh fork, is reported, with the device
time of the indexer per decode step (CUDA events around mla.indexer; one separate timed run, since
timing adds events) and the sequence's state (Engine.sequence_memory). Then one more prefill chunk
on a fork with the stage timers on: where a chunk's time goes at that context. Last, the indexer's
scoring kernels alone at the longest context up to --kernels-at (`fast._cuda.index_scores`: --chunk queries of the real
widths against its pools, random values, per-row and tiled kernels and the selection, median of 5
launches after two untimed ones, and whether the two kernels' bits agree). Nothing else here is
compared: the engine's bits at long context are checked by the tests (CPU = CUDA), not by this script.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def log(*a):
    print(*a, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--contexts", default="1024,2048,4096,16384,32768,65536,131072")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk (tokens per step)")
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed call")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kernels-at", type=int, default=131072,
                   help="the scoring kernels alone at the longest context up to this (the per-row one is slow)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from fast.core import human_bytes
    from fast.cuda import CudaEngine
    from oracle.checkpoint import open_checkpoint

    contexts = sorted(int(c) for c in a.contexts.split(","))
    ck = open_checkpoint(a.checkpoint, verify=False)
    limit = int(ck.config.max_position_embeddings)
    # room for the decode steps and the timed extra chunk after the longest context (within the model's limit)
    room = min(limit, contexts[-1] + max(a.steps, a.chunk) + 8)
    if contexts[-1] + a.steps > room:
        p.error(f"--contexts: {contexts[-1]} positions + {a.steps} decode steps exceed the model's {limit}")
    eng = CudaEngine(ck, max_context=room)
    cfg = eng.config
    log(f"{a.checkpoint}: {eng.device_name}, {cfg.num_hidden_layers} layers, index_topk {cfg.index_topk}, "
        f"kpool {cfg.index_kpool}; state at {contexts[-1]} positions {human_bytes(eng.sequence_bytes(contexts[-1]))}")
    rng = np.random.default_rng(0)
    V = cfg.vocab_size
    seq = eng.new_cache().reserve(room)  # (forks keep the room: no growth while timed)
    # warm the prefill path (kernels tuned, buffers made) on a throwaway sequence
    eng.prefill([int(v) for v in rng.integers(0, V, min(a.chunk, contexts[0]))], eng.new_cache())
    rows = []
    last = None
    for ctx in contexts:
        n = ctx - seq.length
        t0 = time.perf_counter()
        for i in range(0, n, a.chunk):
            m = min(a.chunk, n - i)
            lg = eng.step([(seq, [int(v) for v in rng.integers(0, V, m)], None, "last")])[0]
            last = int(np.argmax(lg[-1]))
        prefill = n / (time.perf_counter() - t0)
        warm = seq.fork()
        eng.greedy(warm, last, a.steps)
        warm.close()
        times = []
        for _ in range(a.repeats):
            f = seq.fork()
            t0 = time.perf_counter()
            eng.greedy(f, last, a.steps)
            times.append((time.perf_counter() - t0) / a.steps)
            f.close()
        f = seq.fork()
        eng.set_timing(True)
        eng.reset_stage_times()
        tok = last
        for _ in range(8):
            tok = int(np.argmax(eng.decode([f], [tok])[0]))
        st = {k: v / 8 for k, v in eng.stage_times().items()}
        eng.set_timing(False)
        f.close()
        # one more chunk on a fork, timed per stage
        f = seq.fork()
        m = min(a.chunk, ctx, room - ctx)
        eng.set_timing(True)
        eng.reset_stage_times()
        t0 = time.perf_counter()
        eng.step([(f, [int(v) for v in rng.integers(0, V, m)], None, "last")])
        chunk_s = time.perf_counter() - t0
        pst = eng.stage_times()
        eng.set_timing(False)
        f.close()
        med = float(np.median(times))
        idx = st.get("mla.indexer", float("nan"))
        row = {"context": ctx, "prefill_tok_s": round(prefill, 1), "decode_tok_s": round(1 / med, 1),
               "decode_ms": round(med * 1e3, 4), "indexer_ms": round(idx, 4),
               "state_bytes": eng.sequence_bytes(ctx), "stage_ms": {k: round(v, 4) for k, v in st.items()}}
        row["prefill_chunk"] = {"tokens": m, "ms": round(chunk_s * 1e3, 2),
                                "stage_ms": {k: round(v, 3) for k, v in pst.items()}}
        rows.append(row)
        log(f"  {ctx:>7} positions: prefill {prefill:8.0f} tok/s | decode b1 {1 / med:7.1f} tok/s "
            f"({med * 1e3:.3f} ms) | mla.indexer {idx:.3f} ms | state {human_bytes(row['state_bytes'])}")
        top = sorted(pst.items(), key=lambda kv: -kv[1])[:6]
        log(f"           a chunk of {m} more: {chunk_s * 1e3:.1f} ms, stages " +
            ", ".join(f"{k} {v:.1f}" for k, v in top))
    kctx = max([c for c in contexts if c <= a.kernels_at] or [contexts[0]])
    kern = indexer_kernels(cfg, kctx, min(a.chunk, kctx))
    if kern:
        log(f"  indexer kernels alone, {kern['queries']} queries at {kctx - kern['queries']}..{kctx - 1}: "
            f"per-row {kern['per_row_ms']:.2f} ms, tiled {kern['tiled_ms']:.2f} ms "
            f"({kern['per_row_ms'] / kern['tiled_ms']:.1f}x), selection {kern['select_ms']:.2f} ms; "
            f"same bits: {kern['same_bits']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"checkpoint": a.checkpoint, "device": eng.device_name, "chunk": a.chunk, "steps": a.steps,
                       "repeats": a.repeats, "rows": rows, "indexer_kernels": kern}, f, indent=1)
    return 0


def indexer_kernels(cfg, ctx: int, n: int) -> dict | None:
    """The scoring kernels alone: n queries at positions ctx-n..ctx-1 with the config's widths, random
    values (time does not depend on them); None when the tiled kernel does not apply."""
    from fast.cuda import cuda_module
    cu = cuda_module()
    ni, di, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    budget = cfg.index_topk // kp
    rng = np.random.default_rng(1)
    pos = list(range(ctx - n, ctx))
    q = rng.standard_normal((n, ni, di), dtype=np.float32)
    w = rng.standard_normal((n, ni), dtype=np.float32)
    keys = rng.standard_normal((ctx // kp, di), dtype=np.float32)
    try:
        a = cu.index_scores(q, w, keys, pos, kp, budget, False, 5)
        b = cu.index_scores(q, w, keys, pos, kp, budget, True, 5)
    except ValueError as e:
        log(f"  indexer kernels alone: {e}")
        return None
    return {"queries": n, "context": ctx, "per_row_ms": a["ms"], "tiled_ms": b["ms"], "select_ms": b["select_ms"],
            "same_bits": bool(np.array_equal(a["scores"].view(np.uint32), b["scores"].view(np.uint32)))}


if __name__ == "__main__":
    sys.exit(main())
