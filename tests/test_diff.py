"""`oracle diff` and `oracle trace`: fault localization, causal order, traces, SPEC strings, exit codes.

The core property: inject one fault (layer, position, stage, element, ULPs) into one side and
`oracle diff` must name exactly that point as the first divergence, with the element, both values
and the ULP distance, and find no other causally minimal divergence. Exactness is checked by bits.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import oracle
from tools import cli
from oracle.capture import Capture
from tools.diff import plot_cells, row_diff, run_diff, ulp_distance
from oracle.inject import Injection
from tools.sides import SideError, open_side, parse_spec
from oracle.stages import F32, F64, I32, model_stages, stage_dtype
from tools.trace import Trace, causally_minimal, compare_traces, downstream, run_traced, stage_order

PROMPT_LEN, NEW = 24, 4          # 24 > tiny's index_topk (8): the indexer selects; 27 positions processed


def prompt(vocab: int, n: int = PROMPT_LEN) -> list[int]:
    return [(37 * i + 11) % vocab for i in range(n)]


@pytest.fixture(scope="session")
def small_dir(small_zoo):
    return small_zoo / "small-bf16"


def checkpoint_path(name, golden_dir, small_dir):
    return small_dir if name == "small" else golden_dir / name


# -- the fault table ----------------------------------------------------------------------------------

# Points every run must cover: (layer, stage, pos); "L-1" = last decoder layer, "L" = the head layer,
# "last" = the last processed position. None = drawn at random.
SPECIAL = {
    "tiny-bf16": [(0, "embed", 0), (0, "attn_hc.pre", 0), ("L-1", "ffn_hc.streams", "last"), ("L", "logits", "last"),
                  (1, "kda.state", None), (3, "mla.c", None), (2, "moe.selected", None), (1, "moe.logits", 0)],
    "tiny-fp8": [(0, "kda.state", 0), (4, "mla.c", "last"), ("L-1", "moe.selected", "last"), (3, "moe.logits", "last"),
                 (3, "indexer.scores", "last"), (3, "mla.scores", None)],
    "tiny-mxfp4": [(3, "mla.c", 0), ("L-1", "kda.state", "last"), (2, "moe.selected", 0), ("L", "final_norm", 0),
                   (4, "mla.probs", None), (0, "mlp.out", None)],
    "small": [(0, "kda.state", 0), (3, "mla.c", "last"), ("L-1", "moe.selected", None), ("L", "logits", "last")],
}
N_CASES = {"tiny-bf16": 16, "tiny-fp8": 16, "tiny-mxfp4": 16, "small": 6}          # 54 in all
SKIP_RANDOM = {"mla.selected"}    # a moved position index can point past the cache: not a value fault


def reference(model, ids):
    cap = Capture(keep_values=True)
    model.generate(ids, NEW, capture=cap)
    return cap


def choose_ulps(value: np.ndarray, elem: int, dtype: str, rng, n_experts: int) -> int:
    """A perturbation that keeps the value finite, of the same sign (so |ULPs| is the exact distance)."""
    v = value.reshape(-1)[elem]
    if dtype == I32:                                          # moe.selected: an expert id that stays in range
        return 1 if int(v) + 1 < n_experts else -1
    mag = rng.choice([1, 1, 2, 3, 17, 100, 1000])
    bits = {"bf16": int(np.float32(v).view(np.uint32)) >> 16 & 0x7FFF,
            F32: int(np.float32(v).view(np.uint32)) & 0x7FFFFFFF,
            F64: int(np.float64(v).view(np.uint64)) & 0x7FFFFFFFFFFFFFFF}[dtype]
    if rng.random() < 0.3 and bits > mag + 1:
        return -int(mag)                                      # towards zero, without crossing it
    return int(mag)


def fault_table(name, model, ref, positions, seed):
    c = model.config
    L = c.num_hidden_layers
    stages = model_stages(c)
    rng = np.random.default_rng(seed)
    cases = []
    specials = list(SPECIAL[name])
    while len(cases) < N_CASES[name]:
        if specials:
            layer, stage, pos = specials.pop(0)
            layer = {"L-1": L - 1, "L": L}.get(layer, layer)
        else:
            layer, stage, pos = None, None, None
        if layer is None:
            layer = int(rng.integers(0, L + 1))
        if stage is None:
            choices = [s for l, s, _ in stages if l == layer and s not in SKIP_RANDOM]
            stage = str(rng.choice(choices))
        if pos is None:
            pos = int(rng.integers(0, positions))
        pos = positions - 1 if pos == "last" else pos
        value = ref.get(layer, stage, pos)
        if value.size == 0:
            continue                                          # e.g. no pool visible yet: draw again
        dtype = stage_dtype(stage)
        elem = int(rng.integers(0, value.size))
        ulps = choose_ulps(value, elem, dtype, rng, c.n_routed_experts)
        cases.append((layer, pos, stage, elem, ulps))
    return cases


@pytest.fixture(scope="module")
def models(golden_dir, small_dir):
    out = {}
    for name in N_CASES:
        path = checkpoint_path(name, golden_dir, small_dir)
        side = open_side("oracle", path)
        ids = prompt(side.config.vocab_size)
        ref = reference(side.engine, ids)
        out[name] = (path, side, ids, ref)
    return out


def all_cases():
    return [(name, i) for name, n in N_CASES.items() for i in range(n)]


@pytest.fixture(scope="module")
def tables(models):
    out = {}
    for seed, (name, (path, side, ids, ref)) in enumerate(sorted(models.items())):
        out[name] = fault_table(name, side.engine, ref, PROMPT_LEN + NEW - 1, seed=1000 + seed)
    return out


def test_fault_table_covers_the_required_points(tables, models):
    cases = [(name, *c) for name, cs in tables.items() for c in cs]
    assert len(cases) >= 50
    stages = {c[3] for c in cases}
    assert {"kda.state", "mla.c", "moe.selected", "moe.logits", "embed", "logits"} <= stages
    for name, cs in tables.items():
        L = models[name][1].config.num_hidden_layers
        assert any(c[0] == 0 for c in cs) and any(c[0] == L - 1 for c in cs), name
        assert any(c[1] == 0 for c in cs) and any(c[1] == PROMPT_LEN + NEW - 2 for c in cs), name
    assert any(u < 0 for *_, u in cases) and any(abs(u) >= 100 for *_, u in cases)


@pytest.mark.parametrize("name,index", all_cases())
def test_injected_fault_is_the_first_divergence(name, index, models, tables):
    path, base, ids, ref = models[name]
    layer, pos, stage, elem, ulps = tables[name][index]
    spec = f"oracle:inject={layer},{pos},{stage},{elem},{ulps}"
    side_b = open_side(spec, path)
    res = run_diff(base, side_b, ids, NEW)
    assert not res.identical
    assert not res.warnings, res.warnings
    first = res.first
    assert (first.layer, first.pos, first.stage) == (layer, pos, stage), f"{spec}: got {first}"
    assert len(res.minimal) == 1, f"{spec}: other minimal divergences {res.minimal[1:]}"
    assert first.elem == elem
    want = ref.get(layer, stage, pos).reshape(-1)[elem]
    assert first.ulps == abs(ulps)
    if stage_dtype(stage) == I32:
        assert first.a_value == int(want) and first.b_value == int(want) + ulps
    else:
        assert np.float64(first.a_value).tobytes() == np.float64(want).tobytes()
        expected_b = Injection(layer, pos, stage, elem, ulps).apply(ref.get(layer, stage, pos)).reshape(-1)[elem]
        assert np.float64(first.b_value).tobytes() == np.float64(expected_b).tobytes()
    # Every differing row is the injected one or causally downstream of it.
    order = stage_order(res.a.stages)
    for r in res.cmp.differing:
        assert r == (layer, stage, pos) or downstream(r, (layer, stage, pos), order), r


# -- the CLI, end to end --------------------------------------------------------------------------------

def run_cli(argv, capsys):
    """-> (exit code, stdout + stderr): results are on stdout, errors on stderr (tests/test_cli.py checks which)."""
    rc = cli.main(argv)
    got = capsys.readouterr()
    return rc, got.out + got.err


def test_cli_identical_exit_0(golden_dir, capsys):
    rc, out = run_cli(["diff", "--checkpoint", str(golden_dir / "tiny-bf16"), "--a", "oracle", "--b", "oracle:chunk=5",
                       "--ids", ",".join(map(str, prompt(300))), "--max-new", "3", "--json"], capsys)
    assert rc == 0, out
    doc = json.loads(out)
    assert doc["identical"] and doc["first"] is None and doc["rows_differing"] == 0


def test_cli_localizes_exit_1_json(golden_dir, capsys):
    rc, out = run_cli(["diff", "--checkpoint", str(golden_dir / "tiny-fp8"), "--a", "oracle",
                       "--b", "oracle:chunk=7,inject=4,20,mla.o_lat,11,5", "--ids", ",".join(map(str, prompt(300))),
                       "--max-new", "3", "--json"], capsys)
    assert rc == 1
    doc = json.loads(out)
    f = doc["first"]
    assert (f["layer"], f["pos"], f["stage"], f["elem"], f["ulps"]) == (4, 20, "mla.o_lat", 11, 5)
    assert len(doc["minimal"]) == 1 and doc["cells"]


def test_cli_tables_and_point(golden_dir, capsys):
    rc, out = run_cli(["diff", "--checkpoint", str(golden_dir / "tiny-bf16"), "--a", "oracle",
                       "--b", "oracle:inject=2,10,kda.g,4,3", "--ids", ",".join(map(str, prompt(300))),
                       "--max-new", "2", "--layer", "2", "--pos", "10"], capsys)
    assert rc == 1
    assert "first divergence at layer 2, position 10, stage kda.g, element 4" in out
    assert "layer 2, position 10: every stage in execution order" in out


def test_point_drill_shows_every_stage(golden_dir):
    path = golden_dir / "tiny-bf16"
    a, b = open_side("oracle", path), open_side("oracle:inject=2,10,kda.g,4,3", path)
    res = run_diff(a, b, prompt(300), 2, point=(2, 10))
    names = [r.stage for r in res.point]
    assert names == [s for l, s, _ in model_stages(a.config) if l == 2]
    i = names.index("kda.g")
    assert all(r.hash_a == r.hash_b and r.n_differ == 0 for r in res.point[:i])
    g = res.point[i]
    assert g.hash_a != g.hash_b and g.elem == 4 and g.ulps == 3 and g.n_differ == 1


def test_token_streams_part(golden_dir):
    """A huge fault on a logit changes the greedy token: only positions fed the same ids are compared."""
    path = golden_dir / "tiny-bf16"
    ids = prompt(300)
    a = open_side("oracle", path)
    ref = reference(a.engine, ids)
    last = PROMPT_LEN - 1
    logits = ref.get(a.config.num_hidden_layers, "logits", last)
    positive = np.flatnonzero(logits > 0)
    loser = int(positive[np.argmin(logits[positive])])        # +4e8 ULPs makes a positive logit huge
    b = open_side(f"oracle:inject={a.config.num_hidden_layers},{last},logits,{loser},400000000", path)
    res = run_diff(a, b, ids, NEW)
    assert res.a.tokens[0] != res.b.tokens[0] and res.b.tokens[0] == loser
    assert res.cmp.parting == PROMPT_LEN and res.cmp.compared_positions == PROMPT_LEN
    assert (res.first.layer, res.first.pos, res.first.stage, res.first.elem) == (a.config.num_hidden_layers, last,
                                                                                 "logits", loser)
    assert all(p < PROMPT_LEN for _, _, p in res.cmp.differing)


def test_exit_codes_errors(golden_dir, tmp_path, capsys):
    ck = str(golden_dir / "tiny-bf16")
    base = ["diff", "--checkpoint", ck, "--a", "oracle", "--ids", "1,2,3", "--max-new", "1"]
    rc, out = run_cli(base + ["--b", "oracle:bogus=1"], capsys)
    assert rc == 2 and "bogus" in out
    rc, out = run_cli(base + ["--b", "oracle:threads=2"], capsys)
    assert rc == 2 and "threads" in out
    rc, out = run_cli(base + ["--b", "gpu"], capsys)
    assert rc == 2 and "gpu" in out
    rc, out = run_cli(base + ["--b", "oracle:inject=1,2,kda.nope,0,1"], capsys)
    assert rc == 2 and "kda.nope" in out
    rc, out = run_cli(base + ["--b", "oracle:inject=1,2,kda.q"], capsys)
    assert rc == 2 and "five" in out
    rc, out = run_cli(base + ["--b", "oracle:inject=3,0,kda.q,0,1"], capsys)      # layer 3 is MLA
    assert rc == 2 and "does not exist at layer 3" in out
    rc, out = run_cli(base + ["--b", "oracle:inject=0,1,embed,100000,1"], capsys)  # element past the row
    assert rc == 2 and "element" in out
    rc, out = run_cli(["diff", "--checkpoint", str(tmp_path), "--a", "oracle", "--b", "oracle", "--ids", "1"], capsys)
    assert rc == 2
    rc, out = run_cli(base + ["--b", "oracle", "--layer", "1"], capsys)
    assert rc == 2 and "--pos" in out
    rc, out = run_cli(base[:-4] + ["--ids", "1,2,99999", "--b", "oracle"], capsys)
    assert rc == 2 and "99999" in out


def _engine_available() -> str | None:
    try:
        from fast.engine import _core
        _core()
        return None
    except ImportError as e:
        return str(e)


def _cuda_available() -> bool:
    try:
        import fast._cuda  # noqa: F401
        return True
    except ImportError:
        return False


def test_engine_side_not_available_is_exit_2(golden_dir, capsys):
    ck = str(golden_dir / "tiny-bf16")
    if _engine_available() is None and _cuda_available():
        pytest.skip("both engines are built: nothing is unavailable")
    if _engine_available() is not None:
        rc, out = run_cli(["diff", "--checkpoint", ck, "--a", "oracle", "--b", "cpu", "--ids", "1,2", "--max-new", "1"],
                          capsys)
        assert rc == 2 and "engine not available" in out
    if not _cuda_available():
        rc, out = run_cli(["diff", "--checkpoint", ck, "--a", "oracle", "--b", "cuda:batch=2", "--ids", "1,2",
                           "--max-new", "1"], capsys)
        assert rc == 2 and "cuda engine not available" in out


CPU_CASES = [("tiny-bf16", i) for i in range(0, 16, 3)] + [("tiny-fp8", i) for i in (0, 1, 2, 9)] + \
            [("tiny-mxfp4", i) for i in (0, 1, 2, 3, 12)]


@pytest.mark.skipif(_engine_available() is not None, reason=f"the fast CPU engine is not built ({_engine_available()})")
@pytest.mark.parametrize("name,index", CPU_CASES)
def test_cpu_injected_fault_is_the_first_divergence(name, index, models, tables):
    """The same faults through the CPU engine's injection (cpu vs cpu:inject=...)."""
    path, _, ids, ref = models[name]
    layer, pos, stage, elem, ulps = tables[name][index]
    base = open_side("cpu", path)
    res = run_diff(base, open_side(f"cpu:inject={layer},{pos},{stage},{elem},{ulps}", path), ids, NEW)
    assert not res.warnings, res.warnings
    f = res.first
    assert (f.layer, f.pos, f.stage, f.elem, f.ulps) == (layer, pos, stage, elem, abs(ulps)), f
    assert len(res.minimal) == 1, res.minimal


