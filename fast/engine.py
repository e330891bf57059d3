"""fast.Engine: the exact CPU engine's Python API (a thin layer over fast._core._Engine).

    eng = fast.Engine("golden/tiny-fp8", device="cpu", threads=None)
    cache = eng.new_cache()                       # one sequence (alias: new_request)
    logits = eng.forward(ids, cache, capture)     # same signature and semantics as oracle's model.forward
    logits = eng.prefill(ids, cache, chunk=5)     # chunked prefill (any chunking gives the same bits)
    logits = eng.decode([c1, c2], [t1, t2])       # one decode token for each of several sequences
    outs = eng.generate([[1, 2, 3], [4, 5]], 8)   # greedy, continuous batching
    eng = fast.Engine(path, ranks=3)              # expert parallelism over 3 processes (docs/ep.md)

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

from oracle import names as N
from oracle.capture import Capture
from oracle.checkpoint import Checkpoint, open_checkpoint
from oracle.stages import ALL_STAGE_NAMES, stage_dtype

__all__ = ["Engine", "Cache", "EngineInputError", "parse_inject"]

_HEAD_STAGES = ("head.mean", "final_norm", "logits")



def _check_switches(threads, dot, expf, parallel_work) -> None:
    """The options both engines take (threads already resolved to an int)."""
    if not _is_int(threads) or not 1 <= threads <= 1024:
        raise EngineInputError(f"threads must be an int in [1, 1024] or None, got {threads!r}")
    if dot not in ("canonical", "sequential"):
        raise EngineInputError(f"dot must be 'canonical' or 'sequential', got {dot!r}")
    if expf not in ("canonical", "native"):
        raise EngineInputError(f"expf must be 'canonical' or 'native', got {expf!r}")
    if parallel_work is not None and (not _is_int(parallel_work) or parallel_work < 0):
        raise EngineInputError(f"parallel_work must be an int >= 0 or None, got {parallel_work!r}")


def _context_limit(cfg, max_context) -> int:
    """Positions a sequence may reach: max_context if given (checked), else the checkpoint's limit."""
    limit = int(cfg.max_position_embeddings)
    if max_context is not None:
        if not _is_int(max_context) or not 1 <= max_context <= limit:
            raise EngineInputError(f"max_context must be an int in [1, {limit}], got {max_context!r}")
        limit = int(max_context)
    return limit


def _load_tensors(eng, core, owns=None) -> None:
    """Every tensor of eng.checkpoint the model expects into an engine core (owns(entry) False: skip an
    expert another rank holds), counted in eng.release and eng.loaded."""
    cfg = eng.checkpoint.config
    for entry in N.expected(cfg):
        if owns is not None and not owns(entry):
            continue  # another rank's routed expert: never read
        role, layer, expert = entry.spec.role, entry.layer, entry.expert
        raw = eng.checkpoint.raw(role, layer, expert)
        data = np.ascontiguousarray(raw.data)
        scale = None if raw.scale is None else np.ascontiguousarray(raw.scale)
        core.add_tensor(role, -1 if layer is None else layer, -1 if expert is None else expert,
                        raw.release, data, scale, list(raw.shape))
        eng.release[raw.release] = eng.release.get(raw.release, 0) + 1
        eng.loaded["tensors"] += 1
        if expert is not None:
            eng.loaded["experts"].add(int(expert))

def _build_core(eng, ep, new_core, kw: dict):
    """The engine's executor: new_core() given eng.checkpoint's tensors (under expert parallelism only
    this rank's share, after its partition) and finalized; with ep, made on every rank through
    ep.build (kw: the engine's options, which driver mode's workers are started with)."""
    def make_local():
        c = new_core()
        if ep is not None:
            c.set_expert_partition(ep.rank, ep.ranks, ep.bounds)
        _load_tensors(eng, c, None if ep is None else ep.owns)
        c.finalize()
        return c

    if ep is None:
        return make_local()
    kw = dict(kw, ranks=ep.ranks, expert_ranges=ep.ranges, memory_limit=ep.memory_limit, verify_ranks=ep.verify)
    return ep.build(make_local, eng.checkpoint.path, kw)


