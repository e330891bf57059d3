"""The CPU engine's two builds of its multi-token kernels (bindings/cpu/isa.hpp): AVX2 everywhere, AVX-512VL where
the CPU and its OS run it. tests/test_cpu_primitives.py holds each build's linear kernels to the cdots bit for bit;
here: which build a process runs and how it is asked for, the whole engine's bits under each, and that no
AVX-512 instruction sits outside the AVX-512 build's own names (where one did, the linker could hand it to a
CPU without AVX-512)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

core = pytest.importorskip("fast._core")

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, kernels: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GLM_CPU_KERNELS"}
    if kernels is not None:
        env["GLM_CPU_KERNELS"] = kernels
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_choice_and_its_refusals():
    avail = core.cpu_kernels()["available"]
    assert "avx2" in avail and set(avail) <= {"avx2", "avx512"}
    show = "import fast._core as c; print(c.cpu_kernels()['chosen'])"
    # unset: the widest that runs here
    assert _run(show, None).stdout.strip() == ("avx512" if "avx512" in avail else "avx2")
    assert _run(show, "avx2").stdout.strip() == "avx2"
    bad = _run(show, "sse4")
    assert bad.returncode != 0 and "GLM_CPU_KERNELS=sse4: expected avx2 or avx512 (unset: the fastest" in bad.stderr
    # an engine refuses it when made, not at its first step
    made = _run(f"import fast; fast.Engine({str(ROOT / 'golden' / 'tiny-bf16')!r})", "sse4")
    assert made.returncode != 0 and "ValueError: GLM_CPU_KERNELS=sse4: expected avx2 or avx512" in made.stderr
    wide = _run(show, "avx512")
    if "avx512" in avail:
        assert wide.stdout.strip() == "avx512"
    else:
        assert wide.returncode != 0 and "GLM_CPU_KERNELS=avx512: does not run here (this CPU" in wide.stderr
    X = np.ones((2, 64), np.float32)
    W = np.zeros((3, 64), np.uint16)
    with pytest.raises(ValueError, match="^kernels: 'sse4': expected avx2 or avx512 \\(None: "):
        core.linear("bf16", W, None, X, kernels="sse4")
    if "avx512" not in avail:
        with pytest.raises(ValueError, match="^kernels: 'avx512': does not run here \\(this CPU"):
            core.linear("bf16", W, None, X, kernels="avx512")


_FP8_PATHS = '''
import numpy as np, fast._core as core
rng = np.random.default_rng(76)
for C in (200, 1088):  # 200: the f32 pre-decode from 18 tokens; 1088: rows turned into FP16 bits from 13
    R = 140
    q = rng.integers(0, 256, (R, C), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x3C  # (turned rows: NaN-free tensors only)
    s = (2.0 ** rng.integers(-12, -4, ((R + 127) // 128, (C + 127) // 128)) * rng.uniform(1, 2, ((R + 127) // 128, (C + 127) // 128))).astype(np.float32)
    X = (rng.standard_normal((25, C)) * 0.5).astype(np.float32)
    X[0, ::7] = -0.0
    Wd = core.decode_fp8_weight(q, s)
    want = np.array([[core.cdot(np.ascontiguousarray(Wd[r]), X[t]) for r in range(R)] for t in range(25)], np.float32)
    for k in core.cpu_kernels()["available"]:
        for T in (2, 6, 13, 18, 25):
            got = core.linear("fp8", q, s, X[:T].copy(), nan_free=True, kernels=k)
            assert np.array_equal(got.view(np.uint32), want[:T].view(np.uint32)), (C, k, T)
print("ok")
'''


@pytest.mark.parametrize("direct", ["0", "1"])
def test_fp8_turned_and_direct_paths(direct):
    # matvec.cpp fp8_direct: which FP8 path a multi-token call takes depends on the CPU (the AVX-512 build turns rows
    # into FP16 bits and pre-decodes short ones except on Zen 4); GLM_CPU_FP8_DIRECT forces either, so both are held
    # to the cdots on any CPU
    env = {k: v for k, v in os.environ.items() if k != "GLM_CPU_KERNELS"}
    env["GLM_CPU_FP8_DIRECT"] = direct
    out = subprocess.run([sys.executable, "-c", _FP8_PATHS], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_fma_peak_probe_of_each_build():
    # the FMA peak's probe runs each build's widest vectors (AVX-512: 16 lanes); bench_cpu takes the best as the peak
    from tools.bench_cpu import fma_peak

    avail = core.cpu_kernels()["available"]
    for k in avail:
        assert core.engine_bench_fma(1, 1, kernels=k) > 0
    assert fma_peak(1, 1)[1] in avail
    with pytest.raises(ValueError, match="^bench_fma: kernels='sse4' expected avx2 or avx512"):
        core.engine_bench_fma(1, 1, kernels="sse4")


# A prefill (several token blocks a weight), a batched decode step of 7 and 8 sequences (one block of 7-8 tokens
# against the head) and its greedy tokens, every logit's bits hashed.
_ENGINE = r"""
import hashlib, sys, numpy as np, fast
eng = fast.Engine(sys.argv[1], threads=2)
h = hashlib.sha256()
V = int(eng.config.vocab_size)
caches = [eng.new_cache() for _ in range(8)]
for i, c in enumerate(caches):
    h.update(np.ascontiguousarray(eng.forward([(7 * j + i) % V for j in range(11 + i)], c)).view(np.uint32).tobytes())
