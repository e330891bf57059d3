"""A sequence's state exported (fast.Cache.export) and imported (fast.Engine.import_cache): the
imported sequence continues with the bits of the original (prefill chunks, then decode), its export
equals the original's, the CPU and CUDA engines export the same bits for the same tokens and take
each other's exports, and a bad import is refused with the tensor named (bindings/state_io.hpp's
layout, docs/engine_cpu.md "Exporting a sequence's state").

Lengths sit around tiny's index_kpool (4) and the server's blocks: 1, 3, 4, 5, 17, 40.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fast._core")

import fast
from fast.core import EngineInputError
from tests.cases import TINY
from tests.engine_checks import (
    EMU_SLOW,
    NO_CUDA,
    NO_GLOO,
    cuda_state,
    have_gloo,
    prompt,
)

LENGTHS = (1, 3, 4, 5, 17, 40)
CONTINUE = 9   # prompt tokens after the export (chunks of 4), then 3 decode tokens


@pytest.fixture(scope="module")
def cpu_engines(one_thread_engines):
    return one_thread_engines


def _u32(arrays: dict) -> dict:
    return {k: (np.ascontiguousarray(v).view(np.uint32) if v.dtype == np.float32 else v).tolist()
            for k, v in arrays.items()}


def _continue(eng, cache, ids) -> np.ndarray:
    """Prefill `ids` in chunks of 4, then three greedy decode tokens -> every logits row's bits."""
    rows = [eng.prefill(ids, cache, chunk=4)]
    for _ in range(3):
        rows.append(eng.decode([cache], [int(np.argmax(rows[-1][-1]))]))
    return np.concatenate(rows).view(np.uint32)


def _check_round_trip(eng, model_seed: int, n: int, other=None) -> dict:
    """Export after n positions (prefilled in chunks of 3), import (into `other`, default eng), continue
    both: the same bits, and the imported export equals the original one. Returns the export."""
    V = eng.config.vocab_size
    ids = prompt(V, n + CONTINUE, model_seed + n)
    cache = eng.new_cache()
    eng.prefill(ids[:n], cache, chunk=3)
    exported = cache.export()
    assert int(exported["length"]) == n
    target = eng if other is None else other
    twin = target.import_cache(exported)
    assert twin.length == n
    assert _u32(twin.export()) == _u32(exported), n
    got, want = _continue(target, twin, ids[n:]), _continue(eng, cache, ids[n:])
    assert np.array_equal(got, want), n
    # and the continuation is a cold run's (one chunk over the whole prompt, then the same decode)
    cold = eng.new_cache()
    first = eng.prefill(ids, cold)[n:]
    assert np.array_equal(first.view(np.uint32), want[:CONTINUE]), n
    for c in (cache, twin, cold):
        c.close()
    return exported


@pytest.mark.parametrize("model", TINY)
def test_an_imported_sequence_continues_with_the_bits_of_the_original(cpu_engines, model):
    eng = cpu_engines(model)
    for n in LENGTHS:
        _check_round_trip(eng, 11, n)


