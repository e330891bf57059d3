"""The peer: transformers' glm5_next text model, run entirely in float64 (docs/contract.md §9).

The peer casts to float32 in many places (RMSNorm, gated norm, KDA kernels, router, indexer,
eager softmax). For a float64 comparison those casts are redirected to float64 while the peer
runs: the modeling module's `torch` is a proxy whose `float32` is `torch.float64`, and
`Tensor.float()` returns float64. Nothing else of the peer's math is touched.
"""
from __future__ import annotations

import collections
import contextlib
import math
import types

import numpy as np

torch = __import__("pytest").importorskip("torch")
transformers = __import__("pytest").importorskip("transformers")
from transformers import Glm5NextTextConfig, Glm5NextTextModel  # noqa: E402
from transformers.models.glm5_next import modeling_glm5_next as peer_mod  # noqa: E402


@contextlib.contextmanager
def peer_in_float64():
    proxy = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.float32 = torch.float64
    saved_torch, saved_float = peer_mod.torch, torch.Tensor.float
    peer_mod.torch = proxy
    torch.Tensor.float = lambda self, *a, **k: self.to(torch.float64)
    try:
        yield
    finally:
        peer_mod.torch = saved_torch
        torch.Tensor.float = saved_float


@contextlib.contextmanager
def canonical_topk():
    """Tensor.topk with the canonical tie rule (equal values: the lower index first), as a stable sort.
    The peer's indexer selects pools with `index_scores.topk(k).indices`, and torch leaves the order of
    equal values unspecified (docs/numerics.md, "Ties at the indexer's selection boundary"). Relu'd
    scores are exactly 0 in both implementations whenever every head's score is negative, so at long
    context a query's boundary can fall on such an exact tie. Only the tie order changes; the values
    and the rest of the peer are untouched."""
    saved = torch.Tensor.topk
    Topk = collections.namedtuple("topk", "values indices")

    def stable(self, k, dim=-1, largest=True, sorted=True):
        v, i = torch.sort(self, dim=dim, descending=largest, stable=True)
        return Topk(v.narrow(dim, 0, k), i.narrow(dim, 0, k))
    torch.Tensor.topk = stable
    try:
        yield
    finally:
        torch.Tensor.topk = saved


def peer_config(**overrides) -> Glm5NextTextConfig:
    base = dict(vocab_size=97, hidden_size=48, intermediate_size=72, moe_intermediate_size=40, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
                kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=12, index_topk=8,
                index_head_dim=16, index_n_heads=2, index_kpool=4, linear_num_heads=2, linear_head_dim=16,
                linear_conv_kernel_dim=4, pad_token_id=None, tie_word_embeddings=True, swiglu_limit=3.0,
                layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
                indexer_types=["full", "full", "shared", "full"],
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    base.update(overrides)
    cfg = Glm5NextTextConfig(**base)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def randomize(model, seed: int) -> None:
    """O(1) activations, spread router scores, non-trivial mHC: every parameter redrawn, then rounded to BF16."""
    g = torch.Generator().manual_seed(seed)

    def normal(p, std, mean=0.0):
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std + mean)

    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.split(".")[-1]
            if name.endswith("layernorm.weight") or name.endswith("norm.weight") and "k_norm" not in name:
                normal(p, 0.1, 1.0)
            elif "k_norm" in name:
                normal(p, 0.1, 1.0 if leaf == "weight" else 0.0)
            elif leaf == "fn":
                normal(p, 0.3)
            elif leaf == "base":
                normal(p, 0.5)
            elif leaf == "scale":
                normal(p, 0.1, 1.0)
            elif leaf == "A_log":
                p.copy_(torch.log(torch.rand(p.shape, generator=g, dtype=torch.float64) * 15 + 1))
            elif leaf == "dt_bias":
                normal(p, 0.5, -2.0)
            elif "conv1d" in name:
                normal(p, 0.5)
            elif leaf == "index_kpool_compress_ape":
                normal(p, 1.0)
            elif leaf == "e_score_correction_bias":
                normal(p, 0.1)
            elif name.endswith("embed_tokens.weight"):
                normal(p, 1.0)
            elif p.dim() >= 2:
                normal(p, 1.5 / math.sqrt(p.shape[-1]))
            else:
                normal(p, 1.0)
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_((torch.randn(b.shape, generator=g, dtype=torch.float64) * 0.1).to(torch.bfloat16).to(b.dtype))


def build_peer(tmp_path, seed: int = 0, **overrides):
    """A random peer model saved (BF16 + its F32 modules) with save_pretrained -> (model in f64, path)."""
    torch.manual_seed(seed)
    model = Glm5NextTextModel(peer_config(**overrides))
    randomize(model, seed)
    path = tmp_path / f"peer-{seed}"
    model.to(torch.bfloat16).save_pretrained(path)
    return model.to(torch.float64).eval(), path


def run_peer(model, ids) -> tuple[np.ndarray, list[np.ndarray]]:
    """-> logits [T, V] (tied head) and each decoder layer's output streams [T, hc, D], all float64."""
    with peer_in_float64(), torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
        hidden = out.last_hidden_state[0]
        logits = hidden @ model.embed_tokens.weight.T
    layers = [h[0].numpy() for h in out.hidden_states]
    return logits.numpy(), layers
