"""`oracle diff`: the first layer, position, stage and element where two runs part, and by how many ULPs.

    oracle diff --checkpoint golden/tiny-bf16 --a oracle --b oracle:inject=3,30,mla.scores,5,100

1. Both sides run traced (one hash per (layer, stage, position) row, no values kept).
2. The token streams are compared: only positions both sides fed with the same token ids are compared.
3. Rows whose hashes part are ordered causally (oracle/trace.py); the causally minimal ones are found.
4. Both sides run again, keeping values only at the (layer, stage) pairs whose hashes parted (and
   only at the differing positions); each differing row gets its first differing element, both
   values and the ULP distance in the stage's dtype (bf16 / f32 / f64 bits; ints: the difference).

`--layer L --pos P` shows every stage of one point side by side; `--plot F.png` draws the worst ULP
of each (layer, position) cell. Exit 0 identical, 1 differ, 2 error.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

from oracle.stages import BF16, F32, F64, I32, stage_dtype
from .prompts import DEFAULT_NEW, prompt_ids
from .term import wide
from .trace import HashComparison, Trace, compare_traces, run_traced

# -- ULPs ---------------------------------------------------------------------------------------------


def _ordered(bits: np.ndarray, nbits: int) -> np.ndarray:
    """Bit patterns -> integers in the order of the values they encode (+0 and -0 one apart)."""
    b = bits.astype(object) if nbits == 64 else bits.astype(np.int64)
    sign = 1 << (nbits - 1)
    mag = b & (sign - 1)
    neg = (b & sign) != 0
    return np.where(neg, -mag - 1, mag)


def _bits(x: np.ndarray, dtype: str) -> tuple[np.ndarray, int]:
    if dtype == BF16:
        return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint32), 16
    if dtype == F32:
        return np.asarray(x, np.float32).view(np.uint32), 32
    return np.asarray(x, np.float64).view(np.uint64), 64


def ulp_distance(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    """Element-wise distance in units in the last place of `dtype` (ints: |a - b|). Python ints for f64."""
    if dtype == I32:
        return np.abs(np.asarray(a, np.int64) - np.asarray(b, np.int64))
    ba, n = _bits(a, dtype)
    bb, _ = _bits(b, dtype)
    d = _ordered(ba, n) - _ordered(bb, n)
    return np.abs(d)


def _hexbits(v, dtype: str) -> str | None:
    """The value's bit pattern in its dtype, as hex (None for ints and missing values)."""
    if v is None or isinstance(v, int):
        return None
    b, n = _bits(np.array([v]), dtype)
    return f"0x{int(b[0]):0{n // 4}x}"


@dataclass
class RowDiff:
    """How one (layer, stage, position) row differs between the sides."""

    layer: int
    stage: str
    pos: int
    dtype: str
    hash_a: str | None
    hash_b: str | None
    size: int = 0
    n_differ: int = 0                 # elements that differ (bits)
    elem: int | None = None           # first differing element (flattened)
    a_value: float | int | None = None
    b_value: float | int | None = None
    ulps: int | None = None           # at the first differing element
    max_ulps: int | None = None
    max_abs: float | None = None
    note: str = ""

    def to_json(self) -> dict:
        def num(v):
            if v is None or isinstance(v, int):
                return v
            return v if math.isfinite(v) else repr(v)
        return {"layer": self.layer, "stage": self.stage, "pos": self.pos, "dtype": self.dtype,
                "hash_a": self.hash_a, "hash_b": self.hash_b, "size": self.size, "elements_differing": self.n_differ,
                "elem": self.elem, "a": num(self.a_value), "b": num(self.b_value),
                "a_bits": _hexbits(self.a_value, self.dtype), "b_bits": _hexbits(self.b_value, self.dtype),
                "ulps": self.ulps,
                "max_ulps": self.max_ulps, "max_abs": num(self.max_abs), "note": self.note}


