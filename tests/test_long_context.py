"""Long context, CPU engine = CUDA engine bit for bit (issue 18): the `deep` zoo model (the real 45-layer
schedule at tiny widths) at 32,768 positions, where each query keeps 2 of up to 8,192 pools (the
selection decides almost everything), and the CUDA engine's own chunk invariance at that length.
On a GPU only (the emulation would take hours); tools/gpu_check.sh runs it."""
from __future__ import annotations

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
