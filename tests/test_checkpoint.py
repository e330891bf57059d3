"""oracle.checkpoint: the committed tiny loads in every release, the peer's layouts load, and every bad
checkpoint gives one clear CheckpointError / ConfigError naming the file, tensor or field."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import oracle.checkpoint as ck
from oracle import names as N
from tools import zoo
from oracle.checkpoint import CheckpointError, open_checkpoint
from oracle.config import ConfigError

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "golden"
RELEASES = ("bf16", "fp8", "mxfp4")


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _decoders(monkeypatch):
    """Use oracle.numerics; if it cannot be imported, a private numpy fallback (this test only)."""
    try:
        from oracle import numerics  # noqa: F401

        return
    except Exception:  # noqa: BLE001
        pass
    import ml_dtypes

    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    e2m1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)

    def fp8(q, s):
        R, C = q.shape
        return (e4m3[q] * np.repeat(np.repeat(s, 128, 0), 128, 1)[:R, :C]).astype(np.float32)

    def mx(p, s):
        R = p.shape[0]
        codes = np.stack([p & 15, p >> 4], axis=-1).reshape(R, -1)
        return (e2m1[codes] * np.repeat(np.ldexp(np.float32(1), s.astype(np.int32) - 127), 32, 1)).astype(np.float32)

    fb = types.SimpleNamespace(
        decode_bf16_weight=lambda u: (u.astype(np.uint32) << 16).view(np.float32),
        decode_fp8_weight=fp8,
        decode_mxfp4_weight=mx,
    )
    monkeypatch.setattr(ck, "_numerics", lambda: fb)


def read_st(path):
    """safetensors file -> ({key: (dtype, shape, bytes)} in file order, metadata)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
        data = f.read()
    md = hdr.pop("__metadata__", None)
    items = sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in items}, md


def write_st(path, tensors, metadata=None, header_patch=None):
    hdr, pos, blobs = {}, 0, []
    if metadata:
        hdr["__metadata__"] = metadata
    for k, (dt, shape, b) in tensors.items():
        hdr[k] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + len(b)]}
        pos += len(b)
        blobs.append(b)
    if header_patch:
        header_patch(hdr)
    text = json.dumps(hdr).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def copy_golden(tmp_path, release="bf16", name=None):
    d = tmp_path / (name or f"tiny-{release}")
    shutil.copytree(GOLDEN / f"tiny-{release}", d)
    return d


