"""The device-neutral core of fast/: what every engine (CPU, CUDA, a rank of expert parallelism) shares
below its API class, and the registry that finds an engine class by device.

* the input error, the option checks (switches, context limit, injection spec);
* the engine config dict (oracle/schema.py's ENGINE_CONFIG) and the stage table check (the engine
  module's table against oracle/schema.py's STAGES: names, dtypes, order);
* building an executor: a C++ core given a checkpoint's tensors (under expert parallelism, this rank's
  share), finalized;
* the extension modules, loaded by name (fast._core; the CUDA ones in fast/cuda.py);
* DEVICES: device name -> "module:class" of its engine; engine_class(device) imports it when asked,
  so fast.Engine(path, device="cuda") finds the CUDA engine without fast/engine.py importing it.

This module imports nothing else of fast/ (fast.engine, fast.cuda and fast.distributed import it).
"""
from __future__ import annotations

import importlib

import numpy as np

from oracle import names as N
from oracle import schema as S
from oracle.stages import ALL_STAGE_NAMES, HEAD, layer_stages

__all__ = ["EngineInputError", "EngineMemoryError", "DEVICES", "engine_class", "parse_inject", "engine_config",
           "is_int", "state_bytes"]


class EngineInputError(ValueError):
    """Input the engine cannot take: bad token ids, shapes, dtypes, context overflow, bad options."""


# ------------------------------------------------------------------------------------------ registry

# device -> "module:class" of the engine that runs there (fast.Engine(path, device=...) looks it up)
DEVICES = {
    "cpu": "fast.engine:Engine",
    "cuda": "fast.cuda:CudaEngine",
    "cuda:0": "fast.cuda:CudaEngine",
}


class EngineMemoryError(EngineInputError):
    """A sequence's state would not fit in the memory left (the message says how much it needs, of what)."""


# ------------------------------------------------------------------------------------------ memory