def row_diff(layer: int, stage: str, pos: int, a, b, hash_a=None, hash_b=None) -> RowDiff:
    """Compare one row's values (any shapes; compared flattened, bit for bit)."""
    dtype = stage_dtype(stage)
    a, b = np.asarray(a), np.asarray(b)
    note = ""
    if dtype != I32 and (a.dtype == np.float64 or b.dtype == np.float64):
        if a.dtype != b.dtype:
            note = "one side holds doubles (float64 mode): compared as f64"
        dtype = F64
    fa, fb = a.reshape(-1), b.reshape(-1)
    r = RowDiff(layer, stage, pos, dtype, hash_a, hash_b, size=int(max(fa.size, fb.size)), note=note)
    m = min(fa.size, fb.size)
    if dtype == I32:
        xa, xb = fa[:m].astype(np.int64), fb[:m].astype(np.int64)
        neq = xa != xb
    else:
        ba, _ = _bits(fa[:m], dtype)
        bb, _ = _bits(fb[:m], dtype)
        neq = ba != bb
    idx = np.flatnonzero(neq)
    r.n_differ = int(idx.size) + abs(fa.size - fb.size)
    if fa.size != fb.size:
        r.note = (r.note + "; " if r.note else "") + f"sizes differ: a {fa.size}, b {fb.size} ({a.shape} vs {b.shape})"
    if idx.size == 0:
        if fa.size != fb.size:
            r.elem = m
        elif a.dtype != b.dtype:
            r.note = (f"equal values in different representations ({a.dtype} vs {b.dtype}): "
                      "the hashes part on the dtype")
        return r
    conv = int if dtype == I32 else float
    r.elem = int(idx[0])
    r.a_value, r.b_value = conv(fa[r.elem]), conv(fb[r.elem])
    d = ulp_distance(fa[idx], fb[idx], dtype)
    r.ulps = int(d[0])
    r.max_ulps = int(max(d))
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(fa[idx].astype(np.float64) - fb[idx].astype(np.float64))
    r.max_abs = float(np.nanmax(diff)) if np.any(~np.isnan(diff)) else float("nan")
    return r


# -- the diff -----------------------------------------------------------------------------------------

@dataclass
class DiffResult:
    a: Trace
    b: Trace
    cmp: HashComparison
    minimal: list = field(default_factory=list)       # RowDiff of each causally minimal divergence
    rows: dict = field(default_factory=dict)           # (layer, stage, pos) -> RowDiff, every differing row
    point: list | None = None                          # --layer/--pos: RowDiff (or identical rows) per stage
    point_at: tuple | None = None
    seconds_trace: float = 0.0
    seconds_values: float = 0.0
    warnings: list = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.cmp.identical

    @property
    def first(self) -> RowDiff | None:
        return self.minimal[0] if self.minimal else None

    def cells(self) -> dict:
        """(layer, pos) -> (worst ULP over the row's stages, that stage)."""
        out: dict = {}
        for (l, s, p), r in self.rows.items():
            u = r.max_ulps if r.max_ulps is not None else 0
            if (l, p) not in out or u > out[(l, p)][0]:
                out[(l, p)] = (u, s)
        return out

    def to_json(self) -> dict:
        c = self.cmp
        doc = {
            "identical": self.identical, "a": self.a.spec, "b": self.b.spec, "checkpoint": self.a.checkpoint,
            "prompt_ids": self.a.prompt_ids, "tokens_a": self.a.tokens, "tokens_b": self.b.tokens,
            "output_hash_a": self.a.output_hash, "output_hash_b": self.b.output_hash,
            "logits_hash_a": self.a.logits_hash, "logits_hash_b": self.b.logits_hash,
            "positions_a": self.a.positions, "positions_b": self.b.positions,
            "compared_positions": c.compared_positions, "token_streams_part_at": c.parting,
            "rows_compared": c.rows_compared, "rows_differing": len(c.differing),
            "rows_only_a": len(c.only_a), "rows_only_b": len(c.only_b),
            "first": self.first.to_json() if self.first else None,
            "minimal": [r.to_json() for r in self.minimal],
            "cells": [{"layer": l, "pos": p, "worst_ulps": u, "stage": s}
                      for (l, p), (u, s) in sorted(self.cells().items())],
            "seconds_trace": round(self.seconds_trace, 3), "seconds_values": round(self.seconds_values, 3),
            "warnings": self.warnings,
        }
        if self.point is not None:
            doc["point"] = {"layer": self.point_at[0], "pos": self.point_at[1],
                            "stages": [r.to_json() for r in self.point]}
        return doc


