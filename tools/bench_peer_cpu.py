"""The CPU engine against the peer on the same work (docs/engine_cpu.md, docs/contract.md §10).

The peer is transformers' glm5_next text model (`Glm5NextTextModel`, BF16; eager attention and eager
experts unless --attn / --experts pick another of transformers' implementations) on torch's CPU
backend, loaded from the same checkpoint (`small-bf16` of the zoo: the original layout with the
`model.` prefix, which `from_pretrained` maps; the TextModel has no head, so the logits are
`lm_head.weight` from the checkpoint applied to the last hidden state, in BF16 as a CausalLM would).

    python tools/bench_peer_cpu.py                     # generates small-bf16 into a temp dir first
    python tools/bench_peer_cpu.py --ckpt /tmp/zoo/small-bf16 --threads 1,2 --json

For each thread count (torch.set_num_threads for the peer, threads= for fast.Engine) and the same
prompt: prefill tokens/s (one forward over the prompt) and greedy decode tokens/s (each side feeds its
own tokens; the peer with its own cache, use_cache=True). Runs alternate peer / engine with a pause
between them (torch's OpenMP workers keep spinning for a while after a parallel region, which would
take the second core from the engine), after `warmup` untimed passes of the same work on each side, the
median of `reps`; the load average is recorded around every run (the VM is shared with other jobs). The report
gives engine / peer ratios and how many greedy tokens agree (the peer is BF16 torch, not the canonical
numerics, so they may part).

With --batches B1,B2,..: batched greedy decode too, as tools/bench_throughput.py times it on the GPU.
B sequences, each prefilled with the same 8 tokens on both sides, then one-token steps for all B at once
(the peer: one forward of a [B, 1] batch with its DynamicCache and the argmax of lm_head; the engine:
one Engine.step of B "argmax" segments), each side feeding its own tokens; the figure is a step's median
after `warmup` untimed steps, and the report counts the sequences whose last token agrees.

    python tools/bench_peer_cpu.py --ckpt /tmp/eng/slice-bf16 --threads 1,2 --batches 8,32
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import numpy as np

__all__ = ["run_peer_bench", "format_peer_report"]


def _load():
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


PEER_ATTN = ("eager", "sdpa")
PEER_EXPERTS = ("eager", "grouped_mm", "batched_mm")


def load_peer(path: str, attn: str = "eager", experts: str = "eager"):
    """The peer on path's weights, with transformers' attention and experts implementations `attn` and
    `experts` (their CPU-capable ones: PEER_ATTN, PEER_EXPERTS), and the head's BF16 weight."""
    import torch
    from transformers import Glm5NextTextModel
    from transformers.utils import logging as tlog

    if attn not in PEER_ATTN or experts not in PEER_EXPERTS:
        raise ValueError(f"peer implementations: attention one of {PEER_ATTN}, experts one of {PEER_EXPERTS}; "
                         f"got {attn!r}, {experts!r}")
    tlog.set_verbosity_error()
    model, info = Glm5NextTextModel.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=attn,
                                                    experts_implementation=experts, output_loading_info=True)
    if info["missing_keys"] or info["mismatched_keys"]:
        raise RuntimeError(f"peer load of {path}: missing {sorted(info['missing_keys'])[:5]}, "
                           f"mismatched {list(info['mismatched_keys'])[:5]}")
    extra = set(info["unexpected_keys"]) - {"lm_head.weight"}
    if extra:
        raise RuntimeError(f"peer load of {path}: unexpected tensors {sorted(extra)[:5]}")
    model.eval()
    # the head (tied or not, from whichever file holds it) by the project's checkpoint reader: BF16 bits
    from oracle.checkpoint import open_checkpoint

    with open_checkpoint(path, verify=False) as ck:
        bits = np.array(ck.raw("lm_head").data, dtype=np.uint16)
    return model, torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def peer_run(model, head, ids: list[int], new: int):
    """(prefill seconds, decode seconds for new - 1 tokens, greedy tokens)."""
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True)
        tok = int(torch.nn.functional.linear(out.last_hidden_state[:, -1], head).float().argmax())
        t1 = time.perf_counter()
        pkv, toks = out.past_key_values, [tok]
        for _ in range(new - 1):
            out = model(torch.tensor([[toks[-1]]]), past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            toks.append(int(torch.nn.functional.linear(out.last_hidden_state[:, -1], head).float().argmax()))
        return t1 - t0, time.perf_counter() - t1, toks


def engine_run(eng, ids: list[int], new: int):
    cache = eng.new_cache()
    t0 = time.perf_counter()
    # (the last row's greedy token, as the peer computes lm_head on its last hidden state only)
    tok = int(eng.step([(cache, ids, None, "argmax")])[0])
    t1 = time.perf_counter()
    toks = [tok]
    for _ in range(new - 1):
        toks.append(int(eng.step([(cache, [toks[-1]], None, "argmax")])[0]))
    return t1 - t0, time.perf_counter() - t1, toks


def batch_prompts(B: int, V: int) -> np.ndarray:
    """The B 8-token prompts both sides take at batch B."""
    return np.random.default_rng(B).integers(0, V, (B, 8))


def peer_batch_step(model, head, prompts: np.ndarray, warmup: int, reps: int) -> tuple[float, list[int]]:
    """(median seconds of one greedy decode step of the prompts' B sequences on the peer, the tokens its last
    step chose)."""
    import torch
    from transformers import DynamicCache

    from tools.bench_throughput import median_of
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)

        def run(x):
            h = model(input_ids=x, past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
            return torch.nn.functional.linear(h, head).argmax(-1, keepdim=True)
        tok = run(torch.from_numpy(prompts))

        def step():
            nonlocal tok
            tok = run(tok)
        return median_of(step, warmup, reps), tok[:, 0].tolist()


def engine_batch_step(eng, prompts: np.ndarray, warmup: int, reps: int) -> tuple[float, list[int]]:
    """The same on the engine: one Engine.step of B "argmax" segments a step."""
    from tools.bench_throughput import median_of
    caches = [eng.new_cache() for _ in range(len(prompts))]
    toks = eng.step([(c, p.tolist(), None, "argmax") for c, p in zip(caches, prompts)])

    def step():
        nonlocal toks
        toks = eng.step([(c, [t], None, "argmax") for c, t in zip(caches, toks)])
    try:
        return median_of(step, warmup, reps), toks
    finally:
        for c in caches:
            c.close()


def run_peer_bench(path: str | None = None, prompt: int = 64, new: int = 32, threads=(1, 2), reps: int = 5,
                   progress=None, pause: float = 1.0, warmup: int = 2, batches=(), attn: str = "eager",
                   experts: str = "eager") -> dict:
    import torch
    import transformers

    import fast

    say = progress or (lambda msg: None)
    tmp = None
    if path is None:
        from tools.zoo import make_zoo
        tmp = tempfile.TemporaryDirectory(prefix="bench_peer_")
        say(f"generating small-bf16 into {tmp.name}")
        make_zoo("small", tmp.name, releases=("bf16",))
        path = os.path.join(tmp.name, "small-bf16")
    try:
        cpu = ""
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        rep = {"checkpoint": path, "prompt": prompt, "new": new, "reps": reps, "warmup": warmup, "statistic": "median",
               "machine": {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                           "torch": torch.__version__, "transformers": transformers.__version__,
                           "load_1min_start": _load()},
               "peer": {"model": f"transformers Glm5NextTextModel, bfloat16, {attn} attention, {experts} experts",
                        "attn_implementation": attn, "experts_implementation": experts},
               "runs": {}}
        model, head = load_peer(path, attn, experts)
        V = head.shape[0]
        ids = [(37 * i + 11) % V for i in range(prompt)]
        for th in threads:
            say(f"{th} thread(s)")
            torch.set_num_threads(th)
            eng = fast.Engine(path, threads=th)
            for _ in range(warmup):  # untimed passes of the timed work on both sides (a first torch pass is slow)
                peer_run(model, head, ids, new)
                time.sleep(pause)
                engine_run(eng, ids, new)
                time.sleep(pause)
            p_runs, e_runs, loads = [], [], []
            for _ in range(reps):
                l0 = _load()
                p_runs.append(peer_run(model, head, ids, new))
                time.sleep(pause)  # torch's OpenMP workers spin a while after a parallel region
                l1 = _load()
                e_runs.append(engine_run(eng, ids, new))
                time.sleep(pause)
                loads.append((l0, l1, _load()))
            med = lambda runs, k: float(np.median([r[k] for r in runs]))  # noqa: E731
            pp, pd, ep, ed = med(p_runs, 0), med(p_runs, 1), med(e_runs, 0), med(e_runs, 1)
            ptoks, etoks = p_runs[0][2], e_runs[0][2]
            agree = next((i for i, (a, b) in enumerate(zip(ptoks, etoks)) if a != b), len(etoks))
            rep["runs"][th] = {
                "peer": {"prefill_tok_s": prompt / pp, "decode_tok_s": (new - 1) / pd},
                "engine": {"prefill_tok_s": prompt / ep, "decode_tok_s": (new - 1) / ed},
                "prefill_ratio": pp / ep, "decode_ratio": pd / ed,
                "greedy_tokens_agreeing": agree,
                "load_1min_before_peer_engine_after": loads,
                "batch_decode": {},
            }
            for B in batches:  # each side's warm-up and repeats in turn, a pause between them
                say(f"{th} thread(s), batch {B}")
                prompts = batch_prompts(B, V)
                ps, ptoks = peer_batch_step(model, head, prompts, warmup, reps)
                time.sleep(pause)
                es, etoks = engine_batch_step(eng, prompts, warmup, reps)
                time.sleep(pause)
                rep["runs"][th]["batch_decode"][B] = {
                    "peer_tok_s": B / ps, "engine_tok_s": B / es, "ratio": ps / es,
                    "steps": 1 + warmup + reps,  # after the prompts' step
                    "sequences_agreeing": sum(a == b for a, b in zip(ptoks, etoks))}
            del eng
        rep["machine"]["load_1min_end"] = _load()
        return rep
    finally:
        if tmp is not None:
            tmp.cleanup()


def format_peer_report(r: dict) -> str:
    m = r["machine"]
    lines = [f"machine: {m['cpu']} ({m['cores']} cores), torch {m['torch']}, transformers {m['transformers']}",
             f"peer: {r['peer']['model']}; checkpoint {os.path.basename(r['checkpoint'])}, prompt {r['prompt']} "
             f"tokens, {r['new']} greedy tokens, median of {r['reps']} after {r['warmup']} untimed passes each "
             f"(peer and engine runs alternate)",
             "",
             "| threads | peer prefill tok/s | engine prefill tok/s | x | peer decode tok/s | engine decode tok/s | x "
             "| tokens agreeing | 1-min load (per rep: before peer, before engine, after) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for th, e in r["runs"].items():
        loads = "; ".join("/".join("?" if v is None else f"{v:.1f}" for v in trip)
                          for trip in e["load_1min_before_peer_engine_after"])
        lines.append(f"| {th} | {e['peer']['prefill_tok_s']:.0f} | {e['engine']['prefill_tok_s']:.0f} | "
                     f"{e['prefill_ratio']:.1f} | {e['peer']['decode_tok_s']:.0f} | {e['engine']['decode_tok_s']:.0f} | "
                     f"{e['decode_ratio']:.1f} | {e['greedy_tokens_agreeing']}/{r['new']} | {loads} |")
    batch_rows = [(th, B, b) for th, e in r["runs"].items() for B, b in e.get("batch_decode", {}).items()]
    if batch_rows:
        lines += ["", "batched greedy decode (8-token prompts; a step's median; sequences whose token after the last "
                  "step is the same on both sides):", "",
                  "| threads | batch | peer tok/s | engine tok/s | x | sequences agreeing |", "|---|---|---|---|---|---|"]
        lines += [f"| {th} | {B} | {b['peer_tok_s']:.1f} | {b['engine_tok_s']:.1f} | {b['ratio']:.2f} | "
                  f"{b['sequences_agreeing']}/{B} |" for th, B, b in batch_rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="a BF16 checkpoint directory (default: generate the zoo's small-bf16)")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed passes of the timed work per side first")
    p.add_argument("--batches", default="", help="batch sizes for batched greedy decode, e.g. 8,32 (default: none)")
    p.add_argument("--attn", default="eager", choices=PEER_ATTN, help="the peer's attention implementation")
    p.add_argument("--experts", default="eager", choices=PEER_EXPERTS, help="the peer's experts implementation")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    r = run_peer_bench(a.ckpt, a.prompt, a.new, [int(t) for t in a.threads.split(",")], a.reps,
                       progress=None if a.json else (lambda msg: print(f"... {msg}", flush=True)), warmup=a.warmup,
                       batches=[int(b) for b in a.batches.split(",") if b], attn=a.attn, experts=a.experts)
    print(json.dumps(r, indent=1, default=str) if a.json else format_peer_report(r))


if __name__ == "__main__":
    main()