# Stages whose own computation evaluates expf (silu, sigmoid, softmax, the KDA decay); mHC uses exp64.
EXPF_STAGES = {"kda.q", "kda.k", "kda.v", "kda.g", "kda.beta", "kda.state", "kda.o", "kda.o_norm", "mla.probs",
               "indexer.scores", "mla.selected", "moe.selected", "moe.weights", "moe.experts", "moe.shared",
               "moe.routed", "moe.out", "mlp.out"}


@pytest.mark.skipif(_engine_available() is not None,
                    reason=f"the fast CPU engine is not built ({_engine_available()})")
@pytest.mark.parametrize("switch,allowed", [("dot=sequential", None), ("expf=native", EXPF_STAGES)])
def test_cpu_switch_is_localized_to_the_first_stage_it_touches(golden_dir, switch, allowed):
    """cpu vs cpu:SWITCH: the first divergence is at layer 0, position 0 (every layer computes dots and
    exps, the first one runs there), it is the only causally minimal one, and it is a stage that uses the
    switched primitive; every stage before it is bit-identical (that is what `first` means)."""
    path = golden_dir / "tiny-bf16"
    a, b = open_side("cpu", path), open_side(f"cpu:{switch}", path)
    res = run_diff(a, b, prompt(300), 2, point=(0, 0))
    assert not res.identical and not res.warnings
    f = res.first
    assert (f.layer, f.pos) == (0, 0) and len(res.minimal) == 1, res.minimal
    assert f.stage != "embed" and f.n_differ >= 1 and f.ulps >= 1
    if allowed is not None:
        assert f.stage in allowed, f.stage
    i = [r.stage for r in res.point].index(f.stage)
    assert all(r.hash_a == r.hash_b for r in res.point[:i])