def run_diff(side_a, side_b, ids, n: int, point: tuple | None = None, values: bool = True,
             trace_a: Trace | None = None, progress=None) -> DiffResult:
    """Diff two sides (objects of tools.sides) on prompt `ids` + `n` new tokens.

    point: (layer, pos) to show stage by stage; values: run the second, value-capturing pass;
    trace_a: a trace of side a already run on the same input (saves one run).
    """
    say = progress or (lambda msg: None)
    keep = None
    if point is not None:
        pl, pp = point
        keep = lambda l, s, p: l == pl and p == pp                               # noqa: E731
    t0 = time.perf_counter()
    say(f"tracing a: {side_a}")
    ta = trace_a if trace_a is not None and point is None else run_traced(side_a, ids, n, keep=keep)
    say(f"tracing b: {side_b}")
    tb = run_traced(side_b, ids, n, keep=keep)
    cmp = compare_traces(ta, tb)
    res = DiffResult(ta, tb, cmp, seconds_trace=time.perf_counter() - t0)

    if cmp.differing and values:
        t1 = time.perf_counter()
        pairs = {(l, s) for l, s, _ in cmp.differing}
        rows = set(cmp.differing)
        keep2 = lambda l, s, p: (l, s, p) in rows                                 # noqa: E731
        say(f"capturing values at {len(pairs)} (layer, stage) pairs: a")
        va = run_traced(side_a, ids, n, keep=keep2, pairs=pairs)
        say(f"capturing values at {len(pairs)} (layer, stage) pairs: b")
        vb = run_traced(side_b, ids, n, keep=keep2, pairs=pairs)
        for name, first, again in (("a", ta, va), ("b", tb, vb)):
            bad = [r for r in rows if again.hashes.get(r) != first.hashes.get(r)]
            if bad:
                res.warnings.append(f"side {name} ({first.spec}) is not reproducible: {len(bad)} rows hashed "
                                    f"differently in the second run, e.g. {sorted(bad)[0]}")
        for r in cmp.differing:
            l, s, p = r
            if (l, s) in va.values and p in va.values[(l, s)] and (l, s) in vb.values and p in vb.values[(l, s)]:
                res.rows[r] = row_diff(l, s, p, va.values[(l, s)][p], vb.values[(l, s)][p],
                                       ta.hashes.get(r), tb.hashes.get(r))
            else:
                res.rows[r] = RowDiff(l, s, p, stage_dtype(s), ta.hashes.get(r), tb.hashes.get(r),
                                      note="value not captured in the second run")
        res.seconds_values = time.perf_counter() - t1
    for r in cmp.minimal:
        l, s, p = r
        res.minimal.append(res.rows.get(r) or RowDiff(l, s, p, stage_dtype(s), ta.hashes.get(r), tb.hashes.get(r)))

    if point is not None:
        pl, pp = point
        res.point_at = (pl, pp)
        res.point = []
        stages = [s for l, s, _ in ta.stages if l == pl]
        if not stages:
            raise ValueError(f"--layer {pl}: the model has layers 0..{ta.num_hidden_layers} "
                             f"({ta.num_hidden_layers} = the head)")
        if pp >= max(ta.positions, tb.positions):
            raise ValueError(f"--pos {pp}: the run processed positions 0..{max(ta.positions, tb.positions) - 1}")
        for s in stages:
            k = (pl, s, pp)
            va_, vb_ = ta.values.get((pl, s), {}).get(pp), tb.values.get((pl, s), {}).get(pp)
            if va_ is None or vb_ is None:
                res.point.append(RowDiff(pl, s, pp, stage_dtype(s), ta.hashes.get(k), tb.hashes.get(k),
                                         note="not recorded by " + ("a" if va_ is None else "b")))
            else:
                res.point.append(row_diff(pl, s, pp, va_, vb_, ta.hashes.get(k), tb.hashes.get(k)))
        if pp >= cmp.compared_positions:
            res.warnings.append(f"position {pp} is past where the token streams part ({cmp.parting}): "
                                f"the sides fed different tokens there")
    return res


# -- the heatmap --------------------------------------------------------------------------------------

