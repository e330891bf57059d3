"""`oracle census expf` on reduced ranges (the full 2^32 census takes minutes: docs/cli.md has its numbers)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tools import cli
from tools.census import census_expf
from tools.census_kernels import cephes_expf, schraudolph_expf
from oracle.numerics import expf

# 2^20 inputs around x = -1 (softmax's range) and 2^20 around x = +1.
NEG = (0xBF800000, 0xBF800000 + (1 << 20))
POS = (0x3F800000, 0x3F800000 + (1 << 20))


@pytest.fixture(scope="module")
def results():
    return {r.name: r for r in census_expf(*NEG)}


def test_ours_and_libm_agree_numpy_and_fast_approximations_do_not(results):
    assert results["oracle"].differ == 0 and results["libm"].differ == 0
    assert results["oracle"].first is None and results["libm"].max_ulps == 0
    for name in ("numpy", "cephes-poly", "schraudolph"):
        r = results[name]
        assert r.differ > 0, name
        assert r.inputs == 1 << 20 and r.softmax_inputs == 1 << 20       # every input here is <= 0
        assert r.differ_softmax == r.differ
        assert r.differ_bf16 <= r.differ
        assert r.first is not None and NEG[0] <= r.first < NEG[1]
    assert results["cephes-poly"].max_ulps <= 4                           # a good fast exp: a few ULPs
    assert results["schraudolph"].max_ulps > 1000                         # a rough one
    assert results["schraudolph"].differ_bf16 > 0


def test_counts_are_exact(results):
    """Recount one implementation with plain NumPy over the same inputs."""
    x = np.arange(*NEG, dtype=np.uint64).astype(np.uint32).view(np.float32)
    canon = np.array([expf(v) for v in x[:20000]], np.float32).view(np.uint32)
    mine = np.array([cephes_expf(v) for v in x[:20000]], np.float32).view(np.uint32)
    part = census_expf(NEG[0], NEG[0] + 20000, only=["cephes-poly"])[0]
    assert part.differ == int(np.count_nonzero(canon != mine))
    first = np.flatnonzero(canon != mine)
    assert part.first == (NEG[0] + int(first[0]) if first.size else None)


def test_positive_range_and_block_boundaries():
    # a range that is not a multiple of the block or work-item size, across x = 0
    lo, hi = 0x7FFFF000, 0x80001001
    res = {r.name: r for r in census_expf(lo, hi)}
    assert res["libm"].differ == 0 and res["oracle"].differ == 0
    assert res["oracle"].inputs == hi - lo
    # x <= 0: +0 and the negatives; NaNs (0x7FC00000.. and 0xFFC00000..) are not softmax inputs
    assert res["oracle"].softmax_inputs == hi - 0x80000000


def test_fast_approximations_are_reasonable():
    for x in (-10.0, -1.0, -0.1, 0.0, 0.5, 3.0, 80.0):
        e = float(expf(np.float32(x)))
        assert abs(float(cephes_expf(np.float32(x))) - e) <= 1e-6 * e
        assert abs(float(schraudolph_expf(np.float32(x))) - e) <= 0.07 * e
    assert np.isnan(cephes_expf(np.float32(np.nan))) and cephes_expf(np.float32(-200.0)) == 0.0


def test_cli_census_range_json(capsys):
    rc = cli.main(["census", "expf", "--range", f"{POS[0]:#x}:{POS[1]:#x}", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    by = {r["name"]: r for r in doc["results"]}
    assert by["oracle"]["differ"] == 0 and by["libm"]["differ"] == 0 and by["numpy"]["differ"] > 0
    assert doc["inputs"] == 1 << 20 and by["numpy"]["softmax_inputs"] == 0


def test_cli_census_table(capsys):
    rc = cli.main(["census", "expf", "--range", "0xbf800000:0xbf810000", "--only", "libm,numpy,oracle"])
    out = capsys.readouterr().out
    assert rc == 0 and "numpy" in out and "wall time" in out


def test_cli_census_errors(capsys):
    assert cli.main(["census", "expf", "--range", "5:3"]) == 2
    assert cli.main(["census", "expf", "--range", "zz"]) == 2
    assert cli.main(["census", "expf", "--only", "nope"]) == 2
    try:
        import fast._cuda  # noqa: F401
    except ImportError:
        assert cli.main(["census", "expf", "--engine", "cuda"]) == 2
        assert "fast._cuda" in capsys.readouterr().err      # errors go to stderr


def test_cli_census_cpu_engine(capsys):
    try:
        import fast._core as core
    except ImportError as e:
        pytest.skip(f"fast._core is not built: {e}")
    if not hasattr(core, "expf"):
        pytest.skip("fast._core has no expf")
    rc = cli.main(["census", "expf", "--engine", "cpu", "--range", "0xc0000000:0xc0040000", "--json"])
    doc = json.loads(capsys.readouterr().out)
    by = {r["name"]: r for r in doc["results"]}
    assert rc == 0 and by["cpu"]["differ"] == 0
    for name in ("cpu-scalar-vs-libm", "cpu-avx2-vs-libm"):
        if name in by:
            assert by[name]["differ"] == 0 and by[name]["inputs"] == 0x40000
