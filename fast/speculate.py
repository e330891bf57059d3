"""Speculative decoding that changes no bit (docs/serve.md, "Speculative decoding").

A drafter proposes up to K next tokens of a sequence; the target engine runs the tokens the sequence
has accepted but not yet fed plus the drafts in ONE step with every row's logits, and position p's
token is chosen from row p exactly as serial decoding chooses it (`oracle.sampling.sample(row,
params, p)`: greedy argmax, ties to the lowest id, or the draw keyed by (seed, p) only). Drafts are
accepted while they equal the chosen token; the first chosen token that differs (or the bonus token
after all K) is emitted too. Row p's logits depend only on the tokens before p (the engine is
batch- and chunk-invariant by construction, docs/contract.md), so the accepted tokens, their rows and
their log-probabilities are the serial ones.

Rollback. The engines have no truncate, so a verify that carries drafts runs on the sequence's cache
after a snapshot (`Cache.fork()`) of it. All accepted: the cache is right as it is and the snapshot
is dropped. Otherwise the cache is dropped and the snapshot (the state before the step) becomes the
cache again; the accepted tokens are not re-run at once but fed at the front of the sequence's next
step (`Spec.todo`), whose rows for them equal the ones already used. A cache therefore only ever
holds accepted tokens. Cost per verify with drafts: one fork (a copy of the sequence's state: the
KDA states, O(1), and the MLA latents and indexer keys, O(length)); on a rejection, the K - a rejected
rows, and the a + 1 accepted tokens run again in the next step.

Drafters (`parse_speculate`):
    ngram:K       NgramDrafter: the continuation of the longest earlier match of the sequence's
                  suffix, in its own tokens (prompt + generated); no model
    model:DIR:K   ModelDrafter: greedy decoding of a smaller checkpoint with the same vocabulary, on
                  its own cache per sequence, rolled back the same way
Any object with `k`, `start()`, `draft(items)`, `settle(state, history)` and `release(state)` is a
drafter too (the tests' forced drafters).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from oracle.capture import Capture
from oracle.sampling import SamplingParams, sample

__all__ = ["NgramDrafter", "ModelDrafter", "Spec", "SpecStats", "parse_speculate", "ngram_propose",
           "open_drafter", "close_drafter", "check_vocabulary", "before_eos", "generate", "sample_loop",
           "GREEDY", "NGRAM_MAX"]

GREEDY = SamplingParams()
NGRAM_MAX = 8   # the longest suffix NgramDrafter matches (longer matches count as this long)


# -- drafters ------------------------------------------------------------------------------------------

def ngram_propose(history, k: int, longest: int = NGRAM_MAX) -> list[int]:
    """Up to k drafts from the sequence's own tokens `history` (prompt + generated, the last one
    included). The rule: among the earlier positions i < n-1 with history[i] == history[-1], take the
    one whose match with the suffix, read backwards, is longest (capped at `longest` tokens), the most
    recent one on a tie; propose the k tokens that followed it, read from the history extended by the
    proposal itself (an overlapping copy, as in LZ77: a run of period q keeps repeating). No earlier
    occurrence of the last token: no drafts."""
    h = np.asarray(history)
    n = h.size
    if k < 1 or n < 2:
        return []
    cand = np.flatnonzero(h[:n - 1] == h[n - 1])
    if cand.size == 0:
        return []
    length = np.ones(cand.size, np.int64)
    alive = np.ones(cand.size, np.bool_)
    for j in range(1, longest):
        idx = cand - j
        ok = alive & (idx >= 0)
        ok[ok] = h[idx[ok]] == h[n - 1 - j]
        if not ok.any():
            break
        length += ok
        alive = ok
    best = np.flatnonzero(length == length.max())[-1]   # the most recent of the longest
    start = int(cand[best]) + 1
    out: list[int] = []
    for j in range(k):
        p = start + j
        out.append(int(h[p]) if p < n else out[p - n])
    return out


class NgramDrafter:
    """ngram:K: drafts by `ngram_propose`; no state per sequence."""

    def __init__(self, k: int):
        self.k = _check_k(k, "ngram")

    def __str__(self) -> str:
        return f"ngram:{self.k}"

    def start(self):
        return None

    def draft(self, items) -> list[list[int]]:
        """items: (state, history, k) per sequence -> up to k drafts each."""
        return [ngram_propose(h, k) if k > 0 else [] for _, h, k in items]

    def settle(self, state, history) -> None:
        pass

    def release(self, state) -> None:
        pass


@dataclass
class _DraftSeq:
    cache: object
    ids: list = field(default_factory=list)   # the tokens the drafter's cache holds
    snapshot: object = None                    # its cache before it fed its own drafts
    base: int = 0                              # len(ids) at the snapshot


class ModelDrafter:
    """model:DIR:K: greedy decoding of `engine` (a smaller checkpoint with the target's vocabulary),
    batched over the sequences: one step catches each drafter cache up with the sequence and gives the
    first draft, then one step per further draft. The drafter's cache is forked before it feeds its
    own drafts and restored when the target rejects one of them, so it too only holds accepted tokens."""

    def __init__(self, engine, k: int, target=None, path: str | None = None):
        self.k = _check_k(k, "model")
        self.engine, self.path = engine, path
        if target is not None:
            check_vocabulary(target, engine)

    def __str__(self) -> str:
        return f"model:{self.path}:{self.k}"

    def start(self) -> _DraftSeq:
        return _DraftSeq(self.engine.new_cache())

    def draft(self, items) -> list[list[int]]:
        out = [[] for _ in items]
        work = [(i, s, [int(t) for t in h], k) for i, (s, h, k) in enumerate(items) if k > 0]
        segs = []
        for _, s, h, _ in work:
            missing = h[len(s.ids):]
            if h[:len(s.ids)] != s.ids or not missing:   # not a prefix: start over (never when settled)
                s.cache.close()
                s.cache, s.ids, missing = self.engine.new_cache(), [], h
            segs.append((s.cache, missing, None, "last"))
            s.ids = list(h)
        rows = self.engine.step(segs) if segs else []
        for (i, s, _, k), lg in zip(work, rows):
            out[i].append(int(np.argmax(lg[-1])))
            if k > 1:
                s.snapshot, s.base = s.cache.fork(), len(s.ids)
        for j in range(1, max((k for *_, k in work), default=0)):
            live = [(i, s) for i, s, _, k in work if k > j]
            rows = self.engine.step([(s.cache, [out[i][-1]], None, "last") for i, s in live])
            for (i, s), lg in zip(live, rows):
                s.ids.append(out[i][-1])
                out[i].append(int(np.argmax(lg[-1])))
        return out

    def settle(self, state: _DraftSeq, history) -> None:
        """The target accepted `history` (prompt + emitted tokens): keep the drafter's cache if it holds
        a prefix of it, else go back to the snapshot."""
        if state.snapshot is None:
            return
        h = history if isinstance(history, list) else [int(t) for t in history]
        if h[:len(state.ids)] == state.ids:
            state.snapshot.close()
        else:
            state.cache.close()
            state.cache, state.ids = state.snapshot, state.ids[:state.base]
        state.snapshot = None

    def release(self, state: _DraftSeq | None) -> None:
        if state is None:
            return
        for c in (state.cache, state.snapshot):
            if c is not None:
                c.close()


def before_eos(drafts: list[int], eos) -> list[int]:
    """The drafts before the first end-of-sequence token: an accepted draft is fed, and serial never
    feeds the token that ends a sequence (an EOS still ends it as the step's last, chosen token)."""
    for j, t in enumerate(drafts):
        if t in eos:
            return drafts[:j]
    return drafts


def _check_k(k, kind: str) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"speculate {kind}: K must be an integer >= 1, got {k!r}")
    return int(k)


def check_vocabulary(target, drafter) -> None:
    """The drafter must speak the target's token ids: equal config.vocab_size, and equal tokenizer.json
    where both checkpoints have one."""
    a, b = target.config.vocab_size, drafter.config.vocab_size
    if a != b:
        raise ValueError(f"speculate model: the drafter's vocab_size is {b}, the target's is {a}; a drafter "
                         f"needs the target's vocabulary")
    ta, tb = (Path(e.checkpoint.path) / "tokenizer.json" for e in (target, drafter))
    if ta.is_file() and tb.is_file() and ta.read_bytes() != tb.read_bytes():
        raise ValueError(f"speculate model: the drafter's tokenizer.json ({tb}) differs from the target's ({ta})")


def parse_speculate(text: str) -> tuple[str, str | None, int]:
    """'ngram:K' -> ('ngram', None, K); 'model:DIR:K' -> ('model', DIR, K) (DIR may hold colons)."""
    if not isinstance(text, str):
        raise ValueError(f"speculate must be 'ngram:K' or 'model:DIR:K', got {text!r}")
    kind, _, rest = text.partition(":")
    if kind == "ngram":
        path, k = None, rest
    elif kind == "model":
        path, _, k = rest.rpartition(":")
        if not path:
            raise ValueError(f"speculate {text!r}: model:DIR:K needs the drafter's checkpoint folder")
    else:
        raise ValueError(f"speculate {text!r}: expected 'ngram:K' or 'model:DIR:K'")
    if not k.isdigit() or int(k) < 1:
        raise ValueError(f"speculate {text!r}: K must be an integer >= 1, got {k!r}")
    return kind, path, int(k)


def open_drafter(spec, target):
    """A drafter for `target` (a fast engine) from 'ngram:K' / 'model:DIR:K', or a drafter object as is.
    The model drafter runs on the target's device with its threads and context limit."""
    if not isinstance(spec, str):
        return spec
    kind, path, k = parse_speculate(spec)
    if kind == "ngram":
        return NgramDrafter(k)
    if not Path(path, "config.json").is_file():
        raise ValueError(f"speculate {spec!r}: {path} is not a checkpoint folder (no config.json)")
    # the target's own class (fast.Engine or fast.cuda.CudaEngine): this module does not import fast.engine
    eng = type(target)(path, device=target.device, threads=target.options.get("threads"),
                       max_context=target.max_context)
    return ModelDrafter(eng, k, target, path)


# -- verification --------------------------------------------------------------------------------------

@dataclass
class SpecStats:
    """Counts of a speculative run: drafted tokens, accepted drafts, verify steps (steps of a sequence
    in decode) and emitted tokens. acceptance = accepted / drafted."""
    drafted: int = 0
    accepted: int = 0
    verifies: int = 0
    emitted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def add(self, other: "SpecStats") -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.verifies += other.verifies
        self.emitted += other.emitted


class Spec:
    """One sequence in decode under speculation: its cache (every position an accepted token) and
    `todo`, the accepted tokens not yet fed (the last emitted token, and after a rejection the tokens
    that ran in the rolled-back step).

        ids = spec.begin(drafts, limit)    # the step's tokens for this sequence (rows: "all")
        ... engine.step([... (spec.cache, ids, capture, "all") ...])
        emitted, rows, positions = spec.end(logits, choose)
    """

    def __init__(self, cache, first_token: int):
        self.cache = cache
        self.todo = [int(first_token)]
        self.drafts: list[int] = []
        self._snapshot = None
        self.start = 0       # the cache length before the pending step

    def begin(self, drafts, limit: int | None = None) -> list[int]:
        """The tokens this sequence runs in the step: todo then the drafts, at most `limit` in all (the
        scheduler stops a step at the next prefix-cache block boundary). todo never passes a limit that
        stays the same while the cache does: after a rejection it grows by a + 1 <= the drafts that fit."""
        self.start = self.cache.length
        if limit is not None and len(self.todo) > limit:
            raise ValueError(f"{len(self.todo)} accepted tokens to feed but a limit of {limit}: the limit moved "
                             f"while the cache did not")
        room = len(drafts) if limit is None else max(0, min(len(drafts), limit - len(self.todo)))
        self.drafts = [int(t) for t in drafts[:room]]
        if self.drafts:
            self._snapshot = self.cache.fork()
        return self.todo + self.drafts

    def end(self, logits, choose) -> tuple[list[int], np.ndarray, range]:
        """After the step: logits are its rows for this sequence (all of them, or the last when it ran
        one token); choose(row, j) is the token for the j-th row from the end of todo (serial's rule
        at that row's next position). -> (emitted tokens, their rows, the positions whose rows and
        state are now settled: what ran and holds an accepted token)."""
        rows = logits[len(logits) - len(self.drafts) - 1:]
        out = []
        for j, row in enumerate(rows):
            t = choose(row, j)
            out.append(t)
            if j == len(self.drafts) or t != self.drafts[j]:
                break
        a = len(out) - 1
        settled = range(self.start, self.start + len(self.todo) + a)
        if a == len(self.drafts):           # all accepted (or no drafts): the cache is right
            if self._snapshot is not None:
                self._snapshot.close()
            self.todo = [out[-1]]
        else:                               # back to the state before the step
            self.cache.close()
            self.cache = self._snapshot
            self.todo = self.todo + self.drafts[:a] + [out[-1]]
        self._snapshot = None
        return out, rows[:len(out)], settled

    @property
    def committed(self) -> bool:
        """Whether the last step moved the cache (False: it was rolled back or ran nothing)."""
        return self.cache.length > self.start

    def close(self) -> None:
        if self._snapshot is not None:
            self._snapshot.close()
            self._snapshot = None


def scratch_capture(capture: Capture | None) -> Capture | None:
    """A capture of the same selection (values kept), for a step whose rejected rows must not reach
    `capture`."""
    if capture is None:
        return None
    return Capture(stages=capture.stages, layers=capture.layers)


def keep_positions(scratch: Capture | None, capture: Capture | None, positions: range) -> None:
    """Put the rows of `positions` (accepted tokens) from `scratch` into `capture`, in position order."""
    if scratch is None or capture is None:
        return
    for (layer, stage), rows in scratch.values.items():
        for pos in sorted(p for p in rows if p in positions):
            capture.put(layer, stage, pos, rows[pos])


# -- the library's greedy loop (Engine.generate(..., speculate=...)) ------------------------------------

def generate(engine, ids, max_new_tokens, caps, chunk, max_batch, arrivals, return_logits, drafter):
    """Engine.generate's loop with speculation (its inputs already checked): the same requests, joins,
    prompt chunks and greedy tokens; in decode each request verifies its drafts. -> (out, logit rows per
    request or None); engine.speculation holds the SpecStats of the call."""
    made = open_drafter(drafter, engine)
    try:
        return _generate(engine, ids, max_new_tokens, caps, chunk, max_batch, arrivals, return_logits, made)
    finally:
        if made is not drafter:   # a model drafter opened for this call
            close_drafter(made)


def close_drafter(drafter) -> None:
    """Free what open_drafter opened (a model drafter's engine)."""
    eng = getattr(drafter, "engine", None)
    if eng is not None:
        eng.close()


def _generate(engine, ids, max_new_tokens, caps, chunk, max_batch, arrivals, return_logits, drafter):
    stats = engine.speculation = SpecStats()
    n = len(ids)
    out = [[] for _ in range(n)]
    rows_of = [dict() for _ in range(n)]        # position -> logits row (return_logits)
    order = sorted(range(n), key=lambda i: (arrivals[i], i))
    active: list[dict] = []
    step_no = 0
    keep = return_logits or any(c is not None for c in caps)   # serial's state at the end is wanted

    def finish(r):
        i, sp = r["i"], r["spec"]
        if keep and len(sp.todo) > 1:   # serial fed every token but the last: the accepted ones still unfed
            lg = engine.step([(sp.cache, sp.todo[:-1], caps[i], "all" if return_logits else None)])[0]
            if return_logits:
                for j, p in enumerate(range(sp.cache.length - lg.shape[0], sp.cache.length)):
                    rows_of[i][p] = lg[j]
        sp.close()
        drafter.release(r.get("dstate"))
        sp.cache.close()

    while order or active:
        while order and arrivals[order[0]] <= step_no and (max_batch is None or len(active) < max_batch):
            i = order.pop(0)
            active.append({"i": i, "cache": engine.new_cache(), "fed": 0})
        if not active:
            step_no = arrivals[order[0]]
            continue
        decoding = [r for r in active if r.get("spec") is not None]
        items = []
        for r in decoding:
            i = r["i"]
            if "dstate" not in r:
                r["dstate"] = drafter.start()
            k = min(drafter.k, max_new_tokens - len(out[i]) - 1)
            items.append((r["dstate"], np.concatenate([ids[i], np.asarray(out[i], np.int32)]), k))
        drafts = dict(zip(map(id, decoding), drafter.draft(items))) if items else {}
        segs, scratch = [], []
        for r in active:
            i, p = r["i"], ids[r["i"]]
            sp = r.get("spec")
            if sp is None:
                take = p.size - r["fed"] if chunk is None else min(chunk, p.size - r["fed"])
                seg = p[r["fed"]:r["fed"] + take]
                r["fed"] += take
                want = "all" if return_logits else ("last" if r["fed"] == p.size else None)
                segs.append((r["cache"], seg, caps[i], want))
                scratch.append(None)
            else:
                seg = sp.begin(drafts[id(r)])
                sc = scratch_capture(caps[i])
                segs.append((sp.cache, seg, sc, "all"))
                scratch.append(sc)
        results = engine.step(segs)
        still = []
        for r, (cache, seg, _, _), sc, lg in zip(active, segs, scratch, results):
            i, sp = r["i"], r.get("spec")
            if sp is None:
                if return_logits:
                    for j in range(lg.shape[0]):
                        rows_of[i][cache.length - lg.shape[0] + j] = lg[j]
                if r["fed"] == ids[i].size:
                    if max_new_tokens == 0:
                        r["cache"].close()
                        continue
                    out[i].append(int(np.argmax(lg[-1])))   # greedy: ties to the lowest id
                    r["spec"] = Spec(r["cache"], out[i][-1])
            else:
                emitted, _, settled = sp.end(lg, lambda row, j: int(np.argmax(row)))  # greedy: ties to the lowest id
                stats.verifies += 1
                stats.drafted += len(sp.drafts)
                stats.accepted += len(emitted) - 1
                keep_positions(sc, caps[i], settled)
                if return_logits:
                    for p in settled:
                        rows_of[i][p] = lg[p - sp.start]
                emitted = emitted[:max_new_tokens - len(out[i])]
                out[i].extend(emitted)
                drafter.settle(r["dstate"], [int(t) for t in ids[i]] + out[i])
                stats.emitted += len(emitted)
            if len(out[i]) >= max_new_tokens and r.get("spec") is not None:
                finish(r)
            else:
                still.append(r)
        active = still
        step_no += 1
    lgs = None
    if return_logits:
        lgs = []
        for i in range(n):
            total = ids[i].size + max(max_new_tokens - 1, 0)
            lgs.append(np.stack([rows_of[i][p] for p in range(total)]))
    return out, lgs


# -- the batch-1 loop (oracle.sampling.sample_loop with speculation) -------------------------------------

def sample_loop(engine, prompt, n: int, params: SamplingParams, drafter, eos=(), capture=None, keep_cache=False):
    """oracle.sampling.sample_loop on a fast engine with speculation: the prompt, then n tokens, each
    chosen by `sample(row, params, position)` with its log_softmax value; stops after a token in `eos`.
    -> (tokens, logprobs, stats), and the cache when keep_cache (holding what serial's holds at the
    end: every token but the last fed). capture: the stage rows of every position fed, as serial's."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    made = open_drafter(drafter, engine)
    try:
        return _sample_loop(engine, prompt, n, params, made, eos, capture, keep_cache)
    finally:
        if made is not drafter:
            close_drafter(made)


def _sample_loop(engine, prompt, n, params, drafter, eos, capture, keep_cache):
    from oracle.sampling import log_softmax
    stats = SpecStats()
    prompt = [int(t) for t in prompt]
    cache = engine.new_cache()
    row = engine.forward(prompt, cache, capture)[-1]
    tokens, lps = [sample(row, params, len(prompt))], []
    lps.append(float(log_softmax(row)[tokens[0]]))
    sp, state = Spec(cache, tokens[0]), drafter.start()
    try:
        while len(tokens) < n and tokens[-1] not in eos:
            k = min(drafter.k, n - len(tokens) - 1)
            drafts = before_eos(drafter.draft([(state, np.asarray(prompt + tokens, np.int32), k)])[0], eos)
            ids = sp.begin(drafts)
            sc = scratch_capture(capture)
            lg = engine.step([(sp.cache, ids, sc, "all")])[0]
            base = len(prompt) + len(tokens)      # the position of the first token this step chooses
            emitted, rows, settled = sp.end(lg, lambda r, j: sample(r, params, base + j))
            keep_positions(sc, capture, settled)
            stats.verifies += 1
            stats.drafted += len(sp.drafts)
            stats.accepted += len(emitted) - 1
            for t, r in zip(emitted, rows):
                tokens.append(t)
                lps.append(float(log_softmax(r)[t]))
                stats.emitted += 1
                if t in eos:
                    break
            drafter.settle(state, prompt + tokens)
        rest = tokens[sp.cache.length - len(prompt):-1]
        if keep_cache and rest:   # serial fed every token but the last: the accepted ones still in todo
            engine.step([(sp.cache, rest, capture, None)])
    finally:
        drafter.release(state)
        sp.close()
    if keep_cache:
        return tokens, lps, stats, sp.cache
    sp.cache.close()
    return tokens, lps, stats
