"""MLA: multi-head latent attention in the absorbed form, NoPE (docs/numerics.md, MLA).

The cache holds only the normalized latent c (kv_lora_rank values) per position. Each head folds
W_UK into its query (q_abs = W_UK^T q) and W_UV after the weighted sum over positions, so keys and
values are never expanded.
"""
from __future__ import annotations

import numpy as np

from .indexer import Indexer, IndexerCache
from .norm import rms_norm
from .ops import Precision


class MLACache:
    def __init__(self, P: Precision, config, has_indexer: bool):
        self.c = np.zeros((0, config.kv_lora_rank), P.dtype)
        self.indexer = IndexerCache(P, config) if has_indexer else None

    def copy(self) -> "MLACache":
        other = object.__new__(MLACache)
        other.c = self.c.copy()
        other.indexer = self.indexer.copy() if self.indexer is not None else None
        return other

    def __repr__(self) -> str:
        idx = "own indexer" if self.indexer is not None else "no indexer"
        return f"MLACache(positions={self.c.shape[0]}, kv_lora_rank={self.c.shape[1]}, {idx})"


class MLA:
    def __init__(self, P: Precision, w, config, has_indexer: bool):
        self.P, self.c = P, config
        self.nh, self.dn, self.dv, self.r = (config.num_attention_heads, config.qk_nope_head_dim,
                                             config.v_head_dim, config.kv_lora_rank)
        self.q_a, self.q_a_norm = w("q_a_proj.weight"), w("q_a_layernorm.weight")
        self.q_b = w("q_b_proj.weight")
        self.kv_a, self.kv_a_norm = w("kv_a_proj_with_mqa.weight"), w("kv_a_layernorm.weight")
        kv_b = w("kv_b_proj.weight").reshape(self.nh, self.dn + self.dv, self.r)
        self.w_uk_t = np.ascontiguousarray(kv_b[:, :self.dn, :].transpose(0, 2, 1))   # [nh, r, dn]
        self.w_uv = np.ascontiguousarray(kv_b[:, self.dn:, :])                          # [nh, dv, r]
        self.o_proj = w("o_proj.weight")
        self.scale = P.inv_sqrt_const(config.qk_nope_head_dim + config.qk_rope_head_dim)
        self.indexer = Indexer(P, w, config) if has_indexer else None

    def forward(self, x: np.ndarray, cache: MLACache, pos0: int, cap, shared_selection):
        """-> (out [T, D], selection: list of ascending position arrays, one per token)."""
        P, c, T = self.P, self.c, x.shape[0]
        q_lat = rms_norm(P, P.lin(self.q_a, x), self.q_a_norm, c.rms_norm_eps)
        q = P.lin(self.q_b, q_lat).reshape(T, self.nh, self.dn)
        latent = rms_norm(P, P.lin(self.kv_a, x)[:, :self.r], self.kv_a_norm, c.rms_norm_eps)
        q_lat = cap("mla.q_lat", q_lat)
        q = cap("mla.q", q.reshape(T, -1)).reshape(T, self.nh, self.dn)
        latent = cap("mla.c", latent)
        cache.c = np.concatenate([cache.c, latent])

        q_abs = np.stack([P.lin(self.w_uk_t[h], q[:, h, :]) for h in range(self.nh)], axis=1)  # [T, nh, r]
        q_abs = cap("mla.q_abs", q_abs.reshape(T, -1)).reshape(T, self.nh, self.r)

        if self.indexer is not None:
            selection = self.indexer.select(x, q_lat, cache.indexer, pos0, cap)
        else:
            selection = shared_selection
        selection = cap("mla.selected", selection)

        o_lat = np.empty((T, self.nh, self.r), P.dtype)
        for i in range(T):
            C = cache.c[selection[i]]                                          # [n_sel, r]
            s = cap.row("mla.scores", pos0 + i, P.matmul(C, q_abs[i]) * self.scale)   # [nh, n_sel]
            e = P.exp(s - s.max(axis=1)[:, None])
            p = cap.row("mla.probs", pos0 + i, P.rnd(e / P.rowsum(e)[:, None]))
            o_lat[i] = P.lin(np.ascontiguousarray(C.T), p)                     # cdot over positions
        o_lat = cap("mla.o_lat", o_lat.reshape(T, -1)).reshape(T, self.nh, self.r)

        o = cap("mla.o", np.concatenate([P.lin(self.w_uv[h], o_lat[:, h, :]) for h in range(self.nh)], axis=1))
        return cap("mla.out", P.lin(self.o_proj, o)), selection
