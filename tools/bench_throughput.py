#!/usr/bin/env python3
"""Throughput of the CUDA engine and of the warmed transformers peer, in one process (issue 19's method).

    python tools/bench_throughput.py --checkpoint /tmp/slice/slice-fp8 [--batches 1,8,32,64,128,256]
        [--prefill 512,2048,8192,16384] [--warm 2] [--reps 5] [--no-peer] [--json OUT]

Decode at batch B: B sequences, each prefilled with 8 tokens, then greedy steps of one token per
sequence (the token chosen on the GPU on both sides). Prefill at length L: one sequence's L-token prompt
in one step, a new cache each pass. Each side and shape: --warm untimed passes of exactly the timed
work, then --reps timed ones; the figure is their median (a first pass of a PyTorch model can be 5-36x
slower than its second, docs/perf.md "Peer").

The step roofline is max(bytes the step reads / the copy bandwidth, FLOPs / the FFMA peak), both
ceilings measured in this run (`fast._cuda.bench_ffma`; a device-to-device copy). Bytes: every weight
but the embedding (a gather of B rows), the routed experts as many as B tokens with top-k routing touch
when the router spreads them evenly (E (1 - (1 - k/E)^B) of E; the zoo's random routers are close to
that); FLOPs: 2 x the multiply-adds of the linear layers (experts k of E per token; the MXFP4 codes two a
byte) x tokens, the head's x the rows that want it (every row of a decode step, the last of a prefill:
both sides compute no other); attention's own products are left out (a few percent at these lengths). The peer is
transformers' glm5_next in BF16 with random weights of the checkpoint's shapes (its speed does not
depend on the values) and a BF16 lm_head.
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import re
import statistics
import struct
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_EXPERT = re.compile(r"\.experts\.\d+\.")


def log(*a):
    print(*a, flush=True)


def weight_census(path: str) -> dict:
    """From the checkpoint's safetensors headers: bytes of the non-expert weights (embedding excluded),
    bytes of all routed experts, and the linear layers' multiply-adds per token (dense but the head; the
    head, lm_head; all experts)."""
    dense_b = expert_b = 0
    dense_mac = expert_mac = head_mac = embed_mac = 0
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for key, t in header.items():
            if key == "__metadata__":
                continue
            if "embed_tokens" in key:  # (a gather; the head's matrix when the embeddings are tied)
                embed_mac = int(np.prod(t["shape"]))
                continue
            nbytes = t["data_offsets"][1] - t["data_offsets"][0]
            shape = t["shape"]
            expert = bool(_EXPERT.search(key))
            linear = len(shape) == 2 and (key.endswith(".weight") and "norm" not in key or key.endswith("_fn"))
            mac = int(np.prod(shape)) * (2 if t["dtype"] == "U8" else 1) if linear else 0
            if expert:
                expert_b, expert_mac = expert_b + nbytes, expert_mac + mac
            elif key.startswith("lm_head."):
                dense_b, head_mac = dense_b + nbytes, head_mac + mac
            else:
                dense_b, dense_mac = dense_b + nbytes, dense_mac + mac
    return {"dense_bytes": dense_b, "expert_bytes": expert_b, "dense_mac": dense_mac, "expert_mac": expert_mac,
            "head_mac": head_mac or embed_mac}


def roofline_s(census: dict, cfg, tokens: int, head_rows: int, bw: float, peak: float) -> tuple[float, str]:
    """(the step's roofline in seconds, which ceiling binds) for a step of `tokens` tokens of which
    `head_rows` want logits (a decode step: all; a prefill: its last)."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = E * (1 - (1 - k / E) ** tokens)
    bytes_ = census["dense_bytes"] + census["expert_bytes"] * touched / E
    flops = 2.0 * (tokens * (census["dense_mac"] + census["expert_mac"] * k / E) + head_rows * census["head_mac"])
    return ceiling_s(bytes_, flops, bw, peak)


def ceiling_s(bytes_: float, flops: float, bw: float, peak: float) -> tuple[float, str]:
    """(max(bytes / bandwidth, FLOPs / peak) in seconds, which binds: "HBM" or "FFMA")."""
    t_mem, t_fma = bytes_ / bw, flops / peak
    return (t_mem, "HBM") if t_mem >= t_fma else (t_fma, "FFMA")


def median_of(fn, warm: int, reps: int, sync=lambda: None) -> float:
    for _ in range(warm):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_engine(path: str, batches, prefills, warm: int, reps: int) -> dict:
    from fast.cuda import CudaEngine
    eng = CudaEngine(path)
    V = eng.config.vocab_size
    rng = np.random.default_rng(0)
    out = {"decode": {}, "prefill": {}}
    for B in batches:
        caches = [eng.new_cache() for _ in range(B)]
        eng.step([(c, rng.integers(0, V, 8).tolist(), None, "argmax") for c in caches])
        toks = [1] * B

        def step():
            nonlocal toks
            toks = eng.step([(c, [t], None, "argmax") for c, t in zip(caches, toks)])
        hb0 = eng.head_bound_stats()
        dt = median_of(step, warm, reps)
        out["decode"][B] = dt
        log(f"  engine decode b{B}: {dt * 1e3:.3f} ms a step, {B / dt:.1f} tok/s")
        hb = {k: v - hb0.get(k, 0) for k, v in eng.head_bound_stats().items() if k != "max_candidates"}
        if hb.get("rows"):  # (how tight the bounded head's intervals were on these steps)
            log(f"    bounded head: {hb['candidates'] / hb['rows']:.2f} candidates a row (at most "
                f"{eng.head_bound_stats()['max_candidates']} so far), full head on {hb['full_steps']} steps")
        for c in caches:
            c.close()
    for L in prefills:
        ids = rng.integers(0, V, L).tolist()

        def prefill():
            c = eng.new_cache()
            eng.step([(c, ids, None, "argmax")])
            c.close()
        dt = median_of(prefill, warm, reps)
        out["prefill"][L] = dt
        log(f"  engine prefill {L}: {dt * 1e3:.1f} ms, {L / dt:.1f} tok/s")
    del eng
    gc.collect()
    return out


def bench_peer(cfg_dict: dict, batches, prefills, warm: int, reps: int) -> dict:
    import torch
    import transformers
    from transformers import DynamicCache

    from tools.bench_cuda import build_peer
    cfg, model, lm_head = build_peer(cfg_dict)
    V = cfg.vocab_size
    sync = torch.cuda.synchronize
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "decode": {}, "prefill": {},
           "experts_implementation": getattr(model.config, "_experts_implementation", None)}

    def run(ids, cache):
        h = model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
        return lm_head(h).argmax(-1, keepdim=True)

    with torch.inference_mode():
        for B in batches:
            try:
                cache = DynamicCache(config=cfg)
                tok = run(torch.randint(0, V, (B, 8), device="cuda"), cache)

                def step():
                    nonlocal tok
                    tok = run(tok, cache)
                dt = median_of(step, warm, reps, sync)
                out["decode"][B] = dt
                log(f"  peer decode b{B}: {dt * 1e3:.3f} ms a step, {B / dt:.1f} tok/s")
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: reported, the others go on
                out["decode"][B] = f"{type(e).__name__}: {str(e)[:200]}"
                log(f"  peer decode b{B}: failed: {out['decode'][B]}")
            cache = tok = None
            torch.cuda.empty_cache()
        for L in prefills:
            try:
                ids = torch.randint(0, V, (1, L), device="cuda")
                dt = median_of(lambda: run(ids, DynamicCache(config=cfg)), warm, reps, sync)
                out["prefill"][L] = dt
                log(f"  peer prefill {L}: {dt * 1e3:.1f} ms, {L / dt:.1f} tok/s")
            except Exception as e:  # noqa: BLE001
                out["prefill"][L] = f"{type(e).__name__}: {str(e)[:200]}"
                log(f"  peer prefill {L}: failed: {out['prefill'][L]}")
            torch.cuda.empty_cache()
    model = lm_head = None
    gc.collect()
    torch.cuda.empty_cache()
    return out


