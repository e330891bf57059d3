"""THE name table: every tensor of the GLM-5.3-Flash text model, in one place.

Shared by the checkpoint loader, both engines and the diff tool. For each tensor:

* ``template``: the canonical key in the original release layout, without prefix
  (``layers.{l}.self_attn.q_conv1d.weight``, ``layers.{l}.mlp.experts.{e}.gate_proj.weight``);
* ``role``: a short name the engines use (``kda.q_proj``, ``mla.q_a_proj``, ``moe.expert.gate_proj``);
* ``shape(cfg)``: the logical (decoded) shape;
* ``kind``:
    - ``linear``: a matmul weight [out, in]; stored BF16, or FP8 E4M3 (+ ``weight_scale_inv``), or, for
      routed experts only, MXFP4 (U8 nibbles + U8 E8M0 ``weight_scale``); F32 is accepted too (the peer's
      ``save_pretrained`` writes float32);
    - ``f32``: kept in F32 by the release (conv taps, dt_bias, A_log, e_score_correction_bias, mHC base
      and scale); BF16 storage is accepted (exactly representable);
    - ``bf16``: stored BF16 by the release (norm weights, embeddings, lm_head, router gate, mHC fn,
      indexer small parameters); F32 storage is accepted;
* ``where``: which layers carry it: ``model`` (global), ``lm_head`` (global, absent when tied), ``all``
  (every layer), ``kda``, ``mla``, ``indexer`` (MLA layers with a 'full' indexer), ``dense``, ``moe``,
  ``expert`` (per routed expert of MoE layers).

Key prefixes in files: ``model.``, ``model.language_model.`` or none (transformers'
``save_pretrained`` of ``Glm5NextTextModel`` writes none). The in-memory transformers names
(``attn_hc.fn``, ``self_attn.forget_gate.*``, fused ``self_attn.conv1d.weight``, packed
``mlp.experts.gate_up_proj`` / ``down_proj``) are accepted as aliases, see ``aliases()``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

from .config import Config

__all__ = [
    "TensorSpec",
    "Entry",
    "Alias",
    "TENSORS",
    "BY_ROLE",
    "BY_TEMPLATE",
    "PREFIXES",
    "LINEAR",
    "F32",
    "BF16",
    "spec",
    "resolve",
    "parse_key",
    "expected",
    "strip_prefix",
    "aliases",
    "fp8_scale_key",
    "mxfp4_scale_key",
    "fp8_scale_shape",
    "mxfp4_packed_shape",
    "mxfp4_scale_shape",
    "FP8_BLOCK",
    "MXFP4_GROUP",
]

LINEAR = "linear"
F32 = "f32"
BF16 = "bf16"

FP8_BLOCK = 128  # FP8 scale_inv block: 128 x 128
MXFP4_GROUP = 32  # one E8M0 scale per 32 columns

# Prefixes under which the text model's keys may be stored (longest first).
PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")

ShapeFn = Callable[[Config], tuple]


@dataclass(frozen=True)
class TensorSpec:
    role: str
    template: str
    kind: str
    where: str
    shape_of: ShapeFn
    zoo_fp8: bool = False  # the FP8 release (and the zoo) stores it as FP8 E4M3
    mxfp4_ok: bool = False  # may be MXFP4 (routed experts only)
    doc: str = ""

    @property
    def per_layer(self) -> bool:
        return "{l}" in self.template

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.template

    def key(self, layer: int | None = None, expert: int | None = None) -> str:
        if self.per_layer and layer is None:
            raise KeyError(f"{self.role} ({self.template}) needs a layer index")
        if self.per_expert and expert is None:
            raise KeyError(f"{self.role} ({self.template}) needs an expert index")
        return self.template.format(l=layer, e=expert)

    def shape(self, cfg: Config) -> tuple[int, ...]:
        return tuple(int(x) for x in self.shape_of(cfg))

    def applies(self, cfg: Config, layer: int | None = None) -> bool:
        w = self.where
        if w == "model":
            return True
        if w == "lm_head":
            return cfg.has_lm_head
        assert layer is not None
        if w == "all":
            return True
        if w == "kda":
            return cfg.is_kda(layer)
        if w == "mla":
            return cfg.is_mla(layer)
        if w == "indexer":
            return cfg.has_indexer(layer)
        if w == "dense":
            return cfg.is_dense(layer)
        if w in ("moe", "expert"):
            return cfg.is_moe(layer)
        raise AssertionError(w)


def _t(role, template, kind, where, shape_of, zoo_fp8=None, mxfp4_ok=False, doc=""):
    if zoo_fp8 is None:
        zoo_fp8 = kind == LINEAR
    return TensorSpec(role, template, kind, where, shape_of, zoo_fp8, mxfp4_ok, doc)


_L = "layers.{l}."
_A = _L + "self_attn."
_I = _A + "indexer."
_M = _L + "mlp."

TENSORS: tuple[TensorSpec, ...] = (
    # ---- global
    _t("embed", "embed_tokens.weight", BF16, "model", lambda c: (c.vocab_size, c.hidden_size)),
    _t("final_norm", "norm.weight", BF16, "model", lambda c: (c.hidden_size,)),
    _t("lm_head", "lm_head.weight", BF16, "lm_head", lambda c: (c.vocab_size, c.hidden_size),
       doc="absent when tie_word_embeddings (then embed_tokens.weight is the head)"),
    # ---- every layer: norms and mHC
    _t("attn_norm", _L + "input_layernorm.weight", BF16, "all", lambda c: (c.hidden_size,)),
    _t("ffn_norm", _L + "post_attention_layernorm.weight", BF16, "all", lambda c: (c.hidden_size,)),
    _t("attn_hc.fn", _L + "hc_attn_fn", BF16, "all", lambda c: (c.hc_dim, c.hc_mult * c.hidden_size)),
    _t("attn_hc.base", _L + "hc_attn_base", F32, "all", lambda c: (c.hc_dim,)),
    _t("attn_hc.scale", _L + "hc_attn_scale", F32, "all", lambda c: (3,)),
    _t("ffn_hc.fn", _L + "hc_ffn_fn", BF16, "all", lambda c: (c.hc_dim, c.hc_mult * c.hidden_size)),
    _t("ffn_hc.base", _L + "hc_ffn_base", F32, "all", lambda c: (c.hc_dim,)),
    _t("ffn_hc.scale", _L + "hc_ffn_scale", F32, "all", lambda c: (3,)),
    # ---- KDA (linear attention) layers
    _t("kda.q_proj", _A + "q_proj.weight", LINEAR, "kda", lambda c: (c.kda_dim, c.hidden_size)),
    _t("kda.k_proj", _A + "k_proj.weight", LINEAR, "kda", lambda c: (c.kda_dim, c.hidden_size)),
    _t("kda.v_proj", _A + "v_proj.weight", LINEAR, "kda", lambda c: (c.kda_dim, c.hidden_size)),
    _t("kda.q_conv", _A + "q_conv1d.weight", F32, "kda", lambda c: (c.kda_dim, 1, c.linear_conv_kernel_dim)),
    _t("kda.k_conv", _A + "k_conv1d.weight", F32, "kda", lambda c: (c.kda_dim, 1, c.linear_conv_kernel_dim)),
    _t("kda.v_conv", _A + "v_conv1d.weight", F32, "kda", lambda c: (c.kda_dim, 1, c.linear_conv_kernel_dim)),
    _t("kda.f_a_proj", _A + "f_a_proj.weight", LINEAR, "kda", lambda c: (c.linear_head_dim, c.hidden_size),
       zoo_fp8=False),
    _t("kda.f_b_proj", _A + "f_b_proj.weight", LINEAR, "kda", lambda c: (c.kda_dim, c.linear_head_dim),
       zoo_fp8=False),
    _t("kda.dt_bias", _A + "dt_bias", F32, "kda", lambda c: (c.kda_dim,)),
    _t("kda.A_log", _A + "A_log", F32, "kda", lambda c: (c.linear_num_heads,)),
    _t("kda.b_proj", _A + "b_proj.weight", LINEAR, "kda", lambda c: (c.linear_num_heads, c.hidden_size),
       zoo_fp8=False),
    _t("kda.g_a_proj", _A + "g_a_proj.weight", LINEAR, "kda", lambda c: (c.linear_head_dim, c.hidden_size),
       zoo_fp8=False),
    _t("kda.g_b_proj", _A + "g_b_proj.weight", LINEAR, "kda", lambda c: (c.kda_dim, c.linear_head_dim),
       zoo_fp8=False),
    _t("kda.o_norm", _A + "o_norm.weight", BF16, "kda", lambda c: (c.linear_head_dim,)),
    _t("kda.o_proj", _A + "o_proj.weight", LINEAR, "kda", lambda c: (c.hidden_size, c.kda_dim)),
    # ---- MLA layers
    _t("mla.q_a_proj", _A + "q_a_proj.weight", LINEAR, "mla", lambda c: (c.q_lora_rank, c.hidden_size)),
    _t("mla.q_a_norm", _A + "q_a_layernorm.weight", BF16, "mla", lambda c: (c.q_lora_rank,)),
    _t("mla.q_b_proj", _A + "q_b_proj.weight", LINEAR, "mla",
       lambda c: (c.num_attention_heads * c.qk_head_dim, c.q_lora_rank)),
    _t("mla.kv_a_proj", _A + "kv_a_proj_with_mqa.weight", LINEAR, "mla",
       lambda c: (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size)),
    _t("mla.kv_a_norm", _A + "kv_a_layernorm.weight", BF16, "mla", lambda c: (c.kv_lora_rank,)),
    _t("mla.kv_b_proj", _A + "kv_b_proj.weight", LINEAR, "mla",
       lambda c: (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)),
    _t("mla.o_proj", _A + "o_proj.weight", LINEAR, "mla",
       lambda c: (c.hidden_size, c.num_attention_heads * c.v_head_dim)),
    # ---- DSA indexer (MLA layers with indexer_types[l] == "full")
    _t("indexer.wq_b", _I + "wq_b.weight", LINEAR, "indexer",
       lambda c: (c.index_n_heads * c.index_head_dim, c.q_lora_rank), zoo_fp8=False),
    _t("indexer.wk", _I + "wk.weight", LINEAR, "indexer", lambda c: (c.index_head_dim, c.hidden_size),
       zoo_fp8=False),
    _t("indexer.k_norm", _I + "k_norm.weight", BF16, "indexer", lambda c: (c.index_head_dim,)),
    _t("indexer.k_norm_bias", _I + "k_norm.bias", BF16, "indexer", lambda c: (c.index_head_dim,)),
    _t("indexer.weights_proj", _I + "weights_proj.weight", LINEAR, "indexer",
       lambda c: (c.index_n_heads, c.hidden_size), zoo_fp8=False),
    _t("indexer.kpool_ape", _I + "index_kpool_compress_ape", BF16, "indexer",
       lambda c: (c.index_kpool, c.index_head_dim)),
    _t("indexer.kpool_gate", _I + "index_kpool_compress_gate", BF16, "indexer",
       lambda c: (c.index_head_dim, c.hidden_size)),
    # ---- dense SwiGLU MLP
    _t("mlp.gate_proj", _M + "gate_proj.weight", LINEAR, "dense", lambda c: (c.intermediate_size, c.hidden_size)),
    _t("mlp.up_proj", _M + "up_proj.weight", LINEAR, "dense", lambda c: (c.intermediate_size, c.hidden_size)),
    _t("mlp.down_proj", _M + "down_proj.weight", LINEAR, "dense", lambda c: (c.hidden_size, c.intermediate_size)),
    # ---- MoE
    _t("moe.gate", _M + "gate.weight", BF16, "moe", lambda c: (c.n_routed_experts, c.hidden_size)),
    _t("moe.gate_bias", _M + "gate.e_score_correction_bias", F32, "moe", lambda c: (c.n_routed_experts,)),
    _t("moe.expert.gate_proj", _M + "experts.{e}.gate_proj.weight", LINEAR, "expert",
       lambda c: (c.moe_intermediate_size, c.hidden_size), mxfp4_ok=True),
    _t("moe.expert.up_proj", _M + "experts.{e}.up_proj.weight", LINEAR, "expert",
       lambda c: (c.moe_intermediate_size, c.hidden_size), mxfp4_ok=True),
    _t("moe.expert.down_proj", _M + "experts.{e}.down_proj.weight", LINEAR, "expert",
       lambda c: (c.hidden_size, c.moe_intermediate_size), mxfp4_ok=True),
    _t("moe.shared.gate_proj", _M + "shared_experts.gate_proj.weight", LINEAR, "moe",
       lambda c: (c.shared_intermediate_size, c.hidden_size)),
    _t("moe.shared.up_proj", _M + "shared_experts.up_proj.weight", LINEAR, "moe",
       lambda c: (c.shared_intermediate_size, c.hidden_size)),
    _t("moe.shared.down_proj", _M + "shared_experts.down_proj.weight", LINEAR, "moe",
       lambda c: (c.hidden_size, c.shared_intermediate_size)),
)

BY_ROLE: dict[str, TensorSpec] = {t.role: t for t in TENSORS}
# A template may be shared by two roles: `layers.{l}.self_attn.o_proj.weight` is kda.o_proj on KDA
# layers and mla.o_proj on MLA layers (same key text and, here, the layer type tells them apart).
BY_TEMPLATE: dict[str, tuple[TensorSpec, ...]] = {}
for _s in TENSORS:
    BY_TEMPLATE[_s.template] = BY_TEMPLATE.get(_s.template, ()) + (_s,)
assert len(BY_ROLE) == len(TENSORS)


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"(\{l\}|\{e\})", template)
    out = []
    for p in parts:
        if p == "{l}":
            out.append(r"(?P<l>\d+)")
        elif p == "{e}":
            out.append(r"(?P<e>\d+)")
        else:
            out.append(re.escape(p))
    return re.compile("^" + "".join(out) + "$")


_REGEX = [(t, _template_regex(t.template)) for t in TENSORS]


class Entry(NamedTuple):
    """One concrete tensor the model needs."""

    key: str  # canonical key, no prefix
    spec: TensorSpec
    layer: int | None
    expert: int | None


def spec(name: str) -> TensorSpec:
    """The spec for a role ('kda.q_proj'), a template or a canonical key.

    A template/key shared by two roles (self_attn.o_proj) gives the first (kda.o_proj); use
    resolve() with a config to pick by layer type.
    """
    if name in BY_ROLE:
        return BY_ROLE[name]
    if name in BY_TEMPLATE:
        return BY_TEMPLATE[name][0]
    p = parse_key(name)
    if p is not None:
        return p.spec
    raise KeyError(f"unknown tensor name {name!r} (neither a role, a template nor a canonical key)")


def parse_key(key: str) -> Entry | None:
    """Canonical key ('layers.3.self_attn.q_proj.weight') -> Entry, or None if not a model tensor.

    Note: q_proj/o_proj templates exist for KDA and MLA alike (same key text for o_proj); a bare key
    is ambiguous for o_proj, so parse_key returns the first match (KDA); use resolve() with a config
    to disambiguate by layer type.
    """
    for t, rx in _REGEX:
        m = rx.match(key)
        if m:
            g = m.groupdict()
            return Entry(key, t, int(g["l"]) if "l" in g else None, int(g["e"]) if "e" in g else None)
    return None


def resolve(cfg: Config, name: str, layer: int | None = None, expert: int | None = None) -> Entry:
    """Role, template or canonical key (+ layer/expert) -> the Entry that applies under `cfg`.

    Raises KeyError if the tensor does not exist for that layer (e.g. 'kda.q_proj' on an MLA layer).
    """
    cands: list[TensorSpec]
    if name in BY_ROLE:
        cands = [BY_ROLE[name]]
    else:
        cands = [t for t, rx in _REGEX if t.template == name or rx.match(name)]
        if not cands:
            raise KeyError(f"unknown tensor name {name!r}")
        if name not in BY_TEMPLATE:  # a concrete key: take the layer/expert from it
            for t, rx in _REGEX:
                m = rx.match(name)
                if m:
                    g = m.groupdict()
                    if "l" in g:
                        if layer is not None and layer != int(g["l"]):
                            raise KeyError(f"{name!r} names layer {g['l']}, but layer={layer} was given")
                        layer = int(g["l"])
                    if "e" in g:
                        if expert is not None and expert != int(g["e"]):
                            raise KeyError(f"{name!r} names expert {g['e']}, but expert={expert} was given")
                        expert = int(g["e"])
                    break
    for t in cands:
        if t.per_layer:
            if layer is None:
                raise KeyError(f"{t.role} ({t.template}) needs a layer index")
            if not 0 <= layer < cfg.num_hidden_layers:
                raise KeyError(f"layer {layer} out of range (num_hidden_layers {cfg.num_hidden_layers})")
        if t.per_expert:
            if expert is None:
                raise KeyError(f"{t.role} ({t.template}) needs an expert index")
            if not 0 <= expert < cfg.n_routed_experts:
                raise KeyError(f"expert {expert} out of range (n_routed_experts {cfg.n_routed_experts})")
        if t.applies(cfg, layer):
            return Entry(t.key(layer, expert), t, layer if t.per_layer else None, expert if t.per_expert else None)
    where = f" in layer {layer} ({cfg.layer_summary(layer)})" if layer is not None else ""
    raise KeyError(f"tensor {name!r} does not exist{where} under this config")


def expected(cfg: Config) -> Iterator[Entry]:
    """Every tensor the model needs under `cfg`, in a fixed order (global, then layer by layer)."""
    for t in TENSORS:
        if not t.per_layer and t.applies(cfg):
            yield Entry(t.key(), t, None, None)
    for l in range(cfg.num_hidden_layers):
        for t in TENSORS:
            if not t.per_layer or not t.applies(cfg, l):
                continue
            if t.per_expert:
                for e in range(cfg.n_routed_experts):
                    yield Entry(t.key(l, e), t, l, e)
            else:
                yield Entry(t.key(l), t, l, None)


def strip_prefix(stored_key: str) -> tuple[str, str]:
    """Stored key -> (canonical key, prefix). `lm_head.weight` lives outside any model prefix."""
    for p in PREFIXES:
        if p and stored_key.startswith(p):
            return stored_key[len(p):], p
    return stored_key, ""


# ---- release siblings


def fp8_scale_key(weight_key: str) -> str:
    """'X.weight' -> 'X.weight_scale_inv' (F32 [ceil(out/128), ceil(in/128)])."""
    return weight_key + "_scale_inv"


def mxfp4_scale_key(weight_key: str) -> str:
    """'X.weight' -> 'X.weight_scale' (U8 E8M0 [out, in/32])."""
    return weight_key + "_scale"


def fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    r, c = shape
    return (-(-r // FP8_BLOCK), -(-c // FP8_BLOCK))


def mxfp4_packed_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    r, c = shape
    return (r, c // 2)


def mxfp4_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    r, c = shape
    return (r, c // MXFP4_GROUP)


# ---- in-memory transformers aliases


class Alias(NamedTuple):
    key: str  # canonical-style key of the stored alias tensor (prefix stripped)
    index: tuple | None  # numpy index applied to the stored array (None: whole tensor)
    stored_shape: tuple[int, ...] | None  # the alias tensor's full expected shape (None: same as spec)


def aliases(cfg: Config, entry: Entry) -> list[Alias]:
    """Other names under which transformers' in-memory model (state_dict) holds this tensor."""
    t, l, e = entry.spec, entry.layer, entry.expert
    out: list[Alias] = []
    P, K = cfg.kda_dim, cfg.linear_conv_kernel_dim
    if t.role.startswith(("attn_hc.", "ffn_hc.")):  # hc_attn_fn <-> attn_hc.fn, ...
        out.append(Alias(f"layers.{l}.{t.role}", None, None))
    elif t.role in ("kda.f_a_proj", "kda.f_b_proj", "kda.dt_bias", "kda.A_log"):
        leaf = entry.key.split("self_attn.", 1)[1]
        out.append(Alias(f"layers.{l}.self_attn.forget_gate.{leaf}", None, None))
    elif t.role in ("kda.q_conv", "kda.k_conv", "kda.v_conv"):
        i = ("kda.q_conv", "kda.k_conv", "kda.v_conv").index(t.role)
        out.append(Alias(f"layers.{l}.self_attn.conv1d.weight", (slice(i * P, (i + 1) * P),), (3 * P, 1, K)))
    elif t.role in ("moe.expert.gate_proj", "moe.expert.up_proj"):
        I, D, E = cfg.moe_intermediate_size, cfg.hidden_size, cfg.n_routed_experts
        j = 0 if t.role == "moe.expert.gate_proj" else 1
        out.append(Alias(f"layers.{l}.mlp.experts.gate_up_proj", (e, slice(j * I, (j + 1) * I)), (E, 2 * I, D)))
    elif t.role == "moe.expert.down_proj":
        I, D, E = cfg.moe_intermediate_size, cfg.hidden_size, cfg.n_routed_experts
        out.append(Alias(f"layers.{l}.mlp.experts.down_proj", (e,), (E, D, I)))
    return out
