"""Long context, CPU engine = CUDA engine bit for bit (issue 18): the `deep` zoo model (the real 45-layer
schedule at tiny widths) at 32,768 positions, where each query keeps 2 of up to 8,192 pools (the
selection decides almost everything), and the CUDA engine's own chunk invariance at that length;
`slice` (real widths: 32 index heads of 128, index_topk 2048, kpool 16) at 8,192 positions, where the
selection keeps 128 of 512 pools. On a GPU only (the emulation would take hours); tools/gpu_check.sh
runs it (the slice test with GLM_SLICE_DIR)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import fast
from fast.cuda import CudaEngine
from tests.engine_checks import EMU_SLOW, NO_CUDA, bits, cuda_state

AVAILABLE, EMU, _ = cuda_state()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not AVAILABLE, reason=NO_CUDA),
              pytest.mark.skipif(EMU, reason=EMU_SLOW)]

N = 32768


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    from tools.zoo import make_checkpoint
    return make_checkpoint("deep", "fp8", tmp_path_factory.mktemp("deep") / "deep-fp8")


def test_deep_32k_cuda_equals_cpu_and_chunking(deep):
    ids = [int(v) for v in np.random.default_rng(32).integers(0, 300, N)]
    cpu = fast.Engine(deep, device="cpu", max_context=N + 4)
    c = cpu.new_cache()
    want = cpu.prefill(ids, c, chunk=8192)
    want_next = [cpu.forward([int(np.argmax(want[-1]))], c)]
    del cpu
    cu = CudaEngine(deep, max_context=N + 4)
    outs = {}
    for chunk in (4096, 8192, None):   # (None: the whole prompt in one step)
        g = cu.new_cache()
        got = cu.prefill(ids, g, chunk=chunk)
        outs[chunk] = got
        nxt = cu.forward([int(np.argmax(got[-1]))], g)
        assert np.array_equal(bits(nxt), bits(want_next[0])), chunk
        g.close()
    for chunk, got in outs.items():
        assert got.shape == want.shape
        bad = np.flatnonzero((bits(got) != bits(want)).any(axis=1))
        assert bad.size == 0, f"chunk {chunk}: {bad.size} positions differ from the CPU engine, first {bad[:5]}"


def test_deep_mixed_long_steps_equal_separate_steps(deep):
    """One step carrying prefill chunks of two long sequences (the indexer's tiled scoring then has
    tiles of two segments, each against its own pool keys, at 20,000 and 13,000 positions) = each
    chunk in a step of its own, bit for bit."""
    rng = np.random.default_rng(5)
    a_ids, b_ids = ([int(v) for v in rng.integers(0, 300, n)] for n in (23000, 15500))
    cu = CudaEngine(deep, max_context=24000)
    a, b = cu.new_cache(), cu.new_cache()
    cu.prefill(a_ids[:20000], a, chunk=8192)
    cu.prefill(b_ids[:13000], b, chunk=8192)
    a2, b2 = a.fork(), b.fork()
    alone = [cu.step([(a2, a_ids[20000:], None, "all")])[0], cu.step([(b2, b_ids[13000:], None, "all")])[0]]
    mixed = cu.step([(a, a_ids[20000:], None, "all"), (b, b_ids[13000:], None, "all")])
    for one, two in zip(alone, mixed):
        assert np.array_equal(bits(one), bits(two))


@pytest.mark.skipif(not os.environ.get("GLM_SLICE_DIR"), reason="GLM_SLICE_DIR (a slice checkpoint) not given")
def test_slice_8k_cuda_equals_cpu():
    """slice-fp8 at 8,192 + 1 positions: the last prompt row's logits and the next decode step's, CPU
    engine (chunks of 2048) = CUDA engine (one step: its tiled indexer scoring), bit for bit."""
    from oracle.checkpoint import open_checkpoint
    ck = open_checkpoint(os.path.join(os.environ["GLM_SLICE_DIR"], "slice-fp8"), verify=False)
    n = 8192
    cu = CudaEngine(ck, max_context=n + 4)
    ids = [int(v) for v in np.random.default_rng(8).integers(0, cu.config.vocab_size, n)]
    g = cu.new_cache()
    got = cu.step([(g, ids, None, "last")])[0]
    got_next = cu.forward([int(np.argmax(got[-1]))], g)
    del cu, g
    cpu = fast.Engine(ck, device="cpu", threads=os.cpu_count(), max_context=n + 4)
    c = cpu.new_cache()
    for i in range(0, n, 2048):   # (only the last row's logits: the lm_head of 8,192 rows would dominate)
        want = cpu.step([(c, ids[i:i + 2048], None, "last" if i + 2048 >= n else None)])[0]
    assert np.array_equal(bits(got), bits(want))
    assert np.array_equal(bits(got_next), bits(cpu.forward([int(np.argmax(want[-1]))], c)))
