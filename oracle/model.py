"""GLM-5.3-Flash, the whole text model in one readable file: the oracle's definition of every bit.

    ids -> embed -> hc streams -> L x [attn_hc -> RMSNorm -> KDA | MLA -> attn_hc
                                       ffn_hc  -> RMSNorm -> SwiGLU | MoE -> ffn_hc] -> head -> logits

Every stage's rounding and summation order is in docs/numerics.md; the layers live in
oracle/layers/, one module each. A forward over a chunk of T tokens treats each token as its own
row (only the conv window, KDA's recurrence, attention and the indexer look across positions, in
position order), so chunked prefill, decode and batching all give the same bits.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .capture import Capture
from .checkpoint import open_checkpoint
from .layers.head import head
from .layers.kda import KDA, KDACache
from .layers.mhc import HyperConnection
from .layers.mla import MLA, MLACache
from .layers.moe import MoE, Router, SwiGLU
from .layers.norm import rms_norm
from .inject import Injection
from .layers.ops import Precision


class PromptError(ValueError):
    """Token ids that the model cannot take (out of the vocabulary, beyond the context)."""


class StageSink:
    """Where a layer hands each stage value: the capture (if it wants it) and the fault injection.

    `x = cap("stage", x)` returns the rows the model carries on with: the same rows, or a copy
    with the injected element perturbed, so an injected fault propagates downstream.
    """

    def __init__(self, capture: Capture | None, layer: int, pos0: int, inject: Injection | None = None):
        self.capture, self.layer, self.pos0 = capture, layer, pos0
        self.inject = inject if inject is not None and inject.layer == layer else None

    def wants(self, stage: str) -> bool:
        return ((self.capture is not None and self.capture.wants(self.layer, stage))
                or (self.inject is not None and self.inject.stage == stage))

    def __call__(self, stage: str, rows):
        """Rows of positions pos0, pos0+1, ... (an array or a list of per-position arrays)."""
        if not self.wants(stage):
            return rows
        out = [self.row(stage, self.pos0 + i, r) for i, r in enumerate(rows)]
        return out if isinstance(rows, list) else np.stack(out) if len(out) else rows

    def row(self, stage: str, pos: int, value):
        """One position's value (inside a per-position loop) -> the value to carry on with."""
        inj = self.inject
        if inj is not None and inj.stage == stage and inj.pos == pos:
            value = inj.apply(value)
        if self.capture is not None and self.capture.wants(self.layer, stage):
            self.capture.put(self.layer, stage, pos, value)
        return value


class Cache:
    """Everything a model keeps between forward calls of one sequence.

    A cache belongs to the model that made it (`model.new_cache()`): its checkpoint, precision and
    config; `Model.forward` refuses a cache of another model. `fork()` gives an independent copy, so
    that two continuations of one prefix can be run from the same state.
    """

    def __init__(self, model: "Model"):
        c = model.config
        self.length = 0
        self.owner = _owner(model)
        self.layers = [KDACache(model.P, c) if c.is_kda(l) else MLACache(model.P, c, c.has_indexer(l))
                       for l in range(c.num_hidden_layers)]

    def fork(self) -> "Cache":
        """An independent copy: extending either leaves the other as it was."""
        other = object.__new__(Cache)
        other.length = self.length
        other.owner = self.owner
        other.layers = [layer.copy() for layer in self.layers]
        return other

    copy = fork  # the older name

    def __repr__(self) -> str:
        path, precision, c = self.owner
        kinds = "".join("K" if c.is_kda(l) else "M" for l in range(c.num_hidden_layers))
        return (f"oracle.Cache(model={path!r}, precision={precision!r}, layers={c.num_hidden_layers} ({kinds}), "
                f"positions={self.length})")


def _owner(model: "Model") -> tuple:
    """What a cache must come from to be usable by `model`: (checkpoint path, precision, config)."""
    return (getattr(model.ckpt, "path", None), model.P.name, model.config)


