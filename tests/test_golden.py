"""Golden hashes (docs/contract.md §8): the committed outputs of the tiny zoo are reproduced by the oracle."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tools import golden
from tools.cli import main


def test_golden_check_passes_from_the_committed_files(monkeypatch, golden_dir):
    monkeypatch.setenv("GLM_GOLDEN", str(golden_dir))
    assert main(["golden", "check"]) == 0


def test_golden_hashes_are_hashes_of_the_stored_tokens(golden_dir):
    for key, case in json.loads((golden_dir / "hashes.json").read_text())["cases"].items():
        assert golden.hash12(np.array(case["tokens"]), "<i4") == case["output"], key


def test_golden_check_fails_on_a_changed_hash(monkeypatch, tmp_path, golden_dir):
    copy = tmp_path / "golden"
    shutil.copytree(golden_dir, copy)
    doc = json.loads((copy / "hashes.json").read_text())
    doc["cases"]["tiny-fp8/short"]["logits"] = "000000000000"
    (copy / "hashes.json").write_text(json.dumps(doc))
    monkeypatch.setenv("GLM_GOLDEN", str(copy))
    assert main(["golden", "check"]) == 1


def test_cpu_engine_reproduces_the_golden_hashes(monkeypatch, golden_dir):
    pytest.importorskip("fast._core")
    monkeypatch.setenv("GLM_GOLDEN", str(golden_dir))
    assert main(["golden", "check", "--engine", "cpu"]) == 0


def test_run_prints_tokens_hashes_and_text(capsys, golden_dir):
    assert main(["run", "--checkpoint", str(golden_dir / "tiny-bf16"), "--prompt", "hello world",
                 "--max-new", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["tokens"]) == 4 and len(out["output_hash"]) == 12 and isinstance(out["text"], str)
    assert out["output_hash"] == golden.hash12(np.array(out["tokens"]), "<i4")
