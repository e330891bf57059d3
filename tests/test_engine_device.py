"""fast.Engine(path, device=...) picks the engine: the CPU one, or the CUDA one where it is built."""
from __future__ import annotations

import pytest

fast = pytest.importorskip("fast")


def test_cpu_is_the_default(golden_dir):
    from fast.engine import Engine
    assert type(fast.Engine(golden_dir / "tiny-bf16")) is Engine


def test_cuda_device_gives_the_cuda_engine_or_a_clear_error(golden_dir):
    from fast.cuda import CudaEngine, cuda_available
    if cuda_available():
        assert isinstance(fast.Engine(golden_dir / "tiny-bf16", device="cuda"), CudaEngine)
    else:
        with pytest.raises(ImportError, match="fast._cuda"):
            fast.Engine(golden_dir / "tiny-bf16", device="cuda")


def test_unknown_device_is_refused(golden_dir):
    with pytest.raises(ValueError, match="device"):
        fast.Engine(golden_dir / "tiny-bf16", device="tpu")
