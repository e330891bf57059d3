"""Traces (docs/contract.md §6): the hash of every (layer, stage, position) row of a run, and how two are compared.

A trace is cheap enough to keep for a whole run: `RunCapture` hashes each row as the model hands it
over and keeps no value (unless asked to keep a few rows, for `oracle diff --layer/--pos` and for the
second, value-capturing pass of `oracle diff`). Two traces are compared row by row; the rows whose
hashes part are put in causal order and the causally minimal ones are picked out:

    a value at (l, t) depends on layers < l at positions <= t, and on layer l at positions < t
    (through the caches: KDA state, conv window, MLA latents, indexer pools); within one
    (layer, position) the stages run in execution order (`oracle.stages.model_stages`).

So (l', t', s') is *downstream* of (l, t, s) when l' > l and t' >= t, or l' == l and t' > t, or
(l', t') == (l, t) and s' comes after s. A divergence is *causally minimal* when it is downstream of
no other divergence; the *first* divergence is the minimal one that comes first in the order
(layer, position, stage): the one to look at first. One injected fault gives exactly one minimal
divergence, at the injected point.

Trace files are JSON, versioned (`format: glm-exact-trace`, `version`), see docs/cli.md.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from oracle.capture import Capture, row_hash
from oracle.stages import model_stages, stage_dtype

from .golden import hash12

TRACE_FORMAT = "glm-exact-trace"
TRACE_VERSION = 1


class RunCapture(Capture):
    """Hashes every row of the (layer, stage) pairs in `pairs` (None: all); keeps the values of the
    rows for which `keep(layer, stage, pos)` is true (None: none)."""

    def __init__(self, pairs: set | None = None, keep=None):
        super().__init__(keep_values=False)
        self.pairs, self.keep = pairs, keep

    def wants(self, layer: int, stage: str) -> bool:
        return self.pairs is None or (layer, stage) in self.pairs

    def put(self, layer: int, stage: str, pos: int, value) -> None:
        if not self.wants(layer, stage):
            return
        value = np.asarray(value)
        dtype = "f64" if value.dtype == np.float64 else stage_dtype(stage)
        self.hashes[(layer, stage, pos)] = row_hash(value, dtype)     # hashed now: no copy needed
        if self.keep is not None and self.keep(layer, stage, pos):
            self.values.setdefault((layer, stage), {})[pos] = np.array(value, copy=True)


@dataclass
class Trace:
    """One run: what went in, what came out, and the hash of every stage row."""

    spec: str
    checkpoint: str
    prompt_ids: list[int]
    tokens: list[int]
    hashes: dict                      # (layer, stage, pos) -> 16 hex digits
    num_hidden_layers: int
    stages: list                      # (layer, stage, dtype) in execution order
    output_hash: str = ""
    logits_hash: str = ""
    seconds: float = 0.0
    values: dict = field(default_factory=dict)   # rows kept by the capture, if any (not saved)

    @property
    def fed_ids(self) -> list[int]:
        """The token id at each processed position (the last new token is produced, not processed)."""
        return list(self.prompt_ids) + list(self.tokens[:max(len(self.tokens) - 1, 0)])

    @property
    def positions(self) -> int:
        return len(self.fed_ids)

    # -- files ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        by_pair: dict = {}
        for (l, s, p), h in self.hashes.items():
            by_pair.setdefault((l, s), {})[p] = h
        order = {(l, s): i for i, (l, s, _) in enumerate(self.stages)}
        rows = []
        for (l, s) in sorted(by_pair, key=lambda k: order.get(k, len(order))):
            hs = by_pair[(l, s)]
            rows.append([l, s, [hs.get(p) for p in range(max(hs) + 1)]])
        return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "spec": self.spec,
                "checkpoint": self.checkpoint, "num_hidden_layers": self.num_hidden_layers,
                "prompt_ids": list(self.prompt_ids), "tokens": list(self.tokens),
                "output_hash": self.output_hash, "logits_hash": self.logits_hash,
                "seconds": round(self.seconds, 4), "positions": self.positions,
                "stages": [list(x) for x in self.stages], "hashes": rows}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")

    @classmethod
    def from_json(cls, doc: dict, source: str = "trace") -> "Trace":
        if not isinstance(doc, dict) or doc.get("format") != TRACE_FORMAT:
            raise ValueError(f"{source}: not a trace file (format {TRACE_FORMAT!r} expected)")
        if doc.get("version") != TRACE_VERSION:
            raise ValueError(f"{source}: trace format version {doc.get('version')!r}; this oracle reads "
                             f"version {TRACE_VERSION}")
        try:
            hashes = {}
            for l, s, hs in doc["hashes"]:
                for p, h in enumerate(hs):
                    if h is not None:
                        hashes[(int(l), str(s), p)] = str(h)
            return cls(spec=doc["spec"], checkpoint=doc["checkpoint"], prompt_ids=list(doc["prompt_ids"]),
                       tokens=list(doc["tokens"]), hashes=hashes, num_hidden_layers=int(doc["num_hidden_layers"]),
                       stages=[tuple(x) for x in doc["stages"]], output_hash=doc.get("output_hash", ""),
                       logits_hash=doc.get("logits_hash", ""), seconds=float(doc.get("seconds", 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source}: malformed trace file ({type(e).__name__}: {e})") from None

    @classmethod
    def load(cls, path) -> "Trace":
        try:
            doc = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        return cls.from_json(doc, str(path))


def run_traced(side, ids, n: int, keep=None, pairs=None) -> Trace:
    """Run `side` (an `tools.sides.Side`) with a hash-only capture (plus the rows `keep` names)."""
    cap = RunCapture(pairs=pairs, keep=keep)
    t0 = time.perf_counter()
    tokens, logits = side.generate(ids, n, capture=cap)
    dt = time.perf_counter() - t0
    cfg = side.config
    return Trace(spec=str(side), checkpoint=str(side.checkpoint), prompt_ids=[int(i) for i in ids],
                 tokens=[int(t) for t in tokens], hashes=cap.hashes, num_hidden_layers=cfg.num_hidden_layers,
                 stages=model_stages(cfg), output_hash=hash12(np.array(tokens), "<i4"),
                 logits_hash=hash12(np.asarray(logits), "<f4"), seconds=dt, values=cap.values)


# -- comparison ---------------------------------------------------------------------------------------

def stage_order(stages) -> dict:
    """(layer, stage) -> index in execution order."""
    return {(l, s): i for i, (l, s, *_) in enumerate(stages)}


def causal_key(row, order: dict) -> tuple:
    l, s, p = row
    return (l, p, order.get((l, s), 1 << 30), s)


def downstream(b, a, order: dict) -> bool:
    """Is row b = (layer, stage, pos) causally downstream of row a?"""
    (la, sa, pa), (lb, sb, pb) = a, b
    if lb > la and pb >= pa:
        return True
    if lb == la and pb > pa:
        return True
    return lb == la and pb == pa and order.get((lb, sb), 1 << 30) > order.get((la, sa), 1 << 30)


def causally_minimal(rows, order: dict) -> list:
    """The rows (layer, stage, pos) downstream of no other row, in causal order. O(n log n)."""
    rows = sorted(rows, key=lambda r: causal_key(r, order))
    if not rows:
        return []
    layers = sorted({l for l, _, _ in rows})
    min_pos = {l: min(p for ll, _, p in rows if ll == l) for l in layers}
    prefix_min: dict = {}                       # min position over layers < l
    best = None
    for l in layers:
        prefix_min[l] = best
        best = min_pos[l] if best is None else min(best, min_pos[l])
    min_stage: dict = {}
    for l, s, p in rows:
        k = order.get((l, s), 1 << 30)
        if (l, p) not in min_stage or k < min_stage[(l, p)]:
            min_stage[(l, p)] = k
    out = []
    for l, s, p in rows:
        if prefix_min[l] is not None and prefix_min[l] <= p:
            continue                            # downstream of an earlier layer at a position <= p
        if min_pos[l] < p:
            continue                            # downstream of this layer at an earlier position
        if order.get((l, s), 1 << 30) > min_stage[(l, p)]:
            continue                            # downstream of an earlier stage at this (l, p)
        out.append((l, s, p))
    return out


@dataclass
class HashComparison:
    """Where two traces part (hashes only)."""

    compared_positions: int          # positions 0 .. compared_positions-1 were fed the same token ids
    parting: int | None              # first position whose token id differs (None: same streams)
    differing: list                  # rows (layer, stage, pos) whose hashes differ, in causal order
    minimal: list                    # the causally minimal ones, in causal order
    only_a: list                     # rows only side a recorded (within the compared positions)
    only_b: list
    rows_compared: int
    tokens_a: list = field(default_factory=list)
    tokens_b: list = field(default_factory=list)
    token_parting: int | None = None  # index of the first differing generated token

    @property
    def identical(self) -> bool:
        return (not self.differing and not self.only_a and not self.only_b and self.parting is None
                and self.tokens_a == self.tokens_b)

    @property
    def first(self):
        return self.minimal[0] if self.minimal else None


def compare_traces(a: Trace, b: Trace) -> HashComparison:
    fa, fb = a.fed_ids, b.fed_ids
    common = min(len(fa), len(fb))
    parting = next((i for i in range(common) if fa[i] != fb[i]), None)
    compared = parting if parting is not None else common
    if parting is None and len(fa) != len(fb):
        parting = common
    order = stage_order(a.stages)
    for k, v in stage_order(b.stages).items():
        order.setdefault(k, v)
    keys_a = {k for k in a.hashes if k[2] < compared}
    keys_b = {k for k in b.hashes if k[2] < compared}
    both = keys_a & keys_b
    differing = [k for k in both if a.hashes[k] != b.hashes[k]]
    differing.sort(key=lambda r: causal_key(r, order))
    token_parting = next((i for i in range(min(len(a.tokens), len(b.tokens))) if a.tokens[i] != b.tokens[i]),
                         None if len(a.tokens) == len(b.tokens) else min(len(a.tokens), len(b.tokens)))
    return HashComparison(
        compared_positions=compared, parting=parting, differing=differing,
        minimal=causally_minimal(differing, order),
        only_a=sorted(keys_a - keys_b, key=lambda r: causal_key(r, order)),
        only_b=sorted(keys_b - keys_a, key=lambda r: causal_key(r, order)),
        rows_compared=len(both), tokens_a=list(a.tokens), tokens_b=list(b.tokens), token_parting=token_parting)


def _same_checkpoint(x: str, y: str) -> bool:
    if x == y:
        return True
    try:
        return Path(x).resolve() == Path(y).resolve() and Path(x).exists()
    except OSError:
        return False


def trace_mismatches(a: Trace, b: Trace) -> tuple[list[dict], bool]:
    """What differs between two traces besides the row hashes: (mismatches, comparable).

    Each mismatch is {"field", "a", "b", "text"}: the model (layers, stages: not comparable at all),
    the checkpoint, the prompt ids, the generated tokens (the fed ids after the prompt). Not
    comparable: different models, or no position fed the same token id.
    """
    out: list[dict] = []
    comparable = True
    sa, sb = [tuple(x[:2]) for x in a.stages], [tuple(x[:2]) for x in b.stages]
    if a.num_hidden_layers != b.num_hidden_layers or sa != sb:
        comparable = False
        out.append({"field": "model", "a": {"num_hidden_layers": a.num_hidden_layers, "stages": len(sa)},
                    "b": {"num_hidden_layers": b.num_hidden_layers, "stages": len(sb)},
                    "text": f"the models differ: a has {a.num_hidden_layers} layers and {len(sa)} (layer, stage) "
                            f"pairs, b {b.num_hidden_layers} layers and {len(sb)}"
                            + ("" if a.num_hidden_layers != b.num_hidden_layers or len(sa) != len(sb)
                               else " (the same counts, different stages)")})
    if not _same_checkpoint(a.checkpoint, b.checkpoint):
        out.append({"field": "checkpoint", "a": a.checkpoint, "b": b.checkpoint,
                    "text": f"the checkpoints differ: a {a.checkpoint}, b {b.checkpoint}"})
    pa, pb = list(a.prompt_ids), list(b.prompt_ids)
    if pa != pb:
        at = next((i for i in range(min(len(pa), len(pb))) if pa[i] != pb[i]), min(len(pa), len(pb)))
        ids = (f"a {pa[at]}, b {pb[at]}" if at < min(len(pa), len(pb))
               else f"{'a' if len(pa) > len(pb) else 'b'} goes on")
        out.append({"field": "prompt_ids", "a": pa, "b": pb, "at": at,
                    "text": f"the prompts differ at position {at} ({ids}; a has {len(pa)} ids, b {len(pb)})"})
        if at == 0:
            comparable = False
    fa, fb = a.fed_ids, b.fed_ids
    if pa == pb and fa != fb:
        at = next((i for i in range(min(len(fa), len(fb))) if fa[i] != fb[i]), min(len(fa), len(fb)))
        ids = (f"a fed {fa[at]}, b fed {fb[at]}" if at < min(len(fa), len(fb))
               else f"a ran {len(fa)} positions, b {len(fb)}")
        out.append({"field": "tokens", "a": list(a.tokens), "b": list(b.tokens), "at": at,
                    "text": f"the generated tokens part: position {at} ({ids}); later positions are not compared"})
    return out, comparable


def comparison_json(cmp: HashComparison, a: Trace, b: Trace) -> dict:
    def row(r):
        l, s, p = r
        return {"layer": l, "stage": s, "pos": p, "hash_a": a.hashes.get(r), "hash_b": b.hashes.get(r)}
    mismatches, comparable = trace_mismatches(a, b)
    return {
        "identical": cmp.identical and not mismatches, "a": a.spec, "b": b.spec,
        "rows_compared": cmp.rows_compared, "rows_differing": len(cmp.differing),
        "compared_positions": cmp.compared_positions, "positions_a": a.positions, "positions_b": b.positions,
        "token_streams_part_at": cmp.parting, "tokens_a": a.tokens, "tokens_b": b.tokens,
        "output_hash_a": a.output_hash, "output_hash_b": b.output_hash,
        "logits_hash_a": a.logits_hash, "logits_hash_b": b.logits_hash,
        "first": row(cmp.first) if cmp.first else None,
        "minimal": [row(r) for r in cmp.minimal],
        "only_a": [row(r) for r in cmp.only_a[:100]], "only_b": [row(r) for r in cmp.only_b[:100]],
        "checkpoint_a": a.checkpoint, "checkpoint_b": b.checkpoint,
        "mismatches": mismatches, "comparable": comparable,
    }


# -- CLI --------------------------------------------------------------------------------------------

def cmd_trace(args, console) -> int:
    if getattr(args, "trace_action", None) == "compare":
        return cmd_trace_compare(args, console)
    from .sides import open_side
    if not args.checkpoint or not args.a or not args.out:
        raise ValueError("oracle trace needs --checkpoint DIR --a SPEC --out FILE.json "
                         "(or: oracle trace compare A.json B.json)")
    from .prompts import prompt_ids
    side = open_side(args.a, args.checkpoint)
    ids, n = prompt_ids(args, side)
    t = run_traced(side, ids, n)
    from .sides import unfired_warning
    from .term import warn
    if unfired_warning(side):
        warn(unfired_warning(side))
    t.save(args.out)
    summary = {"out": str(args.out), "spec": t.spec, "rows": len(t.hashes), "positions": t.positions,
               "tokens": t.tokens, "output_hash": t.output_hash, "logits_hash": t.logits_hash,
               "seconds": round(t.seconds, 3)}
    if args.json:
        print(json.dumps(summary))
    else:
        console.print(f"wrote [bold]{args.out}[/bold]: {len(t.hashes)} row hashes "
                      f"({t.positions} position{'s' if t.positions != 1 else ''}), tokens {' '.join(map(str, t.tokens))}, "
                      f"output {t.output_hash}, logits {t.logits_hash}, {t.seconds:.2f} s")
    return 0


def cmd_trace_compare(args, console) -> int:
    from rich.markup import escape

    from .fit import fit_tables, plural
    from .term import error, wide
    a, b = Trace.load(args.file_a), Trace.load(args.file_b)
    cmp = compare_traces(a, b)
    doc = comparison_json(cmp, a, b)
    mismatches, comparable = doc["mismatches"], doc["comparable"]
    if not comparable:
        why = "; ".join(m["text"] for m in mismatches if m["field"] in ("model", "prompt_ids", "checkpoint"))
        msg = f"trace compare: {args.file_a} and {args.file_b} are not comparable: {why}"
        return error(msg if args.json else escape(msg), args.json,
                     **{k: v for k, v in doc.items() if k != "identical"})
    identical = doc["identical"]
    if args.json:
        print(json.dumps(doc))
        return 0 if identical else 1
    console = wide(console)
    console.print(f"[bold]trace compare[/bold] {escape(str(args.file_a))} ({escape(a.spec)}) vs "
                  f"{escape(str(args.file_b))} ({escape(b.spec)}): {plural(cmp.rows_compared, 'row')} over "
                  f"{plural(cmp.compared_positions, 'position')}")
    for m in mismatches:                             # why the traces cannot agree, before any row
        console.print(f"[yellow]not the same run[/yellow]: {escape(m['text'])}")
    if cmp.parting is not None and not any(m["field"] in ("tokens", "prompt_ids") for m in mismatches):
        console.print(f"[yellow]token streams part at position {cmp.parting}[/yellow]: later positions not compared")
    if identical:
        console.print("[green]IDENTICAL[/green]: every row hash agrees")
        return 0
    if cmp.minimal:
        nd = len(cmp.differing)
        rows = [[str(r[0]), str(r[2]), r[1], a.hashes[r], b.hashes[r]] for r in cmp.minimal]
        title = f"{plural(nd, 'row')} differ{'s' if nd == 1 else ''}; causally minimal divergences (first on top)"
        for part in fit_tables(console.width, title, [("layer", "right"), ("position", "right"), ("stage", "left"),
                                                      ("hash a", "left"), ("hash b", "left")], rows, key=3):
            console.print(part)
        console.print("values are not in trace files: run `oracle diff` on the two sides to see elements and ULPs")
    if cmp.only_a or cmp.only_b:
        console.print(f"[yellow]rows recorded by one side only[/yellow]: a {len(cmp.only_a)}, b {len(cmp.only_b)}"
                      + (f" (first: {cmp.only_a[0] if cmp.only_a else cmp.only_b[0]})"))
    if cmp.differing:
        console.print(f"[red]DIFFER[/red]: {plural(len(cmp.differing), 'row')} of {cmp.rows_compared}")
    else:
        names = {"checkpoint": "the checkpoints", "prompt_ids": "the prompts", "tokens": "the generated tokens",
                 "model": "the models"}
        what = " and ".join(names[m["field"]] for m in mismatches) or "the rows recorded"
        console.print(f"[red]DIFFER[/red]: {what} differ; every one of the {plural(cmp.rows_compared, 'row')} "
                      "compared agrees")
    return 1


def register(sub, console) -> None:
    import argparse
    t = sub.add_parser(
        "trace", help="write a trace file (a hash per layer, stage, position) or compare two",
        description="oracle trace --checkpoint DIR --a SPEC [--ids ...] --out FILE.json writes the trace of one run; "
                    "oracle trace compare A.json B.json compares two: exit 0 identical (same checkpoint, prompt and "
                    "generated tokens, every row hash equal), 1 differ (rows, or the checkpoint, prompt or generated "
                    "tokens, each named first with both values), 2 error or not comparable at all (different "
                    "models, or prompts that differ from their first token: no row can be compared).")
    t.add_argument("--out", metavar="FILE.json", help="where to write the trace")
    t.add_argument("--checkpoint", help="checkpoint directory")
    t.add_argument("--a", metavar="SPEC", help="the side to run, e.g. oracle or cpu:chunk=5")
    t.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    t.add_argument("--ids", help="prompt token ids, comma-separated (default: the canonical `long` prompt)")
    t.add_argument("--max-new", type=int, default=None, help="new tokens to generate (default 8)")
    t.add_argument("--json", action="store_true", help="JSON on stdout")
    tsub = t.add_subparsers(dest="trace_action", required=False, metavar="compare")
    c = tsub.add_parser("compare", help="compare two trace files",
                        description="Compare two trace files row by row (causal order, as oracle diff). A different "
                                    "checkpoint, prompt or generated tokens is named first, with both values. Exit 0 "
                                    "identical, 1 differ, 2 error or not comparable at all (different models, or "
                                    "prompts that differ at their first token).")
    c.add_argument("file_a")
    c.add_argument("file_b")
    c.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="JSON on stdout")
    t.set_defaults(func=lambda args: cmd_trace(args, console))
