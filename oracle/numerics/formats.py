"""Low-precision number formats of the checkpoints, decoded exactly to float32.

Decoding is a table lookup: each table below is built at import from the
format's definition (sign, exponent field, mantissa field, bias), in plain
Python with exact power-of-two arithmetic, and every entry is exactly
representable in float32.

* E4M3 (``float8_e4m3fn``): 1 sign, 4 exponent (bias 7), 3 mantissa bits.
  No infinities; S.1111.111 is NaN (decoded as the quiet NaN with sign S,
  float32 bits 0x7FC00000 / 0xFFC00000); the largest finite value is 448;
  subnormals are m * 2^-9.
* E2M1 (``float4_e2m1fn``, one nibble): 1 sign, 2 exponent (bias 1),
  1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}.  No inf, no NaN.
* E8M0 (``float8_e8m0fnu``, an MX scale): 2^(e - 127); e = 0 gives 2^-127, a
  float32 subnormal; 0xFF is NaN.

Encoders (used to write synthetic checkpoints) round to nearest, ties to even,
computed exactly in float64 (every float32 input and every candidate code value
is exact there).  E4M3 saturates finite values above 448 to +-448 (the FP8
scale is chosen so that this does not happen, but a saturating encoder cannot
produce a NaN by accident); +-inf and NaN become the NaN code with their sign,
as ml_dtypes does.  E2M1 saturates to +-6 (inf included) and refuses NaN, which
it cannot represent.

Weight decoders (docs/contract.md §4.1):
* BF16: exact (the 16 bits become the high half of a float32).
* FP8:  w[r, c] = fl32(e4m3(q[r, c]) * scale_inv[r // 128, c // 128]), one
  float32 multiply, rounded to nearest even.
* MXFP4: w[r, c] = fl32(e2m1(nibble) * 2^(e[r, c // 32] - 127)); byte b of a
  row holds column 2b in its low nibble and column 2b + 1 in its high nibble.
The decoders decode NaN codes to NaN; refusing them (naming the tensor) is the
loader's job.
"""

import math

import numpy as np
from numba import njit

from .bf16 import bf16_bits_to_f32