def plot_cells(res: DiffResult, path=None):
    """Layer x position heatmap of the worst ULP per cell (log colour scale) -> the matplotlib Figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    L = res.a.num_hidden_layers
    npos = max(res.a.positions, res.b.positions, 1)
    grid = np.full((L + 1, npos), np.nan)
    for (l, p), (u, _) in res.cells().items():
        grid[l, p] = max(u, 1)
    worst = np.nanmax(grid) if np.any(~np.isnan(grid)) else 1.0
    fig, ax = plt.subplots(figsize=(max(6.0, min(20.0, 2.5 + npos * 0.18)), max(3.5, 1.5 + (L + 1) * 0.4)))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#f4f4f4")
    im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, interpolation="nearest",
                   norm=LogNorm(vmin=1, vmax=max(worst, 10.0)), origin="upper")
    cmp = res.cmp
    if cmp.compared_positions < npos:
        ax.add_patch(Rectangle((cmp.compared_positions - 0.5, -0.5), npos - cmp.compared_positions, L + 1,
                               facecolor="#bbbbbb", hatch="//", edgecolor="#888888", alpha=0.6,
                               label="not compared (token streams part)"))
    if res.first is not None:
        f = res.first
        ax.add_patch(Rectangle((f.pos - 0.5, f.layer - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2,
                               label=f"first divergence: {f.stage}"))
    npr = len(res.a.prompt_ids)
    if 0 < npr < npos:
        ax.axvline(npr - 0.5, color="black", linestyle="--", linewidth=1)
        ax.text(npr - 0.4, -0.6, "generated \u2192", fontsize=8, va="bottom")
    ax.set_xlabel("position")
    ax.set_ylabel("layer")
    ax.set_yticks(range(L + 1))
    ax.set_yticklabels([str(l) for l in range(L)] + ["head"])
    verdict = "identical" if res.identical else f"{len(cmp.differing)} rows differ"
    ax.set_title(f"oracle diff: {res.a.spec} vs {res.b.spec}\nworst ULP per (layer, position), {verdict}",
                 fontsize=10)
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("worst ULP distance (in each stage's dtype)")
    handles = [h for h in ax.patches if h.get_label() and not h.get_label().startswith("_")]
    if handles:
        ax.legend(handles=handles, loc="upper right", fontsize=7, framealpha=0.85)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


# -- CLI ----------------------------------------------------------------------------------------------

def _fmt(v, dtype: str | None = None) -> str:
    """Shortest text that identifies the value in its dtype (f64: 17 digits when needed)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return repr(v) if dtype == F64 else str(np.float32(v))
    return str(v)


def render(res: DiffResult, console) -> None:
    from rich.table import Table
    console = wide(console)
    a, b, c = res.a, res.b, res.cmp
    console.print(f"[bold]oracle diff[/bold] {a.checkpoint}: a = [cyan]{a.spec}[/cyan], b = [cyan]{b.spec}[/cyan]; "
                  f"{len(a.prompt_ids)} prompt tokens + {len(a.tokens)} new; {c.rows_compared} rows compared "
                  f"over {c.compared_positions} positions ({res.seconds_trace:.2f} s traced"
                  + (f", {res.seconds_values:.2f} s capturing values" if res.seconds_values else "") + ")")
    console.print(f"  tokens a: {' '.join(map(str, a.tokens))}  (output {a.output_hash}, logits {a.logits_hash})")
    console.print(f"  tokens b: {' '.join(map(str, b.tokens))}  (output {b.output_hash}, logits {b.logits_hash})")
    if c.parting is not None:
        console.print(f"[yellow]token streams part at position {c.parting}[/yellow] (generated token "
                      f"{c.token_parting}): positions >= {c.compared_positions} are not compared")
    for w in res.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")
    if res.point is not None:
        pl, pp = res.point_at
        t = Table(title=f"layer {pl}, position {pp}: every stage in execution order")
        for col in ("stage", "dtype", "hash a", "hash b", "same", "elems differ", "max |\u0394|", "max ULP",
                    "first elem", "a", "b"):
            t.add_column(col, justify="right" if col not in ("stage", "hash a", "hash b") else "left")
        for r in res.point:
            same = r.hash_a == r.hash_b and r.hash_a is not None
            t.add_row(r.stage, r.dtype, r.hash_a or "-", r.hash_b or "-",
                      "[green]yes[/green]" if same else "[red]no[/red]",
                      str(r.n_differ) + (f"/{r.size}" if r.size else ""), _fmt(r.max_abs), _fmt(r.max_ulps),
                      _fmt(r.elem), _fmt(r.a_value, r.dtype), _fmt(r.b_value, r.dtype))
        console.print(t)
    if res.identical:
        console.print(f"[green]IDENTICAL[/green]: all {c.rows_compared} row hashes and the tokens agree")
        return
    if res.minimal:
        t = Table(title=f"{len(c.differing)} rows differ; {len(res.minimal)} causally minimal divergence(s), "
                        "first on top")
        for col in ("layer", "pos", "stage", "dtype", "elem", "a", "b", "ULPs", "elems differ", "max ULP"):
            t.add_column(col, justify="left" if col == "stage" else "right")
        for r in res.minimal:
            t.add_row(str(r.layer), str(r.pos), r.stage, r.dtype, _fmt(r.elem), _fmt(r.a_value, r.dtype),
                      _fmt(r.b_value, r.dtype),
                      _fmt(r.ulps), f"{r.n_differ}/{r.size}", _fmt(r.max_ulps))
        console.print(t)
        f = res.first
        console.print(f"[red]DIFFER[/red]: first divergence at layer {f.layer}, position {f.pos}, stage {f.stage}, "
                      f"element {_fmt(f.elem)}: a = {_fmt(f.a_value, f.dtype)}, b = {_fmt(f.b_value, f.dtype)} "
                      f"({_fmt(f.ulps)} {'' if f.dtype == I32 else f.dtype + ' '}ULP{'s' if f.ulps != 1 else ''})"
                      + (f" [{f.note}]" if f.note else ""))
    else:
        console.print("[red]DIFFER[/red]: "
                      + ("the generated tokens differ" if c.tokens_a != c.tokens_b else "")
                      + (f"; rows recorded by one side only: a {len(c.only_a)}, b {len(c.only_b)}"
                         f" (e.g. {(c.only_a or c.only_b)[0]})" if c.only_a or c.only_b else ""))


