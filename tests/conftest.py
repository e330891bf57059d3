"""Shared test configuration: hypothesis profile, paths to the bundled checkpoints."""
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