def poke(path, key, flat_index, raw: bytes):
    """Overwrite element `flat_index` of tensor `key` with `raw` bytes."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
    isz = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1}[hdr[key]["dtype"]]
    off = 8 + n + hdr[key]["data_offsets"][0] + flat_index * isz
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(raw)


def one_error(d, **kw):
    with pytest.raises(CheckpointError) as ei:
        open_checkpoint(d, **kw)
    return str(ei.value), ei.value


# ----------------------------------------------------------------------------- the committed tiny


@pytest.mark.parametrize("release", RELEASES)
def test_golden_loads(release):
    c = open_checkpoint(GOLDEN / f"tiny-{release}")
    s = c.release_summary()
    assert s["release"] == release
    assert s["prefixes"] == ["model."] and s["has_lm_head"] and s["tokenizer"]
    assert not c.warnings
    assert release in c.summary_text() and "experts" in c.summary_text()
    assert len(c.keys()) == len(list(N.expected(c.config)))
    if release == "bf16":
        assert set(s["linear"]) == {"bf16"} and s["experts"] == {"bf16": [1, 2, 3, 4, 5]}
    if release == "fp8":
        assert s["linear"]["fp8"] == sum(1 for e in N.expected(c.config) if e.spec.zoo_fp8)
        assert s["experts"] == {"fp8": [1, 2, 3, 4, 5]}
    if release == "mxfp4":
        assert s["tensors"]["mxfp4"] == 4 * 8 * 3 and s["experts"] == {"bf16": [2], "mxfp4": [1, 3, 4, 5]}
    assert c.tokenizer is not None and c.tokenizer.get_vocab_size() <= c.config.vocab_size


def test_raw_formats():
    b = open_checkpoint(GOLDEN / "tiny-bf16")
    f = open_checkpoint(GOLDEN / "tiny-fp8")
    m = open_checkpoint(GOLDEN / "tiny-mxfp4")
    r = b.raw("kda.q_proj", layer=0)
    assert (r.release, r.data.dtype, r.shape, r.scale) == ("bf16", np.uint16, (72, 96), None)
    assert r.key == "layers.0.self_attn.q_proj.weight" and r.stored_key == "model." + r.key
    r = f.raw("kda.q_proj", layer=0)
    assert (r.release, r.data.dtype, r.data.shape, r.scale.dtype, r.scale.shape) == ("fp8", np.uint8, (72, 96), np.float32, (1, 1))
    assert r.scale_key == "model.layers.0.self_attn.q_proj.weight_scale_inv"
    r = m.raw("moe.expert.down_proj", layer=3, expert=7)
    assert (r.release, r.data.shape, r.scale.dtype, r.scale.shape, r.shape) == ("mxfp4", (96, 48), np.uint8, (96, 3), (96, 96))
    assert m.raw("moe.expert.down_proj", layer=2, expert=7).release == "bf16"
    r = b.raw("kda.q_conv", layer=5)
    assert (r.release, r.data.dtype, r.shape) == ("f32", np.float32, (72, 1, 4))
    assert not r.data.flags.writeable
    # role, template and concrete key name the same tensor
    for name in ("kda.A_log", "layers.{l}.self_attn.A_log", "layers.1.self_attn.A_log"):
        assert b.raw(name, layer=1).key == "layers.1.self_attn.A_log"
    assert b.raw("layers.3.self_attn.o_proj.weight").role == "mla.o_proj"
    assert b.raw("layers.0.self_attn.o_proj.weight").role == "kda.o_proj"
    with pytest.raises(KeyError):
        b.raw("kda.q_proj", layer=3)  # an MLA layer
    with pytest.raises(KeyError):
        b.raw("indexer.wk", layer=4)  # shared indexer: no weights
    with pytest.raises(KeyError):
        b.raw("moe.expert.up_proj", layer=1, expert=8)
    assert b.has("indexer.wk", 3) and not b.has("indexer.wk", 4)


def test_weight_f32_exact_and_cached():
    b = open_checkpoint(GOLDEN / "tiny-bf16")
    cfg = b.config
    for e in N.expected(cfg):
        w = b.weight_f32(e.key)
        assert w.dtype == np.float32 and w.shape == e.spec.shape(cfg)
        assert np.array_equal(w, zoo.master(cfg, e)), e.key
    w = b.weight_f32("mlp.down_proj", 0)
    assert w is b.weight_f32("layers.0.mlp.down_proj.weight") and not w.flags.writeable
    # releases agree where they store the same bf16 master
    f = open_checkpoint(GOLDEN / "tiny-fp8")
    for k in f.keys():
        if f.release_of(k) != "fp8":
            assert np.array_equal(f.weight_f32(k), b.weight_f32(k)), k
    m = open_checkpoint(GOLDEN / "tiny-mxfp4")
    assert np.array_equal(m.weight_f32("moe.expert.gate_proj", 2, 0), b.weight_f32("moe.expert.gate_proj", 2, 0))
    assert not np.array_equal(m.weight_f32("moe.expert.gate_proj", 1, 0), b.weight_f32("moe.expert.gate_proj", 1, 0))


# ----------------------------------------------------------------------------- other layouts


def _peer_model(tie=True, dtype=None):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    torch.manual_seed(0)
    cfg = Glm5NextTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=32, num_hidden_layers=5,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8, index_topk=8, index_kpool=4,
        index_head_dim=8, index_n_heads=2, linear_num_heads=2, linear_head_dim=8, pad_token_id=None,
        tie_word_embeddings=tie, mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"],
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                     "linear_attention"],
        indexer_types=["full", "full", "shared", "full", "full"],
    )
    m = Glm5NextTextModel(cfg)
    if dtype is not None:
        m = m.to(dtype)
    return m


def test_peer_save_pretrained_loads(tmp_path):
    from safetensors import safe_open

    m = _peer_model(tie=True)
    m.save_pretrained(tmp_path / "peer")
    c = open_checkpoint(tmp_path / "peer")
    s = c.release_summary()
    assert s["release"] == "f32" and s["prefixes"] == [""] and s["aliases_used"] == 0 and not c.warnings
    with safe_open(str(tmp_path / "peer" / "model.safetensors"), framework="numpy") as f:
        for k in c.keys():
            assert np.array_equal(c.weight_f32(k), f.get_tensor(k)), k
    assert np.array_equal(c.weight_f32("lm_head"), c.weight_f32("embed"))  # tied


def test_peer_save_without_head(tmp_path):
    m = _peer_model(tie=False)
    m.save_pretrained(tmp_path / "peer")
    msg, _ = one_error(tmp_path / "peer")
    assert "lm_head.weight" in msg and "1 tensor(s) missing" in msg
    c = open_checkpoint(tmp_path / "peer", allow_missing_lm_head=True)
    assert not c.has_lm_head and not c.has("lm_head")


def test_peer_bf16_save_loads(tmp_path):
    torch = pytest.importorskip("torch")
    m = _peer_model(tie=True, dtype=torch.bfloat16)
    m.save_pretrained(tmp_path / "peer")
    c = open_checkpoint(tmp_path / "peer")
    assert c.release_summary()["release"] == "bf16"
    sd = m.state_dict()
    assert np.array_equal(c.weight_f32("kda.A_log", 0), sd["layers.0.self_attn.forget_gate.A_log"].float().numpy())


def test_in_memory_aliases_load(tmp_path):
    """transformers' in-memory names (state_dict): attn_hc.fn, forget_gate.*, fused conv1d, packed experts."""
    pytest.importorskip("torch")
    from safetensors.torch import save_file

    m = _peer_model(tie=True)
    m.save_pretrained(tmp_path / "peer")
    d = tmp_path / "mem"
    d.mkdir()
    shutil.copy(tmp_path / "peer" / "config.json", d / "config.json")
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    assert "layers.1.mlp.experts.gate_up_proj" in sd and "layers.0.self_attn.conv1d.weight" in sd
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    a, b = open_checkpoint(tmp_path / "peer"), open_checkpoint(d)
    assert b.release_summary()["aliases_used"] > 0 and not b.warnings
    for k in a.keys():
        assert np.array_equal(a.weight_f32(k), b.weight_f32(k)), k


