"""Expert parallelism for the exact CPU engine (docs/ep.md).

The routed experts of every MoE layer are split over ranks in contiguous ranges; attention, mHC,
the dense MLP, the router, the shared expert and the head are replicated on every rank. Each rank
loads only its own experts from the checkpoint (opened with verify=False: a tensor is read, and
checked, only when the rank uses it). At each MoE layer the C++ executor computes the selected
experts that this rank owns, then calls the exchange hook set here: an all-gather of those rows
(BF16 bit patterns, as bytes) through torch.distributed (gloo). Every rank then forms
`moe.routed = bf16(cdot over selected j of (w_j, y_j[d]))` in expert-index order with the same cdot
as in one process, so every rank holds the same streams, bit for bit, as the single-process engine.

Two ways to run N ranks (both through `fast.Engine(path, ranks=N, ...)`):

* driver: a plain process asks for ranks=N; this module starts N-1 worker processes (fresh
  interpreters, like multiprocessing's "spawn" but without re-running the caller's script), forms a
  gloo process group on localhost with this process as rank 0, and forwards every engine call to the
  workers (torch.distributed.broadcast_object_list; sequence operations ride with the next step).
  The group is kept for later engines of the same rank count (a different count replaces it).
* SPMD: every rank runs the same script (`python -m fast.launch --ranks N -- ...` or torchrun, which
  set RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT); each process is one rank and makes the same
  calls in the same order.

torch is imported only here, and only when ranks > 1.
"""
from __future__ import annotations

import atexit
import datetime
import hashlib
import os
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field

import numpy as np

from oracle import names as N

from .core import EngineInputError, engine_class, is_int

__all__ = ["even_ranges", "check_ranges", "MemoryPlan", "memory_plans", "format_plans", "EPSetup",
           "launched", "shutdown"]

_TIMEOUT_S = float(os.environ.get("GLM_EP_TIMEOUT", "600"))


def _error(msg: str) -> Exception:
    return EngineInputError(msg)


