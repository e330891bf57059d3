"""RMSNorm (weighted), the gated RMSNorm of KDA and the indexer's LayerNorm."""
from __future__ import annotations

import numpy as np

from .ops import Precision


def rms_norm(P: Precision, X: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """y = bf16(bf16(x * inv) * w), inv = 1/sqrtf(cdot(x, x)/n + eps); X [T, n]."""
    n = P.const(X.shape[1])
    ss = P.rowdot(X, X)
    inv = P.const(1) / np.sqrt(ss / n + P.const(eps))
    return P.rnd(P.rnd(X * inv[:, None]) * w[None, :])


def gated_rms_norm(P: Precision, O: np.ndarray, gate: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """KDA's output norm per head: bf16(((o * inv) * w) * sigmoid(gate)); O, gate [T, H, d], w [d]."""
    T, H, d = O.shape
    flat = O.reshape(T * H, d)
    ss = P.rowdot(flat, flat).reshape(T, H)
    inv = P.const(1) / np.sqrt(ss / P.const(d) + P.const(eps))
    y = ((O * inv[:, :, None]) * w[None, None, :]) * P.sigmoid(gate)
    return P.rnd(y)


def layer_norm(P: Precision, X: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """y = bf16((xc * inv) * w + b), xc = x - csum(x)/n, inv = 1/sqrtf(cdot(xc, xc)/n + eps)."""
    n = P.const(X.shape[1])
    mean = P.rowsum(X) / n
    xc = X - mean[:, None]
    var = P.rowdot(xc, xc) / n
    inv = P.const(1) / np.sqrt(var + P.const(eps))
    return P.rnd((xc * inv[:, None]) * w[None, :] + b[None, :])