__all__ = [
    "E4M3_TABLE",
    "E2M1_TABLE",
    "E8M0_TABLE",
    "decode_e4m3",
    "encode_e4m3",
    "decode_e2m1",
    "encode_e2m1",
    "decode_e8m0",
    "encode_e8m0_from_exponent",
    "decode_bf16_weight",
    "decode_fp8_weight",
    "decode_mxfp4_weight",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0


# ----------------------------------------------------------------------------
# Decode tables, from the definitions
# ----------------------------------------------------------------------------

def _minifloat_value(code, exp_bits, man_bits, bias):
    """Value of a sign/exponent/mantissa code with IEEE-style subnormals."""
    sign = -1.0 if (code >> (exp_bits + man_bits)) & 1 else 1.0
    e = (code >> man_bits) & ((1 << exp_bits) - 1)
    m = code & ((1 << man_bits) - 1)
    if e == 0:  # subnormal: 0.m * 2^(1 - bias)
        return sign * math.ldexp(m, 1 - bias - man_bits)
    return sign * math.ldexp((1 << man_bits) + m, e - bias - man_bits)


def _e4m3_table():
    values = []
    for code in range(256):
        if code & 0x7F == 0x7F:  # S.1111.111: NaN, with the code's sign
            values.append(-math.nan if code & 0x80 else math.nan)
        else:
            values.append(_minifloat_value(code, 4, 3, 7))
    return np.array(values, dtype=np.float32)


def _e2m1_table():
    return np.array([_minifloat_value(code, 2, 1, 1) for code in range(16)], dtype=np.float32)


def _e8m0_table():
    values = [math.ldexp(1.0, e - 127) for e in range(255)] + [math.nan]
    return np.array(values, dtype=np.float32)


E4M3_TABLE = _e4m3_table()
E2M1_TABLE = _e2m1_table()
E8M0_TABLE = _e8m0_table()

# Every table entry is exact in float32 (decoding never rounds).
for _table in (E4M3_TABLE, E2M1_TABLE, E8M0_TABLE):
    assert all(math.isnan(v) or float(np.float32(v)) == v for v in _table.astype(np.float64))
assert E4M3_TABLE[0x7E] == E4M3_MAX and E2M1_TABLE[7] == E2M1_MAX
assert E8M0_TABLE[0] == math.ldexp(1.0, -127)


# ----------------------------------------------------------------------------
# Element decoders
# ----------------------------------------------------------------------------

@njit(cache=True)
def _lookup(codes, table):
    out = np.empty(codes.shape, np.float32)
    out_flat = out.reshape(-1)
    codes_flat = codes.ravel()
    for i in range(codes_flat.size):
        out_flat[i] = table[codes_flat[i]]
    return out


def _as_codes(x, name, dtype, allowed_views=()):
    x = np.asarray(x)
    if x.dtype != dtype:
        if x.dtype.itemsize == np.dtype(dtype).itemsize and x.dtype.name in allowed_views:
            x = x.view(dtype)
        else:
            raise TypeError(f"{name}: expected {np.dtype(dtype).name} codes, got {x.dtype}")
    return x


def decode_e4m3(codes):
    """uint8 E4M3 codes (any shape) -> float32, exact; S.1111.111 -> NaN."""
    return _lookup(_as_codes(codes, "decode_e4m3", np.uint8, ("float8_e4m3fn",)), E4M3_TABLE)


def decode_e2m1(nibbles):
    """uint8 E2M1 nibbles 0..15 (any shape) -> float32, exact."""
    nibbles = _as_codes(nibbles, "decode_e2m1", np.uint8, ("float4_e2m1fn",))
    if nibbles.size and int(nibbles.max()) > 15:
        raise ValueError("decode_e2m1: a nibble must be in 0..15")
    return _lookup(nibbles, E2M1_TABLE)


def decode_e8m0(codes):
    """uint8 E8M0 codes (any shape) -> float32 2^(e-127), exact; 0xFF -> NaN."""
    return _lookup(_as_codes(codes, "decode_e8m0", np.uint8, ("float8_e8m0fnu",)), E8M0_TABLE)


# ----------------------------------------------------------------------------
# Element encoders (round to nearest, ties to even)
# ----------------------------------------------------------------------------

@njit(cache=True)
def _round_half_even(v):
    """Nearest integer to v >= 0, ties to even (v is exact in float64)."""
    n = math.floor(v)
    d = v - n  # exact
    if d > 0.5 or (d == 0.5 and n % 2.0 == 1.0):
        n += 1.0
    return n


@njit(cache=True)
def _encode_magnitude(a, man_bits, bias, max_value):
    """Code (without sign) of the finite magnitude a >= 0: RNE, saturating at max_value.

    a and every intermediate are exact in float64: a is a float32 and the
    scalings are by powers of two within range.
    """
    min_normal_exp = 1 - bias
    if a == 0.0:
        return 0
    e = math.frexp(a)[1] - 1  # a in [2^e, 2^(e+1))
    if e < min_normal_exp:
        e = min_normal_exp  # subnormal range: same quantum as the lowest binade
    quantum = math.ldexp(1.0, e - man_bits)
    v = _round_half_even(a / quantum) * quantum  # may step up one binade
    if v > max_value:
        v = max_value
    if v < math.ldexp(1.0, min_normal_exp):  # subnormal (or zero): code is the count of quanta
        return int(v / math.ldexp(1.0, min_normal_exp - man_bits))
    e = math.frexp(v)[1] - 1
    mantissa = int(v / math.ldexp(1.0, e - man_bits)) - (1 << man_bits)
    return ((e + bias) << man_bits) | mantissa


@njit(cache=True)
def _encode_e4m3_kernel(x, out):
    for i in range(x.size):
        v = np.float64(x[i])
        sign = 0x80 if (v < 0.0 or (v == 0.0 and math.copysign(1.0, v) < 0.0)) else 0
        if np.isnan(v) or np.isinf(v):
            sign = 0x80 if math.copysign(1.0, v) < 0.0 else 0
            out[i] = sign | 0x7F
        else:
            out[i] = sign | _encode_magnitude(abs(v), 3, 7, 448.0)


@njit(cache=True)
def _encode_e2m1_kernel(x, out):
    for i in range(x.size):
        v = np.float64(x[i])
        sign = 0x8 if math.copysign(1.0, v) < 0.0 else 0
        a = abs(v)
        if np.isinf(a):
            a = 6.0
        out[i] = sign | _encode_magnitude(a, 1, 1, 6.0)


def _float32_input(x, name):
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"{name}: expected float32 values, got {x.dtype}")
    return np.ascontiguousarray(x)


def encode_e4m3(x):
    """float32 array -> uint8 E4M3 codes (RNE; finite |x| > 448 -> +-448; inf/NaN -> NaN code)."""
    x = _float32_input(x, "encode_e4m3")
    out = np.empty(x.shape, np.uint8)
    _encode_e4m3_kernel(x.reshape(-1), out.reshape(-1))
    return out


