"""Shared test configuration: hypothesis profile, paths to the bundled and generated checkpoints, and the
engines, oracle models and reference runs every engine test shares (made once per test process)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "golden"

settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN


@pytest.fixture(scope="session")
def small_zoo(tmp_path_factory) -> Path:
    """The `small` zoo checkpoint in every release (small-bf16, small-fp8, small-mxfp4), made once per
    test process (~30 s) and shared by every module that needs it."""
    from tools.zoo import make_zoo
    root = tmp_path_factory.mktemp("zoo")
    make_zoo("small", root)
    return root


@pytest.fixture(scope="session")
def ckpt_path(golden_dir, request):
    """name -> path: tiny-* from golden/, small-* from the generated zoo (made on first use)."""
    def get(name: str) -> str:
        if name.startswith("tiny"):
            return str(golden_dir / name)
        return str(request.getfixturevalue("small_zoo") / name)
    return get


def _cached(make):
    """make(key, **options), made once per (key, options)."""
    cache = {}

    def get(name, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make(name, **kw)
        return cache[key]
    return get


@pytest.fixture(scope="session")
def engines(ckpt_path):
    """(name, **options) -> the CPU engine (fast.Engine), two threads splitting every job
    (parallel_work=0), even on these small models."""
    from tests.engine_checks import make_engine
    return _cached(lambda name, **kw: make_engine("cpu", ckpt_path(name), **kw))


@pytest.fixture(scope="session")
def one_thread_engines(golden_dir):
    """name -> a one-thread CPU engine over golden/NAME (for modules whose runs are many and short)."""
    import fast
    return _cached(lambda name: fast.Engine(str(golden_dir / name), threads=1))


@pytest.fixture(scope="session")
def cuda_engines(ckpt_path):
    """(name, **options) -> the CUDA engine (fast.cuda.CudaEngine; for tests that skip without it)."""
    from tests.engine_checks import make_engine
    return _cached(lambda name, **kw: make_engine("cuda", ckpt_path(name), **kw))


@pytest.fixture(scope="session")
def models(ckpt_path):
    """name -> the oracle's model."""
    import oracle
    return _cached(lambda name: oracle.load(ckpt_path(name)))


@pytest.fixture(scope="session")
def oracle_runs(models):
    """case -> (ids, tokens, logits, capture) of the oracle's greedy generate, every stage captured."""
    from tests.engine_checks import greedy_case
    return _cached(lambda case: greedy_case(models(case[0]), case))


@pytest.fixture(scope="session")
def cpu_runs(engines):
    """case -> (ids, tokens, logits, capture) of the CPU engine's greedy generate, every stage captured:
    the reference of every side but the CPU engine's own (tests/test_engines.py holds it to the oracle)."""
    from tests.engine_checks import greedy_case
    return _cached(lambda case: greedy_case(engines(case[0]), case))
