"""`oracle demo`: the bundled tiny checkpoint through the oracle and the fast CPU engine, compared."""
from __future__ import annotations

import time

import numpy as np

from .golden import canonical_prompts, hash12
from .term import table as make_table


def _timed_generate(engine, prompt, n):
    t0 = time.perf_counter()
    tokens, logits = engine.generate(prompt, n, return_logits=True)
    return tokens, logits, time.perf_counter() - t0


def primitive_selfcheck() -> list[tuple[str, bool]]:
    """The C++ primitives against the oracle's on a fixed sample (used when the engine is absent)."""
    import fast._core as core

    from oracle import numerics as nx
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    x = (rng.standard_normal(4096) * 30).astype(np.float32)
    return [("cdot", np.float32(core.cdot(a, b)).view(np.uint32) == np.float32(nx.cdot(a, b)).view(np.uint32)),
            ("expf", bool(np.array_equal(core.expf(x).view(np.uint32), nx.expf_array(x).view(np.uint32))))]


def demo(console, golden_root) -> int:
    import oracle
    ckpt = golden_root / "tiny-bf16"
    model = oracle.load(ckpt)
    console.print(f"[bold]oracle demo[/bold]: {ckpt}")
    console.print(model.ckpt.summary_text())
    prompt, n = canonical_prompts(model.config.vocab_size)["long"]
    model.generate(prompt[:2], 1)                                    # compile the Numba kernels first
    tokens, logits, dt = _timed_generate(model, prompt, n)
    rows = [("oracle", tokens, hash12(np.array(tokens), "<i4"), hash12(logits, "<f4"), dt)]

    try:
        from fast import Engine
    except ImportError:
        Engine = None
    if Engine is not None:
        engine = Engine(ckpt, device="cpu")
        engine.generate(prompt[:2], 1)
        t2, l2, dt2 = _timed_generate(engine, prompt, n)
        rows.append(("cpu", t2, hash12(np.array(t2), "<i4"), hash12(l2, "<f4"), dt2))

    table = make_table("engine", "tokens", "output hash", "logits hash", "tokens/s",
                       title=f"{len(prompt)} prompt tokens + {n} generated")
    for name, toks, oh, lh, secs in rows:
        table.add_row(name, " ".join(map(str, toks)), oh, lh, f"{(len(prompt) + n) / secs:.1f}")
    console.print(table)

    if len(rows) == 2:
        same = rows[0][3] == rows[1][3] and rows[0][2] == rows[1][2]
        console.print("[green]verdict: oracle and cpu engine are bit-identical[/green]" if same
                      else "[red]verdict: oracle and cpu engine DIFFER (run oracle diff)[/red]")
        return 0 if same else 1
    console.print("The fast CPU engine is not built yet; checking the C++ primitives against the oracle's instead:")
    checks = primitive_selfcheck()
    for name, ok in checks:
        console.print(f"  {name}: {'[green]bit-identical[/green]' if ok else '[red]DIFFERS[/red]'}")
    return 0 if all(ok for _, ok in checks) else 1
