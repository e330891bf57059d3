"""The continuous-batching loop: one thread owns the engine and runs one engine step at a time.

Between two steps requests join (from the waiting queue, while fewer than max_batch are active) and
leave (finished, or cancelled because the client went away: their cache is freed at once). One step
is one `engine.step` call over every active sequence: one token for each sequence in decode, and
prompt chunks for sequences still in prefill, as many prompt tokens as `max_step_tokens` leaves.

Nothing a request gets depends on the others: the engine's logits of a sequence depend only on its
own tokens (any batch, any chunking: docs/contract.md), and the token is chosen from those logits by
oracle.sampling with u(seed, position), never the slot or the step number. A greedy request's decode
row without top_logprobs or speculation asks the engine for "argmax_logprob": the token and its
log-probability chosen where the logits are (on the GPU for the CUDA engine), the same bits as
sample and log_softmax give on the host (fast/engine.py, docs/serve.md), without copying the row.

With a prefix cache (prefix.py) a request starts from a fork of the deepest snapshot of its prompt's
prefix, and its prompt chunks stop at block boundaries, where the sequence is snapshotted after the
step (the last boundary in each chunk, and the end of a prefix it shares with an earlier prompt): the same independence makes the restored sequence's bits those of a cold one. In decode the
sequence is forked at each block boundary; the last such fork joins the cache when the request ends
(stop or length), so the next turn of a conversation (this prompt + this answer + more) resumes
after the answer.

With a drafter (`--speculate`, fast/speculate.py) a sequence in decode runs its accepted-but-unfed
tokens and up to K drafts in its row of the step and may get several tokens from it, each chosen from
its own row exactly as above; a rejected draft leaves no trace (the sequence's cache goes back to a
snapshot), so its cache only ever holds accepted tokens and the block-boundary forks stay exact. Its
steps stop at block boundaries as prompt chunks do.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from fast.speculate import Spec, before_eos
from oracle.sampling import SamplingParams, log_softmax, sample


class QueueFull(Exception):
    """Admission refused: max_batch sequences active and max_queue waiting."""


@dataclass(eq=False)   # requests are compared by identity
class Request:
    prompt: np.ndarray                       # int32 token ids, validated against the vocabulary
    max_tokens: int
    params: SamplingParams
    top_logprobs: int = 0                    # alternatives per token (0: only the chosen token's)
    eos: frozenset = frozenset()             # token ids that end the sequence (finish_reason "stop")
    stop: tuple = ()                         # strings that end it (matched in the decoded text)
    sink: object = None                      # (event loop, put(event)): where its events go (None: nowhere)
    id: int = field(default_factory=itertools.count().__next__)
    # state, owned by the scheduler thread
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)   # np.float32 values
    fed: int = 0
    cache: object = None
    pnode: object = None                     # the prefix cache's node this request pins (its deepest snapshot)
    reach: int = 0                           # where a prefix other prompts share ends (prefix.restore)
    pending: object = None                   # a fork at the last block boundary of its generated tokens
    spec: object = None                      # fast.speculate.Spec in decode under speculation (owns `cache`)
    draft: object = None                     # the drafter's state for this sequence
    cancelled: bool = False
    finished: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None

    def cancel(self) -> None:
        """The client is gone: the scheduler frees the sequence before its next step."""
        self.cancelled = True


class Scheduler:
    """Drives `engine` (a fast.Engine: new_cache, step) for many requests on one thread."""

    def __init__(self, engine, *, max_batch: int = 16, max_queue: int = 64, max_step_tokens: int = 512,
                 tokenizer=None, metrics=None, prefix_cache=None, drafter=None):
        if max_batch < 1 or max_queue < 0 or max_step_tokens < 1:
            raise ValueError("max_batch and max_step_tokens must be >= 1, max_queue >= 0")
        self.engine = engine
        self.max_batch, self.max_queue, self.max_step_tokens = max_batch, max_queue, max_step_tokens
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.prefix = prefix_cache
        self.drafter = drafter           # None: one token per sequence in decode and step
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._closing = False
        self.steps = 0
        self._outbox: dict = {}   # event loop -> [(put, event)], filled by _emit, emptied by _flush
        self._thread = threading.Thread(target=self._run, name="glm-serve-scheduler", daemon=True)

    # -- the HTTP side ------------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def submit(self, req: Request) -> None:
        """Queue a request, or raise QueueFull (the server answers 429)."""
        with self._cv:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self._active) + len(self._waiting) >= self.max_batch + self.max_queue:
                raise QueueFull(f"{len(self._active)} sequences active (max_batch {self.max_batch}) and "
                                f"{len(self._waiting)} waiting (max_queue {self.max_queue})")
            self._waiting.append(req)
            self._cv.notify()

    def wake(self) -> None:
        """A request was cancelled: let an idle loop look at it."""
        with self._cv:
            self._cv.notify()

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the loop after its current step -> whether it has stopped within `timeout` seconds."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def load(self) -> tuple[int, int]:
        """(active, waiting)."""
        with self._cv:
            return len(self._active), len(self._waiting)

    # -- the loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a bug here: fail every request rather than hang them
            with self._cv:
                doomed = list(self._active) + list(self._waiting)
                self._active, self._waiting, self._closing = [], deque(), True
            for r in doomed:
                self._leave(r, "error", error=f"the scheduler stopped: {type(e).__name__}: {e}")
            raise
        finally:
            self._flush()

    def _loop(self) -> None:
        while True:
            self._flush()   # the last step's events, before the loop may wait
            with self._cv:
                while not self._closing and not self._waiting and not self._active:
                    self._cv.wait()
                if self._closing:
                    doomed = list(self._active) + list(self._waiting)
                    self._active, self._waiting = [], deque()
                    break
                for r in [r for r in self._active if r.cancelled]:
                    self._active.remove(r)
                    self._leave(r, "cancelled")
                while self._waiting and len(self._active) < self.max_batch:
                    r = self._waiting.popleft()
                    if r.cancelled:
                        self._leave(r, "cancelled")
                        continue
                    self._active.append(r)
                batch = list(self._active)
            if batch:
                self._step(batch)
        for r in doomed:
            self._leave(r, "cancelled")
        if self.prefix is not None:
            self.prefix.clear()

    def _step(self, batch: list[Request]) -> None:
        segs, rows = [], []
        budget = self.max_step_tokens
        decoding = [r for r in batch if r.cache is not None and r.fed == r.prompt.size]
        drafts = self._drafts(decoding)
        for r, d in zip(decoding, drafts):   # decodes first: one token each (with drafts: more), always
            if r.spec is None:
                segs.append((r.cache, [r.tokens[-1]], None, self._decode_want(r)))
            else:
                segs.append((r.cache, r.spec.begin(d, self._boundary(r)), None, "all"))
            rows.append(r)
            budget -= len(segs[-1][1])
        decodes = len(segs)
        for r in batch:   # then prompt chunks, in arrival order, while the budget lasts
            if r.cache is None:
                try:
                    if self.prefix is not None:
                        r.cache, r.pnode, r.reach = self.prefix.restore(r.prompt)
                        if r.cache is not None:
                            r.fed = r.cache.length
                    if r.cache is None:
                        r.cache = self.engine.new_cache()
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: this request fails, not the server
                    self._finish(r, "error", error=f"no cache for the sequence: {type(e).__name__}: {e}")
                    continue
            if r.fed < r.prompt.size and budget > 0:
                take = min(budget, r.prompt.size - r.fed)
                if self.prefix is not None:
                    take = self.prefix.boundary(r.fed, r.fed + take, r.prompt.size, r.reach) - r.fed
                done = r.fed + take == r.prompt.size
                segs.append((r.cache, r.prompt[r.fed:r.fed + take], None, "last" if done else None))
                rows.append(r)
                r.fed += take
                budget -= take
        if not segs:
            return
        t0 = time.perf_counter()
        try:
            results = self.engine.step(segs)
        except Exception as e:  # noqa: BLE001 - the engine refused: those requests fail, the server lives
            for r in rows:
                self._finish(r, "error", error=f"{type(e).__name__}: {e}")
            return
        dt = time.perf_counter() - t0
        self.steps += 1
        if self.metrics is not None:
            self.metrics.step(dt, len(segs), sum(len(s[1]) for s in segs), mixed=0 < decodes < len(segs))
        if self.prefix is not None:
            for r in rows[decodes:]:   # the prompt chunks of this step
                if r.pnode is not None:
                    r.pnode = self.prefix.insert(r.pnode, r.prompt, r.cache)
        for k, (r, (_, _, _, want), lg) in enumerate(zip(rows, segs, results)):
            if k < decodes:
                self._decoded(r, lg)
            elif want is not None:
                self._produce(r, lg[-1])
                if self.drafter is not None and not r.finished:
                    r.spec = Spec(r.cache, r.tokens[-1])

    @staticmethod
    def _decode_want(r: Request) -> str:
        """A decode row's logits request: a greedy request needing only its token's log-probability
        gets both from the engine, every other one its logits row (sampled, top_logprobs)."""
        return "argmax_logprob" if r.params.greedy and not r.top_logprobs else "last"

    def _boundary(self, r: Request) -> int | None:
        """With the prefix cache, the most tokens r's decode row may run: up to the next block boundary."""
        if self.prefix is None or r.pnode is None:
            return None
        return self.prefix.block - r.cache.length % self.prefix.block

    def _drafts(self, decoding: list[Request]) -> list[list[int]]:
        """Each speculating sequence's drafts: at most K, none past its max_tokens or the next block
        boundary, none from an EOS on, and in all no more than the step budget leaves after every decode's
        tokens not yet fed (in batch order)."""
        items = []
        spare = self.max_step_tokens - sum(1 if r.spec is None else len(r.spec.todo) for r in decoding)
        for r in decoding:
            if r.spec is not None:
                if r.draft is None:
                    r.draft = self.drafter.start()
                k = max(0, min(self.drafter.k, r.max_tokens - len(r.tokens) - 1, spare))
                room = self._boundary(r)
                if room is not None:
                    k = min(k, room - len(r.spec.todo))
                spare -= k
                items.append((r.draft, np.concatenate([r.prompt, np.asarray(r.tokens, np.int32)]), k))
        try:
            made = iter(self.drafter.draft(items) if items else [])
        except Exception:  # noqa: BLE001 - e.g. out of memory in the drafter: no drafts, the drafters start over
            for r in decoding:
                self.drafter.release(r.draft)
                r.draft = None
            made = iter([[] for _ in items])
        return [before_eos(next(made), r.eos) if r.spec is not None else [] for r in decoding]

    def _decoded(self, r: Request, lg) -> None:
        """A sequence in decode after its step: its tokens (with speculation: the accepted drafts and the
        chosen one), and a fork at a block boundary its cache reached (a cache holds only accepted
        tokens). lg: the step's logits, or (token, logprob) for "argmax_logprob"."""
        if isinstance(lg, tuple):   # "argmax_logprob": the engine chose the token and its log-probability
            emitted, rows, lps, moved = [lg[0]], [None], [lg[1]], True
        elif r.spec is None:
            emitted, rows, lps, moved = [None], [lg[-1]], [None], True
        else:
            base = r.prompt.size + len(r.tokens)   # the position of the first token this step chooses
            try:
                emitted, rows, _ = r.spec.end(lg, lambda row, j: sample(row, r.params, base + j))
                lps = [None] * len(emitted)
            except ValueError as e:
                r.cache = r.spec.cache
                self._finish(r, "error", error=str(e))
                return
            r.cache, moved = r.spec.cache, r.spec.committed
            if self.metrics is not None:
                self.metrics.speculation(len(r.spec.drafts), len(emitted) - 1)
        if self.prefix is not None and moved and r.pnode is not None and r.cache.length % self.prefix.block == 0:
            if r.pending is not None:
                r.pending.close()
            try:
                r.pending = r.cache.fork()
            except Exception:  # noqa: BLE001 - e.g. out of memory: no snapshot of this answer
                r.pending = None
        for t, row, lp in zip(emitted, rows, lps):
            self._produce(r, row, t, lp)
            if r.finished:
                return
        if r.draft is not None:
            self.drafter.settle(r.draft, np.concatenate([r.prompt, np.asarray(r.tokens, np.int32)]).tolist())

    def _produce(self, r: Request, row: np.ndarray | None, token: int | None = None, logprob=None) -> None:
        """The token for `row` (`token`: already chosen from it by the same rule) goes to the request.
        row None: the engine chose `token` and gave its log-probability `logprob` (NaN: the row held a
        NaN or an infinity, which the oracle refuses)."""
        position = r.prompt.size + len(r.tokens)   # where the chosen token will sit
        lp = None
        try:
            if row is None:
                t, lp_t = token, logprob
                if np.isnan(lp_t):   # the oracle's own SamplingError for such a row, as the host path raises
                    log_softmax(np.full(1, np.nan, np.float32))
            else:
                t = sample(row, r.params, position) if token is None else token
                lp = log_softmax(row)
                lp_t = lp[t]
        except ValueError as e:
            self._finish(r, "error", error=str(e))
            return
        r.tokens.append(t)
        r.logprobs.append(lp_t)
        top = None
        if r.top_logprobs:
            order = np.argsort(-lp, kind="stable")[:r.top_logprobs]   # ties: the lower id first
            top = [(int(i), float(lp[i])) for i in order]
        if r.t_first is None:
            r.t_first = time.perf_counter()
        if self.metrics is not None:
            self.metrics.token(first=len(r.tokens) == 1, since_submit=r.t_first - r.t_submit)
        reason, text_end = None, None
        if t in r.eos:
            reason = "stop"
        elif r.stop and self.tokenizer is not None:
            # a stop string ends within the last few tokens (a char takes at most 4 byte-tokens): look
            # there first, and at the whole text only on a hit
            tail = self.tokenizer.decode(r.tokens[-(4 * max(map(len, r.stop)) + 4):])
            if any(s in tail for s in r.stop):
                text = self.tokenizer.decode(r.tokens)
                hits = [i for i in (text.find(s) for s in r.stop) if i >= 0]
                if hits:
                    reason, text_end = "stop", min(hits)
        if reason is None and len(r.tokens) >= r.max_tokens:
            reason = "length"
        self._emit(r, {"type": "token", "token": t, "logprob": float(r.logprobs[-1]), "top": top})
        if reason is not None:
            self._finish(r, reason, text_end=text_end)

    def _finish(self, r: Request, reason: str, text_end=None, error=None) -> None:
        with self._cv:
            if r in self._active:
                self._active.remove(r)
        self._leave(r, reason, text_end=text_end, error=error)

    def _leave(self, r: Request, reason: str, text_end=None, error=None) -> None:
        if r.finished:
            return
        r.finished = True
        if r.spec is not None:
            r.spec.close()
            r.cache = r.spec.cache
        if r.draft is not None:
            self.drafter.release(r.draft)
            r.draft = None
        if r.pending is not None:
            seq = np.concatenate([r.prompt, np.asarray(r.tokens, np.int32)])
            # (speculation may have fed accepted tokens past a stop that ended the answer early)
            if reason in ("stop", "length") and r.pnode is not None and r.pending.length <= seq.size:
                r.pnode = self.prefix.insert(r.pnode, seq, r.pending, own=True)
            else:
                r.pending.close()
            r.pending = None
        if r.pnode is not None:
            self.prefix.unpin(r.pnode)
            r.pnode = None
        if r.cache is not None:
            r.cache.close()
            r.cache = None
        if self.metrics is not None:
            self.metrics.finished(reason, len(r.tokens), r.prompt.size)
        self._emit(r, {"type": "done", "reason": reason, "text_end": text_end, "error": error})

    def _emit(self, r: Request, event: dict) -> None:
        if r.sink is not None:
            loop, put = r.sink
            self._outbox.setdefault(loop, []).append((put, event))

    def _flush(self) -> None:
        """The events made since the last flush go to each event loop in one wake-up: a
        call_soon_threadsafe per loop and step, not per token (each writes to the loop's self-pipe:
        ~0.1 ms of the scheduler thread, 1.6 ms a step at batch 16)."""
        box, self._outbox = self._outbox, {}
        for loop, items in box.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                pass


def _put_all(items) -> None:
    for put, event in items:
        put(event)
