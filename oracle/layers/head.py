"""The head: mean of the hc streams, final RMSNorm, f32 logits."""
from __future__ import annotations

import numpy as np

from .norm import rms_norm
from .ops import Precision


def head(P: Precision, X: np.ndarray, norm_w: np.ndarray, lm_head: np.ndarray, eps: float, cap) -> np.ndarray:
    """X [T, hc, D] -> logits [T, V]: mean = bf16(csum over streams / hc), RMSNorm, cdot per vocab row."""
    T, hc, D = X.shape
    cols = np.ascontiguousarray(X.transpose(0, 2, 1).reshape(T * D, hc))
    mean = cap("head.mean", P.rnd(P.rowsum(cols).reshape(T, D) / P.const(hc)))
    normed = cap("final_norm", rms_norm(P, mean, norm_w, eps))
    return cap("logits", P.matmul(lm_head, normed))
