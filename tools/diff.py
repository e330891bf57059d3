"""`oracle diff`: the first layer, position, stage and element where two runs part, and by how many ULPs.

    oracle diff --checkpoint golden/tiny-bf16 --a oracle --b oracle:inject=3,30,mla.scores,5,100

1. Both sides run traced (one hash per (layer, stage, position) row, no values kept).
2. The token streams are compared: only positions both sides fed with the same token ids are compared.
3. Rows whose hashes part are ordered causally (oracle/trace.py); the causally minimal ones are found.
4. Both sides run again, keeping values only at the (layer, stage) pairs whose hashes parted (and
   only at the differing positions); each differing row gets its first differing element, both
   values and the ULP distance in the stage's dtype (bf16 / f32 / f64 bits; ints: the difference).

`--layer L --pos P` shows every stage of one point side by side; `--plot F.png` draws the worst
relative difference |a - b| / max(|a|, |b|) of each (layer, position) cell (ULPs of different dtypes
are not comparable). Tables too wide for the terminal continue below (tools/fit.py): nothing is cut.
Exit 0 identical, 1 differ, 2 error (a plot that cannot be written too, after the report).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.markup import escape

from oracle.stages import BF16, F32, F64, I32, stage_dtype

from .fit import fit_tables, plural
from .prompts import DEFAULT_NEW, prompt_ids
from .sides import options_help
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


def _num(v):
    """A number for JSON: non-finite floats as their repr ('inf', 'nan')."""
    if v is None or isinstance(v, int):
        return v
    return v if math.isfinite(v) else repr(v)


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
    max_rel: float | None = None      # worst |a - b| / max(|a|, |b|) over the differing elements (ids: 1)
    a_holds: str | None = None        # the numpy dtype of the values each side handed over
    b_holds: str | None = None
    note: str = ""

    def to_json(self) -> dict:
        num = _num
        return {"layer": self.layer, "stage": self.stage, "pos": self.pos, "dtype": self.dtype,
                "hash_a": self.hash_a, "hash_b": self.hash_b, "size": self.size, "elements_differing": self.n_differ,
                "elem": self.elem, "a": num(self.a_value), "b": num(self.b_value),
                "a_bits": _hexbits(self.a_value, self.dtype), "b_bits": _hexbits(self.b_value, self.dtype),
                "ulps": self.ulps,
                "max_ulps": self.max_ulps, "max_abs": num(self.max_abs), "note": self.note,
                "max_rel": num(self.max_rel), "a_holds": self.a_holds, "b_holds": self.b_holds}


F64_NOTE = "one side holds doubles (float64 mode): compared as f64"


def row_diff(layer: int, stage: str, pos: int, a, b, hash_a=None, hash_b=None) -> RowDiff:
    """Compare one row's values (any shapes; compared flattened, bit for bit)."""
    dtype = stage_dtype(stage)
    a, b = np.asarray(a), np.asarray(b)
    note = ""
    if dtype != I32 and (a.dtype == np.float64 or b.dtype == np.float64):
        if a.dtype != b.dtype:
            note = F64_NOTE
        dtype = F64
    fa, fb = a.reshape(-1), b.reshape(-1)
    r = RowDiff(layer, stage, pos, dtype, hash_a, hash_b, size=int(max(fa.size, fb.size)), note=note,
                a_holds=str(a.dtype), b_holds=str(b.dtype))
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
            r.note = (f"no element differs: equal values held as {a.dtype} by a and {b.dtype} by b; "
                      "the hashes part on the dtype alone, so there is no element or ULP distance to show")
            r.max_rel = 0.0
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
    r.max_rel = 1.0 if dtype == I32 else relative_difference(fa[idx], fb[idx])
    return r


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max(|a|, |b|) over the elements: in [0, 2], the same scale whatever the dtypes
    (a bf16 value against a double, f32 against f32); inf when a NaN or an infinity is involved."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
        rel = np.abs(x - y) / np.maximum(np.abs(x), np.abs(y))
    rel = np.where(np.isfinite(rel), rel, np.inf)
    return float(rel.max()) if rel.size else 0.0


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

    def rel_cells(self) -> dict:
        """(layer, pos) -> (worst relative difference over the row's stages, that stage): ULPs of
        different dtypes are not comparable (1 bf16 ULP = 65536 f32 ULPs), relative differences are."""
        out: dict = {}
        for (l, s, p), r in self.rows.items():
            u = r.max_rel if r.max_rel is not None else 0.0
            if (l, p) not in out or u > out[(l, p)][0]:
                out[(l, p)] = (u, s)
        return out

    @property
    def mixed_dtypes(self) -> list:
        """Rows whose sides hold different numpy dtypes (e.g. canonical against precision=float64)."""
        return [r for r in self.rows.values() if r.a_holds and r.b_holds and r.a_holds != r.b_holds]

    @property
    def first_value_difference(self) -> RowDiff | None:
        """The first row in causal order with an element that differs in value."""
        return next((self.rows[k] for k in self.cmp.differing if k in self.rows and self.rows[k].elem is not None
                     and self.rows[k].a_value is not None), None)

    def notes(self) -> list[str]:
        """What a reader needs to interpret the numbers (also in --json as `notes`)."""
        mixed = self.mixed_dtypes
        if not mixed:
            return []
        ah = sorted({r.a_holds for r in mixed})
        bh = sorted({r.b_holds for r in mixed})
        return [(f"the sides hold different dtypes in {plural(len(mixed), 'row')}: a {'/'.join(ah)}, b {'/'.join(bh)} "
                "(precision=float64 keeps every stage as a double; the canonical run rounds each stage to its "
                "dtype). Such rows are compared as f64: where the values are equal the hashes part on the dtype "
                "alone (no element, no ULP distance); where they differ, an f64 ULP count between a rounded "
                "and an unrounded value is huge and says little: read the relative difference "
                "|a - b| / max(|a|, |b|) (column 'max rel') instead.")]

    def to_json(self) -> dict:
        c = self.cmp
        rel, fv = self.rel_cells(), self.first_value_difference
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
            "cells": [{"layer": l, "pos": p, "worst_ulps": u, "stage": s,
                       "worst_rel": _num(rel[(l, p)][0]), "worst_rel_stage": rel[(l, p)][1]}
                      for (l, p), (u, s) in sorted(self.cells().items())],
            "first_value_difference": fv.to_json() if fv is not None else None,
            "notes": self.notes(),
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
                res.warnings.append(f"side {name} ({first.spec}) is not reproducible: {plural(len(bad), 'row')} "
                                    f"hashed differently in the second run, e.g. {sorted(bad)[0]}")
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

