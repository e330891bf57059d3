"""Fault injection moves a value in value order (oracle/inject.py's rule) and the engines do the same."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fast
import oracle
from oracle.capture import Capture
from oracle.inject import Injection, step_bits
from oracle.stages import stage_dtype

BF16 = ml_dtypes.bfloat16
WIDTHS = {16: (BF16, np.uint16), 32: (np.float32, np.uint32), 64: (np.float64, np.uint64)}


def edge_values(dtype) -> np.ndarray:
    fi = ml_dtypes.finfo(dtype) if dtype is BF16 else np.finfo(dtype)
    tiny, sub = fi.smallest_normal, fi.smallest_subnormal
    big_sub = np.nextafter(np.array(tiny, dtype), np.array(0, dtype))
    pos = [0.0, sub, np.nextafter(np.array(sub, dtype), np.array(1, dtype)), big_sub, tiny, 0.0332, 1.0, fi.max,
           np.nextafter(np.array(fi.max, dtype), np.array(0, dtype)), np.inf]
    v = np.array(pos, dtype)
    return np.concatenate([v, -v])


def nextafter_walk(x: np.ndarray, k: int, dtype) -> np.ndarray:
    """The reference: k steps of nextafter, never onto an infinity; -0 is the same point as +0."""
    x = np.array(x, dtype)
    to = np.array(np.inf if k > 0 else -np.inf, dtype)
    for _ in range(abs(k)):
        if np.isinf(x) and (x > 0) == (k > 0):  # an infinity moved outwards stays
            break
        with np.errstate(over="ignore"):
            n = np.nextafter(x, to)
        if not np.isfinite(n):
            break
        x = n if n != 0 else np.array(0, dtype)
    return x


@pytest.mark.parametrize("width", [16, 32, 64])
@pytest.mark.parametrize("k", [1, 2, 3, -1, -2, -3])
def test_small_steps_are_nextafter(width, k):
    dtype, utype = WIDTHS[width]
    for x in edge_values(dtype):
        bits = int(np.array(x, dtype).view(utype))
        got = np.array(step_bits(bits, width, k), utype).view(dtype)
        want = nextafter_walk(x, k, dtype)
        assert got.view(utype) == want.view(utype), (width, float(x), k, float(got), float(want))


def test_bf16_any_step_is_an_index_into_the_sorted_values():
    """Every BF16 pattern, every step size: the rank among the distinct finite values, moved and clamped."""
    pats = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):
        vals = pats.view(BF16).astype(np.float64)
    finite = np.unique(vals[np.isfinite(vals)])  # -0 and +0 are one value
    rng = np.random.default_rng(16)
    for p in rng.integers(0, 1 << 16, 3000):
        x = vals[p]
        if not np.isfinite(x):
            continue
        i = int(np.searchsorted(finite, x))
        for k in (20000, -20000, int(rng.integers(-70000, 70000)), 1 << 40, -(1 << 40)):
            want = finite[min(max(i + k, 0), finite.size - 1)]
            got = np.array(step_bits(int(p), 16, k), np.uint16).view(BF16).astype(np.float64)
            assert got == want and (want != 0 or not np.signbit(got)), (hex(p), k)


@pytest.mark.parametrize("width", [32, 64])
def test_large_steps_compose_and_stop_at_the_largest_finite(width):
    dtype, utype = WIDTHS[width]
    fmax = np.finfo(dtype).max
    rng = np.random.default_rng(width)

    def val(bits):
        return np.array(bits, utype).view(dtype)

    for bits in rng.integers(0, 1 << (width - 1), 300, dtype=np.uint64):
        bits = int(bits) | (int(rng.integers(0, 2)) << (width - 1))
        x = val(bits)
        if not np.isfinite(x):
            continue
        a, b = (int(v) for v in rng.integers(-(1 << (width - 3)), 1 << (width - 3), 2))
        mid, once = step_bits(bits, width, a), step_bits(bits, width, a + b)
        if abs(val(mid)) != fmax and abs(val(once)) != fmax:  # no clamp on the way: steps add up
            assert step_bits(mid, width, b) == once
        for k in (1 << 40, -(1 << 40), 1 << 62, -(1 << 62)):
            y = val(step_bits(bits, width, k))
            assert np.isfinite(y) and ((y > x) if k > 0 else (y < x))
        # the int64 extremes reach the end of the finite range from the same sign (f64's range is wider)
        assert val(step_bits(bits, width, (1 << 63) - 1)) == fmax or x < 0 and width == 64
        assert val(step_bits(bits, width, -(1 << 63))) == -fmax or x > 0 and width == 64
    one = int(np.array(1.0, dtype).view(utype))
    inf = int(np.array(np.inf, dtype).view(utype))
    assert val(step_bits(one, width, inf - one)) == fmax  # landing exactly on inf's pattern stops below it


def test_nan_stays_and_int32_saturates():
    for width, (dtype, utype) in WIDTHS.items():
        nan = int(np.array(np.nan, dtype).view(utype)) | 1
        assert step_bits(nan, width, 5) == nan and step_bits(nan, width, -5) == nan
    inj = Injection.parse("0,0,moe.selected,1,3000000000")
    row = np.array([4, 2147483000], np.int64)
    assert list(inj.apply(row)) == [4, 2**31 - 1]
    assert list(Injection.parse("0,0,moe.selected,0,-3000000000").apply(row)) == [-(2**31), 2147483000]


def test_the_issue_example_stays_finite():
    """kda.q (bf16) 0.0332 moved by 20000 ulps walked through inf/NaN to -3.2e-32 before."""
    row = np.array([0.0332], np.float32)
    row = (row.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    up = Injection.parse("0,0,kda.q,0,20000").apply(row)[0]
    down = Injection.parse("0,0,kda.q,0,-20000").apply(row)[0]
    assert up == ml_dtypes.finfo(BF16).max
    assert np.isfinite(down) and down < 0
    with pytest.raises(ValueError, match="64-bit"):
        Injection.parse(f"0,0,kda.q,0,{1 << 63}")


# ---------------------------------------------------------------------------------------------
# the CPU engine takes the same step as the oracle (bindings/inject_step.hpp)

# (steps whose value overflows further down are left out: NaN bits are not part of the contract)
ENGINE_SPECS = [
    "1,3,kda.q,5,20000",          # bf16: to the largest finite
    "1,3,kda.q,5,-20000",         # bf16: across zero
    "3,6,mla.scores,2,2147483647",   # f32: the engine's largest step, to the largest finite
    "0,4,kda.g,2,-2147483647",    # across zero
    "2,5,attn_hc.pre,1,1099511627776",   # f64, 2**40
    "2,5,attn_hc.pre,1,-1099511627776",
    "3,6,mla.scores,2,-1000000",  # f32 at attention
    "0,6,kda.state,40,-2000000000",
]
IDS = [7, 250, 13, 99, 4, 180, 61, 2, 33, 140]


@pytest.fixture(scope="module")
def tiny(golden_dir):
    path = str(golden_dir / "tiny-fp8")
    return path, oracle.load(path)


@pytest.mark.parametrize("spec", ENGINE_SPECS)
def test_engine_large_steps_match_oracle(spec, tiny):
    path, model = tiny
    inj = Injection.parse(spec)
    clean = Capture(stages={inj.stage}, layers={inj.layer})
    model.forward(IDS, model.new_cache(), clean)
    want = Capture(keep_values=False)
    model.forward(IDS, model.new_cache(), want, inj)
    eng = fast.Engine(path, inject=spec)
    got = Capture(keep_values=False)
    eng.forward(IDS, eng.new_cache(), got)
    assert eng.injected >= 1
    assert got.hashes == want.hashes
    # the engine's own perturbed value: the rule applied to the clean value, finite, on the right side
    seen = Capture(stages={inj.stage}, layers={inj.layer})
    eng.forward(IDS, eng.new_cache(), seen)
    before = np.asarray(clean.get(inj.layer, inj.stage, inj.pos)).reshape(-1)[inj.elem]
    after = np.asarray(seen.get(inj.layer, inj.stage, inj.pos)).reshape(-1)[inj.elem]
    width = {"bf16": 16, "f32": 32, "f64": 64}[stage_dtype(inj.stage)]
    utype = np.uint64 if width == 64 else np.uint32
    b = int(np.array(before).view(utype))
    expect = step_bits(b >> 16, 16, inj.ulps) << 16 if width == 16 else step_bits(b, width, inj.ulps)
    assert int(np.array(after).view(utype)) == expect
    assert np.isfinite(after) and (after > before if inj.ulps > 0 else after < before)


def _cuda():
    from fast.cuda import CudaEngine, cuda_available
    return CudaEngine if cuda_available() else None


def _cuda_specs():
    from fast.cuda import cuda_available, cuda_module
    if cuda_available() and getattr(cuda_module(), "EMULATED", False):
        # the emulation takes ~20 s a case: one each of inject_value's bf16 and f64 steps and KDA's state
        return ["1,3,kda.q,5,-20000", "2,5,attn_hc.pre,1,1099511627776", "0,6,kda.state,40,-2000000000"]
    return ENGINE_SPECS


@pytest.mark.skipif(_cuda() is None, reason="no CUDA device, or fast._cuda is not built (GLM_CUDA_EMU=1: the emulation)")
@pytest.mark.parametrize("spec", _cuda_specs())
def test_cuda_large_steps_match_cpu(spec, tiny):
    path, _ = tiny
    ref = fast.Engine(path, inject=spec)
    want = Capture(keep_values=False)
    ref.forward(IDS, ref.new_cache(), want)
    eng = _cuda()(path, inject=spec)
    got = Capture(keep_values=False)
    eng.forward(IDS, eng.new_cache(), got)
    assert eng.injected == ref.injected >= 1
    assert got.hashes == want.hashes