def _cache_mismatch(cache_owner: tuple, model_owner: tuple) -> str | None:
    """Why a cache made for `cache_owner` cannot run on `model_owner` (None: it can)."""
    if cache_owner == model_owner:
        return None
    (p0, prec0, c0), (p1, prec1, c1) = cache_owner, model_owner
    if c0 != c1:
        d0, d1 = c0.to_dict(), c1.to_dict()
        diff = [k for k in sorted(set(d0) | set(d1)) if d0.get(k) != d1.get(k)]
        shown = ", ".join(f"{k}: cache {d0.get(k)!r}, model {d1.get(k)!r}" for k in diff[:3])
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        return f"the cache was made for another config ({shown}{more})"
    if prec0 != prec1:
        return f"the cache was made in precision {prec0!r}, this model runs in {prec1!r}"
    return f"the cache was made by the model of {p0!r}, this model is {p1!r}"


class DecoderLayer:
    def __init__(self, model: "Model", l: int):
        P, c, get = model.P, model.config, model.get
        self.P, self.c, self.l = P, c, l
        pre = f"layers.{l}."
        self.attn_hc = HyperConnection(get(pre + "hc_attn_fn"), get(pre + "hc_attn_base"), get(pre + "hc_attn_scale"), c)
        self.ffn_hc = HyperConnection(get(pre + "hc_ffn_fn"), get(pre + "hc_ffn_base"), get(pre + "hc_ffn_scale"), c)
        self.attn_norm = P.weight(get(pre + "input_layernorm.weight"))
        self.ffn_norm = P.weight(get(pre + "post_attention_layernorm.weight"))

        def attn_w(suffix):
            return P.weight(get(pre + "self_attn." + suffix))
        if c.is_kda(l):
            self.attn = KDA(P, attn_w, c)
        else:
            self.attn = MLA(P, attn_w, c, c.has_indexer(l))

        def swiglu(prefix):
            return SwiGLU(P, *(P.weight(get(f"{prefix}.{n}.weight")) for n in ("gate_proj", "up_proj", "down_proj")),
                          c.swiglu_limit)
        if c.is_moe(l):
            router = Router(P, P.weight(get(pre + "mlp.gate.weight")),
                            P.weight(get(pre + "mlp.gate.e_score_correction_bias")), c)
            experts = [_Lazy(swiglu, f"{pre}mlp.experts.{e}") for e in range(c.n_routed_experts)]
            self.ffn = MoE(P, router, experts, swiglu(pre + "mlp.shared_experts"))
        else:
            self.ffn = swiglu(pre + "mlp")

    def forward(self, X: np.ndarray, cache, pos0: int, cap: StageSink, selection):
        """X [T, hc, D] streams -> (streams after the layer, this layer's attention selection or None)."""
        P, c = self.P, self.c
        pre, post, comb = self.attn_hc.coefficients(X)
        pre, post, comb = cap("attn_hc.pre", pre), cap("attn_hc.post", post), cap("attn_hc.comb", comb)
        x = cap("attn_hc.collapsed", HyperConnection.collapse(P, X, pre))
        x = cap("attn_norm", rms_norm(P, x, self.attn_norm, c.rms_norm_eps))
        if isinstance(self.attn, KDA):
            u, selection = self.attn.forward(x, cache, pos0, cap), None
        else:
            u, selection = self.attn.forward(x, cache, pos0, cap, selection)
        X = cap("attn_hc.streams", HyperConnection.expand(P, X, u, post, comb))

        pre, post, comb = self.ffn_hc.coefficients(X)
        pre, post, comb = cap("ffn_hc.pre", pre), cap("ffn_hc.post", post), cap("ffn_hc.comb", comb)
        x = cap("ffn_hc.collapsed", HyperConnection.collapse(P, X, pre))
        x = cap("ffn_norm", rms_norm(P, x, self.ffn_norm, c.rms_norm_eps))
        u = self.ffn.forward(x, cap)
        X = cap("ffn_hc.streams", HyperConnection.expand(P, X, u, post, comb))
        return X, selection


class _Lazy:
    """An expert decoded on first use (most experts of a small run are never selected)."""

    def __init__(self, build, prefix):
        self.build, self.prefix, self.value = build, prefix, None

    def __call__(self):
        if self.value is None:
            self.value = self.build(self.prefix)
        return self.value


