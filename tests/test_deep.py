"""The `deep` zoo entry (issue 18): GLM-5.3-Flash's 45-layer schedule at tiny widths, generated on demand
(52.8 MB in three releases: too big to commit, so golden/deep.sha256 pins its bytes). On it: oracle =
CPU engine at every stage, activations stay O(1) over the 90 sublayers, and the headline
`oracle diff ... --layer 15 --pos 45` names the injected point. And the indexer's tie rule: equal scores
at the selection boundary go to the lower pool index, in the oracle and in the CPU engine alike."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import oracle
from oracle.capture import Capture
from oracle.config import DENSE, KDA, MLA, SPARSE
from tests.engine_checks import assert_same_capture
from tools import zoo
from tools.golden import canonical_prompts

ROOT = Path(__file__).resolve().parent.parent
HASHES = ROOT / "golden" / "deep.sha256"
RELEASES = ("bf16", "fp8", "mxfp4")


@pytest.fixture(scope="module")
def deep_root(tmp_path_factory) -> Path:
    """deep-{bf16,fp8,mxfp4}, written once for this module (~6 s)."""
    root = tmp_path_factory.mktemp("deep")
    zoo.make_zoo("deep", root)
    return root


@pytest.fixture(scope="module")
def runs(deep_root):
    """release -> (config, oracle capture, engine capture, oracle tokens, engine tokens) on the `long` prompt."""
    import fast
    out = {}
    for r in RELEASES:
        path = str(deep_root / f"deep-{r}")
        model = oracle.load(path)
        ids, n = canonical_prompts(model.config.vocab_size)["long"]
        ca, cb = Capture(), Capture()
        ta = model.generate(ids, n, capture=ca)
        tb = fast.Engine(path, device="cpu", threads=2, parallel_work=0).generate(ids, n, capture=cb)
        out[r] = (model.config, ca, cb, ta, tb)
    return out


def test_schedule_is_the_real_models():
    c = zoo.zoo_config("deep")
    assert c.num_hidden_layers == 45
    for l in range(45):
        assert c.layer_types[l] == (MLA if l % 4 == 3 else KDA), l
        assert c.mlp_layer_types[l] == (DENSE if l < 3 else SPARSE), l
    assert set(c.indexer_types) == {"full"} and c.indexer_layers == c.mla_layers
    assert 15 in c.indexer_layers and len(c.mla_layers) == 11
    # narrow, with the awkward sizes tiny has: D not a multiple of 64, 3 heads, hc_mult 4
    assert c.hidden_size % 64 != 0 and c.hc_mult == 4 and c.num_attention_heads == 3
    # the schedule holds at any depth: a 12-layer cut is the same rule
    c12 = zoo.zoo_config("deep", num_hidden_layers=12)
    assert c12.layer_types == c.layer_types[:12] and c12.mlp_layer_types == c.mlp_layer_types[:12]


def test_regenerates_byte_identically(deep_root):
    want: dict[str, dict[str, str]] = {}
    for line in HASHES.read_text().splitlines():
        digest, name = line.split()
        folder, fn = name.split("/")
        want.setdefault(folder, {})[fn] = digest
    assert set(want) == {f"deep-{r}" for r in RELEASES}
    for r in RELEASES:
        d = deep_root / f"deep-{r}"
        assert zoo.file_hashes(d) == want[f"deep-{r}"], r
        assert zoo.checkpoint_sizes("deep", r) == {fn: os.path.getsize(d / fn) for fn in os.listdir(d)}
        assert (d / "tokenizer.json").exists()


def test_other_entries_do_not_scale_their_residual_writers():
    # deep's residual_scale is its own: the committed tiny bytes (tests/test_zoo.py) depend on it being 1
    assert zoo.ZOO["deep"].residual_scale < 1
    assert all(z.residual_scale == 1.0 for k, z in zoo.ZOO.items() if k != "deep")


@pytest.mark.parametrize("release", RELEASES)
def test_oracle_equals_cpu_engine_at_every_stage(runs, release):
    cfg, ca, cb, ta, tb = runs[release]
    positions = sorted({p for (_, _, p) in ca.hashes})
    assert len(positions) >= 46 and ta == tb
    assert {l for (l, _, _) in ca.hashes} == set(range(cfg.num_hidden_layers + 1))  # every layer and the head
    assert_same_capture(cfg, ca, cb, positions, names=("oracle", "cpu"))


def _rms(cap, layer, stage):
    rows = cap.values[(layer, stage)]
    a = np.concatenate([np.asarray(v, np.float64).reshape(-1) for v in rows.values()])
    return float(np.sqrt(np.mean(a * a)))


def test_activations_stay_order_one(runs):
    """Nothing blows up or vanishes over 45 layers; routing and selection stay non-trivial."""
    cfg, cap, _, tokens, _ = runs["bf16"]
    streams, outs = [], []
    for l in range(cfg.num_hidden_layers):
        streams.append(_rms(cap, l, "ffn_hc.streams"))
        outs.append(_rms(cap, l, "mla.out" if cfg.is_mla(l) else "kda.out"))
        outs.append(_rms(cap, l, "moe.out" if cfg.is_moe(l) else "mlp.out"))
        if cfg.is_moe(l):
            logits = np.stack([np.asarray(v, np.float64) for v in cap.values[(l, "moe.logits")].values()])
            assert (1 / (1 + np.exp(-logits))).std() > 0.2, l  # router scores spread
            used = np.unique(np.concatenate(list(cap.values[(l, "moe.selected")].values())))
            assert used.size == cfg.n_routed_experts, l
        if cfg.has_indexer(l):
            sel = cap.values[(l, "mla.selected")]
            assert any(len(sel[p]) < p + 1 for p in sel), l  # the indexer drops pools
    print("stream RMS per layer:", " ".join(f"{x:.2f}" for x in streams))
    assert 0.5 < min(streams) and max(streams) < 6, streams
    assert 0.1 < min(outs) and max(outs) < 2, outs
    assert len(set(tokens)) > 1


def test_headline_diff_names_layer_15_position_45(deep_root):
    """The issue's acceptance command."""
    cmd = [sys.executable, "-m", "tools", "diff", "--checkpoint", str(deep_root / "deep-bf16"),
           "--a", "oracle", "--b", "cpu:inject=15,45,mla.scores,3,1", "--layer", "15", "--pos", "45"]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, COLUMNS="200", NO_COLOR="1"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    verdict = [line for line in r.stdout.splitlines() if line.startswith("DIFFER:")]
    assert verdict, r.stdout
    assert "first divergence at layer 15, position 45, stage mla.scores, element 3:" in verdict[0], verdict
    assert "(1 f32 ULP" in verdict[0], verdict
    assert "layer 15, position 45: every stage in execution order" in r.stdout


