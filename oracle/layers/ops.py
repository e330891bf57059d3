"""Precision-generic building blocks for the layers.

The oracle runs in two precisions with one body of layer code:
- canonical: arrays are float32, activations are rounded to BF16 where docs/numerics.md says so,
  every reduction is `cdot`, exponentials are the canonical `expf`;
- float64: arrays are float64, rounding is the identity, every reduction is `cdot64`, exponentials
  are double. It removes every rounding, to compare the math with the peer.
The dtype of the arrays decides; these helpers dispatch on it, so a layer reads like its formula.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .. import numerics as nx


class Precision:
    """The numeric rules of one run: `canonical` (f32 + BF16 rounding) or `float64`."""

    def __init__(self, name: str):
        if name not in ("canonical", "float64"):
            raise ValueError(f"precision must be 'canonical' or 'float64', got {name!r}")
        self.name = name
        self.dtype = np.float32 if name == "canonical" else np.float64

    @property
    def canonical(self) -> bool:
        return self.name == "canonical"

    def const(self, v) -> np.floating:
        """A config constant in the working precision ((float)v in canonical mode)."""
        return self.dtype(v)

    def inv_sqrt_const(self, n) -> np.floating:
        """(float)(1.0 / sqrt((double)n)): scales such as d^-1/2."""
        return self.dtype(1.0 / np.sqrt(np.float64(n)))

    def weight(self, w_f32: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(w_f32, dtype=self.dtype)

    def rnd(self, x: np.ndarray) -> np.ndarray:
        """bf16(x) in canonical mode; the identity in float64 mode."""
        x = np.ascontiguousarray(x, dtype=self.dtype)
        return nx.bf16_round_array(x) if self.canonical else x

    def rnd64(self, x: np.ndarray) -> np.ndarray:
        """A double result leaving double land: f64 -> f32 -> bf16 (canonical), identity (float64)."""
        x = np.ascontiguousarray(x, dtype=np.float64)
        return nx.f64_to_bf16_round_array(x) if self.canonical else x

    def matmul(self, W: np.ndarray, X: np.ndarray) -> np.ndarray:
        """[T, R] = cdot of every row of W [R, C] with every row of X [T, C] (no rounding)."""
        W = np.ascontiguousarray(W, dtype=self.dtype)
        X = np.ascontiguousarray(X, dtype=self.dtype)
        if X.shape[1] == 0:
            return np.zeros((X.shape[0], W.shape[0]), self.dtype)
        return nx.matmat(W, X) if self.canonical else nx.matmat64(W, X)

    def lin(self, W: np.ndarray, X: np.ndarray) -> np.ndarray:
        """A linear layer: bf16(cdot(W[r], x)) for each token row x of X [T, C] -> [T, R]."""
        return self.rnd(self.matmul(W, X))

    def dot(self, a: np.ndarray, b: np.ndarray):
        a = np.ascontiguousarray(a, dtype=self.dtype)
        b = np.ascontiguousarray(b, dtype=self.dtype)
        return nx.cdot(a, b) if self.canonical else nx.cdot64(a, b)

    def rowdot(self, A: np.ndarray, B: np.ndarray) -> np.ndarray:
        """cdot(A[t], B[t]) for every row t of two [T, n] arrays -> [T]."""
        A = np.ascontiguousarray(A, dtype=self.dtype)
        B = np.ascontiguousarray(B, dtype=self.dtype)
        return _rowdot32(A, B) if self.canonical else _rowdot64(A, B)

    def rowsum(self, X: np.ndarray) -> np.ndarray:
        """csum of every row of X [T, n] -> [T]."""
        return self.rowdot(X, np.ones_like(X, dtype=self.dtype))

    def exp(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=self.dtype)
        return nx.expf_array(x) if self.canonical else np.exp(x)

    def sigmoid(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=self.dtype)
        return nx.sigmoid_array(x) if self.canonical else 1.0 / (1.0 + np.exp(-x))

    def silu(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=self.dtype)
        return nx.silu_array(x) if self.canonical else x / (1.0 + np.exp(-x))


@njit(cache=True)
def fma_outer_update(k, u, S):
    """S[i][j] = fma(k[i], u[j], S[i][j]) in place (f32 or f64, single rounding)."""
    for i in range(S.shape[0]):
        for j in range(S.shape[1]):
            S[i, j] = nx.fma(k[i], u[j], S[i, j])


@njit(cache=True)
def _rowdot32(A, B):
    out = np.empty(A.shape[0], np.float32)
    for t in range(A.shape[0]):
        out[t] = nx.cdot(A[t], B[t])
    return out


@njit(cache=True)
def _rowdot64(A, B):
    out = np.empty(A.shape[0], np.float64)
    for t in range(A.shape[0]):
        out[t] = nx.cdot64(A[t], B[t])
    return out
