"""Fault injection: perturb exactly one stage value by a number of ULPs, to test the diff tools.

A spec `L,P,STAGE,ELEM,ULPS` names layer L, position P, stage STAGE, the flattened element ELEM of
that stage's row, and how many units in the last place to move it by, in the stage's dtype. The
perturbed value is the one the model carries on with, so it propagates.

The step moves in value order (`step_bits`; the engines share it in bindings/inject_step.hpp):

- A float pattern (the 16-bit pattern of a bf16 stage, f32 bits, f64 bits) maps to an ordered
  integer: +x to its magnitude bits, -x to minus them, so -0 and +0 are the one point 0 and
  neighbouring floats are neighbouring integers (the subnormals included). ULPS is added there and
  the sum clamped to the finite range [-max finite, +max finite], then mapped back (0 -> +0).
  +1 ulp is the next float up, -1 the next float down, across zero as well.
- So a finite value never becomes inf or NaN: a large ULPS stops at the largest finite value of
  its sign. An infinity pushed further out stays where it is; one moved inwards by k becomes the
  k-th finite value from the end. A NaN is left as it is (the same bits).
- int32 stages (`mla.selected`, `moe.selected`) add ULPS to the integer, saturating at the int32
  limits (the model then refuses an index outside its range, as for any other bad index).
- In the oracle's float64 precision every stage holds f64, and the step is the f64 one.

ULPS must be a non-zero integer that fits in a signed 64-bit integer (the engines take an int64).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .stages import BF16, F32, F64, I32, stage_dtype


@dataclass(frozen=True)
class Injection:
    layer: int
    pos: int
    stage: str
    elem: int
    ulps: int

    @classmethod
    def parse(cls, text: str) -> "Injection":
        parts = text.split(",")
        if len(parts) != 5:
            raise ValueError(f"inject spec must be L,P,STAGE,ELEM,ULPS, got {text!r}")
        try:
            layer, pos, elem, ulps = int(parts[0]), int(parts[1]), int(parts[3]), int(parts[4])
        except ValueError:
            raise ValueError(f"inject spec {text!r}: L, P, ELEM and ULPS must be integers") from None
        stage_dtype(parts[2])                              # raises on an unknown stage name
        if layer < 0 or pos < 0 or elem < 0 or ulps == 0:
            raise ValueError(f"inject spec {text!r}: L, P, ELEM must be >= 0 and ULPS non-zero")
        if not -_I64_LIMIT <= ulps < _I64_LIMIT:
            raise ValueError(f"inject spec {text!r}: ULPS must fit in a signed 64-bit integer")
        return cls(layer, pos, parts[2], elem, ulps)

    def __str__(self) -> str:
        return f"{self.layer},{self.pos},{self.stage},{self.elem},{self.ulps}"

    def apply(self, row: np.ndarray) -> np.ndarray:
        """A copy of one position's row with element `elem` moved by `ulps`."""
        out = np.array(row, copy=True)
        flat = out.reshape(-1)
        if self.elem >= flat.size:
            raise ValueError(f"inject: stage {self.stage} has {flat.size} elements at layer {self.layer}, "
                             f"position {self.pos}; element {self.elem} does not exist")
        dtype = stage_dtype(self.stage)
        if out.dtype == np.float64 and dtype != F64:
            dtype = F64
        if dtype in (BF16, F32):
            bits = int(np.array([flat[self.elem]], np.float32).view(np.uint32)[0])
            bits = step_bits(bits >> 16, 16, self.ulps) << 16 if dtype == BF16 else step_bits(bits, 32, self.ulps)
            _put(flat, self.elem, np.array([bits], np.uint32).view(np.float32))
        elif dtype == F64:
            bits = int(np.array([flat[self.elem]], np.float64).view(np.uint64)[0])
            _put(flat, self.elem, np.array([step_bits(bits, 64, self.ulps)], np.uint64).view(np.float64))
        elif dtype == I32:
            flat[self.elem] = min(max(int(flat[self.elem]) + self.ulps, _I32_MIN), _I32_MAX)
        return out


def _put(flat: np.ndarray, i: int, value: np.ndarray) -> None:
    """flat[i] = value[0], by its bits where the dtypes agree (a NaN's payload survives)."""
    if flat.dtype == value.dtype:
        flat.view(value.dtype.str.replace("f", "u"))[i] = value.view(value.dtype.str.replace("f", "u"))[0]
    else:
        flat[i] = value[0]


_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_I64_LIMIT = 1 << 63
_MANT = {16: 7, 32: 23, 64: 52}


def step_bits(bits: int, width: int, ulps: int) -> int:
    """Move a `width`-bit float pattern (16: BF16, 32, 64) by `ulps` in value order (module docstring)."""
    sign = 1 << (width - 1)
    inf = (sign - 1) >> _MANT[width] << _MANT[width]
    mag = bits & (sign - 1)
    if mag > inf:  # NaN
        return bits
    o = -mag if bits & sign else mag
    r = min(max(o + ulps, min(o, -(inf - 1))), max(o, inf - 1))
    return r if r >= 0 else sign | -r
