"""fast.Engine: the exact CPU engine's Python API (a thin layer over fast._core._Engine).

    eng = fast.Engine("golden/tiny-fp8", device="cpu", threads=None)
    cache = eng.new_cache()                       # one sequence (alias: new_request)
    logits = eng.forward(ids, cache, capture)     # same signature and semantics as oracle's model.forward
    logits = eng.prefill(ids, cache, chunk=5)     # chunked prefill (any chunking gives the same bits)
    logits = eng.decode([c1, c2], [t1, t2])       # one decode token for each of several sequences
    outs = eng.generate([[1, 2, 3], [4, 5]], 8)   # greedy, continuous batching -> [[8 ids], [8 ids]]
    toks = eng.generate([1, 2, 3], 8)             # one prompt -> [8 ids]
    arrays = cache.export()                       # the state as named f32 arrays (+ "length")
    twin = eng.import_cache(arrays)               # a new cache holding it (either engine's export)
    eng = fast.Engine(path, ranks=3)              # expert parallelism over 3 processes (docs/ep.md)
    with fast.Engine(path) as eng: ...            # eng.close() at the end: executor and caches freed

Every forward step is ONE call into C++ for the whole batch of rows (all sequences, all layers).
Inputs are validated here before they reach C++ (which checks again and raises, never crashes).

Captures are the oracle's `oracle.capture.Capture`: the C++ side records only the requested
(layer, stage) rows and they are put into the same Capture, so oracle and engine captures and traces
compare directly. Non-canonical switches (`dot="sequential"`, `expf="native"`) and fault injection
(`inject=(layer, pos, stage, element, ulps)`) exist to demonstrate the diff tool; docs/engine_cpu.md.
"""
from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Sequence

import numpy as np

from oracle.capture import Capture
from oracle.checkpoint import Checkpoint, open_checkpoint
from oracle.sampling import SamplingError, SamplingParams, log_softmax, sample
from oracle.stages import ALL_STAGE_NAMES, HEAD

from . import core as _C
from .core import EngineInputError, EngineMemoryError, parse_inject

__all__ = ["Engine", "Cache", "EngineInputError", "EngineMemoryError", "parse_inject"]

_HEAD_STAGES = tuple(name for name, _ in HEAD)  # the stages at layer L, computed with the logits

# the names this module had before fast/core.py held them (tests and tools import some)
_is_int = _C.is_int
_core = _C.core_module
_engine_config = _C.engine_config

_LOGITS_MODES = ("all", "last", "argmax", "argmax_logprob", None)   # Engine.step's logits requests


class _OneId:
    """A checked one-token ids list in Engine.step: what the rest of the step reads of an ids array."""
    __slots__ = ("v",)
    size = 1

    def __init__(self, v: int):
        self.v = v

    def __getitem__(self, i):
        return (self.v,)[i]

    def __array__(self, dtype=None, copy=None):
        return np.array([self.v], dtype or np.int64)


def _argmax_logprob(row: np.ndarray) -> tuple[int, np.float32]:
    """"argmax_logprob" of a row whose logits came to the host anyway (a capture of the head stages): the
    engines' values, from the oracle's definition (NaN where log_softmax refuses the row)."""
    t = int(np.argmax(row))
    try:
        return t, log_softmax(row)[t]
    except SamplingError:
        return t, np.float32(np.nan)


class Cache:
    """One sequence's state in the engine (KDA conv/recurrent state, MLA latents, indexer pools)."""

    def __init__(self, engine: "Engine", sid: int):
        self._engine = engine
        self._id = sid
        self._room = 0  # positions whose state was checked against the memory left (reserve, step)
        self._finalizer = weakref.finalize(self, engine._core.free_sequence, sid)
        engine._caches.add(self)  # (Engine.close frees every live cache before its executor)

    @property
    def length(self) -> int:
        """Positions already in the cache (the next token goes at this position)."""
        return int(self._engine._core.sequence_length(self._id))

    def __len__(self) -> int:
        return self.length

    def fork(self) -> "Cache":
        """An independent copy (e.g. to reuse a prefix)."""
        return Cache(self._engine, int(self._engine._core.fork_sequence(self._id)))

    @property
    def nbytes(self) -> int:
        """Bytes the engine holds for this sequence now (its buffers' capacity, not only what is filled)."""
        return int(self._engine._core.sequence_bytes(self._id))

    def reserve(self, positions: int) -> "Cache":
        """Allocate the state for `positions` positions now, after checking that it fits in the memory
        left (EngineMemoryError, naming what it needs, otherwise); the cache does not grow below that.
        Returns the cache."""
        eng = self._engine
        eng._check_cache(self)
        if not _is_int(positions) or not 0 <= positions <= eng.max_context:
            raise EngineInputError(f"reserve: positions must be an int in [0, {eng.max_context}], got {positions!r}")
        grow = eng.sequence_bytes(int(positions)) - self.nbytes
        eng._check_room(grow, int(positions))
        eng._core.reserve_sequence(self._id, int(positions))
        self._room = max(self._room, int(positions))
        return self

    copy = fork

    def export(self) -> dict[str, np.ndarray]:
        """This sequence's state as named f32 arrays in the layout both engines share (docs/engine_cpu.md,
        "Exporting a sequence's state"), and "length" (0-d int64): what Engine.import_cache takes back,
        on either engine."""
        self._engine._check_cache(self)
        length, arrays = self._engine._core.export_sequence(self._id)
        return {"length": np.array(length, np.int64), **arrays}

    def close(self) -> None:
        self._finalizer()

    def __repr__(self) -> str:
        if not self._finalizer.alive:
            return f"fast.Cache(id={self._id}, closed)"
        return f"fast.Cache(id={self._id}, length={self.length})"


