"""The GLM-5.3-Flash oracle: the readable reference that defines every bit of the output.

    import oracle
    model = oracle.load("golden/tiny-bf16")            # precision="canonical" | "float64"
    tokens = model.generate([1, 2, 3], max_new_tokens=8)
"""


def load(path, precision: str = "canonical"):
    """Open a checkpoint directory -> oracle.model.Model (imported lazily: Numba compiles on first use)."""
    from .model import load as _load
    return _load(path, precision)