def _torch():
    """torch and torch.distributed with gloo, or a clear ImportError."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise ImportError(
            "expert parallelism over several ranks (ranks > 1) needs torch for torch.distributed (gloo): "
            "install it, e.g. pip install 'glm-exact[test]' or pip install torch==2.13.0 "
            f"(the engine itself runs without torch with ranks=1) ({e})") from None
    if not dist.is_available() or not dist.is_gloo_available():
        raise ImportError("expert parallelism needs torch.distributed with the gloo backend, "
                          "which this torch build lacks")
    return torch, dist


# ------------------------------------------------------------------------------------ expert ranges

def even_ranges(n_experts: int, ranks: int) -> list[tuple[int, int]]:
    """Contiguous ranges [E r / N, E (r+1) / N): the default split."""
    return [(n_experts * r // ranks, n_experts * (r + 1) // ranks) for r in range(ranks)]


def check_ranges(ranges, n_experts: int, ranks: int | None = None) -> list[tuple[int, int]]:
    """Validate user ranges: one (start, stop) per rank, contiguous, ascending, covering [0, E)."""
    try:
        rs = [(int(a), int(b)) for a, b in ranges]
        if any(isinstance(v, bool) or int(v) != v for ab in ranges for v in ab):
            raise TypeError
    except (TypeError, ValueError):
        raise _error(f"expert_ranges must be a list of (start, stop) integer pairs, got {ranges!r}") from None
    if not rs:
        raise _error("expert_ranges is empty")
    if ranks is not None and len(rs) != ranks:
        raise _error(f"expert_ranges has {len(rs)} ranges for ranks={ranks}: give one (start, stop) per rank")
    if rs[0][0] != 0 or rs[-1][1] != n_experts:
        raise _error(f"expert_ranges {rs} must cover the experts [0, {n_experts}) from 0 to {n_experts}")
    for i, (a, b) in enumerate(rs):
        if b < a:
            raise _error(f"expert_ranges: range {i} = ({a}, {b}) is reversed")
        if i and a != rs[i - 1][1]:
            raise _error(f"expert_ranges: range {i} starts at {a} but range {i - 1} stops at {rs[i - 1][1]} "
                         "(ranges must be contiguous, in rank order)")
    return rs


# ------------------------------------------------------------------------------------ memory plan

@dataclass
class MemoryPlan:
    """Bytes one rank needs (docs/ep.md, "Memory plan"). Computed from config.json and the safetensors
    headers only, before anything is read or allocated."""

    rank: int
    ranks: int
    experts: tuple[int, int]
    replicated: int          # stored bytes of every tensor all ranks hold (memory-mapped; resident once read)
    derived: int             # copies the engine makes at load (norms/conv/mHC as f32/f64, W_UK^T f32)
    own_experts: int         # stored bytes of this rank's routed experts
    all_experts: int         # stored bytes of all routed experts (for comparison)
    cache_per_token: int     # per sequence and position: MLA latents, indexer k/gate, pool keys (f32)
    cache_per_sequence: int  # per sequence, fixed: KDA conv tails and recurrent states (f32)
    workspace_per_row: int   # estimate of the largest buffers one step holds, per token row
    workspace_fixed: int     # per step, not per row (per-thread scratch: the indexer's pool scores)
    sequences: int = 1
    context: int = 0
    rows: int = 0
    limit: int | None = None

    @property
    def weights(self) -> int:
        return self.replicated + self.derived + self.own_experts

    @property
    def caches(self) -> int:
        return self.sequences * (self.cache_per_sequence + self.context * self.cache_per_token)

    @property
    def workspace(self) -> int:
        return self.rows * self.workspace_per_row + self.workspace_fixed

    @property
    def total(self) -> int:
        return self.weights + self.caches + self.workspace

    @property
    def fits(self) -> bool:
        return self.limit is None or self.total <= self.limit

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "rank", "ranks", "experts", "replicated", "derived", "own_experts", "all_experts", "cache_per_token",
            "cache_per_sequence", "workspace_per_row", "workspace_fixed", "sequences", "context", "rows", "limit",
            "weights", "caches", "workspace", "total", "fits")}
        d["experts"] = list(self.experts)
        return d


def _mib(n: int) -> str:
    if n < 1 << 20:
        return f"{n / 1024:.1f} KiB"
    if n < 1 << 30:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


def format_plans(plans: list[MemoryPlan], device: str = "cpu") -> str:
    """The plan as printed at load: one line per rank, bytes and a readable size."""
    p0 = plans[0]
    lim = "no limit" if p0.limit is None else f"limit {p0.limit} B ({_mib(p0.limit)}) per rank"
    head = (f"memory plan: {len(plans)} rank(s) on {device}, {lim}; caches for {p0.sequences} sequence(s) x "
            f"{p0.context} positions, workspace for a step of {p0.rows} rows")
    cols = ("rank", "experts", "replicated", "derived", "own experts", "cache/token", "cache/seq",
            "caches", "workspace", "total", "")
    rows = []
    for p in plans:
        rows.append((str(p.rank), f"[{p.experts[0]}, {p.experts[1]})", str(p.replicated), str(p.derived),
                     str(p.own_experts), str(p.cache_per_token), str(p.cache_per_sequence), str(p.caches),
                     str(p.workspace), f"{p.total} ({_mib(p.total)})", "ok" if p.fits else "DOES NOT FIT"))
    w = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]

    def fmt(r):
        return "  ".join(v.ljust(w[i]) if i in (1, 10) else v.rjust(w[i]) for i, v in enumerate(r))
    lines = [head, "  " + fmt(cols).rstrip()] + ["  " + fmt(r).rstrip() for r in rows]
    lines.append(f"  (bytes; all experts together: {p0.all_experts}; replicated = stored bytes of the "
                 "non-expert tensors, read in place from the memory-mapped files)")
    return "\n".join(lines)


def _stored_bytes(release: str, shape: tuple[int, ...]) -> int:
    n = int(np.prod(shape)) if shape else 1
    if release == "bf16":
        return 2 * n
    if release == "f32":
        return 4 * n
    if release == "fp8":
        R, C = shape
        return n + 4 * (-(-R // 128)) * (-(-C // 128))
    if release == "mxfp4":
        R, C = shape
        return n // 2 + R * (C // 32)
    raise ValueError(f"unknown release {release!r}")


def _slot_release(ck, entry) -> str:
    # the loader's resolved release of one tensor, from the headers (no value is read)
    slot = ck._slots.get(entry.key)  # noqa: SLF001 - the loader is shared with the engine on purpose
    if slot is None:
        raise _error(f"{entry.key} is not in this checkpoint")
    return slot.release


def memory_plans(ck, ranges, *, context: int, sequences: int = 1, rows: int | None = None,
                 limit: int | None = None, threads: int = 1) -> list[MemoryPlan]:
    """The memory plan of every rank (each rank can compute all of them: same inputs)."""
    cfg = ck.config
    replicated, experts = 0, {}
    for entry in N.expected(cfg):
        b = _stored_bytes(_slot_release(ck, entry), entry.spec.shape(cfg))
        if entry.expert is None:
            replicated += b
        else:
            experts[entry.expert] = experts.get(entry.expert, 0) + b
    L, D, hc, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    P, H, d = cfg.linear_num_heads * cfg.linear_head_dim, cfg.linear_num_heads, cfg.linear_head_dim
    K = cfg.linear_conv_kernel_dim
    nh, dn, dv, r, rq = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank,
                         cfg.q_lora_rank)
    ni, di, kp = cfg.index_n_heads, cfg.index_head_dim, max(1, cfg.index_kpool)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    Im, I = cfg.moe_intermediate_size, cfg.intermediate_size
    Is = Im * cfg.n_shared_experts
    hcd = (2 + hc) * hc
    # derived copies (model.cpp finalize/add_tensor): f32 vectors, f64 mHC, W_UK^T f32
    derived = 4 * D  # final_norm
    per_tok = per_seq = 0
    for l in range(L):
        derived += 4 * 2 * D + 8 * 2 * (hcd * hc * D + hcd)
        if cfg.is_kda(l):
            derived += 4 * (2 * 3 * P * K + P + 2 * H + d)
            per_seq += 4 * ((K - 1) * 3 * P + H * d * d)
        else:
            derived += 4 * (rq + r + nh * r * dn)
            per_tok += 4 * r
            if cfg.has_indexer(l):
                derived += 4 * (2 * di + kp * di)
                per_tok += 4 * (2 * di) + (4 * di + kp - 1) // kp
        if cfg.is_moe(l):
            derived += 4 * E
    # workspace per row: the buffers of one layer (the largest attention and FFN) + streams + head
    ns = min(context, cfg.index_topk + kp) if any(cfg.has_indexer(l) for l in range(L)) else context
    kda = 10 * P + 2 * d + H if any(cfg.is_kda(l) for l in range(L)) else 0
    mla = (2 * rq + nh * dn + 2 * r + 2 * nh * r + nh * dv + (r + 2 * nh) * ns + ni * di + 3 * di + ni
           ) if any(not cfg.is_kda(l) for l in range(L)) else 0
    ffn = max(2 * I if any(cfg.is_dense(l) for l in range(L)) else 0,
              (3 * E + k * D + 2 * D + 2 * Is + k * (2 * D + 2 * Im)) if any(cfg.is_moe(l) for l in range(L)) else 0)
    nranks = len(ranges)
    ws = 4 * (hc * D + 5 * D + max(kda, mla) + ffn + 2 * V) + 8 * (hc * D + hcd + hc * (hc + 2) + hc * (hc + 1))
    ws += 2 * (nranks + 1) * k * D if nranks > 1 else 0  # exchange buffers (send + recv, BF16 bits)
    rows = min(context, 512) if rows is None else rows
    # per thread, not per row: the indexer's score of every visible pool (one query at a time)
    threads = threads if threads else 1
    ws_fixed = 4 * threads * (context // kp + 1) if any(cfg.has_indexer(l) for l in range(L)) else 0
    plans = []
    for rank, (a, b) in enumerate(ranges):
        own = sum(experts.get(e, 0) for e in range(a, b))
        plans.append(MemoryPlan(rank, nranks, (a, b), replicated, derived, own, sum(experts.values()), per_tok,
                                per_seq, ws, ws_fixed, sequences, context, rows, limit))
    return plans


# ------------------------------------------------------------------------------------ launch env

def launched() -> int | None:
    """WORLD_SIZE when this process was started by fast.launch (GLM_EP=1), else None."""
    if os.environ.get("GLM_EP") == "1" and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def _env_rank(ranks: int) -> int | None:
    """RANK when the environment (fast.launch, torchrun) describes a group of `ranks` processes."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != ranks:
            raise _error(f"ranks={ranks} but this process was launched as one of WORLD_SIZE="
                         f"{os.environ['WORLD_SIZE']} processes")
        return int(os.environ["RANK"])
    return None


