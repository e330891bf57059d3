"""Canonical numeric primitives of the oracle (docs/contract.md §4.1-4.3, 4.6).

These functions *define* the canonical result: every rounding and every order
of operations in the model is one of them.  They are written in NumPy + Numba
(``@njit``, no fastmath) and work both from Python and inside other ``@njit``
code, except where noted:

* ``fma`` is a Numba intrinsic (njit code only); ``fma_py`` is callable from Python.
* The format decoders/encoders and weight decoders are Python functions that
  check their inputs and call Numba kernels.

docs/numerics_primitives.md explains each definition and the tests behind it.
"""

from .activation import inv_sqrt, sigmoid, sigmoid64, sigmoid_array, silu, silu_array
from .bf16 import (
    bf16_bits_to_f32,
    bf16_round,
    bf16_round_array,
    f32_to_bf16_bits,
    f64_to_bf16_round,
    f64_to_bf16_round_array,
)
from .exp_f32 import expf, expf_array
from .exp_f64 import exp64
from .formats import (
    decode_bf16_weight,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    decode_fp8_weight,
    decode_mxfp4_weight,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0_from_exponent,
)
from .fused import fma, fma_py
from .reduction import cdot, cdot64, csum, csum64, matmat, matmat64, matvec, matvec64

__all__ = [
    # fused multiply-add
    "fma",
    "fma_py",
    # BF16
    "bf16_round",
    "bf16_round_array",
    "f32_to_bf16_bits",
    "bf16_bits_to_f32",
    "f64_to_bf16_round",
    "f64_to_bf16_round_array",
    # formats
    "decode_e4m3",
    "encode_e4m3",
    "decode_e2m1",
    "encode_e2m1",
    "decode_e8m0",
    "encode_e8m0_from_exponent",
    "decode_bf16_weight",
    "decode_fp8_weight",
    "decode_mxfp4_weight",
    # reductions
    "cdot",
    "cdot64",
    "csum",
    "csum64",
    "matvec",
    "matmat",
    "matvec64",
    "matmat64",
    # transcendentals and activations
    "expf",
    "expf_array",
    "exp64",
    "sigmoid",
    "silu",
    "sigmoid64",
    "sigmoid_array",
    "silu_array",
    "inv_sqrt",
]