def test_the_layout_and_its_names(cpu_engines):
    eng = cpu_engines("tiny-fp8")
    c = eng.config
    cache = eng.new_cache()
    eng.prefill(prompt(c.vocab_size, 9, 1), cache)
    ex = cache.export()
    want = {"length": ()}
    P, H, d = c.linear_num_heads * c.linear_head_dim, c.linear_num_heads, c.linear_head_dim
    for layer in range(c.num_hidden_layers):
        pre = f"layers.{layer}."
        if c.is_kda(layer):
            want[pre + "kda.conv_tail"] = (c.linear_conv_kernel_dim - 1, 3 * P)
            want[pre + "kda.S"] = (H, d, d)
        else:
            want[pre + "mla.c"] = (9, c.kv_lora_rank)
            if c.has_indexer(layer):
                for part in ("k", "gate"):
                    want[pre + f"indexer.{part}"] = (9, c.index_head_dim)
                want[pre + "indexer.pool_keys"] = (9 // c.index_kpool, c.index_head_dim)
    assert {k: v.shape for k, v in ex.items()} == want
    assert all(v.dtype == np.float32 for k, v in ex.items() if k != "length")
    # the state is not all zeros (the export reads the sequence, not a fresh one)
    assert all(np.any(v != 0) for k, v in ex.items() if k.endswith((".S", ".mla.c", ".pool_keys")))
    cache.close()


def test_an_empty_sequence_round_trips(cpu_engines):
    eng = cpu_engines("tiny-bf16")
    cache = eng.new_cache()
    ex = cache.export()
    assert int(ex["length"]) == 0
    twin = eng.import_cache(ex)
    ids = prompt(eng.config.vocab_size, 6, 2)
    assert np.array_equal(_continue(eng, twin, ids), _continue(eng, cache, ids))


def _bad_cases(ex: dict):
    """(what, arrays, the message it must raise)."""
    c_name = next(k for k in ex if k.endswith(".mla.c"))
    s_name = next(k for k in ex if k.endswith(".kda.S"))
    pk_name = next(k for k in ex if k.endswith(".pool_keys"))
    yield "missing", {k: v for k, v in ex.items() if k != s_name}, f"'{s_name}' is missing"
    yield "extra", dict(ex, **{"layers.0.mla.c": ex[c_name]}), "unexpected state tensor 'layers.0.mla.c'"
    yield "shape", dict(ex, **{s_name: ex[s_name][:, :-1]}), f"'{s_name}' has shape"
    yield "dtype", dict(ex, **{c_name: ex[c_name].astype(np.float64)}), f"'{c_name}' has dtype float64"
    yield "not an array", dict(ex, **{pk_name: ex[pk_name].tolist()}), f"'{pk_name}' is not a numpy array"
    yield "length", dict(ex, length=np.array(int(ex["length"]) + 1)), f"'{c_name}' has shape"
    yield "no length", {k: v for k, v in ex.items() if k != "length"}, "'length' is missing"
    yield "negative length", dict(ex, length=np.array(-1)), "length -1"
    yield "float length", dict(ex, length=np.array(3.0)), "'length' must be one integer"
    yield "not a dict", list(ex.items()), "expected a dict"


def test_bad_imports_are_refused_with_the_tensor_named(cpu_engines):
    eng = cpu_engines("tiny-fp8")
    cache = eng.new_cache()
    ids = prompt(eng.config.vocab_size, 14, 3)
    eng.prefill(ids[:9], cache)
    ex = cache.export()
    live = eng._core.live_sequences
    for what, arrays, msg in _bad_cases(ex):
        with pytest.raises(EngineInputError, match=msg):
            eng.import_cache(arrays)
        assert eng._core.live_sequences == live, what   # nothing half-made was left behind
    # a strided (non-contiguous) array of the right dtype and shape is taken as its values
    s_name = next(k for k in ex if k.endswith(".kda.S"))
    twin = eng.import_cache(dict(ex, **{s_name: np.asfortranarray(ex[s_name])}))
    assert _u32(twin.export()) == _u32(ex)
    assert np.array_equal(_continue(eng, twin, ids[9:]), _continue(eng, cache, ids[9:]))


# ---------------------------------------------------------------------------- the CUDA engine

AVAILABLE, EMU, _ = cuda_state()
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not AVAILABLE, reason=NO_CUDA)]


@pytest.fixture(scope="module")
def cuda_engines(golden_dir):
    from fast.cuda import CudaEngine
    made = {}

    def get(model):
        if model not in made:
            made[model] = CudaEngine(str(golden_dir / model))
        return made[model]
    yield get
    for e in made.values():
        e.close()


@pytest.mark.parametrize("model", [pytest.param(m, marks=needs_cuda + (
    [pytest.mark.skipif(EMU, reason=EMU_SLOW)] if m != "tiny-fp8" else [])) for m in TINY])
def test_cuda_exports_the_cpu_engines_bits_and_takes_its_exports(cpu_engines, cuda_engines, model):
    cpu, gpu = cpu_engines(model), cuda_engines(model)
    for n in ((5, 17) if EMU else LENGTHS):
        on_gpu = _check_round_trip(gpu, 29, n)                   # CUDA -> CUDA
        on_cpu = _check_round_trip(cpu, 29, n, other=gpu)        # CPU export -> CUDA, continued there
        assert _u32(on_gpu) == _u32(on_cpu), n                   # the same tokens: the same state bits
        _check_round_trip(gpu, 29, n, other=cpu)                 # CUDA export -> CPU


@pytest.mark.parametrize("_", [pytest.param(0, marks=needs_cuda)])
def test_cuda_refuses_bad_imports(cuda_engines, _):
    gpu = cuda_engines("tiny-fp8")
    cache = gpu.new_cache()
    gpu.prefill(prompt(gpu.config.vocab_size, 6, 4), cache)
    ex = cache.export()
    for what, arrays, msg in _bad_cases(ex):
        with pytest.raises(EngineInputError, match=msg):
            gpu.import_cache(arrays)


# ---------------------------------------------------------------------------- expert parallelism

@pytest.mark.skipif(not have_gloo(), reason=NO_GLOO)
def test_an_import_is_replayed_on_every_rank(cpu_engines, golden_dir):
    """Driver mode: the import is queued to the worker ranks (verify_ranks compares every rank's step)."""
    eng = cpu_engines("tiny-mxfp4")
    with fast.Engine(str(golden_dir / "tiny-mxfp4"), ranks=2, threads=1, verify_ranks=True) as ep:
        _check_round_trip(eng, 41, 17, other=ep)