@pytest.mark.parametrize("prefix", ["model.language_model.", ""])
def test_prefixes(tmp_path, prefix):
    d = copy_golden(tmp_path, "fp8")
    t, md = read_st(d / "model.safetensors")
    t = {(k if k == "lm_head.weight" else prefix + k[len("model."):]): v for k, v in t.items()}
    write_st(d / "model.safetensors", t, md)
    c, g = open_checkpoint(d), open_checkpoint(GOLDEN / "tiny-fp8")
    assert c.release_summary()["prefixes"] == [prefix]
    for k in g.keys():
        assert np.array_equal(c.raw(k).data, g.raw(k).data), k


def test_multimodal_extras_are_warnings(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    t, md = read_st(d / "model.safetensors")
    t["model.visual.blocks.0.attn.qkv.weight"] = ("BF16", [2, 2], b"\0" * 8)
    t["model.layers.6.eh_proj.weight"] = ("BF16", [2, 2], b"\0" * 8)  # an MTP layer
    write_st(d / "model.safetensors", t, md)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({"model_type": "glm5_next", "text_config": cfg,
                                               "vision_config": {"depth": 1}}))
    c = open_checkpoint(d)
    assert any("non-text" in w for w in c.warnings)
    assert any("model.layers.6.eh_proj.weight" in w for w in c.warnings)


