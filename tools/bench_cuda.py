#!/usr/bin/env python3
"""Benchmarks of the CUDA engine on `slice` (real GLM-5.3-Flash widths, few layers), docs/contract.md §10.

    python tools/bench_cuda.py --slice-dir /tmp/slice [--make] [--layers 2] [--experts 288] [--json OUT]

For each release (fp8, mxfp4):
  * decode at batch 1: tokens/s and the fraction of the HBM roofline reached, where the roofline
    time per token is (active weight bytes per token) / (device-to-device copy bandwidth measured in
    this run, bytes read + written per second);
  * decode throughput at batch 8 and 32;
  * prefill tokens/s (one 512-token chunk);
  * device time per module of a decode step (CUDA events around each module's kernels);
and the same work through the peer, `transformers` glm5_next in BF16 on the same GPU (random
weights of the same shapes; the peer's speed does not depend on the values), with the ratios.

--make generates the checkpoints with tools.zoo (2 layers by default: KDA + MLA, both MoE, first
layer not dense, so every expert path is exercised; 288 experts of 2048, top 8).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

KDA, MLA = "linear_attention", "indexed_attention"


def log(*a):
    print(*a, flush=True)


def slice_overrides(layers: int, experts: int) -> dict:
    types = [KDA if i % 2 == 0 else MLA for i in range(layers)]
    return dict(num_hidden_layers=layers, layer_types=types, mlp_layer_types=["sparse"] * layers,
                indexer_types=["full"] * layers, n_routed_experts=experts)


def make_slices(root: str, layers: int, experts: int, releases, workers: int = 1) -> dict:
    from tools.zoo import make_checkpoint
    out = {}
    for rel in releases:
        d = os.path.join(root, f"slice-{rel}")
        t0 = time.perf_counter()
        make_checkpoint("slice", rel, d, workers=workers, **slice_overrides(layers, experts))
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        out[rel] = {"dir": d, "seconds": round(time.perf_counter() - t0, 1), "bytes": size}
        log(f"made {d}: {size / 1e9:.2f} GB in {out[rel]['seconds']} s")
    return out


def median_device_s(fn, warm: int, reps: int) -> float:
    """Seconds of fn's GPU work on the current stream by CUDA events: the median of reps timed calls after warm
    untimed ones (the host's launch time left out)."""
    import torch
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return float(np.median(ts))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 10 after warm-up)."""
    import torch
    n = 1 << 31  # 2 GiB
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.fill_(1)
    dt = median_device_s(lambda: b.copy_(a), warm=3, reps=10)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / dt


def decode_step_tokens(eng, caches, toks) -> list[int]:
    """One greedy decode step of every cache as generate takes it: each row's token chosen in the engine
    ("argmax": on the GPU, no logits copied to the host)."""
    return eng.step([(c, [t], None, "argmax") for c, t in zip(caches, toks)])


def time_batch_decode(eng, B: int, n: int, rng):
    """B caches, each prefilled with 8 random tokens, two warm-up decode steps, then n timed ones:
    (seconds per step, the caches, their last tokens)."""
    V = eng.config.vocab_size
    caches = [eng.new_cache() for _ in range(B)]
    eng.step([(c, [int(v) for v in rng.integers(0, V, 8)], None, "last") for c in caches])
    toks = [1] * B
    for _ in range(2):
        toks = decode_step_tokens(eng, caches, toks)
    t0 = time.perf_counter()
    for _ in range(n):
        toks = decode_step_tokens(eng, caches, toks)
    return (time.perf_counter() - t0) / n, caches, toks


def stage_ms(eng, step, n: int, digits: int) -> dict:
    """Device ms per step by module over n timed calls of step()."""
    eng.set_timing(True)
    eng.reset_stage_times()
    for _ in range(n):
        step()
    st = {k: round(v / n, digits) for k, v in eng.stage_times().items()}
    eng.set_timing(False)
    return st


def bench_engine(path: str, bw: float, steps: int, prefill_lens, batches) -> dict:
    from fast.cuda import CudaEngine
    from oracle.checkpoint import open_checkpoint
    t0 = time.perf_counter()
    eng = CudaEngine(open_checkpoint(path, verify=False))
    load = time.perf_counter() - t0
    V = eng.config.vocab_size
    rng = np.random.default_rng(0)
    res = {"load_seconds": round(load, 1), "weight_bytes_per_token": eng.weight_bytes,
           "device_weight_bytes": eng.device_bytes, "decode_path": eng.decode_path, "device": eng.device_name}
    log(f"  loaded in {load:.1f} s, {eng.device_bytes / 1e9:.2f} GB on the device, E4M3 decode: {eng.decode_path}")

    # decode at batch 1
    cache = eng.new_cache()
    eng.prefill([int(v) for v in rng.integers(0, V, 16)], cache)
    tok = 1
    for _ in range(3):
        tok = int(np.argmax(eng.decode([cache], [tok])[0]))
    per_step = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = int(np.argmax(eng.decode([cache], [tok])[0]))
        per_step.append(time.perf_counter() - t0)
    dt, med = float(np.mean(per_step)), float(np.median(per_step))
    # the bytes the measured steps read (positions 19 .. 19 + steps - 1): at short context the indexer
    # makes no query (indexer_select), so its wq_b is left out of the roofline too
    def roof_of(first: int, n: int) -> float:
        return float(np.mean([eng.decode_weight_bytes(first + i) for i in range(n)])) / bw
    roof = roof_of(16 + 3, steps)
    res["decode_weight_bytes_per_token"] = round(roof * bw)
    res["decode_b1"] = {"ms_per_token": round(dt * 1e3, 3), "tokens_per_s": round(1 / dt, 1),
                        "roofline_ms": round(roof * 1e3, 3), "roofline_fraction": round(roof / dt, 3),
                        "median_ms": round(med * 1e3, 3), "median_roofline_fraction": round(roof / med, 3)}
    log(f"  decode b1: {dt * 1e3:.3f} ms/token ({1 / dt:.1f} tok/s); roofline {roof * 1e3:.3f} ms "
        f"-> {roof / dt:.1%} of the HBM roofline (median step {med * 1e3:.3f} ms: {roof / med:.1%})")
    # the same decode as a device-resident greedy loop (no host round trip between the steps), and a
    # check that it gives the host loop's tokens from the same cache state
    prompt = [int(v) for v in rng.integers(0, V, 16)]
    ca, cb = eng.new_cache(), eng.new_cache()
    first = int(np.argmax(eng.prefill(prompt, ca)[-1]))
    eng.prefill(prompt, cb)
    host, t = [], first
    for _ in range(8):
        t = int(np.argmax(eng.decode([ca], [t])[0]))
        host.append(t)
    same = eng.greedy(cb, first, 8) == host
    t0 = time.perf_counter()
    eng.greedy(cb, host[-1], steps)
    dg = (time.perf_counter() - t0) / steps
    roof_g = roof_of(16 + 8, steps)
    res["decode_b1_greedy"] = {"ms_per_token": round(dg * 1e3, 3), "tokens_per_s": round(1 / dg, 1),
                               "roofline_fraction": round(roof_g / dg, 3), "tokens_equal_host_loop": same}
    log(f"  decode b1, device-resident greedy loop: {dg * 1e3:.3f} ms/token ({1 / dg:.1f} tok/s) -> "
        f"{roof_g / dg:.1%} of the HBM roofline; its tokens = the host loop's: {same}")
    try:
        from fast.cuda import cuda_module
        tuned = cuda_module().tuned()
    except (ImportError, AttributeError):
        tuned = []
    res["tuned"] = tuned
    for t in tuned:
        cands = ", ".join(f"{k} {v:.1f}" for k, v in t["us"].items())
        log(f"  one-token kernel for {t['fmt']} {t['R']}x{t['C']}" + (f" x{t['expert_items']} experts" if t["expert_items"] else "")
            + (" (gate and up)" if t.get("tables", 1) == 2 else "")
            + (" (heads)" if t["heads"] else "") + f" [{t['decode']}]: {t['choice']}  (us: {cands})")
    # per-module device time of decode steps
    def step1():
        nonlocal tok
        tok = int(np.argmax(eng.decode([cache], [tok])[0]))
    st = stage_ms(eng, step1, 5, 4)
    res["decode_b1_stage_ms"] = st
    log("  per-module device ms per decode step: " + ", ".join(f"{k} {v:.3f}" for k, v in st.items()))
    cache.close()

    # batched decode
    res["decode_batch"] = {}
    for B in batches:
        dt, caches, toks = time_batch_decode(eng, B, max(4, steps // 2), rng)
        res["decode_batch"][B] = {"ms_per_step": round(dt * 1e3, 3), "tokens_per_s": round(B / dt, 1)}
        log(f"  decode b{B}: {dt * 1e3:.3f} ms/step, {B / dt:.1f} tok/s")
        # where a batched step's device time goes (two timed steps)
        def stepB():
            nonlocal toks
            toks = decode_step_tokens(eng, caches, toks)
        st = stage_ms(eng, stepB, 2, 3)
        res["decode_batch"][B]["stage_ms"] = st
        ksum = sum(st.values())
        res["decode_batch"][B]["wall_over_kernels"] = round(dt * 1e3 / ksum, 3) if ksum else None
        log(f"  per-module device ms per b{B} step: " + ", ".join(f"{k} {v:.2f}" for k, v in st.items())
            + f" (sum {ksum:.2f}; the step's wall time is {dt * 1e3 / ksum:.2f}x that)" if ksum else "")
        for c in caches:
            c.close()

    for i, plen in enumerate(prefill_lens):  # (--prefill 0: decode only, an A/B run of a decode change)
        if plen <= 0:
            continue
        ids = [int(v) for v in rng.integers(0, V, plen)]
        for _ in range(2):  # warm-up: the same shape twice (kernels tuned, scratch grown)
            eng.step([(eng.new_cache(), ids, None, "last")])
        ts = []
        for _ in range(3):
            cache = eng.new_cache()
            t0 = time.perf_counter()
            eng.step([(cache, ids, None, "last")])
            ts.append(time.perf_counter() - t0)
            cache.close()
        dt = float(np.median(ts))
        row = {"tokens": plen, "seconds": round(dt, 4), "tokens_per_s": round(plen / dt, 1)}
        res.setdefault("prefill_by_len", {})[plen] = row
        log(f"  prefill {plen} tokens: {dt:.3f} s, {plen / dt:.1f} tok/s (median of 3 after 2 warm-ups)")
        if i == 0:
            res["prefill"] = row
            res["prefill_stage_ms"] = stage_ms(eng, lambda: eng.step([(eng.new_cache(), ids, None, "last")]), 1, 3)
            log("  per-module device ms of the prefill: " + ", ".join(f"{k} {v:.2f}" for k, v in res["prefill_stage_ms"].items()))
    del eng
    gc.collect()
    return res


def build_peer(cfg_dict: dict, device: str = "cuda"):
    """transformers' glm5_next text model and a BF16 lm_head with random weights of these shapes (the
    config.json fields our Config writes, Config.to_dict) -> (transformers config, model, lm_head)."""
    import torch
    from transformers import Glm5NextTextConfig, Glm5NextTextModel
    kw = {k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")}
    cfg = Glm5NextTextConfig(**dict(kw, pad_token_id=None, tie_word_embeddings=False))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Glm5NextTextModel(cfg)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype.is_floating_point:
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=g)
        for _, b in model.named_buffers():
            if b.dtype.is_floating_point:
                b.zero_()
    lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=torch.bfloat16)
    model.eval()
    return cfg, model, lm_head


def bench_peer(layers: int, experts: int, steps: int, prefill_len: int, batches, device: str = "cuda") -> dict:
    """transformers glm5_next (text model + a BF16 lm_head) in BF16 on the GPU, the same work."""
    import torch
    import transformers
    from tools.zoo import zoo_config
    t0 = time.perf_counter()
    cfg, model, lm_head = build_peer(zoo_config("slice", **slice_overrides(layers, experts)).to_dict(), device)
    res = {"transformers": transformers.__version__, "torch": torch.__version__,
           "attn_implementation": getattr(cfg, "_attn_implementation", None)}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    res["setup_seconds"] = round(time.perf_counter() - t0, 1)
    res["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    mem = torch.cuda.memory_allocated() / 1e9 if device == "cuda" else float("nan")
    log(f"  peer built in {res['setup_seconds']} s ({mem:.1f} GB); experts: "
        f"{res['experts_implementation']}")

    def run(ids, cache):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        return lm_head(out.last_hidden_state[:, -1]).float()

    from transformers import DynamicCache
    V = cfg.vocab_size
    with torch.inference_mode():
        # decode at batch 1
        cache = DynamicCache(config=cfg)
        tok = run(torch.randint(0, V, (1, 16), device=device), cache).argmax(-1, keepdim=True)
        for _ in range(3):
            tok = run(tok, cache).argmax(-1, keepdim=True)
        sync()
        n = max(4, steps // 2)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = run(tok, cache).argmax(-1, keepdim=True)
        sync()
        dt = (time.perf_counter() - t0) / n
        res["decode_b1"] = {"ms_per_token": round(dt * 1e3, 3), "tokens_per_s": round(1 / dt, 1)}
        log(f"  peer decode b1: {dt * 1e3:.3f} ms/token ({1 / dt:.1f} tok/s)")
        res["decode_batch"] = {}
        for B in batches:
            try:
                cache = DynamicCache(config=cfg)
                tok = run(torch.randint(0, V, (B, 8), device=device), cache).argmax(-1, keepdim=True)
                tok = run(tok, cache).argmax(-1, keepdim=True)
                sync()
                n = 4
                t0 = time.perf_counter()
                for _ in range(n):
                    tok = run(tok, cache).argmax(-1, keepdim=True)
                sync()
                dt = (time.perf_counter() - t0) / n
                res["decode_batch"][B] = {"ms_per_step": round(dt * 1e3, 3), "tokens_per_s": round(B / dt, 1)}
                log(f"  peer decode b{B}: {dt * 1e3:.3f} ms/step, {B / dt:.1f} tok/s")
            except Exception as e:  # noqa: BLE001 - report and go on
                res["decode_batch"][B] = {"error": f"{type(e).__name__}: {e}"[:300]}
                log(f"  peer decode b{B}: failed: {e}")
        ids = torch.randint(0, V, (1, prefill_len), device=device)
        run(ids[:, :64], DynamicCache(config=cfg))
        sync()
        t0 = time.perf_counter()
        run(ids, DynamicCache(config=cfg))
        sync()
        dt = time.perf_counter() - t0
        res["prefill"] = {"tokens": prefill_len, "seconds": round(dt, 4), "tokens_per_s": round(prefill_len / dt, 1)}
        log(f"  peer prefill {prefill_len} tokens: {dt:.3f} s, {prefill_len / dt:.1f} tok/s")
    model = lm_head = None
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slice-dir", default="/tmp/slice")
    p.add_argument("--make", action="store_true", help="generate the slice checkpoints first")
    p.add_argument("--make-only", action="store_true", help="generate the slice checkpoints and stop")
    p.add_argument("--workers", type=int, default=1, help="processes generating each checkpoint")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=288)
    p.add_argument("--releases", default="fp8,mxfp4")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prefill", default="512", help="prefill lengths, comma-separated (the first is also the peer's)")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    releases = [r for r in a.releases.split(",") if r]
    batches = [int(b) for b in a.batches.split(",") if b]
    prefill_lens = [int(v) for v in str(a.prefill).split(",") if v]
    doc = {"slice": slice_overrides(a.layers, a.experts)}
    if a.make or a.make_only:
        doc["made"] = make_slices(a.slice_dir, a.layers, a.experts, releases, a.workers)
        if a.make_only:
            return 0
    bw = copy_bandwidth()
    doc["copy_bandwidth_Bps"] = bw
    log(f"device-to-device copy: {bw / 1e12:.2f} TB/s (bytes read + written)")
    doc["engine"] = {}
    for rel in releases:
        path = os.path.join(a.slice_dir, f"slice-{rel}")
        log(f"== CUDA engine, slice-{rel}")
        doc["engine"][rel] = bench_engine(path, bw, a.steps, prefill_lens, batches)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(doc, f, indent=1, default=str)
    if not a.no_peer:
        log("== peer: transformers glm5_next, BF16")
        try:
            doc["peer"] = bench_peer(a.layers, a.experts, a.steps, prefill_lens[0], batches)
        except Exception as e:  # noqa: BLE001 - the engine's numbers stand without the peer
            doc["peer"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            log(f"  peer failed: {doc['peer']['error']}")
    # summary
    log("\n== summary (slice, %d layers, %d experts)" % (a.layers, a.experts))
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    peer = doc.get("peer", {})
    for rel, r in doc["engine"].items():
        d1 = r["decode_b1"]
        line = (f"{rel:6s} decode b1 {d1['tokens_per_s']:8.1f} tok/s ({d1['roofline_fraction']:.1%} of roofline, "
                f"{r.get('decode_weight_bytes_per_token', r['weight_bytes_per_token']) / 1e9:.3f} GB/token)")
        if "decode_b1_greedy" in r:
            g = r["decode_b1_greedy"]
            line += f" | greedy loop {g['tokens_per_s']:.1f} tok/s ({g['roofline_fraction']:.1%})"
        for B, x in r["decode_batch"].items():
            line += f" | b{B} {x['tokens_per_s']:.1f} tok/s"
        if "prefill" in r:
            line += f" | prefill {r['prefill']['tokens_per_s']:.1f} tok/s"
        log(line)
        if "decode_b1" in peer and "prefill" in r:
            ratios = {"decode_b1": d1["tokens_per_s"] / peer["decode_b1"]["tokens_per_s"],
                      "prefill": r["prefill"]["tokens_per_s"] / peer["prefill"]["tokens_per_s"]}
            for B, x in r["decode_batch"].items():
                px = peer.get("decode_batch", {}).get(B, {})
                if "tokens_per_s" in px:
                    ratios[f"decode_b{B}"] = x["tokens_per_s"] / px["tokens_per_s"]
            r["ratio_vs_peer"] = {k: round(v, 3) for k, v in ratios.items()}
            log("       vs peer (BF16): " + ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items()))
    if "decode_b1" in peer:
        log(f"peer   decode b1 {peer['decode_b1']['tokens_per_s']:.1f} tok/s | "
            + " | ".join(f"b{B} {x.get('tokens_per_s', 'n/a')}" for B, x in peer.get("decode_batch", {}).items())
            + f" | prefill {peer['prefill']['tokens_per_s']:.1f} tok/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