for B in (7, 8):
    out = eng.step([(c, [(3 * i + B) % V], None, "all") for i, c in enumerate(caches[:B])])
    for o in out:
        h.update(np.ascontiguousarray(o).view(np.uint32).tobytes())
print(fast._core.cpu_kernels()["chosen"], h.hexdigest())
"""


@pytest.mark.parametrize("ckpt", ["tiny-bf16", "tiny-fp8", "tiny-mxfp4"])
def test_engine_bits_under_each_build(ckpt):
    if "avx512" not in core.cpu_kernels()["available"]:
        pytest.skip("no AVX-512VL here: the engine runs the AVX2 kernels only (the other tests hold them to the oracle)")
    path = str(ROOT / "golden" / ckpt)
    code = _ENGINE.replace("sys.argv[1]", repr(path))
    runs = {k: _run(code, k) for k in ("avx2", "avx512")}
    for k, r in runs.items():
        assert r.returncode == 0, r.stderr
    (k2, h2), (k5, h5) = (runs[k].stdout.split() for k in ("avx2", "avx512"))
    assert (k2, k5) == ("avx2", "avx512") and h2 == h5


def _evex_functions(path: str) -> dict[str, str]:
    """{function: one of its AVX-512 (EVEX-encoded) instructions} of a shared object's machine code: an
    instruction whose first byte after any segment or address-size prefix is 0x62 (in 64-bit mode only EVEX)."""
    out = subprocess.run(["objdump", "-d", "-w", path], capture_output=True, text=True, check=True).stdout
    found, fn = {}, None
    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            fn = m.group(1)
            continue
        parts = line.split("\t")
        if len(parts) < 3 or fn is None:
            continue
        b = parts[1].split()
        i = 0
        while i < len(b) and b[i] in ("26", "2e", "36", "3e", "64", "65", "67"):
            i += 1
        if i < len(b) and b[i] == "62":
            found.setdefault(fn, parts[2].strip())
    return found


def test_avx512_instructions_only_under_avx512_names():
    if shutil.which("objdump") is None:
        pytest.skip("no objdump (binutils) to read the module's machine code")
    found = _evex_functions(core.__file__)
    outside = {f: ins for f, ins in found.items() if "6avx512" not in f}  # (glm::cpu::avx512, mangled)
    assert not outside, f"AVX-512 instructions outside glm::cpu::avx512: {list(outside.items())[:5]}"
    if "avx512" in core.cpu_kernels()["available"]:
        assert found, "the AVX-512 build's kernels hold no AVX-512 instruction: compiled without the target?"


def test_evex_reader_finds_an_evex_instruction(tmp_path):
    """The reader above on a known instruction: vaddps %zmm1,%zmm2,%zmm3 (62 f1 6c 48 58 d9) is EVEX;
    vaddps %ymm1,%ymm2,%ymm3 (c5 ec 58 d9) is not."""
    if shutil.which("objdump") is None or shutil.which("as") is None:
        pytest.skip("no binutils (objdump, as)")
    src = tmp_path / "k.s"
    src.write_text(".text\n.globl wide\nwide:\n vaddps %zmm1, %zmm2, %zmm3\n ret\n"
                   ".globl narrow\nnarrow:\n vaddps %ymm1, %ymm2, %ymm3\n ret\n")
    obj = tmp_path / "k.o"
    subprocess.run(["as", "-o", str(obj), str(src)], check=True)
    found = _evex_functions(str(obj))
    assert list(found) == ["wide"] and "vaddps" in found["wide"]