# -- the plot -------------------------------------------------------------------------------------------

def test_plot_writes_a_labelled_png(golden_dir, tmp_path):
    path = golden_dir / "tiny-bf16"
    a, b = open_side("oracle", path), open_side("oracle:inject=1,5,kda.state,17,1000", path)
    res = run_diff(a, b, prompt(300), NEW)
    out = tmp_path / "cells.png"
    fig = plot_cells(res, out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    ax = fig.axes[0]
    assert ax.get_xlabel() == "position" and ax.get_ylabel() == "layer"
    assert "relative difference" in ax.get_title() and "oracle:inject" in ax.get_title()
    assert "rows differ" in ax.get_title() and "1 rows" not in ax.get_title()
    label = fig.axes[1].get_ylabel()                                     # the colour bar names its measure
    assert "relative difference" in label and "dtype-independent" in label
    assert ax.images and ax.images[0].norm.__class__.__name__ == "LogNorm"
    assert [t.get_text() for t in ax.get_yticklabels()][-1] == "head"
    cells = res.cells()
    assert cells[(1, 5)][0] == 1000 and cells[(1, 5)][1] == "kda.state"
    # the colour is the relative difference of the injected element (the only one that differs there)
    f = res.first
    assert (f.layer, f.pos, f.stage, f.elem) == (1, 5, "kda.state", 17)
    x, y = np.float64(f.a_value), np.float64(f.b_value)
    rel = abs(x - y) / max(abs(x), abs(y))
    assert ax.images[0].get_array()[1, 5] == rel == res.rel_cells()[(1, 5)][0]
    # the legend is outside the axes: it covers no cell
    fig.canvas.draw()
    boxes = [lg.get_window_extent() for lg in fig.legends + ([ax.get_legend()] if ax.get_legend() else [])]
    assert boxes and not any(bx.overlaps(ax.get_window_extent()) for bx in boxes)


def test_cli_plot(golden_dir, tmp_path, capsys):
    png = tmp_path / "d.png"
    rc, out = run_cli(["diff", "--checkpoint", str(golden_dir / "tiny-bf16"), "--a", "oracle", "--b", "oracle",
                       "--ids", "5,6,7", "--max-new", "2", "--plot", str(png)], capsys)
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG"


# -- traces ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-bf16", "small"])
def test_traced_run_gives_the_same_bits(name, golden_dir, small_dir):
    path = checkpoint_path(name, golden_dir, small_dir)
    model = oracle.load(path)
    ids = prompt(model.config.vocab_size)
    toks0, logits0 = model.generate(ids, NEW, return_logits=True)
    side = open_side("oracle", path)
    t = run_traced(side, ids, NEW)
    toks1, logits1 = side.generate(ids, NEW, capture=Capture(keep_values=False))
    assert toks0 == toks1 == t.tokens
    assert np.array_equal(np.asarray(logits0).view(np.uint32), np.asarray(logits1).view(np.uint32))
    from tools.golden import hash12
    assert t.logits_hash == hash12(logits0, "<f4")
    n_stages = len(model_stages(model.config))
    assert len(t.hashes) == n_stages * (PROMPT_LEN + NEW - 1)


def test_trace_file_roundtrip_and_compare(golden_dir, tmp_path, capsys):
    ck = str(golden_dir / "tiny-mxfp4")
    ids = ",".join(map(str, prompt(300)))
    fa, fb, fc = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    for f, spec in ((fa, "oracle"), (fb, "oracle:chunk=3"), (fc, "oracle:inject=5,12,kda.beta,1,1")):
        rc, out = run_cli(["trace", "--checkpoint", ck, "--a", spec, "--ids", ids, "--max-new", "3", "--out", str(f)],
                          capsys)
        assert rc == 0, out
    doc = json.loads(fa.read_text())
    assert doc["format"] == "glm-exact-trace" and doc["version"] == 1
    ta = Trace.load(fa)
    assert Trace.from_json(ta.to_json()).hashes == ta.hashes
    rc, out = run_cli(["trace", "compare", str(fa), str(fb)], capsys)
    assert rc == 0 and "IDENTICAL" in out
    rc, out = run_cli(["trace", "compare", str(fa), str(fc), "--json"], capsys)
    assert rc == 1
    d = json.loads(out)
    assert (d["first"]["layer"], d["first"]["stage"], d["first"]["pos"]) == (5, "kda.beta", 12)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "glm-exact-trace", "version": 99}')
    rc, out = run_cli(["trace", "compare", str(fa), str(bad)], capsys)
    assert rc == 2 and "version" in out
    rc, out = run_cli(["trace", "compare", str(fa), str(tmp_path / "missing.json")], capsys)
    assert rc == 2
    rc, out = run_cli(["trace", "--checkpoint", ck], capsys)
    assert rc == 2


