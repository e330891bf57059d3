"""CPU engine benchmark (docs/engine_cpu.md): the engine against the oracle on the same work, and the
expert dot's weight streaming against a copy-bandwidth ceiling measured in the same run.

    python tools/bench_cpu.py                       # generates `small` into a temp dir first
    python tools/bench_cpu.py --small /tmp/zoo      # reuse /tmp/zoo/small-{bf16,fp8,mxfp4}
    python tools/bench_cpu.py --json
    python tools/bench_cpu.py --gemm --threads 1 --tokens 6,16,64   # only the multi-token kernels vs the FMA peak
    python tools/bench_cpu.py --prefill-on /tmp/eng/slice-fp8 --threads 1 --lengths 16,64  # only engine prefill
    python tools/bench_cpu.py --gemm --shape 16384x4096 --tokens 2,4,8   # rows that stream from memory
    python tools/bench_cpu.py --batch-on /tmp/eng/slice-bf16 --threads 1,2 --batches 8   # only batched decode
(the last four print one line per thread count: run them with PYTHONPATH at each build for an A/B; each figure
with its share of the roofline, max(bytes read / copy bandwidth, multiply-adds / FMA peak), both ceilings
measured in the same process: cpu_ceilings)

Three measurements, each at 1 and 2 threads:
1. prefill and decode tokens/s of fast.Engine vs the oracle on `small` (bf16, fp8, mxfp4 releases),
   same prompt, same greedy continuation (checked equal), Numba compiled before timing;
2. weight bytes streamed per second on the expert dot (one token: y = W x with W in FP8 block-128 and
   MXFP4, real GLM-5.3-Flash expert width C = 4096, enough rows to stream from DRAM), decoded in
   registers by the engine's kernels, per thread and in total; and multiply-adds per ns of the same
   weight against six tokens at once (the multi-token kernel that prefill and batched decode use);
3. the copy ceiling: memcpy of a large buffer (read + write bytes per second), the same thread counts;
4. optionally (--slice DIR), decode at batch 1 on a real-width checkpoint: weight bytes read per token
   over the copy bandwidth, i.e. the fraction of the memory roofline reached.
`run_bench(...)` returns all of it as a dict (the `oracle bench` CLI calls it); `format_report` prints it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import numpy as np

__all__ = ["run_bench", "format_report", "machine_info"]


def machine_info() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    try:  # (which build of the linear kernels the engine runs here: docs/engine_cpu.md, "Instruction sets")
        from fast import _core
        kernels = _core.cpu_kernels()["chosen"]
    except (ImportError, ValueError):
        kernels = None
    return {"cpu": cpu or platform.processor(), "cores": cores, "machine": platform.machine(),
            "python": platform.python_version(), "load_1min": load, "cpu_kernels": kernels}


def _timed(fn, reps: int):
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench_models(path: str, prompt: int, new: int, threads: list[int], reps: int = 2) -> dict:
    """prefill / decode tokens/s: oracle vs fast.Engine on one checkpoint (best of `reps`)."""
    import fast
    import oracle

    model = oracle.load(path)
    V = model.config.vocab_size
    ids = [(37 * i + 11) % V for i in range(prompt)]
    model.generate(ids[:3], 2)  # compile every Numba kernel first

    def run_oracle():
        cache = model.new_cache()
        t0 = time.perf_counter()
        tok = int(model.forward(ids, cache)[-1].argmax())
        t1 = time.perf_counter()
        toks = [tok]
        for _ in range(new - 1):
            toks.append(int(model.forward([toks[-1]], cache)[-1].argmax()))
        return t1 - t0, time.perf_counter() - t1, toks

    res = {"checkpoint": path, "prompt": prompt, "new": new}
    o = [run_oracle() for _ in range(reps)]
    res["oracle"] = {"prefill_tok_s": prompt / min(r[0] for r in o), "decode_tok_s": (new - 1) / min(r[1] for r in o)}
    ref_toks = o[0][2]
    res["engine"] = {}
    for th in threads:
        eng = fast.Engine(path, threads=th)
        eng.generate(ids[:3], 2)

        def run_engine():
            cache = eng.new_cache()
            t0 = time.perf_counter()
            tok = int(eng.forward(ids, cache)[-1].argmax())
            t1 = time.perf_counter()
            toks = [tok]
            for _ in range(new - 1):
                toks.append(int(eng.forward([toks[-1]], cache)[-1].argmax()))
            return t1 - t0, time.perf_counter() - t1, toks

        e = [run_engine() for _ in range(reps)]
        if e[0][2] != ref_toks:
            raise AssertionError(f"{path}: engine tokens differ from the oracle's: {e[0][2]} vs {ref_toks}")
        pre, dec = min(r[0] for r in e), min(r[1] for r in e)
        wb = int(eng._core.weight_bytes)
        res["engine"][th] = {
            "prefill_tok_s": prompt / pre, "decode_tok_s": (new - 1) / dec,
            "prefill_vs_oracle": (prompt / pre) / res["oracle"]["prefill_tok_s"],
            "decode_vs_oracle": ((new - 1) / dec) / res["oracle"]["decode_tok_s"],
            "weight_bytes_per_token": wb, "decode_weight_GBps": wb * (new - 1) / dec / 1e9,
        }
    return res


def _expert_weights(release: str, R: int, C: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    if release == "fp8":
        q = rng.integers(0, 256, (R, C), dtype=np.uint8)
        q[(q & 0x7F) == 0x7F] = 0x3F  # no NaN codes
        s = np.full(((R + 127) // 128, (C + 127) // 128), 1.0 / 448.0, np.float32)
        return q, s, q.nbytes + s.nbytes
    if release == "mxfp4":
        p = rng.integers(0, 256, (R, C // 2), dtype=np.uint8)
        s = rng.integers(120, 130, (R, C // 32), dtype=np.uint8)
        return p, s, p.nbytes + s.nbytes
    w = (rng.standard_normal((R, C)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return w, None, w.nbytes


def bench_streams(threads: list[int], rows: int = 49152, cols: int = 4096, copy_mb: int = 512,
                  reps: int = 5, releases=("fp8", "mxfp4"), tokens: int = 6) -> dict:
    """Weight bytes/s on the one-token expert dot vs memcpy bytes/s, per thread count; and the
    multiply-adds per ns of the same weight against `tokens` tokens at once (the prefill kernel).
    Both run the engine's Lin kernels (fast._core.linear_bench; FP8 on the NaN-free path the engine
    takes for every checkpoint, since the loader refuses NaN codes)."""
    from fast import _core

    out = {"rows": rows, "cols": cols, "copy_bytes": copy_mb << 20, "tokens": tokens, "copy": {}, "expert_dot": {},
           "fma_peak_MACs_per_ns": {}}
    for th in threads:
        # the compute ceiling: independent FMA chains on every thread, the widest vectors here (multiply-adds per ns)
        out["fma_peak_MACs_per_ns"][th] = fma_peak(th, reps)[0]
        t = _core.engine_bench_copy(copy_mb << 20, th, reps)
        # the ceiling: memory traffic of a large memcpy, read + write (the STREAM "copy" convention; a
        # read-only stream such as a weight sweep can exceed the read half alone)
        out["copy"][th] = {"GBps": 2 * (copy_mb << 20) / t / 1e9, "GBps_read_only_half": (copy_mb << 20) / t / 1e9}
    rng = np.random.default_rng(1)
    X = (rng.standard_normal((max(1, tokens), cols)) * 0.5).astype(np.float32)
    for rel in releases:
        data, scale, nbytes = _expert_weights(rel, rows, cols)
        out["expert_dot"][rel] = {"weight_bytes": nbytes}
        for th in threads:
            t = _core.linear_bench(rel, data, scale, X[:1].copy(), nan_free=rel == "fp8", threads=th, reps=reps)
            tm = _core.linear_bench(rel, data, scale, X, nan_free=rel == "fp8", threads=th, reps=max(1, reps // 2))
            gbps = nbytes / t / 1e9
            out["expert_dot"][rel][th] = {"GBps": gbps, "GBps_per_core": gbps / th,
                                          "fraction_of_copy": gbps / out["copy"][th]["GBps"],
                                          "MACs_per_ns": rows * cols / t / 1e9,
                                          "MACs_per_ns_tokens": rows * cols * X.shape[0] / tm / 1e9,
                                          "fraction_of_fma_peak_tokens":
                                              rows * cols * X.shape[0] / tm / 1e9 / out["fma_peak_MACs_per_ns"][th]}
    return out


def fma_peak(threads: int, reps: int = 5, probes: int = 1) -> tuple[float, str]:
    """(The cores' FMA peak in multiply-adds per ns on `threads` threads, the build whose vectors reached it): independent
    FMA chains on every thread in the widest vectors of each build of the linear kernels that runs here (AVX2: 8
    lanes; AVX-512: 16, which on CPUs with two 512-bit FMA units is twice the 8-lane rate), the best of `probes`
    probes of `reps` each. The machine's peak is the widest's, whichever build the engine runs."""
    from fast import _core

    best = {k: max(_core.engine_bench_fma(threads, reps, kernels=k) for _ in range(probes))
            for k in _core.cpu_kernels()["available"]}
    k = max(best, key=best.get)
    return best[k], k


def cpu_ceilings(threads: int, reps: int = 5, copy_mb: int = 256) -> dict:
    """The two ceilings of a CPU roofline on `threads` threads, measured here: the FMA peak (fma_peak) and the copy
    bandwidth (a memcpy of copy_mb MiB, read + written bytes per second, the STREAM convention the CUDA rooflines use);
    each the best of two probes of `reps`."""
    from fast import _core

    peak, widest = fma_peak(threads, reps, probes=2)
    t = min(_core.engine_bench_copy(copy_mb << 20, threads, reps) for _ in range(2))
    return {"fma_peak_MACs_per_ns": peak, "fma_peak_kernels": widest, "copy_Bps": 2 * (copy_mb << 20) / t}


_BOUND = {"HBM": "memory", "FFMA": "FMA"}  # (bench_throughput's names of the ceilings, as a CPU's)


def gemm_roofline_s(weight_bytes: int, macs: int, ceilings: dict) -> tuple[float, str]:
    """(a weight's multiply of some tokens at its roofline, in seconds; which ceiling binds): max(the weight's bytes /
    the copy bandwidth, the multiply-adds / the FMA peak) (bench_throughput.ceiling_s). x and y are left out (a few
    tokens' rows)."""
    from tools.bench_throughput import ceiling_s

    t, bound = ceiling_s(weight_bytes, macs, ceilings["copy_Bps"], ceilings["fma_peak_MACs_per_ns"] * 1e9)
    return t, _BOUND[bound]


def bench_gemm(rows: int = 8192, cols: int = 4096, tokens=(6, 16, 64), releases=("fp8", "bf16", "mxfp4"),
               threads: int = 1, warm: int = 2, reps: int = 7, kernels=(None,)) -> dict:
    """The multi-token kernels (the engine's Lin, `fast._core.linear_bench`) against the FMA peak and the copy
    bandwidth measured in the same process (cpu_ceilings): per release and token count, `warm` untimed calls, then
    the median of `reps` timed calls; each run's share of the FMA peak and of its roofline (gemm_roofline_s).
    `kernels`: the instruction sets' kernels to run, by turns for each shape (None: the process's choice,
    fast._core.cpu_kernels)."""
    import statistics

    from fast import _core

    ceil = cpu_ceilings(threads)
    peak = ceil["fma_peak_MACs_per_ns"]
    rng = np.random.default_rng(1)
    out = {"rows": rows, "cols": cols, "threads": threads, "fma_peak_MACs_per_ns": peak,
           "fma_peak_kernels": ceil["fma_peak_kernels"], "copy_Bps": ceil["copy_Bps"], "runs": []}
    for rel in releases:
        data, scale, nbytes = _expert_weights(rel, rows, cols)
        for T in tokens:
            X = (rng.standard_normal((T, cols)) * 0.5).astype(np.float32)
            for k in kernels:
                run = lambda n: _core.linear_bench(rel, data, scale, X, nan_free=rel == "fp8", threads=threads, reps=n,
                                                   kernels=k)
                run(warm)
                t = statistics.median(run(1) for _ in range(reps))
                macs = rows * cols * T / t / 1e9
                roof, bound = gemm_roofline_s(nbytes, rows * cols * T, ceil)
                out["runs"].append({"release": rel, "tokens": T, "kernels": k or _core.cpu_kernels()["chosen"],
                                    "MACs_per_ns": macs, "of_fma_peak": macs / peak, "seconds": t, "roofline_s": roof,
                                    "bound": bound, "of_roofline": roof / t})
    return out


def step_roofline(path: str, ceilings: dict):
    """roofline(tokens, head_rows) -> (seconds, bound) of one engine step on the checkpoint at `path`: the CUDA
    rooflines' formula (tools/bench_throughput.py, roofline_s: the weights a step reads, the routed experts as many
    as its tokens touch, and 2 x its multiply-adds) over the CPU's ceilings (cpu_ceilings)."""
    from oracle.checkpoint import open_checkpoint
    from tools.bench_throughput import roofline_s, weight_census

    with open_checkpoint(path, verify=False) as ck:
        cfg = ck.config
    census = weight_census(path)
    bw, flops = ceilings["copy_Bps"], 2e9 * ceilings["fma_peak_MACs_per_ns"]

    def roofline(tokens: int, head_rows: int) -> tuple[float, str]:
        t, bound = roofline_s(census, cfg, tokens, head_rows, bw, flops)
        return t, _BOUND[bound]
    return roofline


def bench_prefill(path: str, lengths=(16, 64), threads: int = 1, warm: int = 2, reps: int = 5) -> dict:
    """Prefill tokens/s of fast.Engine on a checkpoint (a new cache each pass, one Engine.step asking for the last
    row's greedy token: the work the peers' prefills do): `warm` untimed passes of each length, then the median of
    `reps`; and each length's share of its step roofline (step_roofline, the head on one row)."""
    import fast
    # (after fast: bench_throughput puts the checkout first on sys.path, which would shadow the build an A/B
    # run names by PYTHONPATH)
    from tools.bench_throughput import median_of

    eng = fast.Engine(path, threads=threads)
    roofline = step_roofline(path, cpu_ceilings(threads))
    out = {"checkpoint": path, "threads": threads, "prefill_tok_s": {}, "of_roofline": {}, "bound": {}}
    for L in lengths:
        ids = [(7 * i + 3) % 30000 + 1 for i in range(L)]

        def prefill():
            cache = eng.new_cache()
            eng.step([(cache, ids, None, "argmax")])
            cache.close()

        dt = median_of(prefill, warm, reps)
        roof, out["bound"][L] = roofline(L, 1)
        out["prefill_tok_s"][L], out["of_roofline"][L] = L / dt, roof / dt
    return out


def bench_batch(path: str, batches=(8,), threads: int = 1, warm: int = 2, reps: int = 5) -> dict:
    """Batched greedy decode tok/s of fast.Engine on a checkpoint: B sequences of the 8-token prompts
    bench_peer_cpu gives both sides, each fed its own tokens, one Engine.step a step; `warm` untimed steps,
    then a step's median over `reps` (B / that step's time); and each batch's share of its step roofline
    (step_roofline, the head on every row)."""
    import fast
    from tools.bench_peer_cpu import batch_prompts, engine_batch_step

    eng = fast.Engine(path, threads=threads)
    roofline = step_roofline(path, cpu_ceilings(threads))
    V = int(eng.config.vocab_size)
    out = {"checkpoint": path, "threads": threads, "batch_tok_s": {}, "of_roofline": {}, "bound": {}}
    for B in batches:
        dt, _ = engine_batch_step(eng, batch_prompts(B, V), warm, reps)
        roof, out["bound"][B] = roofline(B, B)
        out["batch_tok_s"][B], out["of_roofline"][B] = B / dt, roof / dt
    return out


def bench_roofline(path: str, threads: list[int], new: int = 8, copy: dict | None = None) -> dict:
    """Decode at batch 1 on a real-width checkpoint (e.g. a `slice`): weight bytes read per token over
    the measured copy bandwidth -> the fraction of the memory roofline reached."""
    import fast

    out = {"checkpoint": path, "new": new, "engine": {}}
    for th in threads:
        eng = fast.Engine(path, threads=th)
        cache = eng.new_cache()
        tok = int(eng.forward([1, 2, 3, 4], cache)[-1].argmax())
        t0 = time.perf_counter()
        for _ in range(new):
            tok = int(eng.forward([tok], cache)[-1].argmax())
        dt = (time.perf_counter() - t0) / new
        wb = int(eng._core.weight_bytes)
        gbps = wb / dt / 1e9
        ceiling = (copy or {}).get(th, {}).get("GBps")
        out["engine"][th] = {"decode_tok_s": 1 / dt, "weight_bytes_per_token": wb, "weight_GBps": gbps,
                             "roofline_tok_s": ceiling * 1e9 / wb if ceiling else None,
                             "fraction_of_roofline": gbps / ceiling if ceiling else None}
    return out


def run_bench(small_dir: str | None = None, prompt: int = 64, new: int = 32, threads=(1, 2),
              releases=("bf16", "fp8", "mxfp4"), stream_rows: int = 49152, slice_dirs=(), progress=None) -> dict:
    """Everything in one run -> dict (machine, per-release model speeds, expert-dot streaming, copy,
    and, for each real-width checkpoint in `slice_dirs`, decode against the memory roofline)."""
    threads = list(threads)
    say = progress or (lambda msg: None)
    report = {"machine": machine_info(), "command": "tools/bench_cpu.py", "threads": threads}
    tmp = None
    if small_dir is None:
        from tools.zoo import make_zoo
        tmp = tempfile.TemporaryDirectory(prefix="bench_cpu_")
        small_dir = tmp.name
        say(f"generating small into {small_dir}")
        make_zoo("small", small_dir, releases=releases)
    try:
        def loaded(fn, *a, **k):  # the 1-min load average before and after each part (the VM is shared)
            l0 = machine_info()["load_1min"]
            r = fn(*a, **k)
            r["load_1min"] = (l0, machine_info()["load_1min"])
            return r

        report["models"] = []
        for rel in releases:
            say(f"small-{rel}: oracle vs engine")
            report["models"].append(loaded(bench_models, os.path.join(small_dir, f"small-{rel}"), prompt, new, threads))
        say("expert dot and copy bandwidth")
        report["streams"] = loaded(bench_streams, threads, rows=stream_rows)
        report["roofline"] = []
        for d in slice_dirs:
            say(f"{d}: decode vs the memory roofline")
            report["roofline"].append(loaded(bench_roofline, d, threads, copy=report["streams"]["copy"]))
    finally:
        if tmp is not None:
            tmp.cleanup()
    report["machine"]["load_1min_after"] = machine_info()["load_1min"]
    return report


def format_report(r: dict) -> str:
    m = r["machine"]
    def load(v):
        return "?" if v is None else f"{v:.1f}"
    lines = [f"machine: {m['cpu']} ({m['cores']} cores; the engine's {m.get('cpu_kernels')} kernels), 1-min load "
             f"average {load(m['load_1min'])} before, {load(m.get('load_1min_after'))} after", ""]
    def loads(part):
        lo = part.get("load_1min")
        return "" if not lo else f"{load(lo[0])} -> {load(lo[1])}"
    lines.append("| checkpoint | oracle prefill | oracle decode | threads | engine prefill | x | engine decode | x | load |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for mr in r["models"]:
        name = os.path.basename(mr["checkpoint"])
        for th, e in mr["engine"].items():
            lines.append(f"| {name} | {mr['oracle']['prefill_tok_s']:.0f} | {mr['oracle']['decode_tok_s']:.0f} | {th} | "
                         f"{e['prefill_tok_s']:.0f} | {e['prefill_vs_oracle']:.1f} | {e['decode_tok_s']:.0f} | "
                         f"{e['decode_vs_oracle']:.1f} | {loads(mr)} |")
    s = r["streams"]
    lines += ["", f"expert dot: one token, W [{s['rows']}, {s['cols']}] (real expert width), decoded in registers "
              f"(load {loads(s)});",
              "copy = memcpy of 512 MiB, read + write bytes per second; last column: the same weight against "
              f"{s['tokens']} tokens at once",
              f"| threads | copy GB/s | release | weight GB/s | per core | of copy | MAC/ns | MAC/ns, {s['tokens']} tokens "
              "| of FMA peak |",
              "|---|---|---|---|---|---|---|---|---|"]
    for th, c in s["copy"].items():
        for rel, d in s["expert_dot"].items():
            e = d[th]
            lines.append(f"| {th} | {c['GBps']:.2f} | {rel} | {e['GBps']:.2f} | {e['GBps_per_core']:.2f} | "
                         f"{e['fraction_of_copy']:.0%} | {e['MACs_per_ns']:.2f} | {e['MACs_per_ns_tokens']:.2f} | "
                         f"{e['fraction_of_fma_peak_tokens']:.0%} of {s['fma_peak_MACs_per_ns'][th]:.1f} |")
    if r.get("roofline"):
        lines += ["", "decode at batch 1, real widths: weight bytes per token / copy bandwidth",
                  "| checkpoint | threads | tok/s | GB/token | weight GB/s | roofline tok/s | of roofline |",
                  "|---|---|---|---|---|---|---|"]
        for rr in r["roofline"]:
            for th, e in rr["engine"].items():
                lines.append(f"| {os.path.basename(rr['checkpoint'])} ({loads(rr)}) | {th} | {e['decode_tok_s']:.2f} | "
                             f"{e['weight_bytes_per_token'] / 1e9:.2f} | {e['weight_GBps']:.2f} | "
                             f"{e['roofline_tok_s']:.2f} | {e['fraction_of_roofline']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", help="directory holding small-{bf16,fp8,mxfp4} (default: generate into a temp dir)")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rows", type=int, default=49152, help="rows of the expert-dot weight (C = 4096)")
    p.add_argument("--slice", action="append", default=[],
                   help="a real-width checkpoint (e.g. `oracle make-checkpoint slice`) for the decode roofline; repeatable")
    p.add_argument("--json", action="store_true")
    p.add_argument("--gemm", action="store_true",
                   help="only the multi-token kernels against the FMA peak (--shape, --tokens, --threads)")
    p.add_argument("--tokens", default="6,16,64", help="token counts of --gemm")
    p.add_argument("--kernels", default="", help="--gemm: instruction sets' kernels to run by turns, e.g. avx2,avx512 "
                   "(default: the process's choice; GLM_CPU_KERNELS in the environment sets it for every part)")
    p.add_argument("--shape", default="8192x4096", help="ROWSxCOLS of --gemm's weight (16384x4096: rows that stream "
                   "from memory on any cache)")
    p.add_argument("--batch-on", metavar="DIR", help="only the engine's batched greedy decode tok/s on this "
                   "checkpoint (--batches)")
    p.add_argument("--batches", default="8", help="batch sizes of --batch-on")
    p.add_argument("--prefill-on", metavar="DIR", help="only the engine's prefill tok/s on this checkpoint (--lengths)")
    p.add_argument("--lengths", default="16,64", help="prompt lengths of --prefill-on")
    a = p.parse_args()
    ths = [int(t) for t in a.threads.split(",")]
    if a.gemm or a.prefill_on or a.batch_on:  # one line per thread count: what an A/B of two builds compares
        try:
            rows, cols = (int(v) for v in a.shape.lower().split("x"))
            if rows < 1 or cols < 1:
                raise ValueError
        except ValueError:
            p.error(f"--shape {a.shape!r}: expected ROWSxCOLS, e.g. 16384x4096")
        for th in ths:
            if a.gemm:
                ks = tuple(a.kernels.split(",")) if a.kernels else (None,)
                g = bench_gemm(rows, cols, tokens=[int(t) for t in a.tokens.split(",")], threads=th, kernels=ks)
                line = " | ".join(f"{x['release']}/T{x['tokens']}{'/' + x['kernels'] if a.kernels else ''}: "
                                  f"{x['MACs_per_ns']:.2f} ({x['of_fma_peak']:.1%}; "
                                  f"{x['of_roofline']:.0%} of {x['bound']})" for x in g["runs"])
                print(json.dumps(g) if a.json else f"{th} thread(s), peak {g['fma_peak_MACs_per_ns']:.1f} MAC/ns ({g['fma_peak_kernels']}), copy "
                      f"{g['copy_Bps'] / 1e9:.1f} GB/s | {line}")
            if a.prefill_on:
                f = bench_prefill(a.prefill_on, [int(v) for v in a.lengths.split(",")], threads=th)
                line = " | ".join(f"p{L}: {v:.1f} tok/s ({f['of_roofline'][L]:.0%} of {f['bound'][L]})"
                                  for L, v in f["prefill_tok_s"].items())
                print(json.dumps(f) if a.json else f"{th} thread(s) | {line}")
            if a.batch_on:
                b = bench_batch(a.batch_on, [int(v) for v in a.batches.split(",")], threads=th)
                line = " | ".join(f"b{B}: {v:.1f} tok/s ({b['of_roofline'][B]:.0%} of {b['bound'][B]})"
                                  for B, v in b["batch_tok_s"].items())
                print(json.dumps(b) if a.json else f"{th} thread(s) | {line}")
        return
    r = run_bench(a.small, a.prompt, a.new, [int(t) for t in a.threads.split(",")], stream_rows=a.rows,
                  slice_dirs=a.slice, progress=None if a.json else (lambda msg: print(f"... {msg}", flush=True)))
    print(json.dumps(r, indent=1, default=str) if a.json else format_report(r))


if __name__ == "__main__":
    main()
