"""The fast engine's Python API: a thin layer over the C++/CUDA extension.

    import fast
    eng = fast.Engine("golden/tiny-bf16", device="cpu", threads=None)

`fast.Engine` (fast/engine.py) imports the extension `fast._core` only when an engine is built, so
`import fast` works (and `fast._core` primitives can be imported) even while the engine is absent.
"""

__all__ = ["Engine", "Cache", "EngineInputError", "EngineMemoryError"]


def __getattr__(name):
    if name in __all__:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'fast' has no attribute {name!r}")
