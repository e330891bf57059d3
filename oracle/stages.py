"""Stage names, in execution order: the vocabulary shared by the oracle, both engines and `diff`.

A stage is one named value computed for one (layer, position). Captures hold their arrays, traces
their hashes. The head stages live at layer index L (= num_hidden_layers); `embed` at layer 0.
"""
from __future__ import annotations

import numpy as np

F32, F64, BF16, I32 = "f32", "f64", "bf16", "i32"

HC_SITE = [("pre", F64), ("post", F64), ("comb", F64), ("collapsed", BF16)]

KDA = [
    ("kda.q_proj", BF16), ("kda.k_proj", BF16), ("kda.v_proj", BF16),
    ("kda.q", BF16), ("kda.k", BF16), ("kda.v", BF16),
    ("kda.g", F32), ("kda.beta", F32), ("kda.state", F32), ("kda.o", F32),
    ("kda.gate", BF16), ("kda.o_norm", BF16), ("kda.out", BF16),
]

MLA = [
    ("mla.q_lat", BF16), ("mla.q", BF16), ("mla.c", BF16), ("mla.q_abs", BF16),
    ("indexer.q", BF16), ("indexer.k", BF16), ("indexer.gate", BF16), ("indexer.weights", F32),
    ("indexer.scores", F32), ("mla.selected", I32),
    ("mla.scores", F32), ("mla.probs", BF16), ("mla.o_lat", BF16), ("mla.o", BF16), ("mla.out", BF16),
]

DENSE = [("mlp.gate", BF16), ("mlp.up", BF16), ("mlp.out", BF16)]

MOE = [
    ("moe.logits", F32), ("moe.selected", I32), ("moe.weights", F32), ("moe.experts", BF16),
    ("moe.routed", BF16), ("moe.shared", BF16), ("moe.out", BF16),
]

HEAD = [("head.mean", BF16), ("final_norm", BF16), ("logits", F32)]


def layer_stages(is_kda: bool, is_moe: bool, has_indexer: bool = True) -> list[tuple[str, str]]:
    """(stage, dtype) of one decoder layer in execution order."""
    attn = KDA if is_kda else [s for s in MLA if has_indexer or not s[0].startswith("indexer.")]
    out = [(f"attn_hc.{n}", d) for n, d in HC_SITE] + [("attn_norm", BF16)] + attn
    out += [("attn_hc.streams", BF16)]
    out += [(f"ffn_hc.{n}", d) for n, d in HC_SITE] + [("ffn_norm", BF16)]
    out += MOE if is_moe else DENSE
    out += [("ffn_hc.streams", BF16)]
    return out


def model_stages(config) -> list[tuple[int, str, str]]:
    """(layer, stage, dtype) of the whole model in execution order (per position)."""
    out = [(0, "embed", BF16)]
    for layer in range(config.num_hidden_layers):
        kda = config.layer_types[layer] == "linear_attention"
        moe = config.mlp_layer_types[layer] == "sparse"
        full = config.indexer_types[layer] == "full"
        out += [(layer, s, d) for s, d in layer_stages(kda, moe, full)]
    out += [(config.num_hidden_layers, s, d) for s, d in HEAD]
    return out


_DTYPES = dict([("embed", BF16)] + layer_stages(True, True) + layer_stages(False, False) + HEAD)
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