def cmd_diff(args, console) -> int:
    from .sides import open_side
    if (args.layer is None) != (args.pos is None):
        raise ValueError("--layer and --pos go together")
    side_a = open_side(args.a, args.checkpoint)
    side_b = open_side(args.b, args.checkpoint)
    if side_a.config.num_hidden_layers != side_b.config.num_hidden_layers:
        raise ValueError("the two sides load different models")
    ids, n = prompt_ids(args, side_a)
    point = (args.layer, args.pos) if args.layer is not None else None
    quiet = args.json or not console.is_terminal
    status = None if quiet else console.status("diff")
    if status is not None:
        status.start()
    try:
        res = run_diff(side_a, side_b, ids, n, point=point,
                       progress=None if status is None else (lambda m: status.update(m)))
    finally:
        if status is not None:
            status.stop()
    from .sides import unfired_warning
    res.warnings += [w for w in (unfired_warning(side_a, "a"), unfired_warning(side_b, "b")) if w]
    if args.plot:
        plot_cells(res, args.plot)
    if args.json:
        doc = res.to_json()
        if args.plot:
            doc["plot"] = str(args.plot)
        print(json.dumps(doc))
    else:
        render(res, console)
        if args.plot:
            console.print(f"wrote {args.plot}")
    return 0 if res.identical else 1


def add_run_arguments(p, need_b: bool = True) -> None:
    """The arguments `diff` and `trace` share: the checkpoint, the sides, the prompt."""
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("--a", required=True, metavar="SPEC", help="side a, e.g. oracle, cpu:threads=2, oracle:chunk=7")
    if need_b:
        p.add_argument("--b", required=True, metavar="SPEC", help="side b, e.g. cpu:inject=15,45,mla.scores,3,1")
    p.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    p.add_argument("--ids", help="prompt token ids, comma-separated (default: the canonical 40-token `long` prompt)")
    p.add_argument("--max-new", type=int, default=None, help=f"new tokens to generate (default {DEFAULT_NEW})")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of tables")


def register(sub, console) -> None:
    d = sub.add_parser(
        "diff", help="localize where two runs part: layer, position, stage, element, ULPs",
        description="Run two sides traced, find where the row hashes part, capture values only there and "
                    "report the first divergence in causal order and every causally minimal one. "
                    "SPEC: oracle | cpu | cuda, with options after a colon: batch=N, chunk=N, prefix-cache[=N], "
                    "threads=N, inject=L,P,STAGE,ELEM,ULPS, precision=float64 (oracle), dot=sequential, "
                    "expf=native (engines). Exit 0 identical, 1 differ, 2 error.")
    add_run_arguments(d)
    d.add_argument("--layer", type=int, help="with --pos: show every stage of this layer side by side")
    d.add_argument("--pos", type=int, help="with --layer: the position to show")
    d.add_argument("--plot", metavar="FILE.png", help="write a layer x position heatmap of the worst ULP per cell")
    d.set_defaults(func=lambda args: cmd_diff(args, console))
