"""tools.zoo: the committed golden/tiny-* checkpoints, deterministic regeneration, the quantization
rules, the RNG, the other zoo entries."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from oracle import names as N
from tools import zoo
from oracle.checkpoint import open_checkpoint

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
RELEASES = ("bf16", "fp8", "mxfp4")
TINY_BF16_EXPERT_LAYER = 2


def _stored(key):
    return key if key == "lm_head.weight" else "model." + key


def _headers(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


# ----------------------------------------------------------------------------- committed files


@pytest.mark.parametrize("release", RELEASES)
def test_golden_loads_with_safetensors(release):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    d = GOLDEN / f"tiny-{release}"
    cfg = zoo.zoo_config("tiny")
    want = {}
    for e in N.expected(cfg):
        t, S, k = e.spec, e.spec.shape(cfg), _stored(e.key)
        if t.kind == N.F32:
            want[k] = ("F32", S)
        elif t.kind == N.LINEAR and release == "fp8" and t.zoo_fp8:
            want[k] = ("F8_E4M3", S)
            want[N.fp8_scale_key(k)] = ("F32", N.fp8_scale_shape(S))
        elif t.kind == N.LINEAR and release == "mxfp4" and t.mxfp4_ok and e.layer != TINY_BF16_EXPERT_LAYER:
            want[k] = ("U8", N.mxfp4_packed_shape(S))
            want[N.mxfp4_scale_key(k)] = ("U8", N.mxfp4_scale_shape(S))
        else:
            want[k] = ("BF16", S)
    tdt = {"F32": torch.float32, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8}
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(want)
        md = f.metadata()
        assert md["format"] == "pt" and md["zoo"] == "tiny" and md["release"] == release
        for k, (dt, S) in want.items():
            x = f.get_tensor(k)
            assert x.dtype == tdt[dt], k
            assert tuple(x.shape) == tuple(S), k
    assert json.loads((d / "config.json").read_text())["model_type"] == "glm5_next_text"


def test_golden_mxfp4_layer2_experts_bf16():
    h = _headers(GOLDEN / "tiny-mxfp4" / "model.safetensors")
    for l in range(1, 6):
        for e in range(8):
            for p in ("gate_proj", "up_proj", "down_proj"):
                k = f"model.layers.{l}.mlp.experts.{e}.{p}.weight"
                if l == TINY_BF16_EXPERT_LAYER:
                    assert h[k]["dtype"] == "BF16" and k + "_scale" not in h
                else:
                    assert h[k]["dtype"] == "U8" and h[k + "_scale"]["dtype"] == "U8"
    # everything that is not a routed expert is as in the bf16 release
    hb = _headers(GOLDEN / "tiny-bf16" / "model.safetensors")
    for k, v in hb.items():
        if k != "__metadata__" and ".experts." not in k:
            assert h[k]["dtype"] == v["dtype"], k


def test_same_config_in_every_release():
    texts = {(GOLDEN / f"tiny-{r}" / "config.json").read_text() for r in RELEASES}
    assert len(texts) == 1


def test_regenerates_byte_identically(tmp_path):
    for r in RELEASES:
        d = zoo.make_checkpoint("tiny", r, tmp_path / f"tiny-{r}")
        assert zoo.file_hashes(d) == zoo.file_hashes(GOLDEN / f"tiny-{r}"), r


def test_row_chunking_does_not_change_bytes(tmp_path, monkeypatch):
    orig = zoo._row_chunk
    monkeypatch.setattr(zoo, "_row_chunk", lambda S, target=1: orig(S, 1))  # 128-row chunks
    d = zoo.make_checkpoint("tiny", "fp8", tmp_path / "tiny-fp8")
    assert zoo.file_hashes(d) == zoo.file_hashes(GOLDEN / "tiny-fp8")


def test_cli_writes_the_same_bytes(tmp_path, capsys):
    assert zoo.main_make_checkpoint(["tiny", "--release", "mxfp4", "--out", str(tmp_path), "--quiet"]) == 0
    assert zoo.file_hashes(tmp_path / "tiny-mxfp4") == zoo.file_hashes(GOLDEN / "tiny-mxfp4")
    assert zoo.main_make_checkpoint(["tiny", "--out", str(tmp_path), "--set", "n_group=3", "--quiet"]) == 2
    assert "n_group" in capsys.readouterr().err


# ----------------------------------------------------------------------------- size and free space


@pytest.mark.parametrize("release", RELEASES)
def test_size_estimate_is_exact(release):
    """checkpoint_sizes names every file make_checkpoint writes with its size (the golden files are its output)."""
    d = GOLDEN / f"tiny-{release}"
    assert zoo.checkpoint_sizes("tiny", release) == {fn: os.path.getsize(d / fn) for fn in os.listdir(d)}


def _fake_free(monkeypatch, free):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(free + 10**9, 10**9, free))


def test_refuses_what_does_not_fit_before_writing(tmp_path, monkeypatch, capsys):
    need = sum(zoo.checkpoint_sizes("tiny", "bf16").values())
    margin = zoo.SPACE_MARGIN + need // 50
    _fake_free(monkeypatch, need + margin - 1)
    args = ["tiny", "--release", "bf16", "--out", str(tmp_path / "z")]
    assert zoo.main_make_checkpoint(args) == 2
    err = capsys.readouterr().err
    assert "not enough space" in err and f"{need:,} bytes" in err and f"{need + margin - 1:,} bytes" in err
    assert not (tmp_path / "z").exists()
    with pytest.raises(zoo.NoSpaceError, match="nothing was written"):
        zoo.make_checkpoint("tiny", "bf16", tmp_path / "z")
    assert not (tmp_path / "z").exists()
    _fake_free(monkeypatch, need + margin)
    assert zoo.main_make_checkpoint(args + ["--quiet"]) == 0
    assert sum(os.path.getsize(p) for p in (tmp_path / "z" / "tiny-bf16").iterdir()) == need
    # writing over an existing checkpoint needs only the growth
    fits, _, needed, _, _ = zoo.space_check([tmp_path / "z" / "tiny-bf16"], [need])
    assert fits and needed == 0


def test_dry_run_prints_the_size_and_writes_nothing(tmp_path, capsys):
    assert zoo.main_make_checkpoint(["tiny", "--out", str(tmp_path / "z"), "--dry-run", "--set", "num_hidden_layers=9"]) == 0
    out = capsys.readouterr().out
    for r in RELEASES:
        n = sum(zoo.checkpoint_sizes("tiny", r, num_hidden_layers=9).values())
        assert f"tiny-{r}  {n:,} bytes" in out
    assert not (tmp_path / "z").exists()


def test_no_progress_bar_into_a_pipe(tmp_path):
    import subprocess
    import sys
    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "tools", "make-checkpoint", "tiny", "--release", "bf16", "--out",
                        str(tmp_path)], cwd=repo, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    n = sum(zoo.checkpoint_sizes("tiny", "bf16").values())
    assert f"{n:,} bytes" in r.stderr and "\r" not in r.stderr and "%" not in r.stderr


# ----------------------------------------------------------------------------- quantization


def test_fp8_dequant_error_bounded_per_block():
    b = open_checkpoint(GOLDEN / "tiny-bf16")
    f = open_checkpoint(GOLDEN / "tiny-fp8")
    n = 0
    for key in f.keys():
        r = f.raw(key)
        if r.release != "fp8":
            continue
        n += 1
        w = b.weight_f32(key)
        q = f.weight_f32(key)
        R, C = w.shape
        for bi in range(r.scale.shape[0]):
            for bj in range(r.scale.shape[1]):
                blk = (slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128))
                wb, qb, s = w[blk], q[blk], float(r.scale[bi, bj])
                amax = float(np.abs(wb).max())
                assert s == np.float32(amax) / np.float32(448), key
                # E4M3 has 3 mantissa bits: half an ulp is 2^-4 relative; subnormal spacing 2^-9 * s
                bound = np.maximum(np.abs(wb) * 2.0**-4, s * 2.0**-10) * (1 + 2.0**-20)
                assert (np.abs(qb - wb) <= bound).all(), key
                assert np.abs(qb).max() <= amax * (1 + 2.0**-20), key  # amax maps to 448 exactly-ish
    assert n == len([k for k in f.keys() if f.release_of(k) == "fp8"]) > 100


def test_mxfp4_exponent_rule_and_error():
    b = open_checkpoint(GOLDEN / "tiny-bf16")
    m = open_checkpoint(GOLDEN / "tiny-mxfp4")
    n = 0
    for key in m.keys():
        r = m.raw(key)
        if r.release != "mxfp4":
            continue
        n += 1
        w = b.weight_f32(key)
        e = r.scale.astype(np.int32) - 127
        amax = np.abs(w.reshape(w.shape[0], -1, 32)).max(axis=2)
        # the smallest e with amax <= 6 * 2^e
        assert (amax <= 6.0 * np.ldexp(1.0, e)).all() and (amax > 6.0 * np.ldexp(1.0, e - 1)).all(), key
        q = m.weight_f32(key)
        s = np.repeat(np.ldexp(1.0, e), 32, axis=1)
        bound = np.maximum(np.abs(w) * 2.0**-2, 0.25 * s)  # E2M1: 1 mantissa bit; spacing 0.5 below 1
        assert (np.abs(q - w) <= bound).all(), key
    assert n == 4 * 8 * 3


def test_mxfp4_exponent_examples():
    a = np.array([6.0, 6.0001, 3.0, 3.0001, 0.0, 1.0, 1e-30, 0.75, 0.7, 1e-38], np.float32)
    assert zoo.mxfp4_exponent(a).tolist() == [0, 1, -1, 0, 0, -2, -102, -3, -3, -127]


def _e4m3_table():
    import ml_dtypes

    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _rne_reference(x, table, max_code, sign_bit):
    """Nearest table value, ties to the even code; sign kept (also for zero)."""
    pos = table[: max_code + 1]
    a = np.abs(x)
    i = np.clip(np.searchsorted(pos, a), 1, max_code)
    lo, hi = pos[i - 1], pos[i]
    pick_hi = (a - lo > hi - a) | ((a - lo == hi - a) & (i % 2 == 0))
    code = np.where(pick_hi, i, i - 1).astype(np.uint8)
    return np.where(np.signbit(x), code | np.uint8(sign_bit), code).astype(np.uint8)


def test_fp8_encoder_is_rne():
    t = _e4m3_table()
    rng = np.random.default_rng(0)  # test inputs only; the zoo never uses numpy's RNG
    x = np.concatenate([
        (rng.standard_normal(200000) * 100).astype(np.float32),
        (rng.standard_normal(20000) * 0.01).astype(np.float32),
        t[:126], -t[:126], ((t[:125] + t[1:126]) / 2).astype(np.float32),  # exact ties
    ])
    x = np.clip(x, -448, 448)
    import ml_dtypes

    codes = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(codes, _rne_reference(x, t, 126, 0x80))


def test_fp8_quantize_known_block():
    w = np.zeros((130, 129), np.float32)
    w[0, 0], w[1, 1], w[129, 128], w[5, 128] = 448.0 * 2, -3.0, 0.5, 0.0
    q, s = zoo.quantize_fp8(w)
    assert s.shape == (2, 2) and s.dtype == np.float32
    assert s[0, 0] == 2.0 and s[1, 0] == 1.0 and s[1, 1] == np.float32(0.5) / np.float32(448)
    t = _e4m3_table()
    assert t[q[0, 0]] == 448 and t[q[1, 1]] == -1.5 and t[q[129, 128]] == 448


def test_mxfp4_encoder_is_rne_and_packs_low_nibble_first():
    import ml_dtypes

    e2m1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    x = np.concatenate([mids, -mids, e2m1[:8], np.linspace(-6, 6, 1001, dtype=np.float32)])
    ref = _rne_reference(x, e2m1, 7, 0x8)
    got = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    assert np.array_equal(got, ref)
    w = np.zeros((1, 64), np.float32)
    w[0, 0], w[0, 1], w[0, 33] = 1.0, 6.0, -0.5
    p, s = zoo.quantize_mxfp4(w)
    assert p.shape == (1, 32) and s.tolist() == [[127, 124]]  # amax 6 -> 2^0; amax 0.5 -> 2^-3 (0.5 <= 0.75)
    assert p[0, 0] == (0x2 | (0x7 << 4)) and p[0, 16] == (0x0 | (0xE << 4))  # -0.5 * 2^3 = -4 -> 0b1110


def _awkward_matrix(R, C, seed):
    """Random values over many magnitudes, with zeros, ties and exact E4M3/E2M1 grid points mixed in."""
    rng = np.random.default_rng(seed)  # test inputs only
    w = (rng.standard_normal((R, C)) * np.exp2(rng.integers(-20, 8, (R, C)))).astype(np.float32)
    w[rng.random((R, C)) < 0.05] = 0.0
    w[rng.random((R, C)) < 0.02] *= -0.0
    w[:, :32] = 0.0  # an all-zero MXFP4 group
    if R > 2 and C >= 64:
        w[1, 32:64] = np.linspace(-6, 6, 32, dtype=np.float32)  # E2M1 grid and midpoints at scale 1
        w[2, 32:64] = 1e-40  # f32 subnormals
    return w


@pytest.mark.parametrize("shape", [(1, 32), (130, 257), (128, 128), (300, 96)])
def test_fp8_kernel_equals_reference(shape):
    w = _awkward_matrix(*shape, seed=shape[0])
    q, s = zoo.quantize_fp8(w)
    q2, s2 = zoo.quantize_fp8_reference(w)
    assert np.array_equal(s, s2) and np.array_equal(q, q2)


@pytest.mark.parametrize("shape", [(1, 64), (130, 256), (96, 96)])
def test_mxfp4_kernel_equals_reference(shape):
    w = _awkward_matrix(*shape, seed=shape[1])
    p, s = zoo.quantize_mxfp4(w)
    p2, s2 = zoo.quantize_mxfp4_reference(w)
    assert np.array_equal(s, s2) and np.array_equal(p, p2)


def test_fused_master_equals_reference_formula():
    """master() uses a fused Numba kernel; it must equal the readable formula on every law."""
    cfg = zoo.zoo_config("tiny")
    for role, layer in (("kda.q_proj", 0), ("final_norm", None), ("attn_hc.base", 2), ("moe.gate_bias", 1),
                        ("indexer.kpool_ape", 3), ("attn_hc.scale", 0)):
        e = N.resolve(cfg, role, layer)
        law, mean, std = zoo._init_rule(e.spec, cfg)
        n = int(np.prod(e.spec.shape(cfg)))
        v = zoo.normal(zoo.tensor_key(zoo.DEFAULT_SEED, e.key), 0, n) * std
        if mean != 0.0:
            v = v + mean
        v = v.astype(np.float32)
        if e.spec.kind != N.F32:
            v = zoo.bf16_round(v)
        assert np.array_equal(zoo.master(cfg, e).reshape(-1), v), role


def test_bf16_bits_match_ml_dtypes():
    import ml_dtypes

    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(100000).astype(np.float32),
                        np.frombuffer(rng.bytes(400000), np.float32)])
    x = x[np.isfinite(x)]
    assert np.array_equal(zoo.bf16_bits(x), x.astype(ml_dtypes.bfloat16).view(np.uint16))


# ----------------------------------------------------------------------------- RNG


def test_rng_matches_reference_and_is_pinned():
    key = zoo.tensor_key(zoo.DEFAULT_SEED, "layers.0.self_attn.q_proj.weight")
    got = zoo.raw_stream(key, 1000, 5)
    assert got.tolist() == [zoo.stream_py(key, 1000 + i) for i in range(5)]
    # normal(): element i from words 2i and 2i+1
    a, b = zoo.stream_py(key, 2 * 7), zoo.stream_py(key, 2 * 7 + 1)
    s = (a >> 32) + (a & 0xFFFFFFFF) + (b >> 32) + (b & 0xFFFFFFFF)
    assert zoo.normal(key, 7, 1)[0] == (s * 2.0**-32 - 2.0) * 1.7320508075688772
    # pinned values: a change here changes every zoo checkpoint (and the golden hashes)
    assert zoo.tensor_key(0, "x") == 0x1954BEFEEFC0E91C
    # splitmix64 known answer: the first output from state 0
    assert zoo.stream_py(0, 0) == 0xE220A8397B1DCDAF


def test_normal_statistics():
    z = zoo.normal(zoo.tensor_key(1, "stats"), 0, 1 << 20)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01 and np.abs(z).max() < 3.47
    u = zoo.uniform(zoo.tensor_key(1, "u"), 0, 1 << 16)
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01


def test_counter_based_slices():
    k = zoo.tensor_key(3, "slices")
    whole = zoo.normal(k, 0, 1000)
    assert np.array_equal(np.concatenate([zoo.normal(k, 0, 300), zoo.normal(k, 300, 700)]), whole)


def test_masters_distinct_per_tensor_and_seed():
    cfg = zoo.zoo_config("tiny")
    e1 = N.resolve(cfg, "kda.q_proj", 0)
    e2 = N.resolve(cfg, "kda.k_proj", 0)
    assert not np.array_equal(zoo.master(cfg, e1), zoo.master(cfg, e2))
    assert not np.array_equal(zoo.master(cfg, e1, seed=1), zoo.master(cfg, e1))


# ----------------------------------------------------------------------------- other entries


def test_tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(GOLDEN / "tiny-bf16" / "tokenizer.json"))
    assert tok.get_vocab_size() <= 300
    s = "The oracle defines every bit, 42 times!"
    ids = tok.encode(s).ids
    assert max(ids) < 300 and tok.decode(ids) == s
    assert zoo.tokenizer_json(300) == (GOLDEN / "tiny-bf16" / "tokenizer.json").read_text()


def test_tiny_g1_and_small_configs():
    g1 = zoo.zoo_config("tiny-g1")
    assert (g1.n_group, g1.topk_group) == (1, 1)
    s = zoo.zoo_config("small")
    assert s.mla_layers == (3, 7) and s.dense_layers == (0, 1) and s.n_routed_experts == 16
    assert s.hidden_size == 352 and s.hidden_size % 64 != 0 and s.kda_dim == 256
    sl = zoo.zoo_config("slice")
    assert sl.layer_types == ("linear_attention",) * 3 + ("indexed_attention",)
    assert sl.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    assert (sl.hidden_size, sl.n_routed_experts, sl.vocab_size, sl.kda_dim) == (4096, 288, 154880, 8192)
    sl6 = zoo.zoo_config("slice", num_hidden_layers=6, n_routed_experts=32)
    assert sl6.mlp_layer_types == ("dense",) + ("sparse",) * 5 and sl6.n_routed_experts == 32


def test_tiny_g1_writes_and_loads(tmp_path):
    d = zoo.make_checkpoint("tiny-g1", "mxfp4", tmp_path / "g1")
    c = open_checkpoint(d)
    assert c.config.n_group == 1 and c.release_summary()["experts"] == {"bf16": [2], "mxfp4": [1, 3, 4, 5]}


def test_each_entry_schedule_gives_its_own_lists():
    """The schedules that extend an entry to any layer count reproduce the entry's lists at its own count."""
    for name, z in zoo.ZOO.items():
        for k, v in z.schedule(z.fields["num_hidden_layers"]).items():
            if z.fields.get(k) is not None:  # (slice's first-dense rule: test_tiny_g1_and_small_configs)
                assert list(v) == list(z.fields[k]), (name, k)


