"""What the tools print: diff, trace compare and census as a user meets them, through the CLI.

Every check runs `python -m tools ...` in a subprocess (the worktree's code), in a pipe and in a
simulated terminal of 80 and 140 columns (rich honours COLUMNS; TTY_COMPATIBLE=1 makes it treat the
pipe as a terminal). Nothing a user needs may be cut: every stage name and every full hash of the
--json report must appear whole in the text, and no line may be wider than the terminal.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "golden" / "tiny-bf16")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
from tools.term import PIPE_WIDTH  # the width a pipe is drawn at


def _cpu_built() -> bool:
    try:
        import fast._core  # noqa: F401
        return True
    except ImportError:
        return False


# The cheap side: the C++ engine when it is built (a diff of 14 positions takes ~1 s), else the oracle.
SIDE = "cpu" if _cpu_built() else "oracle"
IDS = ",".join(str(i) for i in range(1, 13))
INJECT = f"{SIDE}:inject=2,10,kda.g,4,3"       # one f32 fault that changes exactly one row (checked below)


def run(args, columns: int | None = None, timeout: int = 240):
    """(exit code, stdout, stderr) of `python -m tools ARGS`; columns: a simulated terminal that wide."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TTY_COMPATIBLE", "FORCE_COLOR")}
    if columns is not None:
        env.update(COLUMNS=str(columns), TTY_COMPATIBLE="1", NO_COLOR="1", TERM="xterm")
    r = subprocess.run([sys.executable, "-m", "tools", *args], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=timeout, check=False)
    return r.returncode, ANSI.sub("", r.stdout), ANSI.sub("", r.stderr)


def whole(word: str, text: str) -> bool:
    """`word` appears in `text` as a whole token (not folded, not cut, not part of a longer token)."""
    return re.search(r"(?<![\w.])" + re.escape(word) + r"(?![\w.])", text) is not None


def check_fits(text: str, width: int) -> None:
    assert "\u2026" not in text, "a cell was cut with an ellipsis"
    wide = [ln for ln in text.splitlines() if len(ln) > width]
    assert not wide, f"{len(wide)} lines wider than {width}: {wide[0]!r}"


# -- diff: the tables never cut a name or a hash -------------------------------------------------------

@pytest.fixture(scope="module")
def point_json():
    rc, out, err = run(["diff", "--checkpoint", TINY, "--a", SIDE, "--b", INJECT, "--ids", IDS, "--max-new", "2",
                        "--layer", "2", "--pos", "10", "--json"])
    assert rc == 1, err
    return json.loads(out)


@pytest.mark.parametrize("columns", [80, 140, None], ids=["80-columns", "140-columns", "pipe"])
def test_diff_tables_keep_every_name_and_hash_whole(point_json, columns):
    rc, out, err = run(["diff", "--checkpoint", TINY, "--a", SIDE, "--b", INJECT, "--ids", IDS, "--max-new", "2",
                        "--layer", "2", "--pos", "10"], columns)
    assert rc == 1, err
    check_fits(out, columns or PIPE_WIDTH)
    stages = point_json["point"]["stages"]
    assert len(stages) > 20
    for r in stages:                                   # the --layer/--pos drill-down: every stage, both hashes
        for word in (r["stage"], r["hash_a"], r["hash_b"]):
            assert whole(word, out), (word, columns)
    f = point_json["first"]
    assert (f["layer"], f["pos"], f["stage"], f["elem"]) == (2, 10, "kda.g", 4)
    for key in ("a", "b"):                             # the values, all their digits
        assert whole(str(np.float32(f[key])), out)
    assert point_json["rows_differing"] == 1
    assert "1 row differs" in out and "1 rows" not in out
    assert "1 causally minimal divergence," in out and "divergence(s)" not in out
    assert "first divergence at layer 2, position 10, stage kda.g, element 4" in " ".join(out.split())


def write_trace(path, spec, checkpoint=TINY, ids=IDS, n=2) -> str:
    """A trace file (made in this process: what is tested is `trace compare`, not `trace`)."""
    from tools.sides import open_side
    from tools.trace import run_traced
    run_traced(open_side(spec, checkpoint), [int(i) for i in ids.split(",")], n).save(path)
    return str(path)


def test_trace_compare_tables_keep_hashes_whole(tmp_path):
    fa, fb = write_trace(tmp_path / "a.json", SIDE), write_trace(tmp_path / "b.json", INJECT)
    rc, out, err = run(["trace", "compare", str(fa), str(fb), "--json"])
    doc = json.loads(out)
    assert rc == 1 and doc["minimal"]
    for columns in (80, None):
        rc, out, err = run(["trace", "compare", str(fa), str(fb)], columns)
        assert rc == 1, err
        check_fits(out, columns or PIPE_WIDTH)
        for r in doc["minimal"]:
            assert whole(r["stage"], out) and whole(r["hash_a"], out) and whole(r["hash_b"], out)


# -- diff: canonical against float64 ------------------------------------------------------------------

