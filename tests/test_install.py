"""A non-editable install carries what the README's first command needs: the `oracle` command, and the
bundled tiny checkpoints with their golden hashes (package data, tools/_golden), so `oracle demo` and
`oracle golden check` run from any directory, not only from a clone.

The README's commands install the package before the tests run (`pip install ".[test]"`), so in CI the
installed distribution is this checkout's. A machine where the package is not installed (an editable or
bare checkout) skips with that reason."""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "golden"
# what CMakeLists.txt installs as tools/_golden: the hashes and the three tiny releases
BUNDLED = [p.relative_to(GOLDEN) for p in sorted(GOLDEN.rglob("*"))
           if p.is_file() and (p.name == "hashes.json" or p.relative_to(GOLDEN).parts[0].startswith("tiny-"))]


def _installed_files() -> dict[str, Path]:
    try:
        dist = md.distribution("glm-exact")
    except md.PackageNotFoundError:
        pytest.skip("glm-exact is not installed (run the README's test command: pip install \".[test]\")")
    files = {str(f): Path(dist.locate_file(f)) for f in (dist.files or [])}
    if not any(k.startswith("tools/") for k in files):
        pytest.skip("the installed glm-exact predates the tools package (reinstall: pip install .)")
    return files


def test_bundled_files_are_listed():
    # the three releases of tiny, each with config, weights and tokenizer, plus the hashes
    names = {str(p) for p in BUNDLED}
    assert "hashes.json" in names
    for release in ("bf16", "fp8", "mxfp4"):
        for f in ("config.json", "model.safetensors", "tokenizer.json"):
            assert f"tiny-{release}/{f}" in names


def test_installed_package_carries_the_golden_folder():
    files = _installed_files()
    missing, differ = [], []
    for rel in BUNDLED:
        key = f"tools/_golden/{rel}"
        if key not in files:
            missing.append(key)
            continue
        got = hashlib.sha256(files[key].read_bytes()).hexdigest()
        want = hashlib.sha256((GOLDEN / rel).read_bytes()).hexdigest()
        if got != want:
            differ.append(key)
    assert not missing, f"not installed: {missing}"
    assert not differ, f"installed copies differ from golden/ (stale install?): {differ}"


def test_installed_command_runs_from_another_directory(tmp_path):
    _installed_files()
    exe = shutil.which("oracle")
    if exe is None:
        pytest.skip("the `oracle` console script is not on PATH")
    env = {k: v for k, v in os.environ.items() if k not in ("GLM_GOLDEN", "PYTHONPATH")}
    # the interpreter that runs the script must not see the checkout: cwd is an empty folder
    r = subprocess.run([exe, "golden", "check", "--engine", "cpu"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "golden check passed" in r.stdout + r.stderr
    # and it used the installed copy, not a checkout (there is none under tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import tools.cli as c; print(c.golden_root())"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    root = Path(probe.stdout.strip())
    assert root.name == "_golden" and ROOT not in root.parents, root