# ------------------------------------------------------------------------------------ the exchange

class _Exchange:
    """The C++ executor's exchange hook: all-gather of the owned rows (BF16 bits, sent as bytes)."""

    def __init__(self, torch, dist, group, ranks: int):
        self.torch, self.dist, self.group, self.ranks = torch, dist, group, ranks
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, layer: int, send: np.ndarray, recv: np.ndarray) -> None:
        t = self.torch.from_numpy(send.reshape(-1).view(np.uint8))
        outs = [self.torch.from_numpy(recv[r].reshape(-1).view(np.uint8)) for r in range(self.ranks)]
        t0 = time.perf_counter()
        self.dist.all_gather(outs, t, group=self.group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1


# NCCL, PyTorch and NVSHMEM without NVLink multicast (a program using it can take a shared host's GPUs
# out of service): kept as the environment has them, set where it has not.
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class _CudaBuffer:
    """A device address as an array torch can view without a copy (__cuda_array_interface__)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (int(ptr), False),
                                         "version": 2}


class _DeviceExchange:
    """The CUDA executor's exchange hook (docs/ep.md, "GPU"): send u16[rows, D] and recv u16[ranks, rows,
    D] are device addresses; an all-gather of bytes into recv on an NCCL group, on torch's current
    stream, which is the engine's (the legacy default stream): ordered after the engine's packing and
    before its unpacking with no host synchronization. Never a reduction. The NCCL group is made at the
    first exchange, which every rank reaches at the same point of the same step. Under the CPU
    emulation (fast._cuda_emu) the addresses are host memory and the rows go through the gloo group.

    With `timing` on, CUDA events bracket each collective on the stream; collective_seconds() sums them
    (it synchronizes)."""

    def __init__(self, torch, dist, group, ranks: int, emulated: bool):
        self.torch, self.dist, self.group, self.ranks, self.emulated = torch, dist, group, ranks, emulated
        self.pg = None
        self.seconds = 0.0  # host time inside the hook (enqueueing on the GPU)
        self.calls = 0
        self.timing = False
        self._events: list = []

    def __call__(self, layer: int, send: int, recv: int, rows: int, D: int) -> None:
        torch, dist = self.torch, self.dist
        n = int(rows) * int(D) * 2
        t0 = time.perf_counter()
        if self.emulated:
            import ctypes
            snd = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(int(send)))
            rcv = np.ctypeslib.as_array((ctypes.c_uint8 * (n * self.ranks)).from_address(int(recv)))
            outs = [torch.from_numpy(rcv[r * n:(r + 1) * n]) for r in range(self.ranks)]
            dist.all_gather(outs, torch.from_numpy(snd), group=self.group)
        else:
            if self.pg is None:
                for k, v in _NO_MULTICAST.items():  # (shared hosts: NVLink multicast stays off)
                    os.environ.setdefault(k, v)
                self.pg = dist.new_group(backend="nccl")
            dev = torch.device("cuda", torch.cuda.current_device())
            snd = torch.as_tensor(_CudaBuffer(send, n), device=dev)
            rcv = torch.as_tensor(_CudaBuffer(recv, n * self.ranks), device=dev)
            if self.timing:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            dist.all_gather_into_tensor(rcv, snd, group=self.pg)
            if self.timing:
                b.record()
                self._events.append((a, b))
        self.seconds += time.perf_counter() - t0
        self.calls += 1

    def collective_seconds(self) -> float:
        """Device time of the collectives recorded while `timing` was on (synchronizes; then clears)."""
        if not self._events:
            return 0.0
        self.torch.cuda.synchronize()
        total = sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        self._events.clear()
        return total


def _digest(result) -> str:
    """What a rank computed in one step: logits, greedy tokens and their log-probabilities, every
    captured row (sorted), injected count."""
    head_rows, logits, caps, injected, tokens, logprobs = result
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(head_rows).tobytes())
    h.update(np.ascontiguousarray(tokens).tobytes())
    h.update(np.ascontiguousarray(logprobs).tobytes())
    h.update(np.ascontiguousarray(logits).tobytes())
    for layer, stage, row, value in sorted(caps, key=lambda c: (c[0], c[1], c[2])):
        h.update(f"{layer}|{stage}|{row}|{value.dtype}|{value.shape}|".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    h.update(str(int(injected)).encode())
    return h.hexdigest()


class _RankCore:
    """One rank's executor (fast._core._Engine) with its exchange hook.

    Frees that arrive while a step runs (a Cache finalizer during the hook's Python code) are
    deferred: the executor holds its lock during the step."""

    def __init__(self, local, group: "_Group"):
        self.local = local
        self.group = group
        self._in_step = False
        self._deferred: list[int] = []
        self.exchange = None
        if group is not None and group.ranks > 1:
            where = getattr(local, "device_exchange", None)  # the CUDA executor: "device" (or "host": emulated)
            if where is not None:
                self.exchange = _DeviceExchange(group.torch, group.dist, group.pg, group.ranks, where == "host")
            else:
                self.exchange = _Exchange(group.torch, group.dist, group.pg, group.ranks)
            local.set_exchange(self.exchange)
        self.steps = 0

    def __getattr__(self, name):
        return getattr(self.local, name)

    def free_sequence(self, sid: int) -> None:
        if self._in_step:
            self._deferred.append(int(sid))
        else:
            self.local.free_sequence(sid)

    def _flush(self) -> None:
        while self._deferred:
            self.local.free_sequence(self._deferred.pop())

    def run_step(self, args, verify: bool):
        """The step on this rank; with verify, every rank's digest is compared (one all_gather_object)."""
        self._in_step = True
        result = err = None
        try:
            result = self.local.step(*args)
        except Exception as e:  # noqa: BLE001 - reported after the digests are compared
            err = e
        finally:
            self._in_step = False
            self._flush()
        self.steps += 1
        if verify and self.group is not None and self.group.ranks > 1:
            mine = f"error: {type(err).__name__}: {err}" if err is not None else _digest(result)
            allv = self.group.gather(mine)
            bad = [r for r, v in enumerate(allv) if v != allv[0]]
            if bad and err is None:
                raise RuntimeError(f"expert parallelism: rank(s) {bad} computed a different step than rank 0 "
                                   f"({[allv[r] for r in bad][0][:80]} vs {allv[0][:80]})")
        if err is not None:
            raise err
        return result

    def stats(self) -> dict:
        d = dict(self.local.ep_stats())
        rank, ranks, bounds = self.local.expert_partition
        d.update(rank=rank, ranks=ranks, experts=(bounds[rank], bounds[rank + 1]) if bounds else None,
                 collective_seconds=self.exchange.seconds if self.exchange else 0.0,
                 collective_calls=self.exchange.calls if self.exchange else 0, steps=self.steps)
        if isinstance(self.exchange, _DeviceExchange):  # (collective_seconds: the host's enqueueing there)
            d["collective_device_seconds"] = self.exchange.collective_seconds()
        return d

    def reset_stats(self) -> None:
        self.local.reset_ep_stats()
        self.steps = 0
        if self.exchange:
            self.exchange.seconds, self.exchange.calls = 0.0, 0


class _MemberCore(_RankCore):
    """SPMD (every rank runs the script): the engine's core; step runs here on every rank."""

    def __init__(self, local, group, verify: bool):
        super().__init__(local, group)
        self.verify = verify

    def step(self, *args):
        return self.run_step(args, self.verify)


class _DriverCore(_RankCore):
    """Driver mode, rank 0: every call is also sent to the worker ranks, which replay it on their own
    executor. Sequence operations are queued and sent with the next step (ids are deterministic)."""

    def __init__(self, local, cluster: "_Cluster", eid: int, verify: bool):
        super().__init__(local, cluster.group)
        self.cluster, self.eid, self.verify = cluster, eid, verify
        self.generation = cluster.generation

    def _check(self):
        if not self.cluster.alive or self.cluster.generation != self.generation:
            raise RuntimeError("this engine's rank group was shut down (a driver process keeps one group: an "
                               "engine with another rank count, or fast.distributed.shutdown(), replaced it)")

    def new_sequence(self):
        self._check()
        sid = int(self.local.new_sequence())
        self.cluster.queue((self.eid, "new_sequence", (), sid))
        return sid

    def fork_sequence(self, sid):
        self._check()
        nid = int(self.local.fork_sequence(sid))
        self.cluster.queue((self.eid, "fork_sequence", (int(sid),), nid))
        return nid

    def reserve_sequence(self, sid, positions):
        self._check()
        self.local.reserve_sequence(sid, positions)
        self.cluster.queue((self.eid, "reserve_sequence", (int(sid), int(positions)), None))

    def import_sequence(self, arrays, length):
        self._check()
        sid = int(self.local.import_sequence(arrays, length))
        self.cluster.queue((self.eid, "import_sequence", (dict(arrays), int(length)), sid))
        return sid

    def free_sequence(self, sid):
        if self.cluster.alive and self.cluster.generation == self.generation:
            self.cluster.queue((self.eid, "free_sequence", (int(sid),), None))
        super().free_sequence(sid)

    def step(self, *args):
        self._check()
        self.cluster.send(("step", self.eid, args, self.verify))
        return self.run_step(args, self.verify)

    def greedy(self, *args):  # (the CUDA executor's device-resident loop: every step exchanges rows)
        self._check()
        self.cluster.send(("greedy", self.eid, args))
        return self.local.greedy(*args)

    def rank_stats(self) -> list[dict]:
        self._check()
        self.cluster.send(("stats", self.eid))
        return self.cluster.group.gather(self.stats())

    def reset_rank_stats(self) -> None:
        self._check()
        self.cluster.send(("reset_stats", self.eid))
        self.reset_stats()

    def rank_info(self, info: dict) -> list[dict]:
        self._check()
        self.cluster.send(("info", self.eid))
        return self.cluster.group.gather(info)


# ------------------------------------------------------------------------------------ process groups

@dataclass
class _Group:
    torch: object
    dist: object
    pg: object  # None: the default group
    rank: int
    ranks: int

    def gather(self, obj) -> list:
        out = [None] * self.ranks
        self.dist.all_gather_object(out, obj, group=self.pg)
        return out


def _spmd_group(ranks: int) -> _Group:
    """This process is one rank of a group launched from outside (fast.launch / torchrun) or already
    initialized by the caller."""
    torch, dist = _torch()
    if not dist.is_initialized():
        if _env_rank(ranks) is None:
            raise _error("no process group: run under python -m fast.launch / torchrun, or in a driver process")
        dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=_TIMEOUT_S))
        atexit.register(_spmd_exit, dist)
    if dist.get_world_size() != ranks:
        raise _error(f"ranks={ranks} but the process group has {dist.get_world_size()} ranks")
    pg = None
    if dist.get_backend() != "gloo":  # e.g. an NCCL default group: the CPU rows go through gloo
        pg = dist.new_group(backend="gloo")
    return _Group(torch, dist, pg, dist.get_rank(), ranks)


