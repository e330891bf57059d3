"""The facts the oracle and both engines share, each defined once here (or in the module named).

* The engine config: every `Config` field marked `_engine(...)` in oracle/config.py, plus the values
  derived from a Config that only the engines take (ENGINE_DERIVED). fast/ builds the dict the C++
  engines read from ENGINE_CONFIG; the C++ struct, the dict reader and the positivity checks are
  generated from it.
* The stages: STAGES, (name, dtype, size) in the engines' order. `size` is an expression over engine
  config fields (elements of one position's value), or None where it depends on the position.
  oracle/stages.py builds its layer and model orders from these groups; the C++ enum and table are
  generated from STAGES.
* The tensor roles: oracle/names.py's TENSORS; the C++ role enum is generated from ROLES.

tools/gen_headers.py writes the C++ header (glm_schema.hpp) from this module at build time (CMake
runs it; bindings/schema.cmake). It runs in the build's isolated environment, so this module and what
it imports use the standard library only (no numpy).
"""
from __future__ import annotations

import ast
from dataclasses import fields
from typing import NamedTuple

from . import names as _names
from .config import _POS_INT_FIELDS, Config

F32, F64, BF16, I32 = "f32", "f64", "bf16", "i32"
DTYPES = (F32, F64, BF16, I32)


# ------------------------------------------------------------------------------------------ config

class EngineField(NamedTuple):
    name: str
    kind: str  # "int", "float", "bool" or "layers" (one 0/1 per layer)
    needed_by: str  # the layer kind whose presence makes the engines check it: any, kda, mla, dense, moe
    positive: bool  # the engines refuse a value < 1 (int fields)


def _kind_of(annotation: str) -> str:
    base = annotation.split("|")[0].strip()
    if base not in ("int", "float", "bool"):
        raise TypeError(f"an engine config field must be an int, float or bool, not {annotation!r}")
    return base


# Values the engines take that are not Config fields: computed by engine_value().
ENGINE_DERIVED = (
    EngineField("max_context", "int", "any", True),  # positions a sequence may reach (the engine's option)
    EngineField("is_kda", "layers", "any", False),
    EngineField("is_moe", "layers", "any", False),
    EngineField("has_indexer", "layers", "any", False),
)

ENGINE_CONFIG: tuple[EngineField, ...] = tuple(
    EngineField(f.name, _kind_of(f.type), f.metadata["engine"], f.name in _POS_INT_FIELDS)
    for f in fields(Config) if "engine" in f.metadata
) + ENGINE_DERIVED


def engine_value(cfg: Config, field: EngineField, max_context: int):
    """One field's value for the engines, in the type the C++ reader takes."""
    if field.name == "max_context":
        return int(max_context)
    if field.kind == "layers":
        test = {"is_kda": cfg.is_kda, "is_moe": cfg.is_moe, "has_indexer": cfg.has_indexer}[field.name]
        return [1 if test(l) else 0 for l in range(cfg.num_hidden_layers)]
    v = getattr(cfg, field.name)
    return {"int": int, "float": float, "bool": bool}[field.kind](v)


def engine_config(cfg: Config, max_context: int) -> dict:
    """The dict both C++ engines' constructors read (bindings/pyglue.hpp, config_from_dict)."""
    return {f.name: engine_value(cfg, f, max_context) for f in ENGINE_CONFIG}


# ------------------------------------------------------------------------------------------ stages

class Stage(NamedTuple):
    name: str
    dtype: str
    size: str | None  # elements of one position's value, over engine config fields; None: varies


def _hc_site(site: str) -> tuple[Stage, ...]:
    """The stages of one mHC site (attn_hc, ffn_hc) before its sublayer; `streams` closes the site."""
    return (Stage(f"{site}.pre", F64, "hc_mult"), Stage(f"{site}.post", F64, "hc_mult"),
            Stage(f"{site}.comb", F64, "hc_mult * hc_mult"), Stage(f"{site}.collapsed", BF16, "hidden_size"))


_P = "linear_num_heads * linear_head_dim"  # width of KDA q, k, v