# -- causal order, ULPs, SPEC strings (no model) ----------------------------------------------------------

def test_causally_minimal():
    stages = [(0, "embed", "bf16"), (0, "x", "f32"), (0, "y", "f32"), (1, "x", "f32"), (1, "y", "f32"),
              (2, "x", "f32")]
    order = stage_order(stages)
    rows = [(1, "y", 3), (0, "y", 5), (1, "x", 4), (2, "x", 2), (0, "x", 6), (1, "x", 3)]
    # (1, y, 3) is after (1, x, 3) at the same point; (1, x, 4) later position of layer 1; (0, x, 6) later
    # position of layer 0; (2, x, 2) is at an earlier position than everything of layers 0-1: minimal too.
    assert causally_minimal(rows, order) == [(0, "y", 5), (1, "x", 3), (2, "x", 2)]
    assert downstream((1, "x", 5), (0, "y", 5), order) and not downstream((1, "x", 4), (0, "y", 5), order)
    assert downstream((0, "x", 6), (0, "y", 5), order) and not downstream((0, "x", 5), (0, "y", 5), order)
    # brute force agrees on random sets
    rng = np.random.default_rng(0)
    for _ in range(200):
        rs = list({(int(rng.integers(0, 3)), str(rng.choice(["x", "y"])), int(rng.integers(0, 6)))
                   for _ in range(int(rng.integers(1, 8)))})
        brute = [r for r in rs if not any(downstream(r, o, order) for o in rs if o != r)]
        assert sorted(causally_minimal(rs, order)) == sorted(brute)