class EngineInputError(ValueError):
    """Input the engine cannot take: bad token ids, shapes, dtypes, context overflow, bad options."""


def _core():
    try:
        from . import _core as core
    except ImportError as e:  # pragma: no cover - build problem
        raise ImportError("fast._core is not built: run `pip install -e .` (or `pip install .`) first") from e
    if not hasattr(core, "_Engine"):
        raise ImportError("fast._core was built without the CPU engine (register_engine missing)")
    return core


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


class Cache:
    """One sequence's state in the engine (KDA conv/recurrent state, MLA latents, indexer pools)."""

    def __init__(self, engine: "Engine", sid: int):
        self._engine = engine
        self._id = sid
        self._finalizer = weakref.finalize(self, engine._core.free_sequence, sid)

    @property
    def length(self) -> int:
        """Positions already in the cache (the next token goes at this position)."""
        return int(self._engine._core.sequence_length(self._id))

    def __len__(self) -> int:
        return self.length

    def fork(self) -> "Cache":
        """An independent copy (e.g. to reuse a prefix)."""
        return Cache(self._engine, int(self._engine._core.fork_sequence(self._id)))

    copy = fork

    def close(self) -> None:
        self._finalizer()

    def __repr__(self) -> str:
        return f"fast.Cache(id={self._id}, length={self.length})"


