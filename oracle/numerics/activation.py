"""Sigmoid, SiLU and 1/sqrt, spelled out in float32 (or float64) basic operations.

* sigmoid(x)   = 1 / (1 + expf(-x))        float32; each operation rounds to float32
* silu(x)      = x / (1 + expf(-x))        float32 (one division, not x * sigmoid(x))
* sigmoid64(x) = 1 / (1 + exp64(-x))       float64
* inv_sqrt(v)  = 1.0f / sqrtf(v)           two correctly rounded float32 operations,
                                           never an approximate rsqrt instruction

The functions are compiled with ``error_model="numpy"``: Numba's default
("python") raises ZeroDivisionError on a float division by zero, where IEEE
gives +-inf (inv_sqrt(0) = inf).

The formulas are taken literally, including at the edges: silu(-inf) is
-inf / inf = NaN, silu(x) for x < -88.7 is x / inf = -0.0, sigmoid(-inf) = +0.
"""

import numpy as np
from numba import njit

from .exp_f32 import expf
from .exp_f64 import exp64

__all__ = ["sigmoid", "silu", "sigmoid64", "sigmoid_array", "silu_array", "inv_sqrt"]

_ONE = np.float32(1.0)


@njit(cache=True, error_model="numpy")
def sigmoid(x):
    """float32 x -> float32 1 / (1 + expf(-x))."""
    return _ONE / (_ONE + expf(-x))


@njit(cache=True, error_model="numpy")
def silu(x):
    """float32 x -> float32 x / (1 + expf(-x))."""
    return x / (_ONE + expf(-x))


@njit(cache=True, error_model="numpy")
def sigmoid64(x):
    """float64 x -> float64 1 / (1 + exp64(-x))."""
    return 1.0 / (1.0 + exp64(-x))


@njit(cache=True, error_model="numpy")
def inv_sqrt(v):
    """float32 v -> float32 1.0f / sqrtf(v)."""
    return _ONE / np.sqrt(v)


@njit(cache=True, error_model="numpy")
def sigmoid_array(x):
    """Element-wise sigmoid of a float32 array of any shape."""
    out = np.empty(x.shape, np.float32)
    out_flat = out.reshape(-1)
    x_flat = x.ravel()
    for i in range(x_flat.size):
        out_flat[i] = sigmoid(x_flat[i])
    return out


@njit(cache=True, error_model="numpy")
def silu_array(x):
    """Element-wise silu of a float32 array of any shape."""
    out = np.empty(x.shape, np.float32)
    out_flat = out.reshape(-1)
    x_flat = x.ravel()
    for i in range(x_flat.size):
        out_flat[i] = silu(x_flat[i])
    return out
