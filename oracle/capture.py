"""Captures (stage values) and traces (stage hashes), in one versioned format.

A capture records, for chosen (layer, stage) pairs, the value of every position as an array in the
stage's canonical dtype. A trace keeps only a hash per (layer, stage, position): cheap enough for a
whole run, so two runs are compared by hashes first and tensors are captured only where they part.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .stages import canonical_bytes, stage_dtype

FORMAT_VERSION = 1


def row_hash(value: np.ndarray, dtype: str) -> str:
    """First 16 hex digits of sha256 over the canonical bytes of one stage row."""
    return hashlib.sha256(canonical_bytes(value, dtype)).hexdigest()[:16]


@dataclass
class Capture:
    """What to record and what was recorded.

    stages: stage names to keep (None = all); layers: layer indices (None = all);
    keep_values: store arrays (capture) or only hashes (trace).
    """

    stages: set[str] | None = None
    layers: set[int] | None = None
    keep_values: bool = True
    values: dict[tuple[int, str], dict[int, np.ndarray]] = field(default_factory=dict)
    hashes: dict[tuple[int, str, int], str] = field(default_factory=dict)

    def wants(self, layer: int, stage: str) -> bool:
        return (self.stages is None or stage in self.stages) and (self.layers is None or layer in self.layers)

    def put(self, layer: int, stage: str, pos: int, value) -> None:
        if not self.wants(layer, stage):
            return
        dtype = stage_dtype(stage)
        value = np.array(value, copy=True)
        if value.dtype == np.float64:          # float64 mode: every stage is a double
            dtype = "f64"
        self.hashes[(layer, stage, pos)] = row_hash(value, dtype)
        if self.keep_values:
            self.values.setdefault((layer, stage), {})[pos] = value

    def get(self, layer: int, stage: str, pos: int) -> np.ndarray:
        return self.values[(layer, stage)][pos]

    # -- files ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """One .npz: a JSON header (format version, hashes) and one array per recorded row."""
        arrays = {}
        for (layer, stage), rows in self.values.items():
            for pos, value in rows.items():
                arrays[f"{layer}/{stage}/{pos}"] = value
        header = {"format": "glm-exact-capture", "version": FORMAT_VERSION,
                  "hashes": [[l, s, p, h] for (l, s, p), h in sorted(self.hashes.items())]}
        np.savez(path, __header__=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), **arrays)

    @classmethod
    def load(cls, path: str | Path) -> "Capture":
        with np.load(path, allow_pickle=False) as f:
            header = json.loads(bytes(f["__header__"]).decode())
            if header.get("format") != "glm-exact-capture" or header.get("version") != FORMAT_VERSION:
                raise ValueError(f"{path}: not a capture file of format version {FORMAT_VERSION}")
            cap = cls()
            for l, s, p, h in header["hashes"]:
                cap.hashes[(l, s, p)] = h
            for key in f.files:
                if key == "__header__":
                    continue
                l, s, p = key.split("/")
                cap.values.setdefault((int(l), s), {})[int(p)] = f[key]
        return cap
