"""Stage names, in execution order: the vocabulary shared by the oracle, both engines and `diff`.

A stage is one named value computed for one (layer, position). Captures hold their arrays, traces
their hashes. The head stages live at layer index L (= num_hidden_layers); `embed` at layer 0.
"""
from __future__ import annotations

import numpy as np

from . import schema as _S
from .schema import BF16, F32, F64, I32  # noqa: F401 (the dtype names, re-exported)


def _pairs(stages) -> list[tuple[str, str]]:
    return [(s.name, s.dtype) for s in stages]


# (name, dtype) groups in execution order; oracle/schema.py defines them (with their sizes) for the
# oracle and both engines.
HC_SITE = [(s.name.split(".", 1)[1], s.dtype) for s in _S.ATTN_HC]
KDA = _pairs(_S.KDA)
MLA = _pairs(_S.MLA)
DENSE = _pairs(_S.DENSE)
MOE = _pairs(_S.MOE)
HEAD = _pairs(_S.HEAD)


def layer_stages(is_kda: bool, is_moe: bool, has_indexer: bool = True) -> list[tuple[str, str]]:
    """(stage, dtype) of one decoder layer in execution order."""
    attn = KDA if is_kda else [s for s in MLA if has_indexer or not s[0].startswith("indexer.")]
    out = _pairs(_S.ATTN_HC) + _pairs([_S.ATTN_NORM]) + attn + _pairs([_S.ATTN_STREAMS])
    out += _pairs(_S.FFN_HC) + _pairs([_S.FFN_NORM])
    out += MOE if is_moe else DENSE
    out += _pairs([_S.FFN_STREAMS])
    return out


def model_stages(config) -> list[tuple[int, str, str]]:
    """(layer, stage, dtype) of the whole model in execution order (per position)."""
    out = [(0, _S.EMBED.name, _S.EMBED.dtype)]
    for layer in range(config.num_hidden_layers):
        kda = config.layer_types[layer] == "linear_attention"
        moe = config.mlp_layer_types[layer] == "sparse"
        full = config.indexer_types[layer] == "full"
        out += [(layer, s, d) for s, d in layer_stages(kda, moe, full)]
    out += [(config.num_hidden_layers, s, d) for s, d in HEAD]
    return out


_DTYPES = dict(_pairs(_S.STAGES))
ALL_STAGE_NAMES = sorted(_DTYPES)


def stage_dtype(stage: str) -> str:
    if stage not in _DTYPES:
        raise KeyError(f"unknown stage {stage!r}; known: {', '.join(ALL_STAGE_NAMES)}")
    return _DTYPES[stage]


def canonical_bytes(value: np.ndarray, dtype: str) -> bytes:
    """The bytes a stage value is hashed by: bf16 as uint16 bits, others as their own little-endian bits."""
    a = np.ascontiguousarray(value)
    if dtype == BF16:
        bits = a.astype(np.float32).view(np.uint32)
        if np.any((bits & 0xFFFF) != 0):
            raise ValueError("bf16 stage holds a value that is not BF16-representable")
        return (bits >> 16).astype("<u2").tobytes()
    np_dtype = {F32: "<f4", F64: "<f8", I32: "<i4"}[dtype]
    return a.astype(np_dtype).tobytes()
