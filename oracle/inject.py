"""Fault injection: perturb exactly one stage value by a number of ULPs, to test the diff tools.

A spec `L,P,STAGE,ELEM,ULPS` names layer L, position P, stage STAGE, the flattened element ELEM of
that stage's row, and how many units in the last place to add to its bit pattern (in the stage's
dtype: BF16 bits for bf16 stages, f32/f64 bits, or the integer itself for int32 stages such as
`moe.selected`). The perturbed value is the one the model carries on with, so it propagates.
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
        if dtype == BF16:
            bits = np.array([flat[self.elem]], np.float32).view(np.uint32)
            bits = ((bits >> 16).astype(np.int64) + self.ulps).astype(np.uint32) << 16
            flat[self.elem] = bits.view(np.float32)[0]
        elif dtype == F32:
            bits = np.array([flat[self.elem]], np.float32).view(np.int32).astype(np.int64) + self.ulps
            flat[self.elem] = bits.astype(np.uint32).view(np.float32)[0]
        elif dtype == F64:
            bits = np.array([flat[self.elem]], np.float64).view(np.int64) + self.ulps
            flat[self.elem] = bits.view(np.float64)[0]
        elif dtype == I32:
            flat[self.elem] += self.ulps
        return out
