"""One source for each fact (oracle/schema.py): the engine config fields, the stage table (name, dtype,
size) and the tensor roles are defined there once, and what the engines were built from agrees.

* Every engine module's stage table (fast._core, and fast._cuda / fast._cuda_emu where built) equals
  the oracle's: names, dtypes, order, and the sizes the engine computes for several configs.
* The sizes are what the engines and the oracle really capture: every recorded row of a full capture
  has the schema's number of elements.
* The C++ reader takes every ENGINE_CONFIG field by its name (a dict without one is refused naming
  it), refuses every positive field at 0 where the schema says it is needed, and the C++ loader
  places every role of oracle/names.py (a wrong shape is reported, never an unknown role).
* The generator writes what the build compiled, and refuses a size it cannot put in C++.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fast.core import engine_config
from oracle import names as N
from oracle import schema as S
from oracle.capture import Capture
from oracle.config import Config
from oracle.stages import ALL_STAGE_NAMES, model_stages

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("fast._core", "fast._cuda", "fast._cuda_emu")


def _module(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.skip(f"{name} is not built")


def _configs(golden_dir):
    """The real model's config, a tiny checkpoint's, and one with every width different (so a size
    expression that reads the wrong field shows)."""
    odd = Config(num_hidden_layers=4, hidden_size=40, vocab_size=301, pad_token_id=None, intermediate_size=23,
                 moe_intermediate_size=9, num_attention_heads=9, num_key_value_heads=9, q_lora_rank=11,
                 kv_lora_rank=13, qk_nope_head_dim=7, v_head_dim=17, n_routed_experts=10, num_experts_per_tok=5,
                 index_topk=12, index_head_dim=6, index_n_heads=2, index_kpool=4, linear_num_heads=4,
                 linear_head_dim=8, linear_conv_kernel_dim=3, hc_mult=3)
    return [Config(), Config.from_json(str(golden_dir / "tiny-fp8" / "config.json")), odd]


@pytest.mark.parametrize("name", MODULES)
def test_engine_stage_table_is_the_oracles(name, golden_dir):
    mod = _module(name)
    assert [tuple(s) for s in mod.ENGINE_STAGES] == [(s.name, s.dtype) for s in S.STAGES]
    assert sorted(s.name for s in S.STAGES) == ALL_STAGE_NAMES
    for cfg in _configs(golden_dir):
        got = [tuple(r) for r in mod.stage_table(engine_config(cfg, 64))]
        want = [(s.name, s.dtype, S.stage_size(s.name, cfg)) for s in S.STAGES]
        assert got == want


def test_the_odd_config_tells_the_sizes_apart(golden_dir):
    # no two fields of the odd config share a value, so a size reading the wrong field differs
    odd = _configs(golden_dir)[2]
    used = sorted({n for s in S.STAGES if s.size for n in S.size_names(s.size)})
    values = [getattr(odd, n) for n in used]
    assert len(set(values)) == len(values), dict(zip(used, values))


def _full_capture_sizes(capture: Capture, cfg) -> list[str]:
    bad = []
    for (layer, stage), rows in capture.values.items():
        want = S.stage_size(stage, cfg)
        for pos, value in rows.items():
            if want is not None and np.asarray(value).size != want:
                bad.append(f"layer {layer} {stage} pos {pos}: {np.asarray(value).size} elements, schema {want}")
    return bad


def test_sizes_are_what_the_engine_and_the_oracle_capture(golden_dir):
    """Every stage with a fixed size, at every layer that has it: the rows the CPU engine and the
    oracle record have exactly the schema's number of elements."""
    import fast
    import oracle

    path = str(golden_dir / "tiny-fp8")
    ids = [5, 17, 99, 3, 42, 7, 250, 11, 64]
    with fast.Engine(path, threads=1, parallel_work=0) as eng:
        cfg = eng.config
        cap = Capture()
        eng.forward(ids, eng.new_cache(), cap)
    ocap = Capture()
    oracle.load(path).forward(ids, capture=ocap)
    expected = {(l, s) for l, s, _ in model_stages(cfg)}
    for c in (cap, ocap):
        assert set(c.values) == expected
        assert _full_capture_sizes(c, cfg) == []
    fixed = {s.name for s in S.STAGES if s.size is not None}
    assert fixed & {s for _, s in expected} == fixed  # every fixed-size stage was checked


def test_engine_reads_every_config_field_by_name(golden_dir):
    core = _module("fast._core")
    cfg = Config.from_json(str(golden_dir / "tiny-fp8" / "config.json"))
    full = engine_config(cfg, 64)
    assert list(full) == [f.name for f in S.ENGINE_CONFIG]
    for f in S.ENGINE_CONFIG:
        d = {k: v for k, v in full.items() if k != f.name}
        with pytest.raises(ValueError, match=f"missing field '{f.name}'"):
            core._Engine(d, 1)
        wrong = "x" if f.kind != "layers" else 3
        with pytest.raises(ValueError, match=f"'{f.name}' has the wrong type"):
            core._Engine(dict(full, **{f.name: wrong}), 1)


