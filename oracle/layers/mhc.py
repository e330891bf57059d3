"""mHC: the manifold-constrained hyper-connection site, in double (docs/numerics.md, "mHC site").

The hc residual streams of a token are collapsed into one sublayer input with `pre`, and the
sublayer output is expanded back and mixed with the streams by `post` and the doubly-stochastic
`comb` (Sinkhorn). Coefficients are doubles in both precisions; only the values leaving double
land (`collapsed`, `streams`) are rounded, and only in canonical mode.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .. import numerics as nx
from .ops import Precision


@njit(cache=True)
def _normalize_rows(C, eps):
    for i in range(C.shape[0]):
        s = nx.cdot64(np.ascontiguousarray(C[i, :]), np.ones(C.shape[1]))
        for j in range(C.shape[1]):
            C[i, j] = C[i, j] / (s + eps)


@njit(cache=True)
def _normalize_cols(C, eps):
    for j in range(C.shape[1]):
        s = nx.cdot64(np.ascontiguousarray(C[:, j]), np.ones(C.shape[0]))
        for i in range(C.shape[0]):
            C[i, j] = C[i, j] / (s + eps)


@njit(cache=True)
def hc_coefficients(v, fn, base, scale, hc, rms_eps, hc_eps, iters):
    """pre [hc], post [hc], comb [hc, hc] for one token's flattened streams v [hc*D] (all f64)."""
    inv = 1.0 / math.sqrt(nx.cdot64(v, v) / v.shape[0] + rms_eps)
    m = np.empty(fn.shape[0])
    for r in range(fn.shape[0]):
        m[r] = nx.cdot64(np.ascontiguousarray(fn[r]), v) * inv
    pre = np.empty(hc)
    post = np.empty(hc)
    for i in range(hc):
        pre[i] = nx.sigmoid64(m[i] * scale[0] + base[i]) + hc_eps
        post[i] = 2.0 * nx.sigmoid64(m[hc + i] * scale[1] + base[hc + i])
    comb = np.empty((hc, hc))
    z = np.empty(hc)
    e = np.empty(hc)
    for i in range(hc):
        for j in range(hc):
            r = 2 * hc + hc * i + j
            z[j] = m[r] * scale[2] + base[r]
        zmax = z.max()
        for j in range(hc):
            e[j] = nx.exp64(z[j] - zmax)
        s = nx.cdot64(e, np.ones(hc))
        for j in range(hc):
            comb[i, j] = e[j] / s + hc_eps
    _normalize_cols(comb, hc_eps)
    for _ in range(iters - 1):
        _normalize_rows(comb, hc_eps)
        _normalize_cols(comb, hc_eps)
    return pre, post, comb


class HyperConnection:
    """One mHC site (`attn_hc` or `ffn_hc`) of one layer."""

    def __init__(self, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, config):
        self.fn = np.ascontiguousarray(fn, dtype=np.float64)
        self.base = np.ascontiguousarray(base, dtype=np.float64)
        self.scale = np.ascontiguousarray(scale, dtype=np.float64)
        self.hc = config.hc_mult
        self.rms_eps = float(config.rms_norm_eps)
        self.hc_eps = float(config.hc_eps)
        self.iters = int(config.hc_sinkhorn_iters)

    def coefficients(self, X: np.ndarray):
        """X [T, hc, D] (streams of T tokens) -> pre [T, hc], post [T, hc], comb [T, hc, hc]."""
        T = X.shape[0]
        pre, post, comb = np.empty((T, self.hc)), np.empty((T, self.hc)), np.empty((T, self.hc, self.hc))
        for t in range(T):
            v = np.ascontiguousarray(X[t].reshape(-1), dtype=np.float64)
            pre[t], post[t], comb[t] = hc_coefficients(v, self.fn, self.base, self.scale, self.hc,
                                                       self.rms_eps, self.hc_eps, self.iters)
        return pre, post, comb

    @staticmethod
    def collapse(P: Precision, X: np.ndarray, pre: np.ndarray) -> np.ndarray:
        """collapsed[t, d] = bf16(cdot64(pre[t], X[t, :, d]))."""
        out = np.empty((X.shape[0], X.shape[2]))
        for t in range(X.shape[0]):
            cols = np.ascontiguousarray(X[t].T, dtype=np.float64)          # [D, hc]
            out[t] = nx.matmat64(cols, pre[t][None, :])[0]
        return P.rnd64(out)

    @staticmethod
    def expand(P: Precision, X: np.ndarray, u: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
        """X'[t, j, d] = bf16(cdot64([post_j, C_0j..C_{hc-1}j], [u[d], X_0[d]..X_{hc-1}[d]]))."""
        T, hc, D = X.shape
        out = np.empty((T, hc, D))
        for t in range(T):
            rows = np.ascontiguousarray(np.concatenate([u[t][None, :], X[t]], axis=0).T, dtype=np.float64)
            mix = np.ascontiguousarray(np.concatenate([post[t][:, None], comb[t].T], axis=1))  # [hc, 1+hc]
            out[t] = nx.matmat64(rows, mix)                    # [hc, D]
        return P.rnd64(out)
