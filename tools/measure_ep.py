"""Expert parallelism on the CPU: decode tokens/s at 1, 2, 3 ranks and the communication share of a step.

    python tools/measure_ep.py --zoo /tmp/ep/zoo                       # small-{bf16,fp8,mxfp4}, made if absent
    python tools/measure_ep.py --checkpoint /tmp/eng/slice-fp8 --ranks 1,2 --tokens 16

For each checkpoint and rank count: the same prompt is prefilled, then `--tokens` decode steps are
timed at batch 1 (and at batch `--batch`): tokens/s, and from rank 0's counters the share of the
decode time spent inside torch.distributed.all_gather (`collective`) and inside the executor's exchange
hook (`hook`: the collective plus the GIL, the numpy/torch views and the packing in C++). Every run's
tokens are checked equal to the single-process engine's. Ranks > 1 run in driver mode (this process is
rank 0), one thread per rank unless --threads. Prints a Markdown table (docs/ep.md); --json for machines.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fast  # noqa: E402
from fast import distributed as D  # noqa: E402


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def run_one(path: str, ranks: int | None, threads: int, prompt: list[int], tokens: int, batch: int) -> dict:
    kw = {} if ranks is None else {"ranks": ranks}
    eng = fast.Engine(path, threads=threads, **kw)
    out = {"ranks": ranks or 1, "mode": "single" if ranks is None else (eng.ep.mode if eng.ep else "single")}
    for b in sorted({1, batch}):
        caches = [eng.new_cache() for _ in range(b)]
        toks = []
        for c in caches:
            lg = eng.prefill(prompt, c)
            toks.append(int(np.argmax(lg[-1])))
        for _ in range(2):  # warm-up steps (first-touch of pages, the workers' first collectives)
            lg = eng.decode(caches, toks)
            toks = [int(np.argmax(r)) for r in lg]
        eng.reset_ep_stats()
        seq = [toks[0]]
        t0 = time.perf_counter()
        for _ in range(tokens):
            lg = eng.decode(caches, toks)
            toks = [int(np.argmax(r)) for r in lg]
            seq.append(toks[0])
        dt = time.perf_counter() - t0
        st = eng.ep_stats()
        r0 = st[0] if st else {}
        step = r0.get("step_seconds", 0.0) or dt
        out[f"b{b}"] = {
            "tok_s": b * tokens / dt, "ms_per_step": 1e3 * dt / tokens, "tokens": seq,
            "collective_share": r0.get("collective_seconds", 0.0) / step if st else 0.0,
            "hook_share": r0.get("hook_seconds", 0.0) / step if st else 0.0,
            "collective_ms_per_step": 1e3 * r0.get("collective_seconds", 0.0) / tokens if st else 0.0,
            "exchanges_per_step": r0.get("exchanges", 0) / tokens if st else 0,
            "bytes_sent_per_step": r0.get("bytes_sent", 0) / tokens if st else 0,
            "per_rank_collective_share": [s["collective_seconds"] / s["step_seconds"] for s in st
                                          if s.get("step_seconds")],
        }
        for c in caches:
            c.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", help="folder with small-{bf16,fp8,mxfp4} (made with tools.zoo.make_zoo if absent)")
    ap.add_argument("--checkpoint", action="append", default=[], help="a checkpoint folder (repeatable)")
    ap.add_argument("--ranks", default="1,2,3", help="rank counts, e.g. 1,2,3")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    ap.add_argument("--tokens", type=int, default=64, help="timed decode steps")
    ap.add_argument("--batch", type=int, default=8, help="second batch size measured (besides 1)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt length")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    os.environ.setdefault("GLM_EP_QUIET", "1")
    paths = list(a.checkpoint)
    if a.zoo:
        if not all(os.path.isdir(os.path.join(a.zoo, f"small-{r}")) for r in ("bf16", "fp8", "mxfp4")):
            from tools.zoo import make_zoo
            make_zoo("small", a.zoo)
        paths += [os.path.join(a.zoo, f"small-{r}") for r in ("bf16", "fp8", "mxfp4")]
    if not paths:
        ap.error("give --zoo or --checkpoint")
    rank_counts = [int(x) for x in a.ranks.split(",")]
    load0 = os.getloadavg()[0]
    results = []
    for p in paths:
        eng0 = fast.Engine(p, threads=a.threads)
        prompt = [int(v) for v in np.random.default_rng(1).integers(0, eng0.config.vocab_size, a.prompt)]
        del eng0
        base = run_one(p, None, a.threads, prompt, a.tokens, a.batch)
        rows = [base]
        for r in rank_counts:
            res = run_one(p, r, a.threads, prompt, a.tokens, a.batch)
            for b in ("b1", f"b{a.batch}"):
                if res[b]["tokens"] != base[b]["tokens"]:
                    raise SystemExit(f"{p}: ranks={r} {b}: tokens differ from the single-process engine")
            rows.append(res)
        results.append((os.path.basename(os.path.normpath(p)), rows))
    D.shutdown()
    load1 = os.getloadavg()[0]
    if a.json:
        print(json.dumps({"machine": cpu_name(), "cores": os.cpu_count(), "load": [load0, load1],
                          "results": results}))
        return 0
    print(f"machine: {cpu_name()} ({os.cpu_count()} cores), threads per rank {a.threads}, prompt {a.prompt}, "
          f"{a.tokens} decode steps, 1-min load average {load0:.2f} before, {load1:.2f} after")
    print()
    bb = f"b{a.batch}"
    print(f"| checkpoint | ranks | decode tok/s b1 | ms/step | collective share | hook share | "
          f"collective ms/step | tok/s b{a.batch} | collective share b{a.batch} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rows in results:
        for r in rows:
            label = "1 (plain engine)" if r["mode"] == "single" and r is rows[0] else str(r["ranks"])
            b1, bn = r["b1"], r[bb]
            print(f"| {name} | {label} | {b1['tok_s']:.0f} | {b1['ms_per_step']:.2f} | "
                  f"{100 * b1['collective_share']:.0f}% | {100 * b1['hook_share']:.0f}% | "
                  f"{b1['collective_ms_per_step']:.2f} | {bn['tok_s']:.0f} | {100 * bn['collective_share']:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