class Model:
    def __init__(self, checkpoint, precision: str = "canonical"):
        self.ckpt = checkpoint
        self.config = c = checkpoint.config
        self.P = Precision(precision)
        if c.index_kpool > 1 and not c.index_kpool_always_select_tail and c.mla_layers:
            raise ValueError("config field 'index_kpool_always_select_tail': false is not supported with "
                             "index_kpool > 1 (the reference then attends to no position for early queries)")
        self.embed = checkpoint.weight_f32("embed_tokens.weight")
        self.norm = self.P.weight(self.get("norm.weight"))
        self.lm_head = self.P.weight(self.get("embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"))
        self.layers = [DecoderLayer(self, l) for l in range(c.num_hidden_layers)]

    def get(self, key: str) -> np.ndarray:
        """A weight decoded exactly to float32, by its key in the original release layout."""
        return self.ckpt.weight_f32(key)

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 20))

    def new_cache(self) -> Cache:
        return Cache(self)

    def check_ids(self, ids, start: int = 0) -> np.ndarray:
        a = np.asarray(ids)
        if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
            raise PromptError(f"token ids must be a non-empty 1-D sequence of integers, got {a.dtype} {a.shape}")
        bad = np.flatnonzero((a < 0) | (a >= self.config.vocab_size))
        if bad.size:
            raise PromptError(f"token id {int(a[bad[0]])} at index {int(bad[0])} is outside the vocabulary "
                              f"[0, {self.config.vocab_size})")
        if start + a.size > self.max_context:
            raise PromptError(f"{start + a.size} positions exceed the maximum context of {self.max_context}")
        return a.astype(np.int64)

    def forward(self, ids: Sequence[int], cache: Cache | None = None, capture: Capture | None = None,
                inject: Injection | None = None) -> np.ndarray:
        """Run the tokens `ids` at the next positions of `cache` (appending to it) -> logits [T, V] f32."""
        cache = cache if cache is not None else self.new_cache()
        if not isinstance(cache, Cache):
            raise TypeError(f"cache must be an oracle.model.Cache (model.new_cache()), got {type(cache).__name__}")
        why = _cache_mismatch(cache.owner, _owner(self))
        if why is not None:
            raise ValueError(f"cache of another model: {why}; make one with this model's new_cache()")
        ids = self.check_ids(ids, cache.length)
        P, c, pos0 = self.P, self.config, cache.length
        e = StageSink(capture, 0, pos0, inject)("embed", P.weight(self.embed[ids]))
        X = np.repeat(e[:, None, :], c.hc_mult, axis=1)
        selection = None
        for l, layer in enumerate(self.layers):
            X, selection = layer.forward(X, cache.layers[l], pos0, StageSink(capture, l, pos0, inject), selection)
        logits = head(P, X, self.norm, self.lm_head, c.rms_norm_eps,
                      StageSink(capture, c.num_hidden_layers, pos0, inject))
        cache.length += ids.size
        return logits

    def prefill(self, ids, cache: Cache | None = None, chunk: int | None = None,
                capture: Capture | None = None, inject: Injection | None = None) -> np.ndarray:
        """forward over `ids` in chunks of `chunk` tokens (None: one chunk) -> logits of every position."""
        cache = cache if cache is not None else self.new_cache()
        ids = self.check_ids(ids, cache.length)
        step = chunk or ids.size
        if step < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        return np.concatenate([self.forward(ids[i:i + step], cache, capture, inject)
                               for i in range(0, ids.size, step)])

    def generate(self, ids, max_new_tokens: int, chunk: int | None = None, capture: Capture | None = None,
                 return_logits: bool = False, inject: Injection | None = None):
        """Greedy decoding: prefill the prompt, then one token at a time. -> new token ids (and logits)."""
        cache = self.new_cache()
        logits = self.prefill(ids, cache, chunk, capture, inject)
        all_logits, out = [logits], []
        for i in range(max_new_tokens):
            tok = greedy(logits[-1])
            out.append(tok)
            if i + 1 == max_new_tokens:
                break
            logits = self.forward([tok], cache, capture, inject)
            all_logits.append(logits)
        if return_logits:
            return out, np.concatenate(all_logits)
        return out


def greedy(logits: np.ndarray) -> int:
    """argmax of f32 logits, ties to the lowest token id (np.argmax returns the first maximum)."""
    return int(np.argmax(logits))


def load(path, precision: str = "canonical") -> Model:
    """Open a checkpoint directory and build the model in `precision` ("canonical" or "float64")."""
    return Model(open_checkpoint(path), precision)
