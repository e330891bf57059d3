"""The README's first command ends with `oracle demo`: it must run and find the engines identical."""
from __future__ import annotations

import pytest

from tools.cli import main


def test_demo_runs_and_the_engines_agree(monkeypatch, capsys, golden_dir):
    pytest.importorskip("fast._core")
    monkeypatch.setenv("GLM_GOLDEN", str(golden_dir))
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "bit-identical" in out and "cpu" in out and "oracle" in out