def table_row(kind: str, n: int, engine_s: float, peer: float | str | None, roof: float, bound: str) -> dict:
    """One shape's figures. `peer` is the peer's seconds, or its error, or None. `peer_of_roofline` is the
    share of this step's roofline that the peer's time is: the engine must reach it to be as fast as the peer
    (the roofline leaves attention's products out, so the true share is a little higher)."""
    peer_s = peer if isinstance(peer, float) else None
    return {"kind": kind, "n": n, "engine_s": engine_s, "engine_tok_s": n / engine_s, "roofline_s": roof,
            "bound": bound, "of_roofline": roof / engine_s,
            "peer_s": peer_s, "peer_tok_s": n / peer_s if peer_s else None,
            "peer_of_roofline": roof / peer_s if peer_s else None,
            "peer_error": peer if isinstance(peer, str) else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--prefill", default="512,2048,8192,16384")
    p.add_argument("--warm", type=int, default=2, help="untimed passes of each shape, each side")
    p.add_argument("--reps", type=int, default=5, help="timed passes; the figure is their median")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.warm < 2 or a.reps < 5:
        p.error("issue 19's method: --warm >= 2 and --reps >= 5")
    import fast._cuda as cu
    from oracle.checkpoint import open_checkpoint
    from tools.bench_cuda import copy_bandwidth
    batches = [int(b) for b in a.batches.split(",") if b]
    prefills = [int(v) for v in a.prefill.split(",") if v]
    with open_checkpoint(a.checkpoint, verify=False) as ck:
        cfg = ck.config
    census = weight_census(a.checkpoint)
    bw, peak = copy_bandwidth(), cu.bench_ffma(5)
    log(f"{a.checkpoint}: copy {bw / 1e12:.2f} TB/s (read + written), FFMA peak {peak / 1e12:.1f} TFLOP/s; "
        f"weights {census['dense_bytes'] / 1e9:.2f} GB dense + {census['expert_bytes'] / 1e9:.2f} GB routed experts; "
        f"multiply-adds a token {census['dense_mac'] / 1e6:.1f} M dense + {census['expert_mac'] / 1e6:.1f} M all experts "
        f"+ {census['head_mac'] / 1e6:.1f} M head a row that wants logits")
    log("== CUDA engine")
    eng = bench_engine(a.checkpoint, batches, prefills, a.warm, a.reps)
    peer = None
    if not a.no_peer:
        log("== peer: transformers glm5_next, BF16, warmed the same way")
        try:
            peer = bench_peer(cfg.to_dict(), batches, prefills, a.warm, a.reps)
        except Exception as e:  # noqa: BLE001 - the engine's figures stand without it
            peer = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            log(f"  peer failed: {peer['error']}")
    rows = []
    for kind, shapes in (("decode", batches), ("prefill", prefills)):
        for n in shapes:
            roof, bound = roofline_s(census, cfg, n, n if kind == "decode" else 1, bw, peak)
            rows.append(table_row(kind, n, eng[kind][n], (peer or {}).get(kind, {}).get(n), roof, bound))
    log(f"\n{'shape':>14} {'engine tok/s':>13} {'roofline':>9} {'% of it':>8} {'peer tok/s':>11} {'engine/peer':>12} "
        f"{'peer, % of roofline':>20}")
    for r in rows:
        name = f"decode b{r['n']}" if r["kind"] == "decode" else f"prefill {r['n']}"
        peer_s = f"{r['peer_tok_s']:11.1f} {r['engine_tok_s'] / r['peer_tok_s']:11.2f}x " \
                 f"{100 * r['peer_of_roofline']:19.1f}%" if r["peer_tok_s"] else \
            f"{'failed' if r['peer_error'] else '-':>11} {'':>12} {'':>20}"
        log(f"{name:>14} {r['engine_tok_s']:13.1f} {r['bound']:>9} {100 * r['of_roofline']:7.1f}% {peer_s}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"checkpoint": a.checkpoint, "copy_Bps": bw, "ffma_flops": peak, "census": census,
                       "warm": a.warm, "reps": a.reps, "rows": rows, "peer": peer and {k: v for k, v in peer.items()
                                                                                      if k not in ("decode", "prefill")}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