class Engine:
    """The exact CPU engine over one checkpoint (weights stay in their release format, memory-mapped).

    `Engine(path, device="cuda")` is the CUDA engine (fast.cuda.CudaEngine, the same API), found through
    fast.core.DEVICES. `close()` (or leaving a `with fast.Engine(...) as eng:` block) frees the executor
    and every cache; the engine refuses any later call.
    """

    ep = None  # expert parallelism (fast.distributed.EPSetup) when ranks / expert_ranges / memory_limit are given
    speculation = None  # the last speculative generate's fast.speculate.SpecStats
    device = "cpu"
    _executor = None  # the C++ executor (self._core); None once closed

    def __new__(cls, path=None, device: str = "cpu", *args, **kwargs):
        if cls is Engine and device != "cpu" and device in _C.DEVICES:
            return object.__new__(_C.engine_class(device))
        return object.__new__(cls)

    def __init__(self, path, device: str = "cpu", threads: int | None = None, *, dot: str = "canonical",
                 expf: str = "canonical", inject=None, max_context: int | None = None,
                 parallel_work: int | None = None, ranks: int | None = None, expert_ranges=None,
                 memory_limit: int | None = None, verify_ranks: bool = False, _ep_member=None):
        if device != "cpu":
            raise EngineInputError(f"device {device!r}: this engine runs on 'cpu' (the CUDA engine is fast._cuda)")
        # expert parallelism (fast/distributed.py, docs/ep.md): ranks / expert_ranges / memory_limit, or
        # started by fast.launch. ep is None for the plain single-process engine.
        ep = self._expert_parallelism(ranks, expert_ranges, memory_limit, verify_ranks, _ep_member)
        if threads is None:
            threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            if ep is not None:
                threads = ep.default_threads()  # the cores shared by the ranks of this host
        _C.check_switches(threads, dot, expf, parallel_work)
        core = _C.core_module()
        self._open(core, path, ep, max_context, {"dot": dot, "expf": expf, "threads": int(threads)}, int(threads), {})
        cfg, limit = self.config, self.max_context

        # parallel_work: jobs below this many multiply-adds run on one thread (None: the engine's default,
        # about 1M; 0 splits every job over the threads, which the tests use on tiny models)
        executor = _C.build_core(
            self, ep, lambda: core._Engine(_C.engine_config(cfg, limit), int(threads), dot, expf,
                                           -1 if parallel_work is None else int(parallel_work)),
            {"threads": int(threads), "dot": dot, "expf": expf, "max_context": limit, "parallel_work": parallel_work})
        self._attach(executor, inject)

    # ---------------------------------------------------------------- construction (shared by the engines)
    def _expert_parallelism(self, ranks, expert_ranges, memory_limit, verify_ranks, member):
        ep = None
        if (ranks is not None or expert_ranges is not None or memory_limit is not None or member is not None
                or os.environ.get("GLM_EP") == "1"):
            from .distributed import EPSetup
            ep = EPSetup.resolve(ranks, expert_ranges, memory_limit, verify_ranks, member)
        self.ep = ep
        return ep

    def _open(self, module, path, ep, max_context, options: dict, plan_threads: int, plan_kw: dict) -> None:
        """The engine module's stage table (checked against the oracle's), the checkpoint, its config,
        the context limit and the options; with expert parallelism the plan (printed; refused before
        anything is allocated)."""
        self._stage_index = _C.check_stage_table(module)
        self._stage_names = list(self._stage_index)
        self._n_stages = len(self._stage_names)
        self._no_capture_mask = None  # (step's greedy decode: the all-false stage mask, made once)
        self._caches = weakref.WeakSet()
        # with expert parallelism the checkpoint is opened without the up-front scan of every value:
        # a rank reads (and checks) only the tensors it loads, never another rank's experts
        self.checkpoint = path if isinstance(path, Checkpoint) else open_checkpoint(path, verify=ep is None)
        self.config = self.checkpoint.config
        self.max_context = limit = _C.context_limit(self.config, max_context)
        self.options = options
        if ep is not None:
            ep.plan(self.checkpoint, limit, plan_threads, **plan_kw)
            self.options["ranks"] = ep.ranks
        self.release = {}
        self.loaded = {"tensors": 0, "experts": set()}  # what this process read from the checkpoint

    def _attach(self, executor, inject) -> None:
        """The built executor and the injection."""
        self._core = executor
        self.inject = inject
        self.injected = 0  # elements perturbed so far (fault injection)

    # ---------------------------------------------------------------- lifetime
    @property
    def _core(self):
        if self._executor is None:
            raise EngineInputError(f"{self._name()} was closed (Engine.close()); make a new engine")
        return self._executor

    @_core.setter
    def _core(self, executor) -> None:
        self._executor = executor

    @property
    def closed(self) -> bool:
        return self._executor is None

    def close(self) -> None:
        """Frees every cache of this engine and the executor (its weights and state); idempotent. Any
        later call on the engine or its caches raises EngineInputError."""
        if self._executor is None:
            return
        for cache in list(getattr(self, "_caches", ())):
            cache.close()
        self._executor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _name(self) -> str:
        return f"fast.{type(self).__name__}"

    def __repr__(self) -> str:
        ck = getattr(self, "checkpoint", None)
        if ck is None:
            return f"{self._name()}(<not built>)"
        parts = [f"{ck.path!r}", f"device={self.device!r}", f"release={ck.release_summary()['release']!r}"]
        parts += [f"{k}={v!r}" for k, v in self.options.items() if k != "device"]
        parts.append(f"max_context={self.max_context}")
        if self.inject is not None:
            parts.append(f"inject={self.inject!r}")
        if self.closed:
            parts.append("closed")
        return f"{self._name()}({', '.join(parts)})"

    # ---------------------------------------------------------------- options
    @property
    def inject(self):
        return self._inject

    @inject.setter
    def inject(self, spec):
        parsed = parse_inject(spec, self.config)
        self._inject = parsed
        self._inject_core = None if parsed is None else (
            parsed[0], parsed[1], self._stage_index[parsed[2]], parsed[3], parsed[4])

    @property
    def threads(self) -> int:
        return int(self._core.threads)

    # ---------------------------------------------------------------- expert parallelism (docs/ep.md)
    @property
    def rank(self) -> int:
        return 0 if self.ep is None else self.ep.rank

    @property
    def ranks(self) -> int:
        return 1 if self.ep is None else self.ep.ranks

    @property
    def expert_ranges(self) -> list[tuple[int, int]]:
        E = self.config.n_routed_experts
        return [(0, E)] if self.ep is None else list(self.ep.ranges)

    @property
    def memory_plan(self):
        """Every rank's fast.distributed.MemoryPlan (None for the plain single-process engine)."""
        return None if self.ep is None else list(self.ep.plans)

    def _ep_local_info(self) -> dict:
        """What this rank loaded: its range, the routed experts it read, and the experts whose values the
        loader has touched (a checkpoint opened with verify=False scans a tensor on its first read)."""
        ck = self.checkpoint
        touched = sorted({s.entry.expert for s in ck._slots.values()  # noqa: SLF001 - the loader's own record
                          if s.entry.expert is not None and s.scanned})
        return {"rank": self.rank, "experts": self.expert_ranges[self.rank], "tensors_read": self.loaded["tensors"],
                "experts_read": sorted(self.loaded["experts"]), "experts_touched": touched,
                "verify_at_open": bool(ck.verify)}

    def ep_info(self) -> list[dict]:
        """_ep_local_info() of every rank (a collective under fast.launch: call it on every rank)."""
        if self.ep is None or self.ep.ranks == 1:
            return [self._ep_local_info()]
        if self.ep.mode == "driver":
            return self._core.rank_info(self._ep_local_info())
        return self.ep.group.gather(self._ep_local_info())

    def ep_stats(self) -> list[dict]:
        """Per rank: steps, exchanges, bytes sent, seconds in steps / in the exchange hook / inside the
        collective (a collective under fast.launch: call it on every rank)."""
        if self.ep is None:
            return []
        if self.ep.mode == "driver":
            return self._core.rank_stats()
        if self.ep.ranks == 1:
            return [self._core.stats()]
        return self.ep.group.gather(self._core.stats())

    def reset_ep_stats(self) -> None:
        if self.ep is None:
            return
        if self.ep.mode == "driver":
            self._core.reset_rank_stats()
        else:
            self._core.reset_stats()

    # ---------------------------------------------------------------- caches
    def new_cache(self) -> Cache:
        return Cache(self, int(self._core.new_sequence()))

    new_request = new_cache

    def import_cache(self, arrays) -> Cache:
        """A new cache holding an exported state (Cache.export, of this engine or the other one): its
        continuation gives the bits of the exported sequence's. Every name, shape and dtype is checked
        (EngineInputError naming the tensor)."""
        if not isinstance(arrays, dict):
            raise EngineInputError(f"import_cache: expected a dict of name -> array, got {type(arrays).__name__}")
        n = arrays.get("length")
        if n is None:
            raise EngineInputError("import_cache: 'length' is missing (Cache.export gives it)")
        n = np.asarray(n)
        if n.shape not in ((), (1,)) or not np.issubdtype(n.dtype, np.integer):
            raise EngineInputError(f"import_cache: 'length' must be one integer, got {n.dtype} {n.shape}")
        length = int(n.reshape(()))
        if not 0 <= length <= self.max_context:
            raise EngineInputError(f"import_cache: length {length} is outside [0, {self.max_context}]")
        self._check_room(self.sequence_bytes(length), length)
        try:
            sid = int(self._core.import_sequence({k: v for k, v in arrays.items() if k != "length"}, length))
        except ValueError as e:
            raise EngineInputError(str(e)) from None
        cache = Cache(self, sid)
        cache._room = length
        return cache

    # ---------------------------------------------------------------- memory
    def sequence_memory(self, length: int) -> dict[str, int]:
        """Bytes of one sequence's state at `length` positions, by part (KDA conv window and recurrent
        state, MLA latents, indexer keys, gates and pool keys), and "total"."""
        parts = _C.state_bytes(self.config, int(length))
        parts["total"] = sum(parts.values())
        return parts

    def sequence_bytes(self, length: int) -> int:
        return self.sequence_memory(length)["total"]

    def available_memory(self) -> int:
        """Bytes left for sequences' state: the host's available memory (the CPU engine)."""
        return _C.available_host_bytes()

    def _check_room(self, grow: int, positions: int) -> None:
        if grow <= 0:
            return
        left = self.available_memory()
        if grow > left:
            parts = self.sequence_memory(positions)
            what = ", ".join(f"{k} {_C.human_bytes(v)}" for k, v in parts.items() if k != "total" and v)
            raise _C.EngineMemoryError(
                f"a sequence of {positions} positions needs {_C.human_bytes(parts['total'])} of state ({what}); "
                f"{_C.human_bytes(grow)} more do not fit in the {_C.human_bytes(left)} left on {self._memory_where()}")

    def _check_growth(self, rows) -> None:
        """Before a step: the state of sequences that grow past the room already checked must fit. The
        engines grow a cache by doubling, so the room checked doubles too (a check every doubling)."""
        grow, worst = 0, 0
        for cache, ids, _, _, start in rows:
            end = start + ids.size
            if end > cache._room:
                target = min(max(end, 2 * cache._room), self.max_context)
                grow += self.sequence_bytes(target) - cache.nbytes
                worst = max(worst, target)
        if worst:
            self._check_room(grow, worst)
            for cache, ids, _, _, start in rows:
                if start + ids.size > cache._room:
                    cache._room = min(max(start + ids.size, 2 * cache._room), self.max_context)

    def _memory_where(self) -> str:
        return "the host"

    # ---------------------------------------------------------------- validation
    def _check_ids(self, ids, start: int) -> np.ndarray:
        if isinstance(ids, np.ndarray):
            a = ids
        else:
            if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
                raise EngineInputError(f"token ids must be a 1-D sequence of integers, got {type(ids).__name__}")
            # (a list of plain ints, the usual prompt, is checked by its set of types: 49 us for 2048 ids on
            # the dev machine where the check per element took 614, before every prefill's first kernel)
            if not set(map(type, ids)) <= {int} and any(not _is_int(v) for v in ids):
                raise EngineInputError("token ids must be integers")
            a = np.asarray(ids, dtype=np.int64) if len(ids) else np.zeros(0, np.int64)
        if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_:
            raise EngineInputError(f"token ids must be a non-empty 1-D sequence of integers, got {a.dtype} {a.shape}")
        V = self.config.vocab_size
        bad = np.flatnonzero((a < 0) | (a >= V))
        if bad.size:
            raise EngineInputError(f"token id {int(a[bad[0]])} at index {int(bad[0])} is outside the vocabulary [0, {V})")
        if start + a.size > self.max_context:
            raise EngineInputError(f"{start + a.size} positions exceed the maximum context of {self.max_context}")
        return a.astype(np.int32)

    def _check_cache(self, cache) -> Cache:
        if not isinstance(cache, Cache) or cache._engine is not self:
            raise EngineInputError(f"cache must be a fast.Cache of this engine (from new_cache()), got {cache!r}")
        if not cache._finalizer.alive:
            raise EngineInputError("cache was closed")
        return cache

    def _check_capture(self, capture) -> Capture | None:
        if capture is None:
            return None
        if not isinstance(capture, Capture):
            raise EngineInputError(f"capture must be an oracle.capture.Capture, got {type(capture).__name__}")
        if capture.stages is not None:
            unknown = sorted(s for s in capture.stages if not isinstance(s, str) or s not in ALL_STAGE_NAMES)
            if unknown:
                raise EngineInputError(f"capture: unknown stage(s) {unknown}; known: {', '.join(ALL_STAGE_NAMES)}")
        if capture.layers is not None:
            L = self.config.num_hidden_layers
            bad = [l for l in capture.layers if not _is_int(l) or not 0 <= l <= L]
            if bad:
                raise EngineInputError(f"capture: layer(s) {bad} out of range [0, {L}]")
        return capture

    # ---------------------------------------------------------------- the one C++ call per step
    def step(self, segments) -> list[np.ndarray | None]:
        """One forward step over several sequences at once.

        segments: list of (cache, ids, capture, logits) with logits "all" (every row's logits),
        "last" (the last row's), "argmax" (only the last row's greedy token, np.argmax's rule, chosen
        where the logits are: on the GPU for the CUDA engine, so a decode step copies one int per
        sequence instead of a vocabulary-wide row), "argmax_logprob" (that token and its
        log-probability, oracle.sampling.log_softmax(row)[token] bit for bit, both computed where the
        logits are; the log-probability is NaN when the row holds a NaN or an infinity, a row the
        oracle's log_softmax refuses with SamplingError) or None. Each cache appears at most once.
        Returns, per segment, the logits [n, V] asked for, the token (an int) for "argmax", the pair
        (token, logprob as np.float32) for "argmax_logprob", or None.
        """
        if not segments:
            raise EngineInputError("step needs at least one segment")
        fast = self._decode_greedy(segments)
        if fast is not None:
            return fast
        seen, rows = set(), []
        V, max_context = self.config.vocab_size, self.max_context
        for seg in segments:
            if not isinstance(seg, (tuple, list)) or len(seg) != 4:
                raise EngineInputError("each segment is (cache, ids, capture, logits)")
            cache, ids, capture, want = seg
            cache = self._check_cache(cache)
            if cache._id in seen:
                raise EngineInputError("a cache appears twice in one step")
            seen.add(cache._id)
            start = cache.length
            # (a decode row, one int in a list: checked without NumPy, a few us a segment at batch 128)
            if type(ids) is list and len(ids) == 1 and type(ids[0]) is int and 0 <= ids[0] < V \
                    and start < max_context:
                ids = _OneId(ids[0])
            else:
                ids = self._check_ids(ids, start)
            capture = self._check_capture(capture)
            if want not in _LOGITS_MODES:
                raise EngineInputError(f"logits must be one of {', '.join(map(repr, _LOGITS_MODES))}, got {want!r}")
            rows.append((cache, ids, capture, want, start))
        self._check_growth(rows)
        T = sum(r[1].size for r in rows)
        want_head = np.zeros(T, np.uint8)   # 0 no head, 1 logits, 2 only the greedy token, 3 and its logprob
        cap_rows = np.zeros(T, np.bool_)
        L = self.config.num_hidden_layers
        mask = np.zeros((L + 1, self._n_stages), np.bool_)
        names = self._stage_names
        t = 0
        spans, seq_of, tok_parts = [], [], []
        for cache, ids, capture, want, start in rows:
            n = ids.size
            seq_of.append((cache._id, n))
            tok_parts.append(ids)
            if want == "all" or (capture is not None and any(capture.wants(L, h) for h in _HEAD_STAGES)):
                want_head[t:t + n] = 1
            elif want == "last":
                want_head[t + n - 1] = 1
            elif want == "argmax":
                want_head[t + n - 1] = 2
            elif want == "argmax_logprob":
                want_head[t + n - 1] = 3
            if capture is not None:
                cap_rows[t:t + n] = True
                for layer in range(L + 1):
                    for i, name in enumerate(names):
                        if not mask[layer, i] and capture.wants(layer, name):
                            mask[layer, i] = True
            spans.append((t, n))
            t += n
        if T == len(rows):  # one row a segment (decode)
            seq_ids = np.fromiter((s for s, _ in seq_of), np.int64, T)
            tokens = np.fromiter((int(a[0]) for a in tok_parts), np.int32, T)
        else:
            seq_ids = np.repeat(np.fromiter((s for s, _ in seq_of), np.int64, len(rows)), [n for _, n in seq_of])
            tokens = np.concatenate([np.asarray(a, np.int32) for a in tok_parts])
        head_rows, logits, caps, injected, argmaxes, logprobs = self._core.step(seq_ids, tokens, want_head, cap_rows,
                                                                      mask.reshape(-1), self._inject_core)
        self.injected += int(injected)
        if self._inject_core is not None and not injected:
            layer, ipos, stage, elem, _ = self._inject
            hit = any(start <= ipos < start + ids.size and (stage not in _HEAD_STAGES or want_head[t0 + ipos - start])
                      for (_, ids, _, _, start), (t0, _) in zip(rows, spans))
            if hit:  # the position ran in this step but the element does not exist (variable-size stages)
                raise EngineInputError(f"inject: {stage} at layer {layer}, position {ipos} has no element {elem}")
        # captures back into each segment's Capture, at absolute positions
        seg_of_row = np.repeat(np.arange(len(rows)), [r[1].size for r in rows])
        for layer, stage, row, value in caps:
            k = int(seg_of_row[row])
            capture = rows[k][2]
            if capture is not None:
                capture.put(int(layer), stage, rows[k][4] + int(row) - spans[k][0], value)
        # logits per segment: views of the one array when its rows are consecutive there (no copy of
        # a 150k-wide row per step)
        where = {int(r): i for i, r in enumerate(head_rows)}
        token_of = dict(zip(np.flatnonzero(want_head >= 2).tolist(), argmaxes.tolist()))
        logprob_of = dict(zip(np.flatnonzero(want_head == 3).tolist(), logprobs))
        out = []
        for (cache, ids, capture, want, start), (t0, n) in zip(rows, spans):
            if want == "all":
                i0 = where[t0]
                if all(where[r] == i0 + r - t0 for r in range(t0, t0 + n)):
                    out.append(logits[i0:i0 + n])
                else:
                    out.append(logits[[where[r] for r in range(t0, t0 + n)]])
            elif want == "last":
                i = where[t0 + n - 1]
                out.append(logits[i:i + 1])
            elif want == "argmax":
                r = t0 + n - 1
                out.append(int(token_of[r]) if r in token_of else int(np.argmax(logits[where[r]])))
            elif want == "argmax_logprob":
                r = t0 + n - 1
                out.append((int(token_of[r]), logprob_of[r]) if r in token_of else _argmax_logprob(logits[where[r]]))
            else:
                out.append(None)
        return out

    def _decode_greedy(self, segments) -> list | None:
        """step's most frequent call, a greedy decode step: every segment (cache, [token], None, want) with
        one want for all, "argmax" (generate's greedy rows) or "argmax_logprob" (the server's greedy rows),
        and a distinct live cache of this engine that has room for one more position. The same call into
        C++ as the general path, with a few attribute tests a segment instead of its checks, spans and
        dictionaries (on the H200's host at batch 128: 251 us of Python a step against 647, the GPU idle
        meanwhile; tools/bench_step_host.py --checkpoint). None where the step is anything else: the general path then checks
        everything and raises what it raises."""
        if self._inject_core is not None or type(segments) is not list or not segments \
                or type(segments[0]) is not tuple or len(segments[0]) != 4:
            return None
        mode = segments[0][3]
        if mode != "argmax" and mode != "argmax_logprob":
            return None
        V, max_context = self.config.vocab_size, self.max_context
        core = self._core
        length = core.sequence_length
        sids, toks, seen = [], [], set()
        for seg in segments:
            if type(seg) is not tuple or len(seg) != 4:
                return None
            cache, ids, capture, want = seg
            if want != mode or capture is not None or type(ids) is not list or len(ids) != 1 \
                    or type(cache) is not Cache or cache._engine is not self or not cache._finalizer.alive:
                return None
            tok, sid = ids[0], cache._id
            if type(tok) is not int or not 0 <= tok < V or sid in seen:
                return None
            start = length(sid)
            if start >= max_context or start + 1 > cache._room:  # (growth: the general path checks the memory)
                return None
            seen.add(sid)
            sids.append(sid)
            toks.append(tok)
        T = len(toks)
        no_mask = self._no_capture_mask
        if no_mask is None:
            no_mask = self._no_capture_mask = np.zeros((self.config.num_hidden_layers + 1) * self._n_stages, np.bool_)
        logprob = mode == "argmax_logprob"
        _, _, _, injected, argmaxes, logprobs = core.step(
            np.array(sids, np.int64), np.array(toks, np.int32), np.full(T, 3 if logprob else 2, np.uint8),
            np.zeros(T, np.bool_), no_mask, None)
        self.injected += int(injected)
        if len(argmaxes) != T or (logprob and len(logprobs) != T):  # (both engines answer every such row)
            raise RuntimeError(f"step: {len(argmaxes)} tokens for {T} greedy rows")
        return list(zip(argmaxes.tolist(), logprobs)) if logprob else argmaxes.tolist()

    # ---------------------------------------------------------------- oracle-style API
    def forward(self, ids, cache: Cache | None = None, capture: Capture | None = None) -> np.ndarray:
        """Run `ids` at the next positions of `cache` (appending to it) -> logits [T, V] f32."""
        cache = self.new_cache() if cache is None else cache
        return self.step([(cache, ids, capture, "all")])[0]

    def prefill(self, ids, cache: Cache | None = None, chunk: int | None = None,
                capture: Capture | None = None) -> np.ndarray:
        """forward over `ids` in chunks of `chunk` tokens (None: one chunk) -> logits of every position."""
        cache = self.new_cache() if cache is None else self._check_cache(cache)
        ids = self._check_ids(ids, cache.length)
        if chunk is not None and (not _is_int(chunk) or chunk < 1):
            raise EngineInputError(f"chunk must be an int >= 1 or None, got {chunk!r}")
        step = int(chunk) if chunk else ids.size
        return np.concatenate([self.forward(ids[i:i + step], cache, capture) for i in range(0, ids.size, step)])

    def decode(self, caches, tokens, capture=None) -> np.ndarray:
        """One token for each cache in one step -> logits [B, V]. capture: None, a Capture (B = 1) or a list."""
        if isinstance(caches, Cache):
            caches = [caches]
        if _is_int(tokens):
            tokens = [tokens]
        caches, tokens = list(caches), list(tokens)
        if len(caches) != len(tokens) or not caches:
            raise EngineInputError(f"decode: {len(caches)} caches but {len(tokens)} tokens")
        caps = self._per_request_captures(capture, len(caches))
        outs = self.step([(c, [t], cp, "all") for c, t, cp in zip(caches, tokens, caps)])
        if all(o.base is not None and o.base is outs[0].base for o in outs) and len(outs) > 0:
            base = outs[0].base  # one row per cache, consecutive in the step's array: that array itself
            if base.ndim == 2 and base.shape[0] == len(outs):
                return base
        return np.concatenate(outs)

    @staticmethod
    def _per_request_captures(capture, n: int) -> list:
        if capture is None:
            return [None] * n
        if isinstance(capture, Capture):
            if n != 1:
                raise EngineInputError("with several requests, capture must be a list of Captures (one per request)")
            return [capture]
        if isinstance(capture, (list, tuple)) and len(capture) == n:
            return list(capture)
        raise EngineInputError(f"capture must be None, a Capture or a list of {n} Captures")

    @staticmethod
    def _sampling_per_request(sampling, n: int) -> list:
        if sampling is None:
            return [SamplingParams()] * n
        if isinstance(sampling, SamplingParams):
            return [sampling] * n
        if isinstance(sampling, (list, tuple)) and len(sampling) == n and all(
                isinstance(sp, SamplingParams) for sp in sampling):
            return list(sampling)
        raise EngineInputError(f"sampling must be None, an oracle.sampling.SamplingParams or a list of {n} of them")

    @staticmethod
    def _want(params) -> str:
        """A producing row's logits request: greedy rows get their token from the engine (on the GPU for
        the CUDA engine), sampled rows their logits row."""
        return "argmax" if params.greedy else "last"

    def _greedy_tail(self, cache, first_token: int, n: int):
        """n greedy decode steps of one cache in one call, or None where the engine has no such path
        (generate then steps through the host loop)."""
        return None

    def generate(self, prompts, max_new_tokens: int, capture=None, *, chunk: int | None = None,
                 max_batch: int | None = None, arrivals: Sequence[int] | None = None,
                 return_logits: bool = False, speculate=None, sampling=None):
        """Greedy or sampled decoding with continuous batching.

        prompts: one prompt (a flat sequence of token ids, or a 1-D integer array) -> one list of new
        token ids; a list of prompts (each a sequence of ids; a list holding one prompt included) -> a
        list with one such list per prompt, in the prompts' order. With return_logits, (tokens, logits)
        in the same shape: one prompt -> (list, f32 array [rows, V]); several -> (list of lists, list of
        arrays), where each request's rows are every position it ran (prompt and generated).

        Every step is one C++ call over the rows of all active requests: prompt chunks of at most
        `chunk` tokens (None: the whole rest) for requests still in prefill, one token for the others.
        Requests join when their arrival step comes (`arrivals`, default all 0) and a slot is free
        (`max_batch` active requests, default unlimited), and leave when they have max_new_tokens.
        Once one request is left with its prompt fed (and no capture or logits asked), an engine with
        a device-resident greedy loop (CUDA) produces its remaining tokens without a host round trip
        per token.

        speculate: None, "ngram:K", "model:DIR:K" or a drafter (fast/speculate.py): requests in decode
        verify up to K drafted tokens per step; the tokens, logits and captures are the same bits as
        without. The call's drafted / accepted counts are left in `self.speculation` (SpecStats).

        sampling: None (greedy), an oracle.sampling.SamplingParams for every request, or a list with one
        per prompt: the token at position p is `oracle.sampling.sample(logits row, params, p)`, the draw
        keyed by (seed, p) only, so a request's tokens do not depend on the batch, the chunking or the
        other requests (docs/sampling.md). Greedy requests take their token where the logits are.
        """
        single = len(prompts) > 0 and all(_is_int(v) for v in prompts) if isinstance(prompts, (list, tuple)) else False
        if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
            single, prompts = True, [prompts]
        elif single:
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise EngineInputError("prompts must be a non-empty list of token-id lists")
        if not _is_int(max_new_tokens) or max_new_tokens < 0:
            raise EngineInputError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if chunk is not None and (not _is_int(chunk) or chunk < 1):
            raise EngineInputError(f"chunk must be an int >= 1 or None, got {chunk!r}")
        if max_batch is not None and (not _is_int(max_batch) or max_batch < 1):
            raise EngineInputError(f"max_batch must be an int >= 1 or None, got {max_batch!r}")
        n = len(prompts)
        if arrivals is None:
            arrivals = [0] * n
        if len(arrivals) != n or any(not _is_int(a) or a < 0 for a in arrivals):
            raise EngineInputError("arrivals must hold one int >= 0 per prompt")
        caps = self._per_request_captures(capture, n)
        for cp in caps:
            self._check_capture(cp)
        ids = [self._check_ids(p, 0) for p in prompts]
        for i, p in enumerate(ids):
            need = p.size + max(max_new_tokens - 1, 0)
            if need > self.max_context:
                raise EngineInputError(f"prompt {i}: {need} positions exceed the maximum context of {self.max_context}")

        params = self._sampling_per_request(sampling, n)
        if speculate is not None:
            if any(not sp.greedy for sp in params):
                raise EngineInputError("generate: speculate decodes greedily here (the server's --speculate "
                                       "samples); give sampling=None or temperature 0 with it")
            from .speculate import generate as speculative
            out, lgs = speculative(self, ids, max_new_tokens, caps, chunk, max_batch, arrivals, return_logits,
                                   speculate)
            if return_logits:
                return (out[0], lgs[0]) if single else (out, lgs)
            return out[0] if single else out

        out = [[] for _ in range(n)]
        logit_rows = [[] for _ in range(n)]
        pending = deque(sorted(range(n), key=lambda i: (arrivals[i], i)))
        active: list[dict] = []
        step_no = 0
        while pending or active:
            while pending and arrivals[pending[0]] <= step_no and (max_batch is None or len(active) < max_batch):
                i = pending.popleft()
                need = ids[i].size + max(max_new_tokens - 1, 0)
                active.append({"i": i, "cache": self.new_cache().reserve(need), "fed": 0})
            if not active:
                step_no = arrivals[pending[0]]
                continue
            if len(active) == 1 and not pending and not return_logits and params[active[0]["i"]].greedy:
                # the last request, its prompt fed and nothing to capture: the rest of its tokens in
                # one call where the engine can keep them on the device (same tokens; CudaEngine)
                r = active[0]
                i = r["i"]
                rest = max_new_tokens - len(out[i])
                if r["fed"] == ids[i].size and out[i] and rest > 0 and caps[i] is None:
                    toks = self._greedy_tail(r["cache"], out[i][-1], rest)
                    if toks is not None:
                        out[i].extend(toks)
                        r["cache"].close()
                        active = []
                        continue
            segs, kinds = [], []
            for r in active:
                i, p = r["i"], ids[r["i"]]
                if r["fed"] < p.size:
                    take = p.size - r["fed"] if chunk is None else min(chunk, p.size - r["fed"])
                    seg_ids = p[r["fed"]:r["fed"] + take]
                    r["fed"] += take
                    done_prefill = r["fed"] == p.size
                    want = "all" if return_logits else (self._want(params[i]) if done_prefill else None)
                    kinds.append(done_prefill)
                else:
                    seg_ids = [out[i][-1]]
                    want = "all" if return_logits else self._want(params[i])
                    kinds.append(True)
                segs.append((r["cache"], seg_ids, caps[i], want))
            results = self.step(segs)
            still = []
            for r, produce, lg in zip(active, kinds, results):
                i = r["i"]
                if return_logits and lg is not None:
                    logit_rows[i].append(lg)
                finished = False
                if produce:
                    if len(out[i]) < max_new_tokens:
                        # greedy: np.argmax's rule (ties to the lowest id), here or in the engine;
                        # sampled: the draw of the token's position
                        pos = ids[i].size + len(out[i])
                        out[i].append(lg if isinstance(lg, int) else sample(lg[-1], params[i], pos))
                    finished = len(out[i]) >= max_new_tokens
                if finished:
                    r["cache"].close()
                else:
                    still.append(r)
            active = still
            step_no += 1
        if return_logits:
            lgs = [np.concatenate(x) for x in logit_rows]
            return (out[0], lgs[0]) if single else (out, lgs)
        return out[0] if single else out
