"""Memory per sequence (docs/contract.md §5 memory; fast.core.state_bytes): computed by part, held
exactly by both engines once reserved, checked before a sequence is admitted or grows, refused with a
message naming what it needs. The bits do not depend on reservation."""
from __future__ import annotations

import numpy as np
import pytest

from fast.core import EngineInputError, EngineMemoryError, state_bytes

PROMPT = [int(v) for v in (np.arange(37) * 7 + 3) % 200]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(request, engines, cuda_engines):
    if request.param == "cpu":
        return engines("tiny-fp8")
    from fast.cuda import cuda_available
    if not cuda_available():
        pytest.skip("no CUDA engine (fast._cuda not built or no device)")
    return cuda_engines("tiny-fp8")


@pytest.mark.parametrize("length", [0, 1, 3, 4, 5, 63, 64, 65, 200])
def test_reserved_state_is_what_state_bytes_says(engine, length):
    """The engine's buffers after reserve(n) are exactly state_bytes(n): the formula is the engines'."""
    c = engine.new_cache()
    try:
        c.reserve(length)
        parts = engine.sequence_memory(length)
        assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
        assert c.nbytes == parts["total"]
    finally:
        c.close()


def test_parts_scale_with_length(engine):
    cfg = engine.config
    a, b = state_bytes(cfg, 1000), state_bytes(cfg, 2000)
    assert a["kda.S"] == b["kda.S"] > 0 and a["kda.conv_tail"] == b["kda.conv_tail"] > 0
    assert 2 * a["mla.c"] == b["mla.c"] > 0 and 2 * a["indexer.k"] == b["indexer.k"] > 0
    assert b["indexer.pool_keys"] == (2000 // cfg.index_kpool) * cfg.index_head_dim * 4 * \
        sum(1 for l in range(cfg.num_hidden_layers) if not cfg.is_kda(l) and cfg.has_indexer(l))


def test_no_growth_below_the_reservation_and_same_bits(engine):
    plain, reserved = engine.new_cache(), engine.new_cache().reserve(80)
    try:
        held = reserved.nbytes
        a = engine.forward(PROMPT, plain)
        b = engine.forward(PROMPT, reserved)
        assert reserved.nbytes == held
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
        a = engine.forward(PROMPT[:5], plain)
        b = engine.forward(PROMPT[:5], reserved)
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    finally:
        plain.close()
        reserved.close()


def test_refused_when_it_does_not_fit(engine, monkeypatch):
    monkeypatch.setattr(engine, "available_memory", lambda: 4096)
    c = engine.new_cache()
    try:
        with pytest.raises(EngineMemoryError, match=r"needs .* of state \(.*mla\.c .*indexer\.pool_keys .*\).* left on"):
            c.reserve(5000)
        assert c.length == 0
        # growing in a step past what was checked is refused before the step runs, the cache untouched
        with pytest.raises(EngineMemoryError):
            engine.forward(PROMPT * 4, c)
        assert c.length == 0
        with pytest.raises(EngineMemoryError):
            engine.generate([PROMPT], 4000)
    finally:
        c.close()


def test_reserve_arguments(engine):
    c = engine.new_cache()
    try:
        for bad in (-1, engine.max_context + 1, 2.5, "10"):
            with pytest.raises(EngineInputError, match="reserve: positions"):
                c.reserve(bad)
    finally:
        c.close()
    with pytest.raises(EngineInputError, match="closed"):
        c.reserve(10)


def test_max_context_accepted_where_memory_allows(engine):
    """The checkpoint's whole context reserved at once when it fits (tiny: ~0.5 GiB)."""
    n = engine.max_context
    need = engine.sequence_bytes(n)
    if need > engine.available_memory() // 2:
        pytest.skip(f"{need} bytes for {n} positions: more than half the memory left here")
    c = engine.new_cache().reserve(n)
    try:
        assert c.nbytes == need
    finally:
        c.close()