@pytest.mark.parametrize("name", ["tiny", "small", "slice"])
def test_layer_count_alone_extends_the_schedules(name):
    for n in (1, 2, 5, 9, 16):
        c = zoo.zoo_config(name, num_hidden_layers=n)
        assert len(c.layer_types) == len(c.mlp_layer_types) == len(c.indexer_types) == n
        base = zoo.zoo_config(name)
        m = min(n, base.num_hidden_layers)  # the entry's own layers keep their kinds
        assert c.layer_types[:m] == base.layer_types[:m] and c.mlp_layer_types[:m] == base.mlp_layer_types[:m]
        assert c.indexer_types[:m] == base.indexer_types[:m]
    c = zoo.zoo_config("tiny", num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["indexed_attention"])
    assert c.indexer_types == ("full",) * 4


def test_tiny_with_nine_layers_runs_the_same_on_oracle_and_engine(tmp_path, capsys):
    """`make-checkpoint tiny --set num_hidden_layers=9` needed three hand-written lists."""
    import fast
    import oracle
    assert zoo.main_make_checkpoint(["tiny", "--release", "bf16", "--out", str(tmp_path), "--quiet",
                                     "--set", "num_hidden_layers=9"]) == 0
    d = str(tmp_path / "tiny-bf16")
    m = oracle.load(d)
    assert m.config.num_hidden_layers == 9 and m.config.mla_layers == (3, 4)
    ids = [(i * 37 + 11) % 300 for i in range(9)]
    toks, logits = m.generate(ids, 3, return_logits=True)
    got_toks, got_logits = fast.Engine(d, threads=2).generate(ids, 3, return_logits=True)
    assert got_toks == toks
    assert np.array_equal(got_logits.view(np.uint32), logits.view(np.uint32))


