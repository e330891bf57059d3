"""fast.cuda.CudaEngine: the exact CUDA engine, with exactly the API of fast.Engine (fast/engine.py).

    eng = CudaEngine("golden/tiny-fp8")          # or fast.Engine(path, device="cuda") where hooked up
    cache = eng.new_cache()
    logits = eng.forward(ids, cache, capture)     # the same signatures and semantics as fast.Engine
    outs = eng.generate([[1, 2, 3], [4, 5]], 8)   # greedy, continuous batching

It is fast.Engine over another core: fast._cuda._Engine has the CPU core's interface (add_tensor,
finalize, sequences, one `step` call per forward step for the whole batch), so validation, captures
(oracle.capture.Capture), fault injection and batching are the same Python code. The weights are
uploaded to the GPU once, in their release format; every sequence's state lives on the GPU.

Extras: `set_timing(True)` + `stage_times()` (device time per module, for tools/bench_cuda.py),
`device_name`, `decode_path`, `weight_bytes`.

The environment variable GLM_CUDA_EMU=1 selects fast._cuda_emu, the CPU emulation build of the same
kernels (bindings/cuda/emu; development without a GPU, very slow).
"""
from __future__ import annotations

import importlib
import os

from . import core as _C
from .core import EngineInputError
from .engine import Engine

__all__ = ["CudaEngine", "cuda_module", "cuda_available"]


def cuda_module():
    """fast._cuda (or fast._cuda_emu with GLM_CUDA_EMU=1); ImportError when not built."""
    name = "fast._cuda_emu" if os.environ.get("GLM_CUDA_EMU", "") not in ("", "0") else "fast._cuda"
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"{name} is not built: build with a GPU present or GLM_FORCE_CUDA=ON "
                          f"(docs/engine_cuda.md) ({e})") from e


def cuda_available() -> bool:
    """True when the CUDA extension imports and a device answers."""
    try:
        cu = cuda_module()
        return bool(cu.decode_table("e8m0").size == 256)
    except Exception:  # noqa: BLE001 - any failure means: not available
        return False


def _emulated(cu) -> bool:
    return bool(getattr(cu, "EMULATED", False))


def _use_rank_device(cu, ep) -> None:
    """One GPU per rank of expert parallelism: LOCAL_RANK under a launcher, else the rank (driver mode
    starts its ranks on this host). torch (NCCL) is pointed at the same device."""
    if ep.ranks <= 1 or _emulated(cu):
        return
    local = int(os.environ.get("LOCAL_RANK", ep.rank)) if ep.mode == "spmd" else ep.rank
    n = cu.device_count()
    if local >= n:
        raise EngineInputError(f"expert parallelism: rank {ep.rank} needs GPU {local} of this host, which has {n}")
    cu.set_device(local)
    import torch
    torch.cuda.set_device(local)


# The CUDA engine's runtime knobs (bindings/cuda/engine_api.hpp, EngineOptions; none changes a bit of any
# result) take their defaults from these environment variables, read here only: tools/gpu_check.sh's A/B
# runs (AB="GLM_PDL=0 ...") set them for whole processes. cuda_options= overrides them per engine.
_ENV_OPTIONS = {
    "GLM_PDL": ("pdl", lambda v: v != "0"),
    "GLM_CUDA_TUNE": ("tune", lambda v: v != "0"),
    "GLM_STREAM_EARLY": ("stream_early", lambda v: v == "1"),
    "GLM_HC_FUSE": ("hc_fuse", lambda v: v != "0"),
    "GLM_EXPERT_TILE": ("expert_tile", lambda v: int(v) if v in ("1", "4", "8", "16", "64") else 0),
    "GLM_LANES_ITEMS": ("lanes_items", lambda v: int(v) if v.strip().isdigit() else v),  # (else refused, named)
    "GLM_ITEMS16": ("items16", lambda v: int(v) if v.strip().isdigit() else v),
    "GLM_LANES_TN": ("lanes_tn", lambda v: int(v) if v.strip().isdigit() else v),
    "GLM_PINNED_LOGITS": ("pinned_logits", lambda v: v != "0"),
    "GLM_GEMM": ("gemm", lambda v: v != "0"),
    "GLM_LANES": ("lanes", lambda v: v != "0"),
    "GLM_IDX_TILED": ("idx_tiled", lambda v: v != "0"),
    "GLM_ATTN_TILED": ("attn_tiled", lambda v: v != "0"),
    "GLM_HEAD_BOUND": ("head_bound", lambda v: v != "0"),
    "GLM_PAIRS": ("pairs", lambda v: v != "0"),
}


def _cuda_options(given) -> dict:
    opts = {name: conv(os.environ[var]) for var, (name, conv) in _ENV_OPTIONS.items() if var in os.environ}
    if given is not None:
        if not isinstance(given, dict):
            raise EngineInputError(f"cuda_options must be a dict, got {type(given).__name__}")
        opts.update(given)
    return opts


