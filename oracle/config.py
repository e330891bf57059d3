"""GLM-5.3-Flash text config: the fields of `Glm5NextTextConfig` that the text model uses.

`Config` is a frozen dataclass. Its defaults are the real GLM-5.3-Flash values (the defaults of
transformers' `Glm5NextTextConfig`, which tests/test_config.py checks field by field).

`Config.from_json(path)` / `Config.from_dict(d)` accept:
  * a text config (model_type "glm5_next_text") or a flat text-only "glm5_next" config,
  * a multimodal config whose text part sits under "text_config",
  * the peer's extra keyword forms: `index_topk_pattern` ("FSSF..."), `index_topk_freq` /
    `index_skip_topk_offset`, `linear_attn_config` dict, and "full_attention" as an alias of
    "indexed_attention".
Unknown or irrelevant keys (vision, training options, quantization_config, ...) are ignored.
Anything we cannot run exactly is refused with a `ConfigError` whose message names the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Config", "ConfigError", "KDA", "MLA", "DENSE", "SPARSE", "FULL", "SHARED"]

KDA = "linear_attention"
MLA = "indexed_attention"
DENSE = "dense"
SPARSE = "sparse"
FULL = "full"
SHARED = "shared"

LAYER_TYPES = (KDA, MLA)
MLP_LAYER_TYPES = (DENSE, SPARSE)
INDEXER_TYPES = (FULL, SHARED)


class ConfigError(ValueError):
    """An invalid or unsupported config. `field` names the offending config field."""

    def __init__(self, field_name: str, message: str, source: str | None = None):
        self.field = field_name
        self.source = source
        self.reason = message
        where = f"{source}: " if source else ""
        super().__init__(f"{where}config field '{field_name}': {message}")

    def with_source(self, source: str) -> "ConfigError":
        return ConfigError(self.field, self.reason, source)


# Peer fields that exist in Glm5NextTextConfig but do not change inference (or are derived).
# They are accepted in a config.json and ignored; tests/test_config.py checks that every peer
# field is either a Config field or listed here.
IGNORED_PEER_FIELDS = frozenset(
    {
        "output_router_logits",  # training/introspection only
        "router_aux_loss_coef",  # training only
        "use_cache",  # runtime option
        "attention_dropout",  # training only (0 at inference)
        "head_dim",  # the peer forces head_dim = qk_rope_head_dim
        "qk_head_dim",  # derived: qk_nope_head_dim + qk_rope_head_dim
    }
)


def _default_layer_types(n: int) -> tuple[str, ...]:
    return tuple(KDA if i % 4 != 3 else MLA for i in range(n))


def _default_mlp_layer_types(n: int) -> tuple[str, ...]:
    return tuple([DENSE] * min(3, n) + [SPARSE] * max(n - 3, 0))


def _default_indexer_types(n: int, freq: int = 1, offset: int = 2) -> tuple[str, ...]:
    freq = max(freq, 1)
    return tuple(FULL if (max(i - offset + 1, 0) % freq) == 0 else SHARED for i in range(n))


def _engine(default, needed_by: str = "any"):
    """A field the C++ engines take too (oracle/schema.py's ENGINE_CONFIG; the C++ struct and its reader
    are generated from it). needed_by: the layer kind (any, kda, mla, dense, moe) whose presence makes
    the engines check it (a field in _POS_INT_FIELDS must then be >= 1)."""
    return field(default=default, metadata={"engine": needed_by})


@dataclass(frozen=True)
class Config:
    # sizes
    vocab_size: int = _engine(154880)
    hidden_size: int = _engine(4096)
    intermediate_size: int = _engine(12288, "dense")
    moe_intermediate_size: int = _engine(2048, "moe")
    num_hidden_layers: int = _engine(45)
    # MLA
    num_attention_heads: int = _engine(64, "mla")
    num_key_value_heads: int = 64
    q_lora_rank: int = _engine(1536, "mla")
    kv_lora_rank: int = _engine(512, "mla")
    qk_nope_head_dim: int = _engine(256, "mla")
    qk_rope_head_dim: int = _engine(0, "mla")
    v_head_dim: int = _engine(256, "mla")
    attention_bias: bool = False
    # MoE
    n_routed_experts: int = _engine(288, "moe")
    num_experts_per_tok: int = _engine(8, "moe")
    n_shared_experts: int = _engine(1, "moe")
    n_group: int = _engine(1, "moe")
    topk_group: int = _engine(1, "moe")
    norm_topk_prob: bool = _engine(True, "moe")
    routed_scaling_factor: float = _engine(2.5, "moe")
    swiglu_limit: float = _engine(10.0)
    hidden_act: str = "silu"
    # norms
    rms_norm_eps: float = _engine(1e-5)
    # DSA indexer
    index_topk: int = _engine(2048, "mla")
    index_head_dim: int = _engine(128, "mla")
    index_n_heads: int = _engine(32, "mla")
    index_kpool: int = _engine(16, "mla")
    index_kpool_always_select_tail: bool = True
    # KDA
    linear_num_heads: int = _engine(64, "kda")
    linear_head_dim: int = _engine(128, "kda")
    linear_conv_kernel_dim: int = _engine(4, "kda")
    linear_lower_bound: float | None = _engine(-5.0, "kda")
    # mHC
    hc_mult: int = _engine(4)
    hc_eps: float = _engine(1e-6)
    hc_sinkhorn_iters: int = _engine(20)
    # schedules (None in the constructor means: the peer's default rule)
    layer_types: tuple[str, ...] | None = None
    mlp_layer_types: tuple[str, ...] | None = None
    indexer_types: tuple[str, ...] | None = None
    # tokens / head
    tie_word_embeddings: bool = _engine(False)
    pad_token_id: int | None = 154820
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02

    # ------------------------------------------------------------------ construction
    def __post_init__(self):
        n = self.num_hidden_layers
        _check_int("num_hidden_layers", n, minimum=1)
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.layer_types is None:
            set_("layer_types", _default_layer_types(n))
        if self.mlp_layer_types is None:
            set_("mlp_layer_types", _default_mlp_layer_types(n))
        if self.indexer_types is None:
            set_("indexer_types", _default_indexer_types(n))
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            v = getattr(self, name)
            if isinstance(v, str) or not isinstance(v, (list, tuple)):
                raise ConfigError(name, f"must be a list of strings, got {type(v).__name__}")
            set_(name, tuple(v))
        set_("layer_types", tuple(MLA if t == "full_attention" else t for t in self.layer_types))
        if isinstance(self.eos_token_id, list):
            set_("eos_token_id", tuple(self.eos_token_id))
        # ints given for float fields are accepted
        for f in fields(self):
            if f.name in _FLOAT_FIELDS:
                v = getattr(self, f.name)
                if isinstance(v, int) and not isinstance(v, bool):
                    set_(f.name, float(v))
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        n = self.num_hidden_layers
        for name in _POS_INT_FIELDS:
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("qk_rope_head_dim", self.qk_rope_head_dim, minimum=0)
        _check_int("max_position_embeddings", self.max_position_embeddings, minimum=1)
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if name == "linear_lower_bound" and v is None:
                raise ConfigError(
                    name,
                    "is null, which selects the softplus forget-gate form "
                    "(g = -exp(A_log)*softplus(f + dt_bias)); the canonical numerics support only the "
                    "lower-bounded sigmoid form (g = linear_lower_bound * sigmoid(...)) for now; "
                    "set a finite negative lower bound (GLM-5.3-Flash uses -5.0)",
                )
            if isinstance(v, bool) or not isinstance(v, float) or not math.isfinite(v):
                raise ConfigError(name, f"must be a finite number, got {v!r}")
        for name in ("rms_norm_eps", "swiglu_limit", "routed_scaling_factor"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)!r}")
        if not self.hc_eps >= 0:
            raise ConfigError("hc_eps", f"must be >= 0, got {self.hc_eps!r}")
        if not self.linear_lower_bound < 0:
            raise ConfigError(
                "linear_lower_bound", f"must be negative (g = lb*sigmoid(.) is a log-decay), got {self.linear_lower_bound!r}"
            )
        if self.hidden_act != "silu":
            raise ConfigError("hidden_act", f"only 'silu' is supported, got {self.hidden_act!r}")
        if self.attention_bias:
            raise ConfigError(
                "attention_bias", "must be false: GLM-5.3-Flash MLA projections have no bias and the loader expects none"
            )
        # token ids
        if self.pad_token_id is not None:
            _check_int("pad_token_id", self.pad_token_id, minimum=0)
            if self.pad_token_id >= self.vocab_size:
                raise ConfigError(
                    "pad_token_id", f"{self.pad_token_id} is outside the vocabulary (vocab_size {self.vocab_size})"
                )
        if self.bos_token_id is not None:
            _check_int("bos_token_id", self.bos_token_id, minimum=0)
        if self.eos_token_id is not None:
            ids = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
            for t in ids:
                _check_int("eos_token_id", t, minimum=0)
        # schedules
        for name, allowed in (
            ("layer_types", LAYER_TYPES),
            ("mlp_layer_types", MLP_LAYER_TYPES),
            ("indexer_types", INDEXER_TYPES),
        ):
            v = getattr(self, name)
            if len(v) != n:
                raise ConfigError(name, f"has {len(v)} entries but num_hidden_layers is {n}")
            for i, t in enumerate(v):
                if t not in allowed:
                    raise ConfigError(name, f"entry {i} is {t!r}; allowed values: {', '.join(allowed)}")
        for l in range(n):
            if self.layer_types[l] == MLA and self.indexer_types[l] == SHARED:
                prev_ok = l > 0 and self.layer_types[l - 1] == MLA and self.indexer_types[l - 1] == FULL
                if not prev_ok:
                    prev = (
                        "there is no previous layer"
                        if l == 0
                        else f"layer {l - 1} is {self.layer_types[l - 1]} with indexer '{self.indexer_types[l - 1]}'"
                    )
                    raise ConfigError(
                        "indexer_types",
                        f"layer {l} is a 'shared' indexed_attention layer but {prev}; a shared layer reuses the "
                        f"top-k selection of the immediately preceding layer, which must be an indexed_attention "
                        f"layer with a 'full' indexer",
                    )
        # MLA
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(
                "num_key_value_heads",
                f"({self.num_key_value_heads}) must equal num_attention_heads ({self.num_attention_heads})",
            )
        if self.qk_rope_head_dim != 0:
            raise ConfigError(
                "qk_rope_head_dim",
                f"is {self.qk_rope_head_dim}; only NoPE MLA (qk_rope_head_dim = 0) is supported, as in GLM-5.3-Flash",
            )
        # indexer
        if self.index_topk % self.index_kpool != 0:
            raise ConfigError(
                "index_topk", f"({self.index_topk}) must be divisible by index_kpool ({self.index_kpool})"
            )
        # MoE
        if self.n_routed_experts % self.n_group != 0:
            raise ConfigError(
                "n_group", f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})"
            )
        if self.n_routed_experts // self.n_group < 2:
            raise ConfigError(
                "n_group",
                f"each expert group needs at least 2 experts (group score = sum of its top-2); "
                f"n_routed_experts {self.n_routed_experts} / n_group {self.n_group} = {self.n_routed_experts // self.n_group}",
            )
        if self.topk_group > self.n_group:
            raise ConfigError("topk_group", f"({self.topk_group}) must be <= n_group ({self.n_group})")
        avail = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > avail:
            raise ConfigError(
                "num_experts_per_tok",
                f"({self.num_experts_per_tok}) exceeds the {avail} experts available in topk_group "
                f"({self.topk_group}) groups of {self.n_routed_experts // self.n_group}",
            )

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | None = None) -> "Config":
        try:
            return cls._from_dict(d)
        except ConfigError as e:
            raise (e.with_source(source) if source else e) from None

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> "Config":
        if not isinstance(d, dict):
            raise ConfigError("<root>", f"config must be a JSON object, got {type(d).__name__}")
        top = d
        mt = top.get("model_type")
        if mt is not None and mt not in ("glm5_next", "glm5_next_text"):
            raise ConfigError("model_type", f"is {mt!r}; expected 'glm5_next' or 'glm5_next_text'")
        if "text_config" in top and top["text_config"] is not None:
            d = top["text_config"]
            if not isinstance(d, dict):
                raise ConfigError("text_config", f"must be an object, got {type(d).__name__}")
            mt = d.get("model_type")
            if mt is not None and mt not in ("glm5_next_text", "glm5_next"):
                raise ConfigError("text_config.model_type", f"is {mt!r}; expected 'glm5_next_text'")
            if "tie_word_embeddings" not in d and "tie_word_embeddings" in top:
                d = dict(d, tie_word_embeddings=top["tie_word_embeddings"])
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        n = kw.get("num_hidden_layers", cls.num_hidden_layers)
        _check_int("num_hidden_layers", n, minimum=1)
        if kw.get("num_key_value_heads", 0) is None:
            kw["num_key_value_heads"] = kw.get("num_attention_heads", cls.num_attention_heads)
        if "q_lora_rank" in d and d["q_lora_rank"] is None:
            raise ConfigError(
                "q_lora_rank", "is null; the DSA indexer and MLA need the low-rank query path (q_lora_rank required)"
            )
        if kw.get("indexer_types") is None:
            pattern = d.get("index_topk_pattern")
            if pattern is not None:
                if isinstance(pattern, str):
                    bad = [c for c in pattern if c not in "FS"]
                    if bad:
                        raise ConfigError("index_topk_pattern", f"may hold only 'F' and 'S', found {bad[0]!r}")
                    kw["indexer_types"] = [{"F": FULL, "S": SHARED}[c] for c in pattern]
                    if len(pattern) != n:
                        raise ConfigError(
                            "index_topk_pattern", f"has {len(pattern)} entries but num_hidden_layers is {n}"
                        )
                elif isinstance(pattern, list):
                    kw["indexer_types"] = list(pattern)
                else:
                    raise ConfigError("index_topk_pattern", f"must be a string like 'FSSF', got {pattern!r}")
            else:
                freq = d.get("index_topk_freq", 1)
                offset = d.get("index_skip_topk_offset", 2)
                _check_int("index_topk_freq", freq, minimum=0)
                _check_int("index_skip_topk_offset", offset)
                kw["indexer_types"] = list(_default_indexer_types(n, freq, offset))
        la = d.get("linear_attn_config")
        if la is not None:
            if not isinstance(la, dict):
                raise ConfigError("linear_attn_config", f"must be an object, got {type(la).__name__}")
            if "head_dim" in la:
                kw["linear_head_dim"] = la["head_dim"]
            if "num_heads" in la:
                kw["linear_num_heads"] = la["num_heads"]
            if "short_conv_kernel_size" in la:
                kw["linear_conv_kernel_dim"] = la["short_conv_kernel_size"]
            if "gate_lower_bound" in la:
                kw["linear_lower_bound"] = la["gate_lower_bound"]
            if la.get("safe_gate", True) and kw.get("linear_lower_bound", -5.0) is None:
                kw["linear_lower_bound"] = -5.0
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            if name in kw and kw[name] is not None and not isinstance(kw[name], (list, tuple)):
                raise ConfigError(name, f"must be a list of strings, got {type(kw[name]).__name__}")
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Config":
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                d = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError("<file>", "config.json not found", path) from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError("<file>", f"is not valid JSON ({e})", path) from None
        return cls.from_dict(d, source=path)

    def to_dict(self) -> dict[str, Any]:
        """A config.json for the text model, readable by us and by transformers' Glm5NextTextConfig."""
        d: dict[str, Any] = {"architectures": ["Glm5NextTextModel"], "model_type": "glm5_next_text"}
        for f in fields(self):
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        d["head_dim"] = self.qk_rope_head_dim
        d["num_key_value_heads"] = self.num_key_value_heads
        return dict(sorted(d.items()))

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        """P = linear_num_heads * linear_head_dim (width of KDA q, k, v)."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def hc_dim(self) -> int:
        """Rows of the mHC projection: pre (hc) + post (hc) + comb (hc*hc) = (2 + hc) * hc."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def index_select_pools(self) -> int:
        return self.index_topk // self.index_kpool

    @property
    def has_lm_head(self) -> bool:
        """False when tie_word_embeddings: the head reuses embed_tokens.weight."""
        return not self.tie_word_embeddings

    def is_kda(self, l: int) -> bool:
        return self.layer_types[l] == KDA

    def is_mla(self, l: int) -> bool:
        return self.layer_types[l] == MLA

    def is_moe(self, l: int) -> bool:
        return self.mlp_layer_types[l] == SPARSE

    def is_dense(self, l: int) -> bool:
        return self.mlp_layer_types[l] == DENSE

    def has_indexer(self, l: int) -> bool:
        """An MLA layer that runs its own indexer (indexer_types[l] == 'full')."""
        return self.is_mla(l) and self.indexer_types[l] == FULL

    def shares_indexer(self, l: int) -> bool:
        """An MLA layer that reuses layer l-1's selection (a 'shared' entry on a KDA layer is ignored)."""
        return self.is_mla(l) and self.indexer_types[l] == SHARED

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_hidden_layers) if self.is_kda(l))

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_hidden_layers) if self.is_mla(l))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_hidden_layers) if self.is_moe(l))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_hidden_layers) if self.is_dense(l))

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.num_hidden_layers) if self.has_indexer(l))

    def layer_summary(self, l: int) -> str:
        attn = "KDA" if self.is_kda(l) else ("MLA+idx" if self.has_indexer(l) else "MLA(shared idx)")
        return f"{attn}/{'MoE' if self.is_moe(l) else 'dense'}"


_POS_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "index_topk",
    "index_head_dim",
    "index_n_heads",
    "index_kpool",
    "linear_num_heads",
    "linear_head_dim",
    "linear_conv_kernel_dim",
    "hc_mult",
    "hc_sinkhorn_iters",
)
_BOOL_FIELDS = ("attention_bias", "norm_topk_prob", "index_kpool_always_select_tail", "tie_word_embeddings")
_FLOAT_FIELDS = (
    "routed_scaling_factor",
    "swiglu_limit",
    "rms_norm_eps",
    "linear_lower_bound",
    "hc_eps",
    "initializer_range",
)


def _check_int(name: str, v: Any, minimum: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        if name == "q_lora_rank" and v is None:
            raise ConfigError(
                name, "is null; the DSA indexer and MLA need the low-rank query path (q_lora_rank required)"
            )
        raise ConfigError(name, f"must be an integer, got {v!r} ({type(v).__name__})")
    if minimum is not None and v < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {v}")