def test_engine_checks_every_positive_field(golden_dir):
    """The tiny model has every layer kind, so every positive field is needed and refused at 0."""
    core = _module("fast._core")
    cfg = Config.from_json(str(golden_dir / "tiny-fp8" / "config.json"))
    assert cfg.kda_layers and cfg.mla_layers and cfg.moe_layers and cfg.dense_layers
    positive = [f for f in S.ENGINE_CONFIG if f.positive]
    assert {f.needed_by for f in positive} == {"any", "kda", "mla", "dense", "moe"}
    for f in positive:
        with pytest.raises(ValueError, match=f"config field '{f.name}': must be >= 1"):
            core._Engine(dict(engine_config(cfg, 64), **{f.name: 0}), 1)


def test_engine_places_every_role(golden_dir):
    """Each role of oracle/names.py reaches its place in the C++ loader: given one value on a layer of its
    kind, the loader reports the size it expected (an unknown name would say 'unknown role')."""
    core = _module("fast._core")
    cfg = Config.from_json(str(golden_dir / "tiny-fp8" / "config.json"))
    assert S.ROLES == tuple(t.role for t in N.TENSORS)
    eng = core._Engine(engine_config(cfg, 64), 1)
    for spec in N.TENSORS:
        layer = next((l for l in range(cfg.num_hidden_layers) if spec.applies(cfg, l)), None) if spec.per_layer else -1
        assert layer is not None, spec.role
        expert = 0 if spec.per_expert else -1
        data = np.zeros(1, np.float32)
        with pytest.raises(ValueError) as e:
            eng.add_tensor(spec.role, layer, expert, "f32", data, None, [1])
        msg = str(e.value)
        assert msg.startswith(spec.role) and "unknown role" not in msg and "expected" in msg, (spec.role, msg)
    with pytest.raises(ValueError, match="unknown role"):
        eng.add_tensor("mlp.nope", 0, -1, "f32", np.zeros(1, np.float32), None, [1])


def _build_header() -> Path | None:
    for d in sorted((ROOT / "build").glob("*/generated/glm_schema.hpp")):
        return d
    return None


def test_generator_output_is_what_the_build_used():
    """A build folder's header equals what the schema generates now (CMake regenerates it when the
    schema changes; a difference means the build is stale)."""
    header = _build_header()
    if header is None:
        pytest.skip("no build folder with a generated header (build/*/generated/glm_schema.hpp)")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_headers.py"), "--check", str(header)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_generator_lists_every_fact(tmp_path):
    """The generator runs where the build runs it: any folder, and an isolated build environment
    without numpy or numba (pip install . builds with only the build requirements)."""
    out = tmp_path / "glm_schema.hpp"
    no_numpy = ("import runpy, sys; sys.modules['numpy'] = sys.modules['numba'] = None; "
                "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", no_numpy, str(ROOT / "tools" / "gen_headers.py"), str(out)],
                       capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    for f in S.ENGINE_CONFIG:
        assert f", {f.name})" in text
    for s in S.STAGES:
        assert f'"{s.name}", {s.dtype.upper()}' in text
    for role in S.ROLES:
        assert f'"{role}")' in text
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_headers.py"), "--check", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0
    out.write_text(text.replace("hc_sinkhorn_iters", "hc_iters"))
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_headers.py"), "--check", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "not what oracle/schema.py generates" in r.stderr


def test_size_expressions_refuse_what_cpp_cannot_compute():
    assert S.size_names("hc_mult * hidden_size") == ["hc_mult", "hidden_size"]
    with pytest.raises(ValueError, match="not an int engine config field"):
        S.size_names("hc_eps * 2")
    with pytest.raises(ValueError, match="only int engine config fields"):
        S.size_names("hidden_size // 2")


def test_config_fields_the_engines_take_are_marked_once():
    """ENGINE_CONFIG is the marked Config fields plus the derived ones; the kinds follow the Config's
    annotations, so the C++ types do too."""
    from dataclasses import fields
    marked = [f.name for f in fields(Config) if "engine" in f.metadata]
    assert [f.name for f in S.ENGINE_CONFIG] == marked + [f.name for f in S.ENGINE_DERIVED]
    kinds = {f.name: f.kind for f in S.ENGINE_CONFIG}
    c = Config()
    for name in marked:
        v = getattr(c, name)
        assert kinds[name] == type(v).__name__, name