KDA = (
    Stage("kda.q_proj", BF16, _P), Stage("kda.k_proj", BF16, _P), Stage("kda.v_proj", BF16, _P),
    Stage("kda.q", BF16, _P), Stage("kda.k", BF16, _P), Stage("kda.v", BF16, _P),
    Stage("kda.g", F32, _P), Stage("kda.beta", F32, "linear_num_heads"),
    Stage("kda.state", F32, "linear_num_heads * linear_head_dim * linear_head_dim"), Stage("kda.o", F32, _P),
    Stage("kda.gate", BF16, _P), Stage("kda.o_norm", BF16, _P), Stage("kda.out", BF16, "hidden_size"),
)

MLA = (
    Stage("mla.q_lat", BF16, "q_lora_rank"), Stage("mla.q", BF16, "num_attention_heads * qk_nope_head_dim"),
    Stage("mla.c", BF16, "kv_lora_rank"), Stage("mla.q_abs", BF16, "num_attention_heads * kv_lora_rank"),
    Stage("indexer.q", BF16, "index_n_heads * index_head_dim"), Stage("indexer.k", BF16, "index_head_dim"),
    Stage("indexer.gate", BF16, "index_head_dim"), Stage("indexer.weights", F32, "index_n_heads"),
    Stage("indexer.scores", F32, None), Stage("mla.selected", I32, None),
    Stage("mla.scores", F32, None), Stage("mla.probs", BF16, None),
    Stage("mla.o_lat", BF16, "num_attention_heads * kv_lora_rank"),
    Stage("mla.o", BF16, "num_attention_heads * v_head_dim"), Stage("mla.out", BF16, "hidden_size"),
)

DENSE = (Stage("mlp.gate", BF16, "intermediate_size"), Stage("mlp.up", BF16, "intermediate_size"),
         Stage("mlp.out", BF16, "hidden_size"))

MOE = (
    Stage("moe.logits", F32, "n_routed_experts"), Stage("moe.selected", I32, "num_experts_per_tok"),
    Stage("moe.weights", F32, "num_experts_per_tok"), Stage("moe.experts", BF16, "num_experts_per_tok * hidden_size"),
    Stage("moe.routed", BF16, "hidden_size"), Stage("moe.shared", BF16, "hidden_size"),
    Stage("moe.out", BF16, "hidden_size"),
)

HEAD = (Stage("head.mean", BF16, "hidden_size"), Stage("final_norm", BF16, "hidden_size"),
        Stage("logits", F32, "vocab_size"))

EMBED = Stage("embed", BF16, "hidden_size")
ATTN_HC = _hc_site("attn_hc")
FFN_HC = _hc_site("ffn_hc")
ATTN_NORM = Stage("attn_norm", BF16, "hidden_size")
FFN_NORM = Stage("ffn_norm", BF16, "hidden_size")
ATTN_STREAMS = Stage("attn_hc.streams", BF16, "hc_mult * hidden_size")
FFN_STREAMS = Stage("ffn_hc.streams", BF16, "hc_mult * hidden_size")

# Every stage once, in the engines' order (a capture mask and an injection name a stage by its index).
STAGES: tuple[Stage, ...] = (
    EMBED, *ATTN_HC, ATTN_NORM, *KDA, *MLA, ATTN_STREAMS, *FFN_HC, FFN_NORM, *DENSE, *MOE, FFN_STREAMS, *HEAD
)
BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}

_INT_FIELDS = frozenset(f.name for f in ENGINE_CONFIG if f.kind == "int")


def size_names(expr: str) -> list[str]:
    """The config fields a size expression reads; refuses anything but int fields, + and *."""
    tree = ast.parse(expr, mode="eval")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if node.id not in _INT_FIELDS:
                raise ValueError(f"size {expr!r}: {node.id!r} is not an int engine config field")
            out.append(node.id)
        elif not isinstance(node, (ast.Expression, ast.BinOp, ast.Add, ast.Mult, ast.Load, ast.Constant)):
            raise ValueError(f"size {expr!r}: only int engine config fields, integers, + and * are allowed")
    return out


def stage_size(stage: str, cfg) -> int | None:
    """Elements of one position's value of `stage` under cfg (a Config or an engine config dict);
    None where it depends on the position."""
    expr = BY_NAME[stage].size
    if expr is None:
        return None
    get = cfg.__getitem__ if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    return int(eval(expr, {"__builtins__": {}}, {k: int(get(k)) for k in size_names(expr)}))  # noqa: S307


# ------------------------------------------------------------------------------------------ roles

# The checkpoint tensor roles (oracle/names.py), in its table's order.
ROLES: tuple[str, ...] = tuple(t.role for t in _names.TENSORS)
