"""BF16, E4M3, E2M1, E8M0 and the weight decoders, bit for bit against ml_dtypes and NumPy."""

import math

import ml_dtypes
import numpy as np
import pytest

from oracle.numerics import (
    bf16_bits_to_f32,
    bf16_round,
    bf16_round_array,
    decode_bf16_weight,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    decode_fp8_weight,
    decode_mxfp4_weight,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0_from_exponent,
    f32_to_bf16_bits,
    f64_to_bf16_round,
    f64_to_bf16_round_array,
)

U32 = np.uint32


def f32_from_bits(bits):
    return np.asarray(bits, dtype=U32).view(np.float32)


def bits_of(x):
    return np.asarray(x, dtype=np.float32).view(U32)


# ---------------------------------------------------------------------------------------------
# BF16
# ---------------------------------------------------------------------------------------------

def test_bf16_ties_to_even():
    x = f32_from_bits([0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF, 0x80008000, 0x80018000])
    assert f32_to_bf16_bits(x).tolist() == [0x3F80, 0x3F82, 0x3F81, 0x3F81, 0x8000, 0x8002]


def test_bf16_overflow_and_infinities():
    x = f32_from_bits([0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0xFF7F8000])
    assert f32_to_bf16_bits(x).tolist() == [0x7F7F, 0x7F80, 0x7F80, 0x7F80, 0xFF80, 0xFF80]


def test_bf16_every_nan_is_canonical():
    rng = np.random.default_rng(0)
    payloads = rng.integers(1, 1 << 23, 2000, dtype=np.int64).astype(U32)
    nans = np.concatenate([
        0x7F800000 | payloads, 0xFF800000 | payloads,  # both signs, quiet and signalling
        np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF], U32),
    ]).astype(U32)
    x = nans.view(np.float32)
    assert np.isnan(x).all()
    assert (f32_to_bf16_bits(x) == 0x7FC0).all()
    assert (bits_of(bf16_round_array(x)) == 0x7FC00000).all()
    for v in x[:50]:
        assert bits_of(np.float32(bf16_round(v))) == 0x7FC00000
    assert bits_of(np.float32(f64_to_bf16_round(-math.nan))) == 0x7FC00000


def bf16_reference(x):
    """ml_dtypes' RNE conversion (it keeps a NaN's sign, so NaNs are handled separately)."""
    return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def test_bf16_matches_ml_dtypes_on_random_bit_patterns():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 1 << 32, 4_000_000, dtype=np.uint64).astype(U32)
    # Many patterns next to rounding boundaries: low halves near 0x8000.
    bits[::2] = (bits[::2] & 0xFFFF0000) | (0x8000 + (bits[::2] & 3) - 1).astype(U32)
    x = bits.view(np.float32)
    ok = ~np.isnan(x)
    assert np.array_equal(f32_to_bf16_bits(x[ok]), bf16_reference(x[ok]))


def test_bf16_every_exact_value_round_trips():
    codes = np.arange(1 << 16, dtype=np.uint16)
    x = bf16_bits_to_f32(codes)
    assert np.array_equal(bits_of(x), codes.astype(U32) << 16)  # exact decode, NaN payloads kept
    ok = ~np.isnan(x)
    assert np.array_equal(f32_to_bf16_bits(x[ok]), codes[ok])
    assert np.array_equal(bits_of(bf16_round_array(x[ok])), bits_of(x[ok]))
    assert np.array_equal(f32_to_bf16_bits(x[ok]), bf16_reference(x[ok]))


def test_bf16_array_shapes():
    x = np.random.default_rng(2).standard_normal((3, 4, 5)).astype(np.float32)
    y = bf16_round_array(x)
    assert y.shape == x.shape and y.dtype == np.float32
    assert np.array_equal(bits_of(y), bits_of(bf16_round_array(x.reshape(-1))).reshape(x.shape))
    z = bf16_round_array(x[:, ::2, 1])  # non-contiguous input
    assert np.array_equal(bits_of(z), bits_of(y[:, ::2, 1]))
    assert f32_to_bf16_bits(x).shape == x.shape


def test_bf16_refuses_float64():
    with pytest.raises(Exception, match="f32_to_bits takes exactly float32"):
        bf16_round_array(np.ones(3))