def encode_e2m1(x):
    """float32 array -> uint8 E2M1 nibbles (RNE; |x| > 6 and inf -> +-6; NaN refused)."""
    x = _float32_input(x, "encode_e2m1")
    if np.isnan(x).any():
        raise ValueError("encode_e2m1: E2M1 has no NaN code")
    out = np.empty(x.shape, np.uint8)
    _encode_e2m1_kernel(x.reshape(-1), out.reshape(-1))
    return out


def encode_e8m0_from_exponent(exponent):
    """Integer exponent(s) e in [-127, 127] -> uint8 E8M0 code(s) e + 127 (value 2^e)."""
    e = np.asarray(exponent)
    if not np.issubdtype(e.dtype, np.integer):
        raise TypeError(f"encode_e8m0_from_exponent: expected integers, got {e.dtype}")
    if e.size and (int(e.min()) < -127 or int(e.max()) > 127):
        raise ValueError("encode_e8m0_from_exponent: exponent outside [-127, 127]")
    return (e.astype(np.int64) + 127).astype(np.uint8)


# ----------------------------------------------------------------------------
# Weight decoders
# ----------------------------------------------------------------------------

def _matrix(x, name, what):
    if x.ndim != 2:
        raise ValueError(f"{name}: {what} must be 2-D, got shape {x.shape}")
    return x


def decode_bf16_weight(u16):
    """BF16 weight as uint16 (usually [R, C]; any shape) -> float32 of the same shape, exact."""
    return bf16_bits_to_f32(_as_codes(u16, "decode_bf16_weight", np.uint16, ("bfloat16",)))


@njit(cache=True)
def _decode_fp8_kernel(q, scale_inv, table):
    rows, cols = q.shape
    out = np.empty((rows, cols), np.float32)
    for r in range(rows):
        for c in range(cols):
            out[r, c] = table[q[r, c]] * scale_inv[r // 128, c // 128]  # one float32 multiply
    return out


def decode_fp8_weight(q, scale_inv):
    """FP8 weight: q uint8 [R, C] E4M3 codes, scale_inv float32 [ceil(R/128), ceil(C/128)]
    -> float32 [R, C], w = fl32(e4m3(q) * scale_inv[r // 128][c // 128])."""
    q = _matrix(_as_codes(q, "decode_fp8_weight", np.uint8, ("float8_e4m3fn",)),
                "decode_fp8_weight", "q")
    scale_inv = _matrix(np.asarray(scale_inv), "decode_fp8_weight", "scale_inv")
    if scale_inv.dtype != np.float32:
        raise TypeError(f"decode_fp8_weight: scale_inv must be float32, got {scale_inv.dtype}")
    rows, cols = q.shape
    expected = (-(-rows // 128), -(-cols // 128))
    if scale_inv.shape != expected:
        raise ValueError(f"decode_fp8_weight: scale_inv shape {scale_inv.shape}, "
                         f"expected {expected} for a weight of shape {q.shape}")
    return _decode_fp8_kernel(q, scale_inv, E4M3_TABLE)


@njit(cache=True)
def _decode_mxfp4_kernel(packed, scale, e2m1, e8m0):
    rows, half = packed.shape
    out = np.empty((rows, 2 * half), np.float32)
    for r in range(rows):
        for b in range(half):
            byte = packed[r, b]
            c0 = 2 * b  # low nibble
            c1 = 2 * b + 1  # high nibble
            out[r, c0] = e2m1[byte & 0x0F] * e8m0[scale[r, c0 // 32]]  # one float32 multiply
            out[r, c1] = e2m1[byte >> 4] * e8m0[scale[r, c1 // 32]]
    return out


def decode_mxfp4_weight(packed, scale):
    """MXFP4 weight: packed uint8 [R, C/2] (column 2b in the low nibble of byte b, 2b+1 in
    the high nibble), scale uint8 E8M0 [R, ceil(C/32)] -> float32 [R, C],
    w = fl32(e2m1 * 2^(e - 127))."""
    packed = _matrix(_as_codes(packed, "decode_mxfp4_weight", np.uint8), "decode_mxfp4_weight",
                     "packed")
    scale = _matrix(_as_codes(scale, "decode_mxfp4_weight", np.uint8, ("float8_e8m0fnu",)),
                    "decode_mxfp4_weight", "scale")
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    expected = (rows, -(-cols // 32))
    if scale.shape != expected:
        raise ValueError(f"decode_mxfp4_weight: scale shape {scale.shape}, expected {expected} "
                         f"for packed shape {packed.shape} ({cols} columns)")
    return _decode_mxfp4_kernel(packed, scale, E2M1_TABLE, E8M0_TABLE)