def parse_inject(spec, config) -> tuple | None:
    """An injection spec -> (layer, pos, stage_index, element, ulps), validated.

    Accepts None, a tuple/list (layer, pos, stage, element, ulps), a dict with those keys, or the CLI
    string "layer,pos,stage,element,ulps" (e.g. "15,45,mla.scores,3,1").
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",")]
        if len(parts) != 5:
            raise EngineInputError(f"inject: expected 'layer,pos,stage,element,ulps', got {spec!r}")
        try:
            spec = (int(parts[0]), int(parts[1]), parts[2], int(parts[3]), int(parts[4]))
        except ValueError:
            raise EngineInputError(f"inject: layer, pos, element and ulps must be integers, got {spec!r}") from None
    elif isinstance(spec, dict):
        try:
            spec = tuple(spec[k] for k in ("layer", "pos", "stage", "element", "ulps"))
        except KeyError as e:
            raise EngineInputError(f"inject: missing key {e}") from None
    if not isinstance(spec, (tuple, list)) or len(spec) != 5:
        raise EngineInputError(f"inject: expected (layer, pos, stage, element, ulps), got {spec!r}")
    layer, pos, stage, element, ulps = spec
    for name, v in (("layer", layer), ("pos", pos), ("element", element), ("ulps", ulps)):
        if not _is_int(v):
            raise EngineInputError(f"inject: {name} must be an int, got {v!r}")
    if not isinstance(stage, str) or stage not in ALL_STAGE_NAMES:
        raise EngineInputError(f"inject: unknown stage {stage!r}; known: {', '.join(ALL_STAGE_NAMES)}")
    L = config.num_hidden_layers
    if not 0 <= layer <= L:
        raise EngineInputError(f"inject: layer {layer} out of range [0, {L}]")
    valid = _stages_of_layer(config, layer)
    if stage not in valid:
        raise EngineInputError(f"inject: stage {stage!r} does not exist at layer {layer}")
    dtype = stage_dtype(stage)
    if pos < 0:
        raise EngineInputError(f"inject: pos must be >= 0, got {pos}")
    size = _stage_size(config, stage)
    if element < 0 or (size is not None and element >= size):
        raise EngineInputError(f"inject: element {element} out of range for {stage} (size {size})")
    bits = {"bf16": 16, "f32": 32, "f64": 64, "i32": 32}[dtype]
    if ulps == 0 or abs(int(ulps)) >= (1 << (bits - 1)):
        raise EngineInputError(f"inject: ulps must be nonzero and fit the {bits}-bit pattern, got {ulps}")
    return int(layer), int(pos), stage, int(element), int(ulps)


def _stages_of_layer(config, layer: int) -> set[str]:
    from oracle.stages import HEAD, layer_stages
    L = config.num_hidden_layers
    if layer == L:
        return {s for s, _ in HEAD}
    out = {s for s, _ in layer_stages(config.is_kda(layer), config.is_moe(layer), config.has_indexer(layer))}
    if layer == 0:
        out.add("embed")
    return out


def _stage_size(c, stage: str) -> int | None:
    """Elements in one row of a fixed-size stage (None: depends on the position)."""
    D, hc = c.hidden_size, c.hc_mult
    P, H, d = c.linear_num_heads * c.linear_head_dim, c.linear_num_heads, c.linear_head_dim
    nh, r = c.num_attention_heads, c.kv_lora_rank
    sizes = {
        "embed": D, "attn_norm": D, "ffn_norm": D, "head.mean": D, "final_norm": D, "logits": c.vocab_size,
        "kda.q_proj": P, "kda.k_proj": P, "kda.v_proj": P, "kda.q": P, "kda.k": P, "kda.v": P, "kda.g": P,
        "kda.beta": H, "kda.state": H * d * d, "kda.o": P, "kda.gate": P, "kda.o_norm": P, "kda.out": D,
        "mla.q_lat": c.q_lora_rank, "mla.q": nh * c.qk_nope_head_dim, "mla.c": r, "mla.q_abs": nh * r,
        "indexer.q": c.index_n_heads * c.index_head_dim, "indexer.k": c.index_head_dim,
        "indexer.gate": c.index_head_dim, "indexer.weights": c.index_n_heads,
        "mla.o_lat": nh * r, "mla.o": nh * c.v_head_dim, "mla.out": D,
        "mlp.gate": c.intermediate_size, "mlp.up": c.intermediate_size, "mlp.out": D,
        "moe.logits": c.n_routed_experts, "moe.weights": c.num_experts_per_tok,
        "moe.experts": c.num_experts_per_tok * D, "moe.routed": D, "moe.shared": D, "moe.out": D,
    }
    for site in ("attn_hc", "ffn_hc"):
        sizes.update({f"{site}.pre": hc, f"{site}.post": hc, f"{site}.comb": hc * hc,
                      f"{site}.collapsed": D, f"{site}.streams": hc * D})
    return sizes.get(stage)


def _engine_config(cfg, max_context: int) -> dict:
    L = cfg.num_hidden_layers
    d = {k: getattr(cfg, k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size",
        "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "norm_topk_prob",
        "routed_scaling_factor", "swiglu_limit", "rms_norm_eps", "num_attention_heads", "q_lora_rank",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk", "index_head_dim",
        "index_n_heads", "index_kpool", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
        "linear_lower_bound", "hc_mult", "hc_eps", "hc_sinkhorn_iters", "tie_word_embeddings")}
    for k in ("routed_scaling_factor", "swiglu_limit", "rms_norm_eps", "linear_lower_bound", "hc_eps"):
        d[k] = float(d[k])
    d["max_context"] = int(max_context)
    d["is_kda"] = [1 if cfg.is_kda(l) else 0 for l in range(L)]
    d["is_moe"] = [1 if cfg.is_moe(l) else 0 for l in range(L)]
    d["has_indexer"] = [1 if cfg.has_indexer(l) else 0 for l in range(L)]
    return d


class Engine:
    """The exact CPU engine over one checkpoint (weights stay in their release format, memory-mapped)."""

    ep = None  # expert parallelism (fast.distributed.EPSetup) when ranks / expert_ranges / memory_limit are given

    def __new__(cls, path=None, device: str = "cpu", *args, **kwargs):
        """`Engine(path, device="cuda")` builds the CUDA engine (fast.cuda.CudaEngine, the same API)."""
        if cls is Engine and device in ("cuda", "cuda:0"):
            from .cuda import CudaEngine
            return object.__new__(CudaEngine)
        return object.__new__(cls)

    def __init__(self, path, device: str = "cpu", threads: int | None = None, *, dot: str = "canonical",
                 expf: str = "canonical", inject=None, max_context: int | None = None,
                 parallel_work: int | None = None, ranks: int | None = None, expert_ranges=None,
                 memory_limit: int | None = None, verify_ranks: bool = False, _ep_member=None):
        if device != "cpu":
            raise EngineInputError(f"device {device!r}: this engine runs on 'cpu' (the CUDA engine is fast._cuda)")
        # expert parallelism (fast/distributed.py, docs/ep.md): ranks / expert_ranges / memory_limit, or
        # started by fast.launch. ep is None for the plain single-process engine.
        ep = None
        if (ranks is not None or expert_ranges is not None or memory_limit is not None or _ep_member is not None
                or os.environ.get("GLM_EP") == "1"):
            from .distributed import EPSetup
            ep = EPSetup.resolve(ranks, expert_ranges, memory_limit, verify_ranks, _ep_member)
        self.ep = ep
        if threads is None:
            threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            if ep is not None:
                threads = ep.default_threads()  # the cores shared by the ranks of this host
        _check_switches(threads, dot, expf, parallel_work)
        core = _core()
        # with expert parallelism the checkpoint is opened without the up-front scan of every value:
        # a rank reads (and checks) only the tensors it loads, never another rank's experts
        self.checkpoint = path if isinstance(path, Checkpoint) else open_checkpoint(path, verify=ep is None)
        self.config = cfg = self.checkpoint.config
        self.max_context = limit = _context_limit(cfg, max_context)
        self.options = {"dot": dot, "expf": expf, "threads": int(threads)}
        if ep is not None:
            ep.plan(self.checkpoint, limit, int(threads))  # prints the plan; refuses before allocating
            self.options["ranks"] = ep.ranks
        self.release = {}
        self.loaded = {"tensors": 0, "experts": set()}  # what this process read from the checkpoint

        # parallel_work: jobs below this many multiply-adds run on one thread (None: the engine's default,
        # about 1M; 0 splits every job over the threads, which the tests use on tiny models)
        self._core = _build_core(
            self, ep, lambda: core._Engine(_engine_config(cfg, limit), int(threads), dot, expf,
                                           -1 if parallel_work is None else int(parallel_work)),
            {"threads": int(threads), "dot": dot, "expf": expf, "max_context": limit, "parallel_work": parallel_work})
        self._stage_index = {name: i for i, (name, _) in enumerate(core.ENGINE_STAGES)}
        missing = set(ALL_STAGE_NAMES) - set(self._stage_index)
        if missing:  # pragma: no cover - the two stage tables must agree
            raise RuntimeError(f"engine and oracle stage tables differ: {sorted(missing)}")
        self._n_stages = len(core.ENGINE_STAGES)
        self.inject = inject
        self.injected = 0  # elements perturbed so far (fault injection)

    # ---------------------------------------------------------------- options
    @property
    def inject(self):
        return self._inject

    @inject.setter
    def inject(self, spec):
        parsed = parse_inject(spec, self.config)
        self._inject = parsed
        self._inject_core = None if parsed is None else (
            parsed[0], parsed[1], self._stage_index_of(parsed[2]), parsed[3], parsed[4])

    def _stage_index_of(self, name: str) -> int:
        return _core().ENGINE_STAGES.index((name, stage_dtype(name)))

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

    # ---------------------------------------------------------------- validation
    def _check_ids(self, ids, start: int) -> np.ndarray:
        if isinstance(ids, np.ndarray):
            a = ids
        else:
            if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
                raise EngineInputError(f"token ids must be a 1-D sequence of integers, got {type(ids).__name__}")
            if any(not _is_int(v) for v in ids):
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
        "last" (the last row's) or None. Each cache appears at most once. Returns, per segment, the
        logits [n, V] asked for (or None).
        """
        if not segments:
            raise EngineInputError("step needs at least one segment")
        seen, rows = set(), []
        for seg in segments:
            if not isinstance(seg, (tuple, list)) or len(seg) != 4:
                raise EngineInputError("each segment is (cache, ids, capture, logits)")
            cache, ids, capture, want = seg
            cache = self._check_cache(cache)
            if cache._id in seen:
                raise EngineInputError("a cache appears twice in one step")
            seen.add(cache._id)
            ids = self._check_ids(ids, cache.length)
            capture = self._check_capture(capture)
            if want not in ("all", "last", None):
                raise EngineInputError(f"logits must be 'all', 'last' or None, got {want!r}")
            rows.append((cache, ids, capture, want, cache.length))
        T = sum(r[1].size for r in rows)
        seq_ids = np.empty(T, np.int64)
        tokens = np.empty(T, np.int32)
        want_head = np.zeros(T, np.bool_)
        cap_rows = np.zeros(T, np.bool_)
        L = self.config.num_hidden_layers
        mask = np.zeros((L + 1, self._n_stages), np.bool_)
        names = [n for n, _ in _core().ENGINE_STAGES]
        t = 0
        spans = []
        for cache, ids, capture, want, start in rows:
            n = ids.size
            seq_ids[t:t + n] = cache._id
            tokens[t:t + n] = ids
            if want == "all" or (capture is not None and any(capture.wants(L, h) for h in _HEAD_STAGES)):
                want_head[t:t + n] = True
            elif want == "last":
                want_head[t + n - 1] = True
            if capture is not None:
                cap_rows[t:t + n] = True
                for layer in range(L + 1):
                    for i, name in enumerate(names):
                        if not mask[layer, i] and capture.wants(layer, name):
                            mask[layer, i] = True
            spans.append((t, n))
            t += n
        head_rows, logits, caps, injected = self._core.step(seq_ids, tokens, want_head, cap_rows,
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
            else:
                out.append(None)
        return out

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

    def _greedy_tail(self, cache, first_token: int, n: int):
        """n greedy decode steps of one cache in one call, or None where the engine has no such path
        (generate then steps through the host loop)."""
        return None

    def generate(self, prompts, max_new_tokens: int, capture=None, *, chunk: int | None = None,
                 max_batch: int | None = None, arrivals: Sequence[int] | None = None,
                 return_logits: bool = False):
        """Greedy decoding of several prompts with continuous batching -> list of new-token lists.

        Every step is one C++ call over the rows of all active requests: prompt chunks of at most
        `chunk` tokens (None: the whole rest) for requests still in prefill, one token for the others.
        Requests join when their arrival step comes (`arrivals`, default all 0) and a slot is free
        (`max_batch` active requests, default unlimited), and leave when they have max_new_tokens.
        A single prompt (list of ints) is accepted too and returns a single list. Once one request is
        left with its prompt fed (and no capture or logits asked), an engine with a device-resident
        greedy loop (CUDA) produces its remaining tokens without a host round trip per token.
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

        out = [[] for _ in range(n)]
        logit_rows = [[] for _ in range(n)]
        pending = deque(sorted(range(n), key=lambda i: (arrivals[i], i)))
        active: list[dict] = []
        step_no = 0
        while pending or active:
            while pending and arrivals[pending[0]] <= step_no and (max_batch is None or len(active) < max_batch):
                i = pending.popleft()
                active.append({"i": i, "cache": self.new_cache(), "fed": 0})
            if not active:
                step_no = arrivals[pending[0]]
                continue
            if len(active) == 1 and not pending and not return_logits:
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
                    want = "all" if return_logits else ("last" if done_prefill else None)
                    kinds.append(done_prefill)
                else:
                    seg_ids = [out[i][-1]]
                    want = "all" if return_logits else "last"
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
                        out[i].append(int(np.argmax(lg[-1])))  # greedy: ties to the lowest id
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