class CudaEngine(Engine):
    """The exact CUDA engine over one checkpoint (fast.Engine's API; weights resident on the GPU)."""

    device = "cuda"

    def __init__(self, path, device: str = "cuda", threads: int | None = None, *, dot: str = "canonical",
                 expf: str = "canonical", inject=None, max_context: int | None = None,
                 parallel_work: int | None = None, ranks: int | None = None, expert_ranges=None,
                 memory_limit: int | None = None, verify_ranks: bool = False, cuda_options: dict | None = None,
                 _ep_member=None):
        # threads and parallel_work are accepted for fast.Engine's API; the GPU work split is the grid's
        if device not in ("cuda", "cuda:0", "gpu"):
            raise EngineInputError(f"device {device!r}: this engine runs on 'cuda'")
        if threads is None:
            threads = 1
        _C.check_switches(threads, dot, expf, parallel_work)
        cu = cuda_module()
        self.cuda = cu
        # expert parallelism (docs/ep.md, "GPU"): one GPU per rank, the routed experts split over ranks
        ep = self._expert_parallelism(ranks, expert_ranges, memory_limit, verify_ranks, _ep_member)
        if ep is not None:
            _use_rank_device(cu, ep)
            if ep.memory_limit is None:  # the device's memory (the emulation: no limit)
                ep.memory_limit = None if _emulated(cu) else int(cu.device_memory()[1])
        cuda_opts = _cuda_options(cuda_options)
        self._open(cu, path, ep, max_context, {"dot": dot, "expf": expf, "threads": int(threads), "device": "cuda"},
                   1, {"device": "cuda"})
        cfg, limit = self.config, self.max_context

        def new_core():
            try:
                return cu._Engine(_C.engine_config(cfg, min(limit, (1 << 30) - 1)), int(threads), dot, expf, cuda_opts)
            except RuntimeError as e:
                raise EngineInputError(f"device 'cuda': {e}") from None
            except ValueError as e:
                raise EngineInputError(str(e)) from None

        executor = _C.build_core(self, ep, new_core, {"device": "cuda", "threads": int(threads), "dot": dot,
                                                       "expf": expf, "max_context": limit,
                                                       "parallel_work": parallel_work, "cuda_options": cuda_opts})
        core_opts = getattr(executor, "options", None)  # (every knob with its value; driver mode: as given)
        self.options["cuda"] = dict(core_opts) if isinstance(core_opts, dict) else dict(cuda_opts)
        self._attach(executor, inject)

    # ---------------------------------------------------------------- extras
    @property
    def device_name(self) -> str:
        return str(self._core.device_name)

    @property
    def decode_path(self) -> str:
        """How E4M3 codes are decoded on this device (hardware conversion, or software)."""
        return str(self._core.decode_path)

    @property
    def weight_bytes(self) -> int:
        """Streamed bytes of the weights one decode token reads (active experts only)."""
        return int(self._core.weight_bytes)

    def decode_weight_bytes(self, position: int) -> int:
        """Bytes of the weights a one-token decode step at `position` reads: `weight_bytes` less the
        indexer's query projection while the query selects every position it sees (position + 1 <=
        index_topk), where the engine does not make the query."""
        return int(self._core.decode_weight_bytes(int(position)))

    @property
    def device_bytes(self) -> int:
        return int(self._core.device_bytes)

    def available_memory(self) -> int:
        """Bytes free on the device (cudaMemGetInfo) and those of freed sequences' buffers the engine keeps
        for new ones: what sequences' state can still take."""
        # (builds before session 33 keep none: the A/B harness runs them with this module)
        return int(self.cuda.device_memory()[0]) + int(getattr(self._core, "pooled_bytes", 0))

    def _memory_where(self) -> str:
        return self.device_name

    def greedy(self, cache, first_token: int, n: int) -> list[int]:
        """n greedy decode steps of `cache` on the device, the first fed `first_token` (the token the
        cache's last logits chose), each next one the argmax of the previous step's logits (np.argmax's
        rule), without a host round trip between steps. Returns the n tokens produced; the same tokens
        as n decode() calls with a host argmax."""
        cache = self._check_cache(cache)
        if self._inject_core is not None:
            raise EngineInputError("greedy: not with an injection set (decode() runs it)")
        if not _C.is_int(n) or n < 1:
            raise EngineInputError(f"n must be an int >= 1, got {n!r}")
        first = self._check_ids([first_token], cache.length)
        if cache.length + n > self.max_context:  # (the n steps feed n positions)
            raise EngineInputError(f"{cache.length + n} positions exceed the maximum context of {self.max_context}")
        return [int(v) for v in self._core.greedy(cache._id, int(first[0]), int(n))]

    def _greedy_tail(self, cache, first_token: int, n: int):
        if self._inject_core is not None or os.environ.get("GLM_DEVICE_GREEDY", "1") == "0":
            return None  # (injections run through decode(); GLM_DEVICE_GREEDY=0: the host loop, for A/B)
        return self.greedy(cache, first_token, n)

    def set_timing(self, on: bool = True) -> None:
        """Bracket each module's kernels with device events (stage_times sums them per module)."""
        self._core.set_timing(bool(on))

    def set_exchange_timing(self, on: bool = True) -> None:
        """Expert parallelism: bracket this rank's collectives with device events (ep_stats()'s
        collective_device_seconds sums them)."""
        exchange = getattr(self._core, "exchange", None)  # (a _DeviceExchange with ranks > 1)
        if exchange is not None:
            exchange.timing = bool(on)

    def head_bound_stats(self) -> dict[str, int]:
        """The bounded head (docs/engine_cuda.md, "The bounded head") since the last reset: greedy rows
        it chose, their candidates (rows whose exact logit was computed), the most of one row, and the
        steps the full head decided instead."""
        return dict(self._core.head_bound_stats())

    def reset_head_bound_stats(self) -> None:
        self._core.reset_head_bound_stats()

    def stage_times(self) -> dict[str, float]:
        """Device milliseconds per module since the last reset_stage_times()."""
        return dict(self._core.stage_times())

    def reset_stage_times(self) -> None:
        self._core.reset_stage_times()