def test_ulp_distance():
    bf = np.array([1.0, -1.0, 0.0], np.float32)
    nxt = np.array([1.0078125, -1.0078125, -0.0], np.float32)      # one bf16 step up in magnitude; -0
    assert list(ulp_distance(bf, nxt, "bf16")) == [1, 1, 1]
    a = np.array([1.0], np.float32)
    b = (a.view(np.uint32) + 1000).view(np.float32)
    assert int(ulp_distance(a, b, F32)[0]) == 1000
    x = np.array([1e-300, -2.0], np.float64)
    y = (x.view(np.uint64) + np.uint64(7)).view(np.float64)
    assert list(ulp_distance(x, y, F64)) == [7, 7]
    assert list(ulp_distance(np.array([3, 5], np.int32), np.array([4, 5], np.int32), I32)) == [1, 0]
    tiny_pos, tiny_neg = np.array([1.4e-45], np.float32), np.array([-1.4e-45], np.float32)
    assert int(ulp_distance(tiny_pos, tiny_neg, F32)[0]) == 3          # -min, -0, +0, +min
    r = row_diff(0, "kda.g", 0, np.array([1.0, 2.0], np.float32), np.array([1.0, 2.5], np.float32))
    assert (r.elem, r.n_differ, r.a_value, r.b_value, r.ulps) == (1, 1, 2.0, 2.5, 1 << 21)