REL_LABEL = "worst relative difference |a \u2212 b| / max(|a|, |b|) (dtype-independent; ids: 1)"


def plot_cells(res: DiffResult, path=None):
    """Layer x position heatmap of the worst relative difference per cell (log colour scale) -> the Figure.

    Coloured by the relative difference, not by ULPs: ULPs of different dtypes are not comparable
    (one bf16 ULP is 65536 f32 ULPs, and an f64 row against a rounded one is ~1e9 f64 ULPs), so a
    ULP colour scale is saturated by whichever stages hold doubles.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import MaxNLocator

    L = res.a.num_hidden_layers
    npos = max(res.a.positions, res.b.positions, 1)
    grid = np.full((L + 1, npos), np.nan)
    cells = res.rel_cells()
    positive = [u for u, _ in cells.values() if 0 < u < math.inf]
    lo = min(positive) if positive else 1e-8
    hi = max(positive) if positive else 1.0
    vmin, vmax = lo / 2, max(hi, lo * 10)
    for (l, p), (u, _) in cells.items():
        grid[l, p] = vmax if u == math.inf else max(u, vmin)   # 0: equal values, the dtype alone differs
    fig, ax = plt.subplots(figsize=(max(6.0, min(20.0, 2.5 + npos * 0.18)), max(4.0, 2.2 + (L + 1) * 0.4)),
                           layout="constrained")
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#f4f4f4")
    im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, interpolation="nearest",
                   norm=LogNorm(vmin=vmin, vmax=vmax), origin="upper")
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
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("layer")
    ax.set_yticks(range(L + 1))
    ax.set_yticklabels([str(l) for l in range(L)] + ["head"])
    n = len(cmp.differing)
    verdict = "identical" if res.identical else f"{plural(n, 'row')} differ{'s' if n == 1 else ''}"
    ax.set_title(f"oracle diff: {res.a.spec} vs {res.b.spec}\nworst relative difference per (layer, position), "
                 f"{verdict}", fontsize=10, pad=14)
    cb = fig.colorbar(im, ax=ax)
    cb.set_label(REL_LABEL, fontsize=8)
    handles = [h for h in ax.patches if h.get_label() and not h.get_label().startswith("_")]
    if handles:   # below the plot, never over a cell
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=7, frameon=False)
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


def _fmt_rel(v) -> str:
    if v is None:
        return "-"
    return "0" if v == 0 else ("inf" if v == math.inf else f"{v:.3g}")


def _own_note(r: RowDiff) -> str:
    """The row's note without the float64 remark (the report's general note says that once)."""
    return r.note.replace(F64_NOTE, "").strip("; ")


def _print_tables(console, parts) -> None:
    for p in parts:
        console.print(p)


def render(res: DiffResult, console) -> None:
    """The text report. Tables never cut a cell: too wide for the console, they continue below."""
    console = wide(console)
    width = console.width
    a, b, c = res.a, res.b, res.cmp
    console.print(f"[bold]oracle diff[/bold] {escape(a.checkpoint)}: a = [cyan]{escape(a.spec)}[/cyan], "
                  f"b = [cyan]{escape(b.spec)}[/cyan]; {plural(len(a.prompt_ids), 'prompt token')} + "
                  f"{len(a.tokens)} new; {plural(c.rows_compared, 'row')} compared over "
                  f"{plural(c.compared_positions, 'position')} ({res.seconds_trace:.2f} s traced"
                  + (f", {res.seconds_values:.2f} s capturing values" if res.seconds_values else "") + ")")
    console.print(f"  tokens a: {' '.join(map(str, a.tokens))}  (output {a.output_hash}, logits {a.logits_hash})")
    console.print(f"  tokens b: {' '.join(map(str, b.tokens))}  (output {b.output_hash}, logits {b.logits_hash})")
    if c.parting is not None:
        console.print(f"[yellow]token streams part at position {c.parting}[/yellow] (generated token "
                      f"{c.token_parting}): positions >= {c.compared_positions} are not compared")
    for w in res.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(w)}")
    for n in res.notes():
        console.print(f"[yellow]note:[/yellow] {escape(n)}")
    if res.point is not None:
        pl, pp = res.point_at
        cols = [("stage", "left"), ("dtype", "right"), ("hash a", "left"), ("hash b", "left"), ("same", "right"),
                ("elems differ", "right"), ("max |\u0394|", "right"), ("max ULP", "right"), ("max rel", "right"),
                ("first elem", "right"), ("a", "right"), ("b", "right")]
        rows, detail = [], []
        for r in res.point:
            same = r.hash_a == r.hash_b and r.hash_a is not None
            rows.append([r.stage, r.dtype, r.hash_a or "-", r.hash_b or "-",
                         "[green]yes[/green]" if same else "[red]no[/red]",
                         str(r.n_differ) + (f"/{r.size}" if r.size else ""), _fmt(r.max_abs, r.dtype),
                         _fmt(r.max_ulps), _fmt_rel(r.max_rel), _fmt(r.elem), _fmt(r.a_value, r.dtype), _fmt(r.b_value, r.dtype)])
            detail.append(not same)
        _print_tables(console, fit_tables(width, f"layer {pl}, position {pp}: every stage in execution order",
                                          cols, rows, key=1, detail=detail,
                                          detail_what=("stage that differs", "stages that differ")))
        for r in res.point:
            note = _own_note(r)
            if note:
                console.print(f"  {r.stage}: {escape(note)}")
    if res.identical:
        unfired = any("the injection did not fire" in w for w in res.warnings)
        console.print(f"[green]IDENTICAL[/green]: all {plural(c.rows_compared, 'row hash', 'row hashes')} "
                      "and the tokens agree" + (" (but an injection did not fire: see the warning)" if unfired else ""))
        return
    if res.minimal:
        nd = len(c.differing)
        cols = [("layer", "right"), ("pos", "right"), ("stage", "left"), ("dtype", "right"), ("elem", "right"),
                ("a", "right"), ("b", "right"), ("ULPs", "right"), ("elems differ", "right"), ("max ULP", "right"),
                ("max rel", "right")]
        rows = [[str(r.layer), str(r.pos), r.stage, r.dtype, _fmt(r.elem), _fmt(r.a_value, r.dtype),
                 _fmt(r.b_value, r.dtype), _fmt(r.ulps), f"{r.n_differ}/{r.size}", _fmt(r.max_ulps),
                 _fmt_rel(r.max_rel)] for r in res.minimal]
        title = (f"{plural(nd, 'row')} differ{'s' if nd == 1 else ''}; "
                 f"{plural(len(res.minimal), 'causally minimal divergence')}, first on top")
        _print_tables(console, fit_tables(width, title, cols, rows, key=3))
        f = res.first
        where = f"layer {f.layer}, position {f.pos}, stage {f.stage}"
        if f.elem is not None and (f.a_value is not None or f.b_value is not None):
            console.print(f"[red]DIFFER[/red]: first divergence at {where}, element {_fmt(f.elem)}: "
                          f"a = {_fmt(f.a_value, f.dtype)}, b = {_fmt(f.b_value, f.dtype)} ({_fmt(f.ulps)} "
                          f"{'' if f.dtype == I32 else f.dtype + ' '}ULP{'s' if f.ulps != 1 else ''}"
                          + (f", relative difference {_fmt_rel(f.max_rel)}" if f.dtype != I32 else "") + ")"
                          + (f"; {escape(_own_note(f))}" if _own_note(f) else ""))
        else:
            console.print(f"[red]DIFFER[/red]: first divergence at {where}: "
                          + escape(f.note or "no element was compared (values not captured)"))
            fv = res.first_value_difference
            if fv is not None:
                console.print(f"  first row whose values differ: layer {fv.layer}, position {fv.pos}, stage "
                              f"{fv.stage}, element {fv.elem}: a = {_fmt(fv.a_value, fv.dtype)}, "
                              f"b = {_fmt(fv.b_value, fv.dtype)} (relative difference {_fmt_rel(fv.max_rel)}; "
                              f"{plural(fv.ulps, fv.dtype + ' ULP')})")
        for r in res.minimal[1:]:
            if _own_note(r):
                console.print(f"  layer {r.layer}, position {r.pos}, {r.stage}: {escape(_own_note(r))}")
    else:
        console.print("[red]DIFFER[/red]: "
                      + ("the generated tokens differ" if c.tokens_a != c.tokens_b else "")
                      + (f"; rows recorded by one side only: a {len(c.only_a)}, b {len(c.only_b)}"
                         f" (e.g. {(c.only_a or c.only_b)[0]})" if c.only_a or c.only_b else ""))


def plot_path(text: str) -> Path:
    """Check a --plot FILE before anything runs: a format matplotlib writes (no extension: .png), a
    folder that exists. Returns the path the plot will be written to."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as e:
        raise ValueError(f"--plot needs matplotlib ({e})") from None
    path = Path(text)
    if not path.name or path.name in (".", ".."):
        raise ValueError(f"--plot {text!r}: give a file name, e.g. cells.png")
    formats = FigureCanvasBase.get_supported_filetypes()
    ext = path.suffix[1:].lower()
    if not ext:
        path = path.with_name(path.name + ".png")
    elif ext not in formats:
        raise ValueError(f"--plot {text}: matplotlib cannot write .{ext} files; use one of "
                         + ", ".join("." + f for f in sorted(formats)))
    if path.is_dir():
        raise ValueError(f"--plot {text}: is a folder; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"--plot {text}: the folder {parent} does not exist")
    return path


def cmd_diff(args, console) -> int:
    from .sides import open_side
    from .term import err
    if (args.layer is None) != (args.pos is None):
        raise ValueError("--layer and --pos go together")
    plot = plot_path(args.plot) if args.plot else None          # before the runs: a typo costs nothing
    side_a = open_side(args.a, args.checkpoint)
    side_b = open_side(args.b, args.checkpoint)
    if side_a.config.num_hidden_layers != side_b.config.num_hidden_layers:
        raise ValueError("the two sides load different models")
    ids, n = prompt_ids(args, side_a)
    point = (args.layer, args.pos) if args.layer is not None else None
    progress = err()
    status = None if args.json or not progress.is_terminal else progress.status("diff")
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
    plot_error = None
    if plot is not None:
        try:
            plot_cells(res, plot)
        except Exception as e:  # noqa: BLE001 - any failure to write: the report still comes first
            plot_error = f"--plot {plot}: could not write the plot ({type(e).__name__}: {e})"
    if args.json:
        doc = res.to_json()
        if plot is not None:
            doc["plot"] = str(plot)
        if plot_error:
            doc["error"] = plot_error
        print(json.dumps(doc))
    else:
        render(res, console)
        if plot is not None and not plot_error:
            console.print(f"wrote {escape(str(plot))}")
    if plot_error:
        if not args.json:
            import sys

            from .term import error
            sys.stdout.flush()                      # the report, then the error
            error(escape(plot_error))
        return 2
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
                    + options_help() + ". Exit 0 identical, 1 differ, 2 error (bad input, or the plot could not "
                    "be written: the report is printed first). Tables wider than the terminal continue below "
                    "(the key columns repeated), so no stage name, hash or value is cut.")
    add_run_arguments(d)
    d.add_argument("--layer", type=int, help="with --pos: show every stage of this layer side by side")
    d.add_argument("--pos", type=int, help="with --layer: the position to show")
    d.add_argument("--plot", metavar="FILE.png",
                   help="write a layer x position heatmap of the worst relative difference |a-b|/max(|a|,|b|) per "
                        "cell (any format matplotlib writes; no extension: .png); checked before the runs")
    d.set_defaults(func=lambda args: cmd_diff(args, console))
