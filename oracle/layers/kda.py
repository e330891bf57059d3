"""KDA: Kimi delta attention, a linear attention with a per-channel forget gate (docs/numerics.md, KDA).

Per token: q, k, v projections -> causal depthwise conv + SiLU -> per-head l2 norms -> the delta
rule on an f32 state S [d_k, d_v] -> gated RMSNorm -> o_proj. Prefill runs the same per-token
recurrence as decode, so any chunking gives the same bits.
"""
from __future__ import annotations

import numpy as np

from .norm import gated_rms_norm
from .ops import Precision, fma_outer_update


class KDACache:
    """Per-layer KDA state: the last K-1 pre-conv rows of q|k|v and the recurrent state."""

    def __init__(self, P: Precision, config):
        n = config.linear_num_heads * config.linear_head_dim
        d = config.linear_head_dim
        self.conv_tail = np.zeros((config.linear_conv_kernel_dim - 1, 3 * n), P.dtype)
        self.state = np.zeros((config.linear_num_heads, d, d), P.dtype)

    def copy(self) -> "KDACache":
        other = object.__new__(KDACache)
        other.conv_tail = self.conv_tail.copy()
        other.state = self.state.copy()
        return other

    def __repr__(self) -> str:
        H, d, _ = self.state.shape
        return f"KDACache(heads={H}, head_dim={d}, state {self.state.dtype.name})"


class KDA:
    def __init__(self, P: Precision, w, config):
        self.P, self.c = P, config
        self.H, self.d = config.linear_num_heads, config.linear_head_dim
        self.q_proj, self.k_proj, self.v_proj = w("q_proj.weight"), w("k_proj.weight"), w("v_proj.weight")
        # one depthwise conv over the concatenated q|k|v channels: taps [3P, K]
        self.conv = np.concatenate([w(f"{n}_conv1d.weight")[:, 0, :] for n in "qkv"], axis=0)
        self.f_a, self.f_b = w("f_a_proj.weight"), w("f_b_proj.weight")
        self.dt_bias, self.A_log = w("dt_bias"), w("A_log")
        self.b_proj = w("b_proj.weight")
        self.g_a, self.g_b = w("g_a_proj.weight"), w("g_b_proj.weight")
        self.o_norm, self.o_proj = w("o_norm.weight"), w("o_proj.weight")

    def forward(self, x: np.ndarray, cache: KDACache, pos0: int, cap) -> np.ndarray:
        P, H, d = self.P, self.H, self.d
        T = x.shape[0]
        proj = [cap(name, P.lin(W, x)) for name, W in
                (("kda.q_proj", self.q_proj), ("kda.k_proj", self.k_proj), ("kda.v_proj", self.v_proj))]

        # causal depthwise conv over q|k|v, then SiLU; the window holds K rows ending at t
        qkv = np.concatenate(proj, axis=1)
        hist = np.concatenate([cache.conv_tail, qkv], axis=0)
        K = self.conv.shape[1]
        conv = np.empty_like(qkv)
        for t in range(T):
            window = np.ascontiguousarray(hist[t:t + K].T)               # [3P, K]
            conv[t] = P.rowdot(self.conv, window)
        cache.conv_tail = hist[hist.shape[0] - (K - 1):].copy()
        act = P.rnd(P.silu(conv))
        n = H * d
        q, k, v = cap("kda.q", act[:, :n]), cap("kda.k", act[:, n:2 * n]), cap("kda.v", act[:, 2 * n:])

        # forget gate g (f32, per channel) and beta (f32, per head)
        f = P.lin(self.f_b, P.lin(self.f_a, x))
        decay_rate = P.exp(self.A_log)                                     # [H]
        lb = P.const(self.c.linear_lower_bound)
        g = lb * P.sigmoid(np.repeat(decay_rate, d)[None, :] * (f + self.dt_bias[None, :]))
        g, beta = cap("kda.g", g), cap("kda.beta", P.sigmoid(P.lin(self.b_proj, x)))

        o = self._recurrence(q.reshape(T, H, d), k.reshape(T, H, d), v.reshape(T, H, d),
                             g.reshape(T, H, d), beta, cache, cap, pos0)
        o = cap("kda.o", o.reshape(T, n)).reshape(T, H, d)
        gate = cap("kda.gate", P.lin(self.g_b, P.lin(self.g_a, x)))
        y = gated_rms_norm(P, o, gate.reshape(T, H, d), self.o_norm, self.c.rms_norm_eps).reshape(T, n)
        y = cap("kda.o_norm", y)
        return cap("kda.out", P.lin(self.o_proj, y))

    def _recurrence(self, q, k, v, g, beta, cache: KDACache, cap, pos0: int) -> np.ndarray:
        """The delta rule, one token at a time: S *= exp(g); u = (v - k.S) beta; S += k u^T; o = q.S."""
        P, H, d = self.P, self.H, self.d
        T = q.shape[0]
        eps, scale = P.const(1e-6), P.inv_sqrt_const(d)
        o = np.empty((T, H, d), P.dtype)
        decay = P.exp(g)
        for t in range(T):
            qn = q[t] / np.sqrt(P.rowdot(q[t], q[t]) + eps)[:, None]
            kn = k[t] / np.sqrt(P.rowdot(k[t], k[t]) + eps)[:, None]
            qs = qn * scale
            for h in range(H):
                S = cache.state[h]
                S *= decay[t, h][:, None]
                pred = P.matmul(S.T, kn[h][None, :])[0]                 # pred_j = cdot(k, S[:, j])
                u = (v[t, h] - pred) * beta[t, h]
                fma_outer_update(kn[h], u, S)
                o[t, h] = P.matmul(S.T, qs[h][None, :])[0]                # o_j = cdot(q, S[:, j])
            if cap.wants("kda.state"):                                    # the state is carried on as stored
                cache.state[...] = cap.row("kda.state", pos0 + t, cache.state)
        return o