def _spmd_exit(dist) -> None:
    """At exit of a rank whose group we created: wait for every rank, then destroy the group while the
    interpreter is alive (gloo's threads can otherwise abort the process during finalization)."""
    if not dist.is_initialized():
        return
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=60), wait_all_ranks=True)
    except Exception:  # noqa: BLE001 - a rank is gone: tear down anyway
        pass
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class _Cluster:
    """Driver mode: this process is rank 0 of a gloo group with ranks-1 spawned workers."""

    def __init__(self, ranks: int):
        torch, dist = _torch()
        if dist.is_initialized():
            raise _error("a torch.distributed process group already exists in this process: run every rank "
                         "with the same script (SPMD) instead of spawning workers, or destroy it first")
        self.ranks = ranks
        store = dist.TCPStore("127.0.0.1", 0, ranks, True, timeout=datetime.timedelta(seconds=_TIMEOUT_S),
                              wait_for_workers=False)  # the port is picked by the OS: no race for a free port
        # workers are fresh interpreters running fast.distributed._worker_main (a plain subprocess rather
        # than multiprocessing's spawn, which would re-run the caller's __main__ in every worker)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get(
            "PYTHONPATH", "").split(os.pathsep) if p]), GLM_EP_WORKER="1")
        env.pop("GLM_EP", None)
        self.procs = [subprocess.Popen(
            [sys.executable, "-c", "import sys; from fast.distributed import _worker_main; "
             "_worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))",
             str(r), str(ranks), str(store.port), str(_TIMEOUT_S)], env=env, stdin=subprocess.DEVNULL)
            for r in range(1, ranks)]
        dist.init_process_group("gloo", store=store, rank=0, world_size=ranks,
                                timeout=datetime.timedelta(seconds=_TIMEOUT_S))
        self.store = store
        self.group = _Group(torch, dist, None, 0, ranks)
        self.alive = True
        global _GENERATION
        _GENERATION += 1
        self.generation = _GENERATION
        self.next_id = 1
        self.pending: list = []

    def queue(self, op) -> None:
        self.pending.append(op)

    def send(self, cmd) -> None:
        if not self.alive:
            raise RuntimeError("the expert-parallel rank group is shut down")
        ops, self.pending = self.pending, []
        dead = [f"rank {r} (exit code {p.returncode})" for r, p in enumerate(self.procs, 1) if p.poll() is not None]
        if dead:
            self.alive = False
            raise RuntimeError(f"expert parallelism: worker process(es) {dead} died; the rank group is unusable")
        self.group.dist.broadcast_object_list([(ops, cmd)], src=0)

    def shutdown(self) -> None:
        if not self.alive:
            return
        try:
            self.send(("exit",))
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass
        self.alive = False
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        try:
            self.group.dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