SLICE_SMALL = dict(hidden_size=256, vocab_size=512, pad_token_id=None, n_routed_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=64, intermediate_size=160, num_attention_heads=2, num_key_value_heads=2,
                   q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, v_head_dim=32, index_n_heads=2,
                   index_head_dim=32, linear_num_heads=2, linear_head_dim=64, index_topk=64)


@pytest.mark.parametrize("release", RELEASES)
def test_slice_streams_into_shards(tmp_path, release):
    d = zoo.make_checkpoint("slice", release, tmp_path / "s", shard_bytes=300_000, **SLICE_SMALL)
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    idx = json.loads((Path(d) / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"].values()) == set(files)
    c = open_checkpoint(d)
    assert c.release_summary()["release"] == release
    if release == "mxfp4":
        assert c.release_summary()["experts"] == {"bf16": [3], "mxfp4": [1, 2]}
    # regenerating with a different shard size gives the same tensors
    d2 = zoo.make_checkpoint("slice", release, tmp_path / "s2", **SLICE_SMALL)
    c2 = open_checkpoint(d2)
    assert len(os.listdir(d2)) == 2  # one file + config.json
    for k in c.keys():
        a, b = c.raw(k), c2.raw(k)
        assert np.array_equal(a.data, b.data) and (a.scale is None or np.array_equal(a.scale, b.scale)), k
    assert zoo.checkpoint_sizes("slice", release, shard_bytes=300_000, **SLICE_SMALL) == {
        fn: os.path.getsize(Path(d) / fn) for fn in os.listdir(d)}
    # and again in the same place: stale shards are removed first
    zoo.make_checkpoint("slice", release, tmp_path / "s2", shard_bytes=300_000, **SLICE_SMALL)
    assert zoo.file_hashes(tmp_path / "s2") == zoo.file_hashes(d)


def test_small_activations_stay_bounded(tmp_path):
    """Weight scales keep the oracle's activations O(1) through all layers of `small` (and router
    scores spread); checked through the peer in float64 if transformers is present."""
    torch = pytest.importorskip("torch")
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    d = zoo.make_checkpoint("small", "bf16", tmp_path / "small")
    m = Glm5NextTextModel.from_pretrained(d, dtype=torch.float64, experts_implementation="eager")
    m.eval()
    ids = torch.tensor([[(i * 37 + 11) % 1000 for i in range(48)]])
    rms, scores = [], []
    hooks = [l.register_forward_hook(lambda mod, i, o: rms.append(o[0].pow(2).mean().sqrt().item()))
             for l in m.layers]
    hooks += [l.mlp.gate.register_forward_hook(lambda mod, i, o: scores.append(o[0].sigmoid().std().item()))
              for l in m.layers if hasattr(l.mlp, "gate")]
    with torch.no_grad():
        h = m(ids).last_hidden_state[0]
    c = open_checkpoint(d)
    logits = h @ torch.from_numpy(c.weight_f32("lm_head").astype(np.float64)).T
    assert all(0.3 < r < 8 for r in rms), rms
    assert all(s > 0.15 for s in scores), scores
    assert len(set(logits.argmax(-1).tolist())) > 10
