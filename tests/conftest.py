"""Shared test configuration: hypothesis profile, paths to the bundled and generated checkpoints."""
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