# ------------------------------------------------------------------------------------------ ties


def _zero_rows(path: Path, key: str, r0: int, r1: int) -> None:
    """Set rows [r0, r1) of a BF16 tensor of a safetensors file to +0 in place."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        h = json.loads(f.read(n))[key]
        assert h["dtype"] == "BF16"
        row = 2 * int(np.prod(h["shape"][1:]))
        f.seek(8 + n + h["data_offsets"][0] + r0 * row)
        f.write(bytes(row * (r1 - r0)))


def _canonical(scores: np.ndarray, budget: int, lower_wins: bool = True) -> list[int]:
    """The best `budget` pools, equal scores to the lower (or, for the contrast, the higher) index."""
    idx = np.arange(scores.size)
    order = sorted(idx, key=lambda p: (-float(scores[p]), p if lower_wins else -p))
    return sorted(int(p) for p in order[:budget])


def test_ties_at_the_selection_boundary_go_to_the_lower_pool(tmp_path, golden_dir):
    """tiny-bf16 with layer 3's indexer queries zeroed for heads 1 and 2: a pool's score is then
    w_0 * relu(q_0 . K_p), exactly 0 for every pool head 0 does not see, so where w_0 < 0 the zeros
    are the best scores, and with more of them than the budget the boundary falls inside a tie."""
    import fast
    d = tmp_path / "tiny-ties"
    shutil.copytree(golden_dir / "tiny-bf16", d)
    cfg = zoo.zoo_config("tiny")
    L, hd = 3, cfg.index_head_dim
    assert cfg.has_indexer(L)
    _zero_rows(d / "model.safetensors", f"model.layers.{L}.self_attn.indexer.wq_b.weight", hd, cfg.index_n_heads * hd)

    model = oracle.load(str(d))
    ids, n = canonical_prompts(cfg.vocab_size)["long"]
    ca, cb = Capture(), Capture()
    ta = model.generate(ids, n, capture=ca)
    tb = fast.Engine(str(d), device="cpu", threads=2, parallel_work=0).generate(ids, n, capture=cb)
    positions = sorted({p for (_, _, p) in ca.hashes})
    assert ta == tb
    assert_same_capture(cfg, ca, cb, positions, names=("oracle", "cpu"))

    kp, budget = cfg.index_kpool, cfg.index_topk // cfg.index_kpool
    boundary_ties = 0
    for p, scores in ca.values[(L, "indexer.scores")].items():
        scores = np.asarray(scores)
        if scores.size <= budget:
            continue
        want = _canonical(scores, budget)
        got = sorted({int(t) // kp for t in ca.values[(L, "mla.selected")][p] if int(t) < scores.size * kp})
        assert got == want, (p, scores.tolist(), got)
        s = np.sort(scores)[::-1]
        if s[budget - 1] == s[budget]:
            boundary_ties += 1
            assert _canonical(scores, budget, lower_wins=False) != want  # the rule decides here
    print("positions with a tie at the boundary:", boundary_ties)
    assert boundary_ties >= 3, f"only {boundary_ties} positions with a tie at the boundary"
