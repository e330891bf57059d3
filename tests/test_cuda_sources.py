"""Rules of the CUDA engine's sources that no GPU-less test can observe, checked on the text.

Every launch of the engine is a programmatic dependent launch (bindings/cuda/compat.cuh): a kernel may
start while the kernel before it in the stream is still running. That is only correct because every
kernel's first statement is pdl_enter(), which waits for the previous kernel's completion; a kernel
that forgot it would race its predecessor on the GPU and nowhere else (the emulation runs launches in
order), so the rule is checked here, where CI sees it.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

CUDA = Path(__file__).resolve().parents[1] / "bindings" / "cuda"
SOURCES = sorted(CUDA.glob("*.cu")) + sorted(CUDA.glob("*.cuh"))
KERNEL = re.compile(r"__global__\s[^{;]*?\b(k_\w+)\s*\(")


def kernels(text: str):
    """(name, first statement of the body) of every __global__ function definition."""
    for m in KERNEL.finditer(text):
        body = text.index("{", m.end())
        if ";" in text[m.end():body]:  # a declaration, not a definition
            continue
        first = text[body + 1:].lstrip().split(";", 1)[0]
        yield m.group(1), first.strip()


def test_the_sources_define_kernels():
    found = [name for p in SOURCES for name, _ in kernels(p.read_text())]
    # the parser finds every kernel (a regex that missed one would exempt it from the rule below)
    assert len(found) == sum(p.read_text().count("__global__") for p in SOURCES), found
    assert {"k_linear", "k_linear_st", "k_linear_mt", "k_linear_stream", "k_hc_mix", "k_moe_route", "k_kda_rec"} <= set(found)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_kernel_waits_for_its_predecessor_first(path):
    text = path.read_text()
    bad = [name for name, first in kernels(text) if first not in ("pdl_enter()", "pdl_release()")]
    assert not bad, f"{path.name}: kernels whose first statement is not pdl_enter(): {bad}"
    # a kernel that starts with pdl_release() (reading weights before it waits) must wait in its body
    for m in KERNEL.finditer(text):
        body = text.index("{", m.end())
        if ";" in text[m.end():body]:
            continue
        nxt = text.find("__global__", body)
        span = text[body:nxt if nxt > 0 else len(text)]
        if span[1:].lstrip().startswith("pdl_release()"):
            assert "pdl_wait();" in span, f"{path.name}: {m.group(1)} releases but never waits"


def test_the_rule_catches_a_kernel_without_it():
    text = "__global__ void k_a(int* p) {\n    pdl_enter();\n    *p = 1;\n}\n" \
           "__global__ void __launch_bounds__(64) k_b(int* p) {\n    *p = 2;\n    pdl_enter();\n}\n"
    assert dict(kernels(text)) == {"k_a": "pdl_enter()", "k_b": "*p = 2"}


def test_launches_go_through_the_launch_helper():
    # a raw <<<...>>> launch would not carry the programmatic-launch attribute the helper sets
    raw = [f"{p.name}:{i + 1}" for p in SOURCES for i, line in enumerate(p.read_text().splitlines())
           if "<<<" in line and not line.lstrip().startswith("//")]
    assert not raw, raw


def test_the_engine_reads_no_environment():
    # the engine's runtime knobs are options given at construction (engine_api.hpp: EngineOptions), never
    # environment reads inside the engine (fast/cuda.py maps the A/B variables onto options, in one place)
    host = SOURCES + sorted(CUDA.glob("*.cpp")) + sorted(CUDA.glob("*.hpp"))
    reads = [f"{p.name}:{i + 1}" for p in host for i, line in enumerate(p.read_text().splitlines())
             if re.search(r"\b(getenv|env_is|environ)\b", line) and not line.lstrip().startswith("//")]
    assert not reads, reads
    assert host and any(p.name == "engine_api.hpp" for p in host)
