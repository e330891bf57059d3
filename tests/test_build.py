"""The build keeps IEEE semantics (docs/contract.md §4.6): no contraction, no flush of subnormals, no
reciprocal division, and a clean MXCSR in a normal process."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from fast import _core as core

F32, U32 = np.float32, np.uint32


def test_no_contraction():
    # a*b + c with a = b = 1 + 2^-12, c = -(1 + 2^-11): a*b = 1 + 2^-11 + 2^-24 exactly, which rounds
    # to 1 + 2^-11 (a tie, to even), so the separate multiply and add give 0; an FMA gives 2^-24.
    a, c = Fraction(1) + Fraction(1, 2 ** 12), -(Fraction(1) + Fraction(1, 2 ** 11))
    assert a * a + c == Fraction(1, 2 ** 24)  # what a contracted build would return
    r = core.contract_probe()
    assert np.array(r, F32).view(U32) == 0, f"the build contracts a*b + c into an FMA (got {r!r})"


def test_build_flags():
    info = core.build_info()
    flags = info["cxx_flags"].split()
    assert "-ffp-contract=off" in flags and "-mfma" in flags and "-mavx2" in flags
    for bad in ("-ffast-math", "-Ofast", "-ffp-contract=fast", "-funsafe-math-optimizations",
                "-freciprocal-math", "-fassociative-math", "-mdaz-ftz"):
        assert bad not in flags
    assert info["fma"] and info["avx2"] and not info["fast_math"]


def test_mxcsr_clean():
    assert core.ftz_daz_enabled() is False


def test_subnormals_preserved():
    tiny = np.array([2.0 ** -149], F32)
    one = np.array([1.0], F32)
    assert core.cdot(tiny, one).view(U32) == 0x00000001  # a subnormal input is not treated as 0 (DAZ)
    half = np.array([0.5], F32)
    assert core.cdot(np.array([2.0 ** -126], F32), half).view(U32) == 0x00400000  # nor flushed (FTZ)
    assert core.csum(np.array([2.0 ** -149] * 3, F32)).view(U32) == 3
    assert core.decode_e8m0(np.array([0], np.uint8))[0].view(U32) == 0x00400000
    assert core.decode_e4m3(np.array([0x01], np.uint8))[0] == 2.0 ** -9
    # decode of an E4M3 subnormal (read as an f32 subnormal and rebiased) and a subnormal matvec product
    q = np.array([[0x01, 0x02, 0x07]], np.uint8)
    assert core.decode_fp8_weight(q, np.array([[2.0 ** -140]], F32)).view(U32).tolist() == [[
        0x00000001, 0x00000002, 0x00000007]]
    y = core.matvec_bf16(np.array([[0x0001]], np.uint16), np.array([0.5], F32))  # 2^-133 * 0.5 = 2^-134
    assert y.view(U32).tolist() == [0x00008000]
    # an expf result in the subnormal range
    e = core.expf(np.array([-100.0], F32))[0]
    assert 0 < e.view(U32) < 0x00800000


def test_division_is_not_multiplication_by_reciprocal():
    x = (np.arange(1, 4097, dtype=F32) * F32(0.7)).astype(F32)
    d = F32(3.0)
    exact = x / d  # NumPy's float32 division is the IEEE one
    recip = x * (F32(1.0) / d)
    differ = exact.view(U32) != recip.view(U32)
    assert differ.sum() > 100  # the probe set does tell the two apart
    got = core.div_probe(x, 3.0)
    assert np.array_equal(got.view(U32), exact.view(U32))


def test_ftz_daz_refused():
    # A library that sets FTZ/DAZ in this thread would break exactness: the engine refuses to run.
    a = np.ones(8, F32)
    prev = core._set_ftz_daz(True)
    try:
        assert core.ftz_daz_enabled() is True
        with pytest.raises(RuntimeError, match="flush-to-zero"):
            core.cdot(a, a)
        with pytest.raises(RuntimeError):
            core.matvec_bf16(np.ones((1, 8), np.uint16), a)
    finally:
        core._set_ftz_daz(prev)
    assert core.ftz_daz_enabled() is False
    assert core.cdot(a, a) == 8.0
