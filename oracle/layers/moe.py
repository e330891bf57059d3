"""Feed-forward: the clamped SwiGLU (dense layers, shared and routed experts) and the MoE router."""
from __future__ import annotations

import numpy as np

from .ops import Precision


class SwiGLU:
    def __init__(self, P: Precision, gate, up, down, limit: float):
        self.P, self.gate, self.up, self.down = P, gate, up, down
        self.limit = P.const(limit)

    def forward(self, x: np.ndarray, cap=None) -> np.ndarray:
        """y = lin(down, bf16(silu(min(g, L)) * clamp(u, -L, L))); `cap` given for a dense layer's MLP."""
        P, L = self.P, self.limit
        g, u = P.lin(self.gate, x), P.lin(self.up, x)
        if cap is not None:
            g, u = cap("mlp.gate", g), cap("mlp.up", u)
        g = np.where(g > L, L, g)
        u = np.where(u > L, L, np.where(u < -L, -L, u))
        y = P.lin(self.down, P.rnd(P.silu(g) * u))
        return cap("mlp.out", y) if cap is not None else y


class Router:
    """Sigmoid scores + bias choose the experts (group-limited); weights are the unbiased scores."""

    def __init__(self, P: Precision, weight, bias, config):
        self.P, self.weight, self.bias, self.c = P, weight, bias, config

    def route(self, x: np.ndarray, cap):
        """-> selected [T, k] (ascending expert ids), weights [T, k]; logits captured on the way."""
        P, c = self.P, self.c
        logits = cap("moe.logits", P.matmul(self.weight, x))
        scores = P.sigmoid(logits)
        choice = scores + self.bias[None, :]
        T = logits.shape[0]
        selected = np.empty((T, c.num_experts_per_tok), np.int32)
        for t in range(T):
            selected[t] = np.sort(self._top_experts(choice[t]))
        selected = cap("moe.selected", selected)
        weights = np.empty((T, c.num_experts_per_tok), P.dtype)
        for t in range(T):
            w = scores[t, selected[t]]
            if c.norm_topk_prob:
                w = w / (P.rowsum(w[None, :])[0] + P.const(1e-20))
            weights[t] = w * P.const(c.routed_scaling_factor)
        return selected, cap("moe.weights", weights)

    def _top_experts(self, choice: np.ndarray) -> np.ndarray:
        c = self.c
        allowed = np.ones(choice.shape[0], bool)
        if c.n_group > 1:
            groups = choice.reshape(c.n_group, -1)
            top2 = -np.sort(-groups, axis=1)[:, :2]
            group_score = top2[:, 0] + top2[:, 1]
            keep = np.argsort(-group_score, kind="stable")[:c.topk_group]
            allowed = np.zeros((c.n_group, groups.shape[1]), bool)
            allowed[keep] = True
            allowed = allowed.reshape(-1)
        candidates = np.flatnonzero(allowed)
        order = np.argsort(-choice[candidates], kind="stable")      # ties to the lower expert index
        return candidates[order[:c.num_experts_per_tok]]


class MoE:
    def __init__(self, P: Precision, router: Router, experts: list, shared: SwiGLU):
        self.P, self.router, self.experts, self.shared = P, router, experts, shared

    def forward(self, x: np.ndarray, cap) -> np.ndarray:
        P = self.P
        selected, weights = self.router.route(x, cap)
        T, D = x.shape
        k = selected.shape[1]
        ys = np.empty((T, k, D), P.dtype)
        for t in range(T):
            for j, e in enumerate(selected[t]):
                ys[t, j] = self.experts[e]().forward(x[t:t + 1])[0]
        ys = cap("moe.experts", ys)
        routed = np.empty((T, D), P.dtype)
        for t in range(T):
            routed[t] = P.lin(np.ascontiguousarray(ys[t].T), weights[t][None, :])[0]   # cdot over experts
        routed, shared = cap("moe.routed", routed), cap("moe.shared", self.shared.forward(x))
        return cap("moe.out", P.rnd(routed + shared))
