"""Golden hashes (docs/contract.md §8): the canonical outputs of the tiny zoo, checked in CI.

For each checkpoint x release x canonical prompt: the output hash (first 12 hex of sha256 over the
generated int32 token ids, little-endian) and the logits hash (the same over the f32 logits of
every forward position: the prompt's and each decoded token's, in order).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
GOLDEN_DIR = REPO / "golden"
HASHES = GOLDEN_DIR / "hashes.json"
RELEASES = ("bf16", "fp8", "mxfp4")
CHECKPOINTS = ("tiny",)


def canonical_prompts(vocab_size: int) -> dict[str, tuple[list[int], int]]:
    """name -> (prompt ids, new tokens). `long` exceeds tiny's index_topk so the indexer selects."""
    def ids(n, a, b):
        return [(a * i + b) % vocab_size for i in range(n)]
    return {
        "short": (ids(5, 7, 1), 8),
        "mixed": (ids(13, 101, 17), 8),
        "long": (ids(40, 37, 11), 8),
    }


def hash12(a: np.ndarray, dtype: str) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype=dtype).tobytes()).hexdigest()[:12]


def run_case(model, prompt: list[int], new_tokens: int) -> dict[str, str]:
    tokens, logits = model.generate(prompt, new_tokens, return_logits=True)
    return {"output": hash12(np.array(tokens), "<i4"), "logits": hash12(logits, "<f4"), "tokens": tokens}


def checkpoint_dir(name: str, release: str) -> Path:
    return GOLDEN_DIR / f"{name}-{release}"


def compute_all(engine_factory, progress=None) -> dict:
    """{"tiny-bf16/short": {"output": ..., "logits": ..., "tokens": [...]}, ...}."""
    out = {}
    for name in CHECKPOINTS:
        for release in RELEASES:
            model = engine_factory(checkpoint_dir(name, release))
            for pname, (prompt, n) in canonical_prompts(model.config.vocab_size).items():
                out[f"{name}-{release}/{pname}"] = run_case(model, prompt, n)
                if progress:
                    progress(f"{name}-{release}/{pname}")
    return out


def load_hashes() -> dict:
    if not HASHES.exists():
        raise FileNotFoundError(f"{HASHES} does not exist; run `oracle golden update`")
    return json.loads(HASHES.read_text())["cases"]


def save_hashes(cases: dict) -> None:
    doc = {"about": "canonical outputs of the tiny zoo; see oracle/golden.py and SPEC 8", "cases": cases}
    HASHES.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def compare(expected: dict, got: dict) -> list[str]:
    """Differences as readable lines (empty when identical)."""
    lines = []
    for key in sorted(set(expected) | set(got)):
        e, g = expected.get(key), got.get(key)
        if e is None:
            lines.append(f"{key}: new case (output {g['output']}, logits {g['logits']})")
        elif g is None:
            lines.append(f"{key}: missing from this run")
        else:
            for field in ("output", "logits"):
                if e[field] != g[field]:
                    lines.append(f"{key}: {field} {e[field]} -> {g[field]}")
    return lines