_CLUSTER: _Cluster | None = None
_GENERATION = 0


def _cluster(ranks: int) -> _Cluster:
    global _CLUSTER
    if _CLUSTER is not None and _CLUSTER.alive and _CLUSTER.ranks == ranks:
        return _CLUSTER
    shutdown()
    _CLUSTER = _Cluster(ranks)
    return _CLUSTER


def shutdown() -> None:
    """Stop the driver's worker processes and destroy its process group (engines on it become unusable)."""
    global _CLUSTER
    if _CLUSTER is not None:
        _CLUSTER.shutdown()
        _CLUSTER = None


atexit.register(shutdown)


def _worker_main(rank: int, ranks: int, port: int, timeout_s: float) -> None:
    """A worker rank of driver mode: replays rank 0's engine calls on its own executors."""
    torch, dist = _torch()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, ranks, False, timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=timeout_s))
    group = _Group(torch, dist, None, rank, ranks)
    engines: dict[int, object] = {}  # rank 0's engine id -> this rank's engine
    desync: list[str] = []
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        ops, cmd = box[0]
        for eid, name, args, want in ops:  # queued sequence operations, in rank 0's order
            if name == "__drop__":  # rank 0's engine was garbage-collected
                engines.pop(eid, None)
                continue
            eng = engines.get(eid)
            if eng is None:
                continue
            got = getattr(eng._core.local, name)(*args)
            if want is not None and got != want:
                desync.append(f"rank {rank}: {name} gave {got}, rank 0 {want}")
        op = cmd[0]
        if op == "exit":
            break
        if op == "load":
            _, eid, path, kwargs = cmd
            status = None
            try:
                cls = engine_class(kwargs.get("device", "cpu"))
                engines[eid] = cls(path, _ep_member=(rank, ranks, group), **kwargs)
            except Exception as e:  # noqa: BLE001 - reported to rank 0
                status = f"{type(e).__name__}: {e}"
            if any(s is not None for s in group.gather(status)):  # rank 0 raises; nobody keeps it
                engines.pop(eid, None)
        elif op == "drop":
            engines.pop(cmd[1], None)
        elif op == "step":
            _, eid, args, verify = cmd
            core = engines[eid]._core
            try:
                core.run_step(args, verify)
            except Exception:  # noqa: BLE001 - rank 0 computes the same step and raises the same error
                pass
        elif op == "greedy":
            try:
                engines[cmd[1]]._core.local.greedy(*cmd[2])
            except Exception:  # noqa: BLE001 - rank 0 runs the same loop and raises the same error
                pass
        elif op == "stats":
            group.gather(engines[cmd[1]]._core.stats() | {"desync": list(desync)})
        elif op == "reset_stats":
            engines[cmd[1]]._core.reset_stats()
        elif op == "info":
            group.gather(engines[cmd[1]]._ep_local_info())
    engines.clear()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ engine setup