def test_spec_parsing():
    s = parse_spec("cpu:chunk=7,inject=15,45,mla.scores,3,1,threads=2")
    assert s.engine == "cpu" and s.options["chunk"] == 7 and s.options["threads"] == 2
    assert s.options["inject"] == Injection(15, 45, "mla.scores", 3, 1)
    assert parse_spec("cuda:batch=4,expf=native,dot=sequential,prefix-cache").options == {
        "batch": 4, "expf": "native", "dot": "sequential", "prefix-cache": True}
    assert parse_spec("oracle:precision=float64").options == {"precision": "float64"}
    assert parse_spec("oracle:prefix-cache=5").options == {"prefix-cache": 5}
    for bad, word in [("oracle:dot=sequential", "dot"), ("oracle:expf=native", "expf"), ("cpu:precision=float64",
                      "precision"), ("cpu:chunk=0", "chunk"), ("cpu:chunk=x", "chunk"), ("cpu:dot=fast", "dot"),
                      ("tpu", "tpu"), ("cpu:chunk=2,chunk=3", "twice"), ("cpu:inject=1,2,x", "five"),
                      ("cpu:inject=1,2,kda.q,0,0", "non-zero"), ("oracle:,", "empty"), ("cpu:batch", "batch")]:
        with pytest.raises(SideError, match=word):
            parse_spec(bad)


def test_oracle_side_options_are_canonical(golden_dir):
    """chunk= and prefix-cache change the schedule, not the bits; float64 changes the representation."""
    path = golden_dir / "tiny-bf16"
    ids = prompt(300)
    base = run_traced(open_side("oracle", path), ids, NEW)
    for spec in ("oracle:chunk=5", "oracle:prefix-cache", "oracle:prefix-cache=7,chunk=2"):
        t = run_traced(open_side(spec, path), ids, NEW)
        cmp = compare_traces(base, t)
        assert cmp.identical, (spec, cmp.first)
    res = run_diff(open_side("oracle", path), open_side("oracle:precision=float64", path), [1, 2, 3], 1)
    assert not res.identical and (res.first.layer, res.first.pos) == (0, 0)