def test_sharded_with_index(tmp_path):
    d = copy_golden(tmp_path, "fp8")
    t, md = read_st(d / "model.safetensors")
    keys = list(t)
    half = {k: t[k] for k in keys[: len(keys) // 2]}, {k: t[k] for k in keys[len(keys) // 2:]}
    os.remove(d / "model.safetensors")
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for n, part in zip(names, half):
        write_st(d / n, part, md)
    wm = {k: names[0] if k in half[0] else names[1] for k in keys}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    c = open_checkpoint(d)
    assert c.release_summary()["files"] == names
    # the index names a missing shard / the wrong file
    os.rename(d / names[1], d / "elsewhere.bin")
    msg, _ = one_error(d)
    assert names[1] in msg and "missing from the directory" in msg
    os.rename(d / "elsewhere.bin", d / names[1])
    wm[keys[0]] = names[1]
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    msg, _ = one_error(d)
    assert keys[0] in msg and "index" in msg


# ----------------------------------------------------------------------------- bad checkpoints


def test_missing_tensors_all_listed(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    t, md = read_st(d / "model.safetensors")
    gone = ["model.layers.3.self_attn.indexer.wk.weight", "model.layers.1.mlp.experts.5.up_proj.weight", "model.norm.weight"]
    write_st(d / "model.safetensors", {k: v for k, v in t.items() if k not in gone}, md)
    msg, e = one_error(d)
    assert "3 tensor(s) missing" in msg
    for k in gone:
        assert k[len("model."):] in msg
    assert len(e.problems) == 1


def test_wrong_shape(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    t, md = read_st(d / "model.safetensors")
    k = "model.layers.0.self_attn.q_proj.weight"
    dt, shape, b = t[k]
    t[k] = (dt, [96, 72], b)
    write_st(d / "model.safetensors", t, md)
    msg, _ = one_error(d)
    assert k in msg and "[96, 72]" in msg and "expected [72, 96]" in msg and "model.safetensors" in msg


def test_wrong_dtype(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    t, md = read_st(d / "model.safetensors")
    k = "model.layers.2.post_attention_layernorm.weight"
    t[k] = ("F16", t[k][1], t[k][2])
    k2 = "model.layers.1.self_attn.dt_bias"
    t[k2] = ("I32", t[k2][1], t[k2][2])
    write_st(d / "model.safetensors", t, md)
    msg, e = one_error(d)
    assert k in msg and "F16" in msg and "expected BF16" in msg
    assert k2 in msg and "I32" in msg and "expected F32" in msg
    assert len(e.problems) == 2


def test_mxfp4_only_for_routed_experts(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    t, md = read_st(d / "model.safetensors")
    k = "model.layers.1.mlp.shared_experts.up_proj.weight"
    t[k] = ("U8", [96, 48], b"\0" * 96 * 48)
    t[k + "_scale"] = ("U8", [96, 3], b"\x7f" * 96 * 3)
    write_st(d / "model.safetensors", t, md)
    msg, _ = one_error(d)
    assert k in msg and "only for routed experts" in msg


def test_fp8_without_scale(tmp_path):
    d = copy_golden(tmp_path, "fp8")
    t, md = read_st(d / "model.safetensors")
    k = "model.layers.0.self_attn.v_proj.weight_scale_inv"
    del t[k]
    write_st(d / "model.safetensors", t, md)
    msg, _ = one_error(d)
    assert k in msg and "without its scale" in msg


def test_truncated_file(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    p = d / "model.safetensors"
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(size - 1000)
    msg, e = one_error(d)
    assert "model.safetensors" in msg and "truncated" in msg
    assert "missing" not in msg  # the tensors are there, only cut: named as such


def test_header_offset_beyond_file(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    t, md = read_st(d / "model.safetensors")
    k = "model.layers.4.hc_ffn_fn"

    def patch(h):
        b, e = h[k]["data_offsets"]
        h[k]["data_offsets"] = [b + 10**9, e + 10**9]

    write_st(d / "model.safetensors", t, md, header_patch=patch)
    msg, e = one_error(d)
    assert k in msg and "beyond" in msg and len(e.problems) == 1


def test_header_length_beyond_file(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    with open(d / "model.safetensors", "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    msg, _ = one_error(d)
    assert "model.safetensors: header length" in msg and "exceeds the file size" in msg


@pytest.mark.parametrize("content", [b"", b"1234", b"\x10\0\0\0\0\0\0\0{not json!!!!!!!}", b"\x02\0\0\0\0\0\0\0[]"])
def test_not_a_safetensors_file(tmp_path, content):
    d = copy_golden(tmp_path, "bf16")
    (d / "model.safetensors").write_bytes(content)
    msg, _ = one_error(d)
    assert "model.safetensors" in msg


def test_nan_in_bf16_weight(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    k = "model.layers.5.mlp.experts.3.down_proj.weight"
    poke(d / "model.safetensors", k, 17, struct.pack("<H", 0x7FC1))
    poke(d / "model.safetensors", "model.norm.weight", 3, struct.pack("<H", 0xFF80))  # -inf
    msg, e = one_error(d)
    assert k in msg and "1 NaN" in msg and "flat index 17" in msg
    assert "model.norm.weight" in msg and "inf" in msg and len(e.problems) == 2
    # verify=False defers the scan to first use
    c = open_checkpoint(d, verify=False)
    c.raw("kda.q_proj", layer=0)
    with pytest.raises(CheckpointError, match="NaN"):
        c.raw("moe.expert.down_proj", layer=5, expert=3)


def test_nan_in_f32_weight(tmp_path):
    d = copy_golden(tmp_path, "fp8")
    k = "model.layers.2.self_attn.k_conv1d.weight"
    poke(d / "model.safetensors", k, 5, struct.pack("<f", float("nan")))
    k2 = "model.layers.3.mlp.shared_experts.gate_proj.weight_scale_inv"
    poke(d / "model.safetensors", k2, 0, struct.pack("<f", float("inf")))
    msg, e = one_error(d)
    assert k in msg and "NaN" in msg and k2 in msg and "non-finite" in msg


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nan_fp8_code(tmp_path, code):
    d = copy_golden(tmp_path, "fp8")
    k = "model.layers.3.self_attn.kv_b_proj.weight"
    poke(d / "model.safetensors", k, 100, bytes([code]))
    msg, _ = one_error(d)
    assert k in msg and "NaN code" in msg and "flat index 100" in msg


def test_e8m0_nan_scale(tmp_path):
    d = copy_golden(tmp_path, "mxfp4")
    k = "model.layers.4.mlp.experts.6.gate_proj.weight_scale"
    poke(d / "model.safetensors", k, 2, b"\xff")
    msg, _ = one_error(d)
    assert k in msg and "0xFF" in msg


def test_missing_config(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    os.remove(d / "config.json")
    msg, _ = one_error(d)
    assert "config.json is missing" in msg


def test_bad_config_field(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    cfg = json.loads((d / "config.json").read_text())
    cfg["topk_group"] = 5
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as ei:
        open_checkpoint(d)
    assert ei.value.field == "topk_group" and "config.json" in str(ei.value)


def test_config_shape_mismatch_lists_everything(tmp_path):
    """A config that does not match the tensors: every mismatching tensor is named, once."""
    d = copy_golden(tmp_path, "bf16")
    cfg = json.loads((d / "config.json").read_text())
    cfg["linear_head_dim"] = 16
    (d / "config.json").write_text(json.dumps(cfg))
    msg, e = one_error(d)
    assert "layers.0.self_attn.q_proj.weight" in msg and "expected [48, 96]" in msg


def test_no_safetensors_and_not_a_dir(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    os.remove(d / "model.safetensors")
    msg, _ = one_error(d)
    assert "no *.safetensors" in msg
    msg, _ = one_error(d / "config.json")
    assert "not a directory" in msg


def test_extra_and_duplicate_keys(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    t, md = read_st(d / "model.safetensors")
    t["model.layers.0.self_attn.rotary.inv_freq"] = ("F32", [2], b"\0" * 8)
    write_st(d / "model.safetensors", t, md)
    c = open_checkpoint(d)
    assert any("rotary.inv_freq" in w for w in c.warnings)
    t["layers.0.input_layernorm.weight"] = t["model.layers.0.input_layernorm.weight"]
    write_st(d / "model.safetensors", t, md)
    msg, _ = one_error(d)
    assert "duplicates" in msg and "layers.0.input_layernorm.weight" in msg


def test_bad_tokenizer(tmp_path):
    d = copy_golden(tmp_path, "bf16")
    (d / "tokenizer.json").write_text("{}")
    msg, _ = one_error(d)
    assert "tokenizer.json" in msg


def test_fuzzed_headers_never_crash(tmp_path):
    """Random corruptions of the header and random truncations: a clear error or a clean load, nothing else."""
    src = (GOLDEN / "tiny-fp8" / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", src[:8])[0]
    d = copy_golden(tmp_path, "fp8")
    p = d / "model.safetensors"
    for seed in range(60):
        buf = bytearray(src)
        h = zoo.uniform(zoo.tensor_key(seed, "fuzz"), 0, 8)
        if seed % 3 == 0:
            buf = buf[: int(h[0] * len(buf))]
        else:
            for j in range(1 + seed % 4):
                buf[int(h[j] * (8 + n))] = int(h[j + 4] * 256)
        p.write_bytes(bytes(buf))
        try:
            open_checkpoint(d)
        except (CheckpointError, ConfigError):
            pass


def test_many_problems_are_summarized(tmp_path):
    """Every BF16 tensor stored as F16 and expert 3 dropped: ~200 problems. The message groups them by
    kind and shows the first few of each, then "and N more", with the total; the exception keeps all."""
    d = copy_golden(tmp_path, "bf16")
    t, md = read_st(d / "model.safetensors")
    gone = [k for k in t if ".experts.3." in k]
    t = {k: ("F16" if dt == "BF16" else dt, shape, b) for k, (dt, shape, b) in t.items() if k not in gone}
    write_st(d / "model.safetensors", t, md)
    msg, e = one_error(d)
    f16 = [k for k, (dt, _, _) in t.items() if dt == "F16"]
    assert len(e.problems) == len(f16) + 1 > 100                  # every wrong dtype, and one missing line
    assert sorted(e.missing) == sorted(k[len("model."):] for k in gone)
    lines = msg.splitlines()
    assert f"{len(e.problems)} problems:" in lines[0]
    assert len(lines) <= 40, len(lines)
    more = [ln for ln in lines if "more like the" in ln]
    shown = [ln for ln in lines if "found F16" in ln]
    assert more and sum(int(ln.split("and ")[1].split()[0]) for ln in more) + len(shown) == len(f16)
    missing_line = next(ln for ln in lines if "tensor(s) missing" in ln)
    assert missing_line.rstrip().endswith(f"and {len(gone) - 8} more")
    assert all(k in e.full_text() for k in f16)
    assert e.to_json()["problems"] == e.problems
    # the CLI a user meets: the same summary, exit 2
    r = subprocess.run([sys.executable, "-m", "tools", "run", "--checkpoint", str(d), "--ids", "1,2", "--max-new", "1"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    text = r.stdout + r.stderr
    assert r.returncode == 2 and f"{len(e.problems)} problems" in text and "more like the 8 above" in text
    assert text.count("  - ") <= 40, text                           # problems listed (wrapping aside)
