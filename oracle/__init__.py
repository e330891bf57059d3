"""The GLM-5.3-Flash oracle: the readable reference that defines every bit of the output.

    import oracle
    model = oracle.load("golden/tiny-bf16")            # precision="canonical" | "float64"
    tokens = model.generate([1, 2, 3], max_new_tokens=8)
"""
import hashlib as _hashlib
import os as _os
from pathlib import Path as _Path


def _numba_cache_dir() -> str:
    """A Numba disk cache keyed by the oracle's own sources.

    Numba invalidates a cached kernel only when the file that defines it changes, not when a
    primitive it inlines from another file does, so a stale kernel could silently compute yesterday's
    numerics. Keying the folder by a hash of every oracle source makes any edit start a fresh cache.
    """
    h = _hashlib.sha256()
    root = _Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    base = _os.environ.get("XDG_CACHE_HOME") or _os.path.join(_os.path.expanduser("~"), ".cache")
    return _os.path.join(base, "glm-exact", "numba", h.hexdigest()[:16])


if "NUMBA_CACHE_DIR" not in _os.environ:
    _os.environ["NUMBA_CACHE_DIR"] = _numba_cache_dir()


def load(path, precision: str = "canonical"):
    """Open a checkpoint directory -> oracle.model.Model (imported lazily: Numba compiles on first use)."""
    from .model import load as _load
    return _load(path, precision)