@dataclass
class EPSetup:
    """How one engine takes part in expert parallelism (fast.Engine(..., ranks=, expert_ranges=, ...))."""

    ranks: int
    ranges: list[tuple[int, int]] | None
    memory_limit: int | None
    verify: bool
    member: tuple | None = None  # (rank, ranks, group) for a worker of driver mode
    mode: str = "single"  # "single" (one rank), "driver", "spmd", "worker"
    rank: int = 0
    plans: list[MemoryPlan] = field(default_factory=list)
    group: _Group | None = None
    cluster: _Cluster | None = None
    eid: int = 0

    @classmethod
    def resolve(cls, ranks, expert_ranges, memory_limit, verify, member) -> "EPSetup":
        if member is not None:
            return cls(member[1], expert_ranges, memory_limit, verify, member, "worker", member[0])
        if ranks is None:
            ranks = len(expert_ranges) if expert_ranges is not None else (launched() or 1)
        if not is_int(ranks) or ranks < 1:
            raise _error(f"ranks must be an int >= 1, got {ranks!r}")
        if memory_limit is not None and (not is_int(memory_limit) or memory_limit < 1):
            raise _error(f"memory_limit must be a number of bytes >= 1, got {memory_limit!r}")
        st = cls(int(ranks), expert_ranges, memory_limit, bool(verify))
        if st.ranks > 1:
            _torch()  # a clear ImportError now, before anything is read or spawned
            env_rank = _env_rank(st.ranks)
            import torch.distributed as dist
            driver_group = _CLUSTER is not None and _CLUSTER.alive
            if env_rank is not None or (dist.is_initialized() and not driver_group):
                st.mode = "spmd"
                st.rank = env_rank if env_rank is not None else dist.get_rank()
            else:
                st.mode = "driver"
        return st

    def default_threads(self) -> int:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.ranks)) if self.mode == "spmd" else self.ranks
        return max(1, cores // max(1, local))

    def plan(self, ck, context: int, threads: int = 1, device: str = "cpu") -> None:
        """Validate the ranges, compute every rank's memory plan, print it (rank 0), refuse what cannot fit."""
        E = ck.config.n_routed_experts
        self.ranges = (even_ranges(E, self.ranks) if self.ranges is None
                       else check_ranges(self.ranges, E, self.ranks))
        self.plans = memory_plans(ck, self.ranges, context=context, limit=self.memory_limit, threads=threads)
        if self.rank == 0 and os.environ.get("GLM_EP_QUIET", "") in ("", "0"):
            print(format_plans(self.plans, device), file=sys.stderr, flush=True)
        over = [p for p in self.plans if not p.fits]
        if over:
            p = over[0]
            raise _error(
                f"memory plan: rank {p.rank} (experts [{p.experts[0]}, {p.experts[1]})) needs {p.total} bytes "
                f"({_mib(p.total)}: weights {p.weights} = replicated {p.replicated} + derived {p.derived} + own "
                f"experts {p.own_experts}; caches {p.caches} for {p.sequences} x {p.context} positions; workspace "
                f"{p.workspace} for {p.rows} rows), more than memory_limit={p.limit} bytes ({_mib(p.limit)}). "
                f"Nothing was allocated. Use more ranks, other expert_ranges, or a smaller max_context.")

    @property
    def bounds(self) -> list[int]:
        return [a for a, _ in self.ranges] + [self.ranges[-1][1]]

    def owns(self, entry) -> bool:
        a, b = self.ranges[self.rank]
        return entry.expert is None or a <= entry.expert < b

    def build(self, make_local, path, kwargs: dict):
        """Connect the ranks, build this rank's executor with make_local(), wrap it. Every rank reports
        whether its load succeeded before any step (a failed rank never leaves the others waiting)."""
        if self.mode == "single":
            return _MemberCore(make_local(), None, False)
        if self.mode == "worker":
            self.group = self.member[2]
            return _MemberCore(make_local(), self.group, self.verify)
        if self.mode == "spmd":
            self.group = _spmd_group(self.ranks)
            if self.group.rank != self.rank:
                raise _error(f"RANK={self.rank} but the process group says rank {self.group.rank}")
        else:
            self.cluster = _cluster(self.ranks)
            self.group = self.cluster.group
            self.eid = self.cluster.next_id
            self.cluster.next_id += 1
            self.cluster.send(("load", self.eid, path, kwargs))
        local = err = None
        try:
            local = make_local()
        except Exception as e:  # noqa: BLE001 - every rank must report before anyone raises
            err = e
        statuses = self.group.gather(None if err is None else f"{type(err).__name__}: {err}")
        if err is not None:
            raise err
        bad = [(r, s) for r, s in enumerate(statuses) if s is not None]
        if bad:
            r, s = bad[0]
            raise _error(f"expert parallelism: rank {r} could not load its share: {s}")
        if self.mode == "driver":
            core = _DriverCore(local, self.cluster, self.eid, self.verify)
            cl, eid = self.cluster, self.eid
            weakref.finalize(core, lambda: cl.alive and cl.queue((eid, "__drop__", (), None)))
            return core
        return _MemberCore(local, self.group, self.verify)
