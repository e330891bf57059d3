"""The DSA k-pool indexer: which past positions an MLA query attends (docs/numerics.md, indexer).

Keys of complete pools of `kp` consecutive positions are compressed into one pool key by a learned
softmax over the pool; a query scores the pools it can see and keeps the best `index_topk / kp`,
plus the tail (its own incomplete pool). With at most `index_topk` visible positions it sees all.
"""
from __future__ import annotations

import numpy as np

from .norm import layer_norm
from .ops import Precision


class IndexerCache:
    def __init__(self, P: Precision, config):
        d = config.index_head_dim
        self.k = np.zeros((0, d), P.dtype)        # indexer.k per position
        self.gate = np.zeros((0, d), P.dtype)     # indexer.gate per position
        self.pool_keys = np.zeros((0, d), P.dtype)

    def copy(self) -> "IndexerCache":
        other = object.__new__(IndexerCache)
        other.k, other.gate, other.pool_keys = self.k.copy(), self.gate.copy(), self.pool_keys.copy()
        return other


class Indexer:
    def __init__(self, P: Precision, w, config):
        self.P, self.c = P, config
        self.n, self.d, self.kp = config.index_n_heads, config.index_head_dim, config.index_kpool
        self.wq_b, self.wk = w("indexer.wq_b.weight"), w("indexer.wk.weight")
        self.k_norm_w, self.k_norm_b = w("indexer.k_norm.weight"), w("indexer.k_norm.bias")
        self.weights_proj = w("indexer.weights_proj.weight")
        self.ape = w("indexer.index_kpool_compress_ape")
        self.gate_w = w("indexer.index_kpool_compress_gate")

    def select(self, x: np.ndarray, q_lat: np.ndarray, cache: IndexerCache, pos0: int, cap) -> list[np.ndarray]:
        """Positions attended by each token of the chunk (ascending int32 arrays)."""
        P, T = self.P, x.shape[0]
        q = P.lin(self.wq_b, q_lat)
        k = layer_norm(P, P.lin(self.wk, x), self.k_norm_w, self.k_norm_b, 1e-6)
        gate = P.lin(self.gate_w, x)
        weights = P.lin(self.weights_proj, x) * P.inv_sqrt_const(self.n)
        q, k = cap("indexer.q", q), cap("indexer.k", k)
        gate, weights = cap("indexer.gate", gate), cap("indexer.weights", weights)

        cache.k = np.concatenate([cache.k, k])
        cache.gate = np.concatenate([cache.gate, gate])
        self._complete_pools(cache)

        selected = []
        for i in range(T):
            t = pos0 + i
            scores = self._pool_scores(q[i].reshape(self.n, self.d), weights[i], cache.pool_keys[:(t + 1) // self.kp])
            selected.append(self._choose(cap.row("indexer.scores", t, scores), t))
        return selected

    def _complete_pools(self, cache: IndexerCache) -> None:
        """Compress every pool whose kp positions are all known and that has no key yet."""
        P, kp = self.P, self.kp
        keys = [cache.pool_keys]
        for p in range(cache.pool_keys.shape[0], cache.k.shape[0] // kp):
            span = slice(p * kp, (p + 1) * kp)
            z = cache.gate[span] + self.ape                                 # [kp, d]
            e = P.exp(z - z.max(axis=0)[None, :])
            probs = P.rnd(e / P.rowsum(e.T)[None, :])                       # softmax over the pool, per channel
            keys.append(P.rnd(P.rowdot(probs.T, cache.k[span].T))[None, :])  # K_p[c] = cdot_j(pi_j[c], k_j[c])
        cache.pool_keys = np.concatenate(keys)

    def _pool_scores(self, q: np.ndarray, weights: np.ndarray, pool_keys: np.ndarray) -> np.ndarray:
        """score_p = cdot over heads of (weights_h, relu(cdot(q_h, K_p) * d^-1/2)) -> [n_pools]."""
        P = self.P
        if pool_keys.shape[0] == 0:
            return np.zeros(0, P.dtype)
        s = P.matmul(pool_keys, q) * P.inv_sqrt_const(self.d)              # [n_heads, n_pools]
        s = np.where(s > 0, s, P.const(0))
        return P.matmul(np.ascontiguousarray(s.T), weights[None, :])[0]

    def _choose(self, scores: np.ndarray, t: int) -> np.ndarray:
        """Best index_topk/kp pools (ties to the lower pool index) + the tail, as ascending positions."""
        kp, budget = self.kp, self.c.index_topk // self.kp
        n_pools = scores.shape[0]
        if n_pools <= budget:
            pools = np.arange(n_pools)
        else:
            pools = np.sort(np.argsort(-scores, kind="stable")[:budget])
        pos = (pools[:, None] * kp + np.arange(kp)[None, :]).reshape(-1)
        tail = np.arange(n_pools * kp, t + 1)
        return np.concatenate([pos, tail]).astype(np.int32)
