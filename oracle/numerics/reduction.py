"""The one reduction primitive (docs/contract.md §4.2): cdot, and everything built on it.

cdot(a, b) over n elements, float32:

* 64 partial sums P[g][l] (g, l in 0..7) start at +0.0.  Here they live in a
  flat array ``acc`` with ``acc[8*g + l] = P[g][l]``, so element i goes to
  ``acc[i % 64]``.
* Element i = 64c + 8g + l is accumulated as P[g][l] = fma(a[i], b[i], P[g][l]),
  chunks c in increasing order; elements past n are skipped.
* The eight accumulators P[0..7] are folded lane-wise by a 4/2/1 tree:
  for w in 4, 2, 1: P[g] += P[g + w] for g < w.
* The eight lanes of P[0] are folded the same way:
  for w in 4, 2, 1: P[0][l] += P[0][l + w] for l < w.
* The result is P[0][0].  n = 0 gives +0.0.

This is eight AVX2 accumulators of eight float32 lanes with a tree fold, or
eight CUDA threads per row with shuffles.  The order depends only on n and on
the element index, never on how the work is split.

cdot64 is the same in float64; it also accepts float32 inputs, converting each
element to float64 first (exact).  csum(x) = cdot(x, 1) and csum64 likewise
(fma(x, 1, s) is exactly the addition x + s).

matvec/matmat apply cdot to rows; every output element is one cdot of one
weight row with one input row, so a row's result does not depend on the other
rows or on the matrix shape.
"""

import numpy as np
from numba import njit

from .fused import fma

__all__ = ["cdot", "cdot64", "csum", "csum64", "matvec", "matmat", "matvec64", "matmat64"]


@njit(cache=True)
def _fold(acc):
    """The 4/2/1 tree over the accumulators P[g], lane-wise, then over the lanes of P[0]."""
    w = 4
    while w >= 1:
        for g in range(w):
            for lane in range(8):
                acc[8 * g + lane] = acc[8 * g + lane] + acc[8 * (g + w) + lane]
        w //= 2
    w = 4
    while w >= 1:
        for lane in range(w):
            acc[lane] = acc[lane] + acc[lane + w]
        w //= 2
    return acc[0]


@njit(cache=True)
def cdot(a, b):
    """Canonical float32 dot product of two float32 vectors of equal length."""
    n = a.shape[0]
    if b.shape[0] != n:
        raise ValueError("cdot: the two vectors differ in length")
    acc = np.zeros(64, np.float32)  # acc[8*g + l] = P[g][l], all +0.0
    full = n - n % 64
    for base in range(0, full, 64):  # chunk c = base / 64, in increasing order
        for k in range(64):
            acc[k] = fma(a[base + k], b[base + k], acc[k])
    for k in range(n - full):  # the last, partial chunk
        acc[k] = fma(a[full + k], b[full + k], acc[k])
    return _fold(acc)


@njit(cache=True)
def cdot64(a, b):
    """Canonical float64 dot product (inputs float32 or float64, widened exactly)."""
    n = a.shape[0]
    if b.shape[0] != n:
        raise ValueError("cdot64: the two vectors differ in length")
    acc = np.zeros(64, np.float64)
    full = n - n % 64
    for base in range(0, full, 64):
        for k in range(64):
            acc[k] = fma(np.float64(a[base + k]), np.float64(b[base + k]), acc[k])
    for k in range(n - full):
        acc[k] = fma(np.float64(a[full + k]), np.float64(b[full + k]), acc[k])
    return _fold(acc)


@njit(cache=True)
def csum(x):
    """Canonical float32 sum: cdot(x, ones)."""
    return cdot(x, np.ones(x.shape[0], np.float32))


@njit(cache=True)
def csum64(x):
    """Canonical float64 sum: cdot64(x, ones)."""
    return cdot64(x, np.ones(x.shape[0], np.float64))


@njit(cache=True)
def matvec(W, x):
    """y[r] = cdot(W[r, :], x): float32 [R, C] x [C] -> [R]."""
    rows, cols = W.shape
    if x.shape[0] != cols:
        raise ValueError("matvec: W has a different number of columns than x has elements")
    y = np.empty(rows, np.float32)
    for r in range(rows):
        y[r] = cdot(W[r], x)
    return y


@njit(cache=True)
def matmat(W, X):
    """Y[t, r] = cdot(W[r, :], X[t, :]): float32 [R, C], [T, C] -> [T, R]."""
    rows, cols = W.shape
    if X.shape[1] != cols:
        raise ValueError("matmat: W and X differ in their number of columns")
    Y = np.empty((X.shape[0], rows), np.float32)
    for t in range(X.shape[0]):
        for r in range(rows):
            Y[t, r] = cdot(W[r], X[t])
    return Y


@njit(cache=True)
def matvec64(W, x):
    """y[r] = cdot64(W[r, :], x): [R, C] x [C] -> float64 [R]."""
    rows, cols = W.shape
    if x.shape[0] != cols:
        raise ValueError("matvec64: W has a different number of columns than x has elements")
    y = np.empty(rows, np.float64)
    for r in range(rows):
        y[r] = cdot64(W[r], x)
    return y


@njit(cache=True)
def matmat64(W, X):
    """Y[t, r] = cdot64(W[r, :], X[t, :]): [R, C], [T, C] -> float64 [T, R]."""
    rows, cols = W.shape
    if X.shape[1] != cols:
        raise ValueError("matmat64: W and X differ in their number of columns")
    Y = np.empty((X.shape[0], rows), np.float64)
    for t in range(X.shape[0]):
        for r in range(rows):
            Y[t, r] = cdot64(W[r], X[t])
    return Y
