"""oracle.config: defaults equal the peer's, the peer's config forms are accepted, invalid configs are
refused with a ConfigError naming the field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from oracle.config import IGNORED_PEER_FIELDS, Config, ConfigError
from tools.zoo import zoo_config

transformers = pytest.importorskip("transformers")
from transformers import PretrainedConfig  # noqa: E402
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig  # noqa: E402


def _norm(v):
    return list(v) if isinstance(v, tuple) else v


def test_defaults_equal_peer_defaults():
    ours, peer = Config(), Glm5NextTextConfig()
    for f in dataclasses.fields(Config):
        assert _norm(getattr(ours, f.name)) == _norm(getattr(peer, f.name)), f.name


def test_every_peer_field_is_known():
    generic = set(PretrainedConfig().to_dict())
    peer_fields = set(Glm5NextTextConfig().to_dict()) - generic - {"model_type", "transformers_version"}
    ours = {f.name for f in dataclasses.fields(Config)}
    unknown = peer_fields - ours - IGNORED_PEER_FIELDS
    assert not unknown, f"peer fields neither used nor explicitly ignored: {sorted(unknown)}"


def test_default_schedules():
    c = Config()
    assert c.layer_types[:4] == ("linear_attention",) * 3 + ("indexed_attention",)
    assert c.mla_layers == tuple(range(3, 45, 4)) and len(c.mla_layers) == 11 and len(c.kda_layers) == 34
    assert c.dense_layers == (0, 1, 2) and len(c.moe_layers) == 42
    assert set(c.indexer_types) == {"full"} and c.indexer_layers == c.mla_layers
    assert c.qk_head_dim == 256 and c.kda_dim == 8192 and c.hc_dim == 24
    assert c.experts_per_group == 288 and c.index_select_pools == 128


def test_tiny_derived():
    c = zoo_config("tiny")
    assert c.kda_layers == (0, 1, 2, 5) and c.mla_layers == (3, 4)
    assert c.indexer_layers == (3,) and c.shares_indexer(4) and not c.shares_indexer(3)
    assert c.moe_layers == (1, 2, 3, 4, 5) and c.dense_layers == (0,)
    assert c.is_kda(0) and c.is_mla(3) and c.is_moe(1) and c.is_dense(0) and c.has_indexer(3)
    assert (c.qk_head_dim, c.kda_dim, c.hc_dim, c.shared_intermediate_size) == (24, 72, 24, 96)
    assert c.has_lm_head


def test_roundtrip_with_peer():
    c = zoo_config("tiny")
    d = c.to_dict()
    assert d["model_type"] == "glm5_next_text" and d["architectures"] == ["Glm5NextTextModel"]
    peer = Glm5NextTextConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    back = Config.from_dict(peer.to_dict())
    assert back == c
    assert Config.from_dict(json.loads(json.dumps(d))) == c


def test_from_json(tmp_path):
    c = zoo_config("small")
    p = tmp_path / "config.json"
    c.to_json(p)
    assert Config.from_json(p) == c


def test_multimodal_text_config():
    text = zoo_config("tiny").to_dict()
    d = {"model_type": "glm5_next", "text_config": text, "vision_config": {"depth": 2, "hidden_size": 32},
         "image_token_id": 5, "quantization_config": {"quant_method": "fp8"}}
    assert Config.from_dict(d) == zoo_config("tiny")
    # a flat multimodal config (text fields at the top level) is a text config
    flat = dict(text, model_type="glm5_next")
    assert Config.from_dict(flat) == zoo_config("tiny")


def test_unknown_keys_ignored():
    d = zoo_config("tiny").to_dict()
    d.update(foo=1, use_cache=False, router_aux_loss_coef=0.5, output_router_logits=True, head_dim=99)
    assert Config.from_dict(d) == zoo_config("tiny")


def test_peer_forms():
    base = {k: v for k, v in zoo_config("tiny").to_dict().items() if k != "indexer_types"}
    c = Config.from_dict(dict(base, index_topk_pattern="FFFFSF"))
    assert c.indexer_types == ("full", "full", "full", "full", "shared", "full")
    for freq, offset in ((1, 2), (2, 0), (3, 1)):
        L = 8
        d = dict(num_hidden_layers=L, layer_types=["linear_attention"] * L, mlp_layer_types=["dense"] * L,
                 index_topk_freq=freq, index_skip_topk_offset=offset)
        peer = Glm5NextTextConfig(**d)
        assert list(Config.from_dict(d).indexer_types) == peer.indexer_types
    c = Config.from_dict(dict(base, linear_attn_config={"head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 3,
                                                         "gate_lower_bound": -4.0}))
    assert (c.linear_head_dim, c.linear_num_heads, c.linear_conv_kernel_dim, c.linear_lower_bound) == (32, 2, 3, -4.0)
    c = Config.from_dict(dict(base, linear_attn_config={"gate_lower_bound": None}))  # safe_gate default -> -5
    assert c.linear_lower_bound == -5.0
    lt = list(base["layer_types"])
    lt[3] = "full_attention"
    assert Config.from_dict(dict(base, layer_types=lt)).layer_types[3] == "indexed_attention"
    assert Config.from_dict(dict(base, num_key_value_heads=None)).num_key_value_heads == 3
    assert Config.from_dict(dict(base, routed_scaling_factor=2)).routed_scaling_factor == 2.0


def test_allowed_variants():
    base = zoo_config("tiny").to_dict()
    # a "shared" entry on a KDA layer is ignored (only MLA layers use it)
    c = Config.from_dict(dict(base, indexer_types=["shared", "full", "full", "full", "shared", "shared"]))
    assert c.indexer_layers == (3,)
    c = Config.from_dict(dict(base, hc_mult=2))
    assert c.hc_dim == 8
    c = Config.from_dict(dict(base, tie_word_embeddings=True))
    assert not c.has_lm_head


TINY_LT = ["linear_attention"] * 3 + ["indexed_attention"] * 2 + ["linear_attention"]

INVALID = [
    (dict(layer_types=TINY_LT[:5]), "layer_types"),
    (dict(mlp_layer_types=["dense"] * 7), "mlp_layer_types"),
    (dict(indexer_types=["full"] * 5), "indexer_types"),
    (dict(layer_types=TINY_LT[:5] + ["attention"]), "layer_types"),
    (dict(layer_types="linear_attention"), "layer_types"),
    (dict(mlp_layer_types=["dense"] * 5 + ["moe"]), "mlp_layer_types"),
    (dict(indexer_types=["full"] * 5 + ["half"]), "indexer_types"),
    (dict(index_topk_pattern="FFXFSF", indexer_types=None), "index_topk_pattern"),
    (dict(index_topk_pattern="FFF", indexer_types=None), "index_topk_pattern"),
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(qk_rope_head_dim=64), "qk_rope_head_dim"),
    (dict(num_key_value_heads=1), "num_key_value_heads"),
    (dict(index_topk=10), "index_topk"),
    (dict(index_kpool=0), "index_kpool"),
    (dict(n_routed_experts=9), "n_group"),
    (dict(n_group=8), "n_group"),  # one expert per group
    (dict(topk_group=3), "topk_group"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(linear_lower_bound=None), "linear_lower_bound"),
    (dict(linear_lower_bound=1.0), "linear_lower_bound"),
    (dict(indexer_types=["full", "full", "full", "shared", "full", "full"]), "indexer_types"),  # after KDA
    (dict(indexer_types=["full", "full", "full", "full", "shared", "full"],
          layer_types=["indexed_attention"] * 2 + TINY_LT[2:]), None),  # valid control: see below
    (dict(layer_types=["indexed_attention"] + TINY_LT[1:], indexer_types=["shared"] + ["full"] * 5), "indexer_types"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(vocab_size=-1), "vocab_size"),
    (dict(hc_mult=0), "hc_mult"),
    (dict(num_hidden_layers=0), "num_hidden_layers"),
    (dict(n_shared_experts=0), "n_shared_experts"),
    (dict(hidden_size="96"), "hidden_size"),
    (dict(hidden_size=96.0), "hidden_size"),
    (dict(hidden_size=True), "hidden_size"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob"),
    (dict(rms_norm_eps="x"), "rms_norm_eps"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(swiglu_limit=0), "swiglu_limit"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
    (dict(model_type="llama"), "model_type"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(pad_token_id=300), "pad_token_id"),
    (dict(linear_attn_config="x"), "linear_attn_config"),
]


@pytest.mark.parametrize("change,field", INVALID, ids=[f"{i}-{f}" for i, (_, f) in enumerate(INVALID)])
def test_invalid(change, field):
    d = zoo_config("tiny").to_dict()
    d.update(change)
    if field is None:
        Config.from_dict(d)  # a valid control case
        return
    with pytest.raises(ConfigError) as ei:
        Config.from_dict(d)
    assert ei.value.field == field
    assert f"'{field}'" in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_shared_message_names_layer():
    d = zoo_config("tiny").to_dict()
    d["indexer_types"] = ["full", "full", "full", "shared", "full", "full"]
    with pytest.raises(ConfigError, match=r"layer 3 .*layer 2 is linear_attention"):
        Config.from_dict(d)


def test_nope_message():
    d = dict(zoo_config("tiny").to_dict(), qk_rope_head_dim=64)
    with pytest.raises(ConfigError, match="NoPE"):
        Config.from_dict(d)


def test_from_json_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        Config.from_json(tmp_path / "config.json")
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON") as ei:
        Config.from_json(p)
    assert str(p) in str(ei.value)
    p.write_text(json.dumps(dict(zoo_config("tiny").to_dict(), n_group=3)))
    with pytest.raises(ConfigError, match="n_group") as ei:
        Config.from_json(p)
    assert str(p) in str(ei.value)
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError):
        Config.from_json(p)


def test_frozen_and_hashable():
    c = zoo_config("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 5
    assert hash(c) == hash(zoo_config("tiny"))
    assert c.replace(n_group=1, topk_group=1) == zoo_config("tiny-g1")