def state_bytes(config, length: int) -> dict[str, int]:
    """Bytes of one sequence's state at `length` positions, by part, as both engines hold it (f32):
    per KDA layer the conv window [K-1][3P] and the recurrent state [H][d][d] (whatever the length);
    per MLA layer the latents [length][r]; per layer with an indexer its keys and gates [length][d_i]
    each and the keys of complete pools [length // kpool][d_i]."""
    P = config.linear_num_heads * config.linear_head_dim
    H, d, K = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
    r, di, kp = config.kv_lora_rank, config.index_head_dim, max(1, config.index_kpool)
    n_kda = sum(1 for layer in range(config.num_hidden_layers) if config.is_kda(layer))
    n_mla = config.num_hidden_layers - n_kda
    n_idx = sum(1 for layer in range(config.num_hidden_layers)
                if not config.is_kda(layer) and config.has_indexer(layer))
    return {"kda.conv_tail": 4 * n_kda * (K - 1) * 3 * P, "kda.S": 4 * n_kda * H * d * d,
            "mla.c": 4 * n_mla * length * r, "indexer.k": 4 * n_idx * length * di,
            "indexer.gate": 4 * n_idx * length * di, "indexer.pool_keys": 4 * n_idx * (length // kp) * di}


def available_host_bytes() -> int:
    """Host memory a new allocation can take without swapping (/proc/meminfo's MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def engine_class(device: str):
    """The engine class for `device`; KeyError for a device no engine is registered for."""
    module, _, name = DEVICES[device].partition(":")
    return getattr(importlib.import_module(module), name)


def core_module():
    """fast._core, the C++ extension with the CPU engine (loaded by name, as the CUDA ones are)."""
    try:
        core = importlib.import_module(f"{__package__}._core")
    except ImportError as e:  # pragma: no cover - build problem
        raise ImportError("fast._core is not built: run `pip install -e .` (or `pip install .`) first") from e
    if not hasattr(core, "_Engine"):
        raise ImportError("fast._core was built without the CPU engine (register_engine missing)")
    return core


# ------------------------------------------------------------------------------------------ options

def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_switches(threads, dot, expf, parallel_work) -> None:
    """The options both engines take (threads already resolved to an int)."""
    if not is_int(threads) or not 1 <= threads <= 1024:
        raise EngineInputError(f"threads must be an int in [1, 1024] or None, got {threads!r}")
    if dot not in ("canonical", "sequential"):
        raise EngineInputError(f"dot must be 'canonical' or 'sequential', got {dot!r}")
    if expf not in ("canonical", "native"):
        raise EngineInputError(f"expf must be 'canonical' or 'native', got {expf!r}")
    if parallel_work is not None and (not is_int(parallel_work) or parallel_work < 0):
        raise EngineInputError(f"parallel_work must be an int >= 0 or None, got {parallel_work!r}")


def context_limit(cfg, max_context) -> int:
    """Positions a sequence may reach: max_context if given (checked), else the checkpoint's limit."""
    limit = int(cfg.max_position_embeddings)
    if max_context is not None:
        if not is_int(max_context) or not 1 <= max_context <= limit:
            raise EngineInputError(f"max_context must be an int in [1, {limit}], got {max_context!r}")
        limit = int(max_context)
    return limit


def engine_config(cfg, max_context: int) -> dict:
    """The config dict both C++ engines take (oracle/schema.py's ENGINE_CONFIG)."""
    return S.engine_config(cfg, max_context)


# ------------------------------------------------------------------------------------------ stages

def check_stage_table(module) -> dict[str, int]:
    """The engine module's stage table held against oracle/schema.py's (names, dtypes, order: a stale
    build of the extension disagrees) -> {stage: index}."""
    got = [tuple(s) for s in module.ENGINE_STAGES]
    want = [(s.name, s.dtype) for s in S.STAGES]
    if got != want:
        diff = [f"{i}: engine {g}, oracle {w}" for i, (g, w) in enumerate(zip(got, want)) if g != w]
        if len(got) != len(want):
            diff.append(f"engine has {len(got)} stages, oracle {len(want)}")
        raise RuntimeError(f"{module.__name__} was built from another stage table than oracle/schema.py "
                           f"(rebuild it): " + "; ".join(diff[:4]))
    return {name: i for i, (name, _) in enumerate(got)}


def stages_of_layer(config, layer: int) -> set[str]:
    L = config.num_hidden_layers
    if layer == L:
        return {s for s, _ in HEAD}
    out = {s for s, _ in layer_stages(config.is_kda(layer), config.is_moe(layer), config.has_indexer(layer))}
    if layer == 0:
        out.add("embed")
    return out


def parse_inject(spec, config) -> tuple | None:
    """An injection spec -> (layer, pos, stage, element, ulps), validated.

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
        if not is_int(v):
            raise EngineInputError(f"inject: {name} must be an int, got {v!r}")
    if not isinstance(stage, str) or stage not in ALL_STAGE_NAMES:
        raise EngineInputError(f"inject: unknown stage {stage!r}; known: {', '.join(ALL_STAGE_NAMES)}")
    L = config.num_hidden_layers
    if not 0 <= layer <= L:
        raise EngineInputError(f"inject: layer {layer} out of range [0, {L}]")
    if stage not in stages_of_layer(config, layer):
        raise EngineInputError(f"inject: stage {stage!r} does not exist at layer {layer}")
    if pos < 0:
        raise EngineInputError(f"inject: pos must be >= 0, got {pos}")
    size = S.stage_size(stage, config)
    if element < 0 or (size is not None and element >= size):
        raise EngineInputError(f"inject: element {element} out of range for {stage} (size {size})")
    # any dtype takes any int64 ulps: the step moves in value order and stops at the largest finite value
    if ulps == 0 or not -(1 << 63) <= int(ulps) < (1 << 63):
        raise EngineInputError(f"inject: ulps must be nonzero and fit int64 (docs/numerics.md, fault injection), "
                               f"got {ulps}")
    return int(layer), int(pos), stage, int(element), int(ulps)


# ------------------------------------------------------------------------------------------ building

def load_tensors(eng, core, owns=None) -> None:
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


def build_core(eng, ep, new_core, kw: dict):
    """The engine's executor: new_core() given eng.checkpoint's tensors (under expert parallelism only
    this rank's share, after its partition) and finalized; with ep, made on every rank through
    ep.build (kw: the engine's options, which driver mode's workers are started with)."""
    def make_local():
        c = new_core()
        if ep is not None:
            c.set_expert_partition(ep.rank, ep.ranks, ep.bounds)
        load_tensors(eng, c, None if ep is None else ep.owns)
        c.finalize()
        return c

    if ep is None:
        return make_local()
    kw = dict(kw, ranks=ep.ranks, expert_ranges=ep.ranges, memory_limit=ep.memory_limit, verify_ranks=ep.verify)
    return ep.build(make_local, eng.checkpoint.path, kw)