def _reference_f64_to_bf16_bits(d):
    """The definition written out with integers: IEEE float64 -> float32 (RNE, NumPy's cast is the
    hardware conversion), then float32 -> BF16 (RNE on the bit pattern, canonical NaN). Independent
    of the oracle's code and of any library's float64 -> bfloat16 conversion (ml_dtypes 0.7 rounds
    float64 straight to bfloat16, a single rounding: not our definition)."""
    with np.errstate(over="ignore"):
        u = np.asarray(d, np.float64).astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    is_nan = np.isnan(np.asarray(d, np.float64))
    return np.where(is_nan, np.uint16(0x7FC0), rounded)


def test_f64_to_bf16_is_two_roundings():
    # 1 + 2^-8 + 2^-30: to float32 it is 1 + 2^-8 (the 2^-30 is below half an ulp), which is a
    # BF16 tie that goes to even, 1.0.  Rounding the double straight to BF16 would give 1 + 2^-7.
    x = 1 + 2.0**-8 + 2.0**-30
    # The BF16 neighbours of x are 1 and 1 + 2^-7; the direct (single) rounding picks the nearer.
    assert abs(x - (1 + 2.0**-7)) < abs(x - 1.0)
    assert np.float32(x) == 1 + 2.0**-8  # the float32 step lands exactly on the BF16 tie
    assert bits_of(np.float32(f64_to_bf16_round(x))) == 0x3F800000
    assert f64_to_bf16_round_array(np.array([x, -x])).tolist() == [1.0, -1.0]
    assert _reference_f64_to_bf16_bits(np.array([x]))[0] == 0x3F80
    # And it agrees with the integer reference of the two steps on random doubles, including values
    # next to the float32 and BF16 rounding boundaries, overflow, underflow and NaN.
    rng = np.random.default_rng(3)
    d = rng.standard_normal(200_000) * np.exp2(rng.integers(-140, 130, 200_000))
    ties = (rng.integers(0, 1 << 16, 1000).astype(np.float64) * 2.0**-16 + 1) * (1 + 2.0**-9)
    specials = [np.nan, -np.nan, np.inf, -np.inf, 1e300, -1e300, 1e-300, 0.0, -0.0]
    d = np.concatenate([specials, ties, d])
    d = d[: (d.size // 200) * 200]
    got = f64_to_bf16_round_array(d.reshape(-1, 200))
    assert got.shape == (d.size // 200, 200)
    got_bits = (bits_of(got).reshape(-1) >> 16).astype(np.uint16)
    assert np.array_equal(got_bits, _reference_f64_to_bf16_bits(d))
    assert np.isinf(f64_to_bf16_round(1e300))
    assert f64_to_bf16_round(1e-300) == 0.0


# ---------------------------------------------------------------------------------------------
# E4M3, E2M1, E8M0 decoding: every code against ml_dtypes
# ---------------------------------------------------------------------------------------------

def test_decode_e4m3_every_code():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = decode_e4m3(codes)
    assert np.array_equal(bits_of(got), bits_of(want))
    assert np.isnan(got[[0x7F, 0xFF]]).all() and np.isnan(got).sum() == 2
    assert got[0x7E] == 448.0 and got[0x01] == 2.0**-9 and got[0x08] == 2.0**-6
    assert decode_e4m3(codes.view(ml_dtypes.float8_e4m3fn)).tobytes() == got.tobytes()


def test_decode_e2m1_every_code():
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = decode_e2m1(codes)
    assert np.array_equal(bits_of(got), bits_of(want))
    assert got[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    with pytest.raises(ValueError):
        decode_e2m1(np.array([16], np.uint8))


def test_decode_e8m0_every_code():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = decode_e8m0(codes)
    assert np.array_equal(bits_of(got), bits_of(want))
    assert got[0] == np.float32(2.0**-127) and bits_of(got[0]) == 0x00400000  # a subnormal
    assert got[127] == 1.0 and got[254] == 2.0**127 and np.isnan(got[255])


# ---------------------------------------------------------------------------------------------
# Encoders: round trips, RNE against ml_dtypes, saturation
# ---------------------------------------------------------------------------------------------

def _neighbourhood(values):
    """Every value, the midpoints between consecutive ones, and float32 neighbours of both."""
    v = np.unique(values.astype(np.float64))
    mids = (v[:-1] + v[1:]) / 2  # exact: close binary values
    pts = np.concatenate([v, mids]).astype(np.float32)
    up = np.nextafter(pts, np.float32(np.inf))
    down = np.nextafter(pts, np.float32(-np.inf))
    return np.concatenate([pts, up, down])


def test_encode_e4m3_round_trip_every_value():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    assert np.array_equal(encode_e4m3(decode_e4m3(codes)), codes)


def test_encode_e4m3_rne_matches_ml_dtypes():
    finite = decode_e4m3(np.arange(256, dtype=np.uint8))
    finite = finite[~np.isnan(finite)]
    ties = _neighbourhood(finite)
    rng = np.random.default_rng(4)
    randoms = (rng.standard_normal(1_000_000) * np.exp2(rng.integers(-14, 9, 1_000_000)))
    randoms = randoms.astype(np.float32)
    x = np.concatenate([ties, randoms, f32_from_bits([0x80000000, 0x00000001, 0x80000001])])
    x = x[np.abs(x) < 464]  # ml_dtypes does not saturate: beyond 464 it gives NaN
    want = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(encode_e4m3(x), want)
    # Ties go to even: halfway between 2^-9 and 2*2^-9 -> 2*2^-9; halfway between 0 and 2^-9 -> 0.
    assert encode_e4m3(np.array([1.5 * 2.0**-9, 0.5 * 2.0**-9, 1.0625, 464.0], np.float32)).tolist() \
        == [0x02, 0x00, 0x38, 0x7E]


def test_encode_e4m3_saturates_finite_and_marks_nonfinite():
    x = np.array([448, 449, 464, 465, 1e30, 3.4e38, -500, -3.4e38], np.float32)
    assert encode_e4m3(x).tolist() == [0x7E] * 6 + [0xFE] * 2
    special = np.array([np.inf, -np.inf, np.nan, -np.nan], np.float32)
    assert encode_e4m3(special).tolist() == [0x7F, 0xFF, 0x7F, 0xFF]
    assert encode_e4m3(np.array([-0.0, 0.0], np.float32)).tolist() == [0x80, 0x00]


def test_encode_e2m1_round_trip_every_value():
    codes = np.arange(16, dtype=np.uint8)
    assert np.array_equal(encode_e2m1(decode_e2m1(codes)), codes)


def test_encode_e2m1_rne_matches_ml_dtypes():
    ties = _neighbourhood(decode_e2m1(np.arange(16, dtype=np.uint8)))
    rng = np.random.default_rng(5)
    randoms = (rng.standard_normal(1_000_000) * 4).astype(np.float32)
    x = np.concatenate([ties, randoms, np.array([7, 100, -1e38, np.inf, -np.inf, 1e-45], np.float32)])
    want = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    assert np.array_equal(encode_e2m1(x), want)
    assert encode_e2m1(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6.5], np.float32)).tolist() \
        == [0, 2, 2, 4, 4, 6, 6, 7]


def test_encode_e2m1_refuses_nan():
    with pytest.raises(ValueError):
        encode_e2m1(np.array([1.0, np.nan], np.float32))


def test_encoders_refuse_float64():
    with pytest.raises(TypeError):
        encode_e4m3(np.ones(3))
    with pytest.raises(TypeError):
        encode_e2m1(np.ones(3))


def test_encode_e8m0():
    e = np.arange(-127, 128)
    codes = encode_e8m0_from_exponent(e)
    assert codes.dtype == np.uint8 and codes.tolist() == list(range(255))
    assert np.array_equal(decode_e8m0(codes), np.exp2(e.astype(np.float64)).astype(np.float32))
    for bad in (-128, 128):
        with pytest.raises(ValueError):
            encode_e8m0_from_exponent(np.array([bad]))
    with pytest.raises(TypeError):
        encode_e8m0_from_exponent(np.array([1.0]))


# ---------------------------------------------------------------------------------------------
# Weight decoders against a plain NumPy reference
# ---------------------------------------------------------------------------------------------

def test_decode_bf16_weight():
    rng = np.random.default_rng(6)
    u = rng.integers(0, 1 << 16, (37, 70), dtype=np.int64).astype(np.uint16)
    w = decode_bf16_weight(u)
    assert w.shape == u.shape and w.dtype == np.float32
    assert np.array_equal(bits_of(w), u.astype(U32) << 16)
    assert np.array_equal(bits_of(decode_bf16_weight(u.view(ml_dtypes.bfloat16))), bits_of(w))
    assert decode_bf16_weight(u.reshape(-1)).shape == (37 * 70,)


@pytest.mark.parametrize("rows,cols", [(1, 1), (128, 128), (130, 200), (257, 129), (300, 64)])
def test_decode_fp8_weight(rows, cols):
    rng = np.random.default_rng(rows + cols)
    q = rng.integers(0, 256, (rows, cols), dtype=np.int64).astype(np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x11  # no NaN codes
    s = (rng.standard_normal((-(-rows // 128), -(-cols // 128))) * 1e-3).astype(np.float32)
    s[0, 0] = 3e-39  # a subnormal scale: products round into the subnormal range
    w = decode_fp8_weight(q, s)
    full_scale = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:rows, :cols]
    want = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * full_scale  # one f32 multiply
    assert w.dtype == np.float32 and w.shape == (rows, cols)
    assert np.array_equal(bits_of(w), bits_of(want))


def test_decode_fp8_weight_bad_scale_shape():
    with pytest.raises(ValueError, match="scale_inv shape"):
        decode_fp8_weight(np.zeros((130, 10), np.uint8), np.ones((1, 1), np.float32))
    with pytest.raises(TypeError):
        decode_fp8_weight(np.zeros((130, 10), np.uint8), np.ones((2, 1), np.float64))


def mxfp4_reference(packed, scale):
    rows, half = packed.shape
    nibbles = np.empty((rows, 2 * half), np.uint8)
    nibbles[:, 0::2] = packed & 0x0F  # column 2b: low nibble of byte b
    nibbles[:, 1::2] = packed >> 4  # column 2b + 1: high nibble
    values = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scales = scale.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    with np.errstate(over="ignore"):
        return values * np.repeat(scales, 32, axis=1)[:, : 2 * half]


@pytest.mark.parametrize("rows,cols", [(1, 32), (5, 64), (33, 96), (7, 48), (64, 2)])
def test_decode_mxfp4_weight(rows, cols):
    rng = np.random.default_rng(rows * cols)
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.int64).astype(np.uint8)
    scale = rng.integers(0, 255, (rows, -(-cols // 32)), dtype=np.int64).astype(np.uint8)
    scale[0, 0] = 0  # 2^-127: e2m1 * 2^-127 is a float32 subnormal
    if scale.size > 1:
        scale.flat[1] = 254  # 6 * 2^127 overflows to inf: fl32 of the product
    w = decode_mxfp4_weight(packed, scale)
    want = mxfp4_reference(packed, scale)
    assert w.dtype == np.float32 and w.shape == (rows, cols)
    assert np.array_equal(bits_of(w), bits_of(want))


def test_decode_mxfp4_nibble_order():
    packed = np.array([[0x72]], np.uint8)  # low nibble 2 (1.0) -> column 0, high 7 (6.0) -> column 1
    scale = np.array([[128]], np.uint8)  # 2^1
    assert decode_mxfp4_weight(packed, scale).tolist() == [[2.0, 12.0]]


def test_decode_mxfp4_bad_scale_shape():
    with pytest.raises(ValueError, match="scale shape"):
        decode_mxfp4_weight(np.zeros((4, 32), np.uint8), np.zeros((4, 1), np.uint8))


def test_decoders_are_fast_enough():
    # MB-sized tensors decode in well under a second (Numba loops, not Python).
    import time

    q = np.zeros((2048, 4096), np.uint8)
    s = np.ones((16, 32), np.float32)
    decode_fp8_weight(q[:1, :1], s[:1, :1])
    t = time.perf_counter()
    decode_fp8_weight(q, s)
    assert time.perf_counter() - t < 1.0