def test_diff_explains_a_dtype_mismatch_in_text():
    """`--b oracle:precision=float64`: the text says which dtypes each side holds and why the first row
    (equal values, different representation) has no element or ULP, as --json does, and shows the
    first row whose values do differ with its relative difference."""
    args = ["diff", "--checkpoint", TINY, "--a", SIDE, "--b", "oracle:precision=float64", "--ids", "1",
            "--max-new", "1"]
    rc, out, err = run(args + ["--json"])
    assert rc == 1, err
    doc = json.loads(out)
    first, fv = doc["first"], doc["first_value_difference"]
    assert first["elements_differing"] == 0 and first["elem"] is None and first["a_holds"] != first["b_holds"]
    assert doc["notes"] and fv is not None and fv["elem"] is not None
    rc, out, err = run(args)
    assert rc == 1, err
    text = " ".join(out.split())
    assert "element -" not in text and "a = -, b = -" not in text
    assert f"held as {first['a_holds']} by a and {first['b_holds']} by b" in text
    assert "no element or ULP distance" in text and "relative difference" in text
    assert (f"first row whose values differ: layer {fv['layer']}, position {fv['pos']}, stage {fv['stage']}, "
            f"element {fv['elem']}") in text


# -- diff --plot: checked before the runs; a failed save comes after the report -----------------------------

def test_plot_path_is_checked_before_anything_runs(tmp_path):
    # a checkpoint that does not exist: the --plot error comes first, so nothing was opened or run
    rc, out, err = run(["diff", "--checkpoint", str(tmp_path / "nope"), "--a", SIDE, "--b", SIDE, "--ids", "1",
                        "--plot", str(tmp_path / "x.xyz")])
    assert rc == 2 and ".xyz" in out + err and "nope" not in out + err and "oracle diff" not in out
    rc, out, err = run(["diff", "--checkpoint", TINY, "--a", SIDE, "--b", SIDE, "--ids", "1",
                        "--plot", str(tmp_path / "no-such-folder" / "x.png")])
    assert rc == 2 and "no-such-folder" in out + err and "oracle diff" not in out


def test_plot_without_extension_gets_png_and_says_so(tmp_path):
    base = tmp_path / "cells"
    rc, out, err = run(["diff", "--checkpoint", TINY, "--a", SIDE, "--b", SIDE, "--ids", "1,2", "--max-new", "1",
                        "--plot", str(base)])
    png = tmp_path / "cells.png"
    assert rc == 0, err
    assert png.read_bytes()[:4] == b"\x89PNG" and not base.exists()
    assert f"wrote {png}" in out


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (a folder no file can be created in)")
def test_plot_that_cannot_be_saved_comes_after_the_report():
    rc, out, err = run(["diff", "--checkpoint", TINY, "--a", SIDE, "--b", INJECT, "--ids", IDS, "--max-new", "1",
                        "--plot", "/proc/glm-exact-cells.png"])
    assert rc == 2
    assert "DIFFER" in out and "first divergence at layer 2" in " ".join(out.split())     # the report
    assert "/proc/glm-exact-cells.png" in out + err and "could not write" in out + err


# -- trace compare: different runs are said first ----------------------------------------------------------

def test_trace_compare_names_what_differs_besides_the_rows(tmp_path):
    def trace(name, ckpt, ids):
        return write_trace(tmp_path / f"{name}.json", SIDE, ckpt, ids)
    base = trace("base", TINY, "1,2,3,4,5,6")
    fp8 = trace("fp8", str(REPO / "golden" / "tiny-fp8"), "1,2,3,4,5,6")
    late = trace("late", TINY, "1,2,3,9,5,6")               # the prompts part at position 3
    early = trace("early", TINY, "7,2,3")                   # ... at position 0: nothing to compare

    rc, out, err = run(["trace", "compare", base, fp8])
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert rc == 1
    assert "checkpoints differ" in lines[1] and "tiny-bf16" in lines[1] and "tiny-fp8" in lines[1]

    rc, out, err = run(["trace", "compare", base, late])
    assert rc == 1
    text = " ".join(out.split())
    assert "prompts differ at position 3 (a 4, b 9" in text and "DIFFER: the prompts differ" in text
    rc, out, err = run(["trace", "compare", base, late, "--json"])
    doc = json.loads(out)
    assert rc == 1 and doc["comparable"] and not doc["identical"]
    assert [(m["field"], m["at"]) for m in doc["mismatches"]] == [("prompt_ids", 3)]

    rc, out, err = run(["trace", "compare", base, early])
    assert rc == 2 and "not comparable" in err and "position 0" in err and "DIFFER" not in out
    rc, out, err = run(["trace", "compare", base, early, "--json"])
    doc = json.loads(out)
    assert rc == 2 and "not comparable" in doc["error"] and doc["comparable"] is False

    other = json.loads(Path(base).read_text())            # another model: more layers
    other["num_hidden_layers"] += 2
    Path(tmp_path / "other.json").write_text(json.dumps(other))
    rc, out, err = run(["trace", "compare", base, str(tmp_path / "other.json")])
    assert rc == 2 and "models differ" in err


# -- census: plain numbers, tables fitted ---------------------------------------------------------------

def test_census_prints_plain_numbers_and_fits_80_columns():
    names = ["libm", "numpy", "cephes-poly", "oracle"]
    rc, out, err = run(["census", "expf", "--range", "0xbf800000:0xbf810000", "--only", ",".join(names)], 80)
    assert rc == 0, err
    assert not re.search(r"np\.(float|u?int)\d+\(", out), out      # no np.float32(-1.0)
    check_fits(out, 80)
    for name in names:
        assert whole(name, out)
    # each first differing input: its bits and its f32 value as a plain decimal that reads back to those bits
    firsts = re.findall(r"0x([0-9a-f]{8}) \(([^)\s]+)\)", out)
    assert len(firsts) >= 2, out                        # numpy and cephes-poly differ in this range
    for bits, value in firsts:
        assert np.float32(float(value)).view(np.uint32) == int(bits, 16), (bits, value)
