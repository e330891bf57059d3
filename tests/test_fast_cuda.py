"""The CUDA engine's own parts (fast.cuda.CudaEngine over fast._cuda): batches of few pairs per expert,
decode over several caches and forks, the device-resident greedy loop and generate's hand-over to it,
the fused mHC streams, the roofline's weight bytes, pooled logits buffers, the golden hashes, refused
input; its device expf equals the host canonical expf (exhaustively on a GPU), its exp64 and decoders
equal the CPU engine's; every linear kernel equals the CPU engine's; and on `slice` (real widths;
GLM_SLICE_DIR) it equals the CPU engine.

That the engine is bit-identical to the CPU engine over the shared cases (generate, chunked prefill,
batches, fault injection, config corners, F32 weights, the non-canonical switches) is
tests/test_engines.py's cuda side, over tests/cases.py. The reference is the CPU engine
(tests/test_engines.py holds it to the oracle) and, for tiny, the oracle's golden hashes. Comparisons
are on bits, never a tolerance.

Skips cleanly without a GPU (fast._cuda not built, or no device). GLM_CUDA_EMU=1 runs the tiny cases
on fast._cuda_emu, the CPU emulation of the same kernels (bindings/cuda/emu), slowly.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import fast
from fast.cuda import CudaEngine, cuda_module
from oracle.capture import Capture
from tests.cases import TINY
from tests.engine_checks import EMU_SLOW, NO_CUDA, assert_same_capture, bits, cuda_state, prompt
from tools.golden import canonical_prompts, hash12

AVAILABLE, EMU, _ = cuda_state()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not AVAILABLE, reason=NO_CUDA)]
needs_gpu = pytest.mark.skipif(EMU, reason=EMU_SLOW)


@pytest.mark.parametrize("release,batch", [("fp8", 3), ("fp8", 8), ("fp8", 16), ("mxfp4", 16)])
def test_batched_few_pairs_per_expert(tmp_path, release, batch):
    """Batches whose pairs are few against the experts (4 T k <= E) run one pair per expert item; from
    2 T k >= E, items of up to 8 pairs, which the few-pair kernel takes (FP8, and MXFP4 rows of whole
    512-column slabs, under 5 pairs an entry)."""
    from tools.zoo import make_checkpoint
    path = str(tmp_path / "experts-64")
    width = {"fp8": (128, 64), "mxfp4": (512, 512)}[release]  # (hidden, expert intermediate)
    make_checkpoint("tiny", release, path, hidden_size=width[0], moe_intermediate_size=width[1], n_routed_experts=64)
    ref, eng = fast.Engine(path, device="cpu"), CudaEngine(path)
    V = eng.config.vocab_size
    prompts = [prompt(V, 5 + 3 * i, 90 + i) for i in range(batch)]
    outs, lgs = eng.generate(prompts, 3, chunk=4, max_batch=batch, return_logits=True)
    for p, out, lg in zip(prompts, outs, lgs):
        toks, logits = ref.generate(p, 3, return_logits=True)
        assert out == toks
        assert np.array_equal(bits(lg), bits(logits))


def test_decode_batch_of_caches_and_fork(cuda_engines, engines):
    """One decode step over several caches at different positions; a forked cache continues alike."""
    eng, ref = cuda_engines("tiny-fp8"), engines("tiny-fp8")
    V = eng.config.vocab_size
    prompts = [prompt(V, n, 70 + n) for n in (3, 17, 33)]
    caches, rcaches = [], []
    for p in prompts:
        c, r = eng.new_cache(), ref.new_cache()
        eng.prefill(p, c, chunk=7)
        ref.prefill(p, r)
        caches.append(c)
        rcaches.append(r)
    forked = caches[1].fork()
    toks = [5, 77, 201]
    a = eng.decode(caches, toks)
    b = ref.decode(rcaches, toks)
    assert np.array_equal(bits(a), bits(b))
    c2 = eng.decode([forked], [77])
    assert np.array_equal(bits(c2), bits(a[1:2]))


def test_closed_caches_buffers_are_reused_from_zero(ckpt_path, engines, monkeypatch):
    """A closed cache's device buffers are kept for the next caches (pooled_bytes, counted in
    available_memory), and a cache that takes them starts from zero state: prompts run in new caches after
    other caches were closed (their KDA state and MLA latents left in the buffers), in a fork, and in caches
    whose MLA cache grows (64 -> 128 positions) into a fresh buffer and into a kept one, each give the CPU
    engine's bits."""
    eng, ref = CudaEngine(ckpt_path("tiny-fp8")), engines("tiny-fp8")
    V = eng.config.vocab_size
    assert eng._core.pooled_bytes == 0
    c = eng.new_cache()
    eng.prefill(prompt(V, 40, 91), c)
    held = c.nbytes
    c.close()
    assert eng._core.pooled_bytes == held > 0
    monkeypatch.setattr(eng.cuda, "device_memory", lambda: (1000, 2000))
    assert eng.available_memory() == 1000 + held
    monkeypatch.undo()

    def same(cache, ids, chunk=None, start=()):  # ids run in cache (after start) = the CPU engine's bits
        got = eng.prefill(ids, cache, chunk=chunk)
        assert np.array_equal(bits(got), bits(ref.prefill(list(start) + ids)[len(start):]))

    second = prompt(V, 23, 92)
    c2 = eng.new_cache()  # (the KDA state kept; the MLA latents when its prefill reserves the same 64 positions)
    same(c2, second)
    assert eng._core.pooled_bytes == 0
    fork = c2.fork()
    c2.close()
    same(fork, [3, 1, 4], start=second)
    long = prompt(V, 70, 93)
    c3 = eng.new_cache()
    same(c3, long, chunk=30)  # (64 positions kept, then 128 new: the 64 go back)
    c3.close()
    c4 = eng.new_cache()
    same(c4, long[::-1], chunk=30)  # (64 kept, then the kept 128)


@pytest.mark.parametrize("name", TINY)
def test_greedy_loop_matches_decode(name, cuda_engines):
    """The device-resident greedy loop gives the tokens of decode() + np.argmax, and leaves the cache
    where those steps would (the next step's logits are the same bits)."""
    eng = cuda_engines(name)
    V = eng.config.vocab_size
    p = prompt(V, 9, 123)
    a, b = eng.new_cache(), eng.new_cache()
    first = int(np.argmax(eng.prefill(p, a)[-1]))
    eng.prefill(p, b)
    want, tok = [], first
    for _ in range(7):
        tok = int(np.argmax(eng.decode([a], [tok])[0]))
        want.append(tok)
    got = eng.greedy(b, first, 7)
    assert got == want and a.length == b.length
    assert np.array_equal(bits(eng.decode([a], [want[-1]])), bits(eng.decode([b], [got[-1]])))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.greedy(b, V, 2)
    with pytest.raises(ValueError, match="n must be"):
        eng.greedy(b, 1, 0)


@pytest.mark.parametrize("name", ["tiny-fp8"])
def test_generate_hands_the_tail_to_the_device_loop(name, cuda_engines, engines, monkeypatch):
    """generate() runs a lone request's remaining tokens through greedy() (one call), with the CPU
    engine's tokens; with a capture, or GLM_DEVICE_GREEDY=0, it keeps the host loop."""
    eng, ref = cuda_engines(name), engines(name)
    p = prompt(eng.config.vocab_size, 11, 7)
    want = ref.generate(p, 6)
    calls = []
    real = eng.greedy
    monkeypatch.setattr(eng, "greedy", lambda *a: calls.append(a[2]) or real(*a))
    assert eng.generate(p, 6) == want and calls == [5]
    assert eng.generate([p, p[:4]], 6, arrivals=[0, 2]) == [want, ref.generate(p[:4], 6)] and len(calls) == 2
    assert eng.generate(p, 6, capture=Capture()) == want and len(calls) == 2
    monkeypatch.setenv("GLM_DEVICE_GREEDY", "0")
    assert eng.generate(p, 6) == want and len(calls) == 2


@pytest.mark.parametrize("release,hc", [("fp8", 4), ("mxfp4", 2), ("bf16", 4)])
def test_decode_with_and_without_the_streams_observed(tmp_path, release, hc):
    """A decode step's hc_expand is made by the next site's mHC kernel (few tokens, a width of whole
    64-column chunks) unless the streams are captured: the logits are the CPU engine's either way, also
    with one site's streams captured and the others fused, and in batches."""
    from tools.zoo import make_checkpoint
    path = str(tmp_path / f"w128-{release}")
    make_checkpoint("tiny", release, path, hidden_size=128, hc_mult=hc)
    eng, ref = CudaEngine(path), fast.Engine(path, device="cpu")
    p = prompt(eng.config.vocab_size, 7, 3)
    for stages, layers in ((None, None), ({"ffn_hc.streams"}, {0}), ({"attn_hc.streams"}, None)):
        cap = None if stages is None else [Capture(stages=stages, layers=layers) for _ in range(3)]
        a, b = [eng.new_cache() for _ in range(3)], [ref.new_cache() for _ in range(3)]
        for i in range(3):
            eng.prefill(p[:4 + i], a[i])
            ref.prefill(p[:4 + i], b[i])
        toks = [5, 6, 7]
        for _ in range(3):
            got, want = eng.decode(a, toks, capture=cap), ref.decode(b, toks)
            assert np.array_equal(bits(got), bits(want))
            toks = [int(np.argmax(w)) for w in want]


def test_decode_weight_bytes_leave_out_the_dense_indexer_query(cuda_engines):
    """The roofline's bytes: below the indexer's dense threshold a decode step does not read wq_b
    (indexer_select makes no query there), at and past it, it reads every weight_bytes counts."""
    from oracle import names as N
    eng = cuda_engines("tiny-fp8")
    c = eng.config
    def stored(e):
        raw = eng.checkpoint.raw(e.spec.role, e.layer, e.expert)
        return raw.data.nbytes + (0 if raw.scale is None else raw.scale.nbytes)
    wq_b = sum(stored(e) for e in N.expected(c) if e.spec.role == "indexer.wq_b")
    assert wq_b > 0
    last_dense = c.index_topk + c.index_kpool - 2  # (position + 1) // kpool <= index_topk // kpool
    assert eng.decode_weight_bytes(0) == eng.decode_weight_bytes(last_dense) == eng.weight_bytes - wq_b
    assert eng.decode_weight_bytes(last_dense + 1) == eng.weight_bytes


def test_device_argmax_rule():
    """The greedy rule on the device is np.argmax's: the lowest index of the maximum, a NaN first. A row is
    cut into segments (a block each, 16-byte loads where n % 4 == 0), their winners folded: rows of one to
    many segments, the vocabulary's length, several rows at once (fewer segments a row), ties and NaNs
    across segments."""
    cu = cuda_module()
    rng = np.random.default_rng(5)

    def row(n, trial):
        x = rng.integers(-2, 3, n).astype(np.float32)  # many ties
        if trial % 3 == 0:
            x[rng.integers(0, n, 2)] = np.nan
        if trial % 5 == 0:
            x[:] = -np.inf
        if trial % 7 == 0:
            x[x == 0] = -0.0
        if trial % 11 == 0:  # one maximum, late: no tie decides it
            x[rng.integers(n // 2, n)] = 7.0
        return x

    for trial in range(60):
        n = int(rng.integers(1, 5000)) if trial % 4 else int(rng.integers(5000, 160000))
        x = row(n, trial)
        assert cu.argmax(x) == int(np.argmax(x)), trial
    for trial, (rows, n) in enumerate([(2, 154880), (3, 4099), (33, 20000), (130, 2051), (7, 1)]):
        x = np.stack([row(n, trial + r) for r in range(rows)])
        got = cu.argmax(x)
        assert got.tolist() == [int(np.argmax(r)) for r in x], (rows, n)


def test_kept_logits_stay_intact(cuda_engines, engines):
    """Decode logits come back in page-locked buffers of a pool (at most 32 out at once, then ordinary
    arrays): arrays kept across many steps keep their own values, equal to the CPU engine's."""
    eng, ref = cuda_engines("tiny-bf16"), engines("tiny-bf16")
    a, b = eng.new_cache(), ref.new_cache()
    eng.prefill([1, 2, 3], a)
    ref.prefill([1, 2, 3], b)
    kept, want, tok = [], [], 4
    for _ in range(40):
        lg, lr = eng.decode([a], [tok]), ref.decode([b], [tok])
        kept.append(lg)
        want.append(lr.copy())
        tok = int(np.argmax(lr[0]))
    assert all(np.array_equal(bits(k), bits(w)) for k, w in zip(kept, want))


# ---------------------------------------------------------------------------------------------
# golden hashes (the oracle's outputs) reproduced directly


@pytest.mark.parametrize("name", TINY)
def test_golden_hashes(name, golden_dir, cuda_engines):
    cases = json.loads((golden_dir / "hashes.json").read_text())["cases"]
    eng = cuda_engines(name)
    for pname, (ids, n) in canonical_prompts(eng.config.vocab_size).items():
        toks, logits = eng.generate(ids, n, return_logits=True)
        want = cases[f"{name}/{pname}"]
        assert toks == want["tokens"], pname
        assert hash12(np.array(toks), "<i4") == want["output"], pname
        assert hash12(logits, "<f4") == want["logits"], pname


def test_bad_input_is_refused(cuda_engines):
    eng = cuda_engines("tiny-bf16")
    with pytest.raises(fast.EngineInputError):
        eng.forward([1, 2, 10_000])
    with pytest.raises(fast.EngineInputError):
        eng.forward([])
    with pytest.raises(fast.EngineInputError):
        CudaEngine(eng.checkpoint, inject="99,0,embed,0,1")
    assert eng.forward([1, 2, 3]).shape == (3, eng.config.vocab_size)


# ---------------------------------------------------------------------------------------------
# numerics on the device


def test_device_expf_sample():
    from fast import _core
    cu = cuda_module()
    rng = np.random.default_rng(7)
    n = 1 << 16 if EMU else 1 << 24
    x = np.concatenate([rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        rng.uniform(-104, 89, n).astype(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 88.0, -88.0, 88.72283, 88.72284, -103.97208,
                                  -103.97209, -87.33655, 1e-45, -1e-45], np.float32)])
    got = cu.expf(x)
    want = _core.expf(x)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{int((~same).sum())} differ, first x = {x[~same][0]!r}"


@needs_gpu
def test_device_expf_exhaustive():
    """All 2^32 inputs: the device's expf (made and computed on the device) = the host canonical expf."""
    import time

    from fast import _core
    cu = cuda_module()
    t0 = time.perf_counter()
    block = 1 << 27
    host_threads = max(1, min(16, os.cpu_count() or 1))

    def host(lo):
        x = (np.arange(block, dtype=np.uint32) + np.uint32(lo)).view(np.float32)
        parts = np.array_split(x, host_threads)
        with ThreadPoolExecutor(host_threads) as ex:
            return np.concatenate(list(ex.map(_core.expf, parts)))

    bad = 0
    first = None
    for lo in range(0, 1 << 32, block):
        got = cu.expf_device_bits(lo, block).view(np.uint32)
        want = host(lo).view(np.uint32)
        nan = ((got & 0x7FFFFFFF) > 0x7F800000) & ((want & 0x7FFFFFFF) > 0x7F800000)
        diff = (got != want) & ~nan
        if diff.any():
            bad += int(diff.sum())
            first = first if first is not None else lo + int(np.flatnonzero(diff)[0])
    print(f"exhaustive device expf vs host: {bad} differ, {time.perf_counter() - t0:.1f} s")
    assert bad == 0, f"first differing input bits 0x{first:08x}"


def test_device_exp64_sample():
    from fast import _core
    cu = cuda_module()
    rng = np.random.default_rng(64)
    n = 20_000 if EMU else 400_000
    x = np.concatenate([
        rng.uniform(-750, 710, n), rng.uniform(-40, 40, n), rng.uniform(-1, 1, n // 2),
        rng.integers(0, 2**64, n // 2, dtype=np.uint64).view(np.float64),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-300, -1e-300, 5e-324, 709.782712893384,
                  709.79, -745.1332191019411, -745.14, -708.39, 512.0, -512.0, 1024.0, -1024.0]),
    ])
    a = cu.exp64(x)
    b = _core.engine_exp64(x)
    same = (a.view(np.uint64) == b.view(np.uint64)) | (np.isnan(a) & np.isnan(b))
    assert same.all(), f"{int((~same).sum())} differ, first x = {x[~same][0]!r}"


def test_device_decoders():
    from fast import _core
    cu = cuda_module()
    codes = np.arange(256, dtype=np.uint8)
    for which in ("e4m3", "e4m3_sw"):
        got, want = cu.decode_table(which), _core.decode_e4m3(codes)
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), which
    got, want = cu.decode_table("e2m1"), _core.decode_e2m1(np.arange(16, dtype=np.uint8))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    got, want = cu.decode_table("e8m0"), _core.decode_e8m0(codes)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all()


def test_device_census():
    cu = cuda_module()
    hi = (1 << 20) if EMU else (1 << 32)
    lo = 0xC0000000 if EMU else 0
    ctl = cu.expf_census("canonical", lo, lo + hi if EMU else hi)
    assert ctl["differ"] == 0 and ctl["first"] is None
    for kind in ("expf", "__expf"):
        r = cu.expf_census(kind, lo, lo + hi if EMU else hi)
        print(kind, r)
        assert r["inputs"] == hi
        assert 0 <= r["differ_nonpos"] <= r["differ"] <= r["inputs"]
    if not EMU:
        assert cu.expf_census("__expf")["differ"] > 0


# ---------------------------------------------------------------------------------------------
# The linear kernels one by one, in the real model's shapes (and small ones the emulation can run):
# every kernel the engine may pick (the staged one-token kernel, the register kernel, the routed-expert
# path) = the CPU engine's Lin kernels, bit for bit.

# (name, release, R, C, T, expert, staged applies, round)
LINEAR_CASES = [
    ("kda.q_proj", "fp8", 8192, 4096, 1, False, True, True),
    ("kda.o_proj", "fp8", 4096, 8192, 1, False, True, True),
    ("mla.o_proj", "fp8", 4096, 16384, 1, False, True, False),
    ("experts.gate", "fp8", 2048, 4096, 8, True, True, True),
    ("experts.down", "fp8", 4096, 2048, 8, True, True, True),
    ("experts.gate-mxfp4", "mxfp4", 2048, 4096, 8, True, True, True),
    ("experts.down-mxfp4", "mxfp4", 4096, 2048, 8, True, True, False),
    ("shared.down-mxfp4", "mxfp4", 4096, 2048, 1, False, True, True),
    ("kda.b_proj", "bf16", 64, 4096, 1, False, True, True),
    ("kda.f_a", "bf16", 128, 4096, 1, False, True, True),
    ("mla.kv_a", "bf16", 512, 4096, 1, False, True, True),
    ("moe.router", "bf16", 288, 4096, 1, False, True, False),
    ("lm_head-part", "bf16", 40000, 4096, 1, False, False, False),
    ("f32", "f32", 256, 1024, 1, False, True, False),
    ("batch4", "fp8", 2048, 4096, 4, False, False, True),
    ("fp8-bigscale", "fp8", 1024, 4096, 1, False, True, True),
    # several tokens: the tiled kernel (and the register kernel) at batch 8 / 32 and prefill-like rows
    ("mla.o_proj-b8", "fp8", 4096, 16384, 8, False, False, False),
    ("lm_head-part-b32", "bf16", 8200, 4096, 32, False, False, False),
    ("experts.down-b13", "fp8", 4096, 2048, 13, True, True, True),
    ("experts.gate-mxfp4-b11", "mxfp4", 2048, 4096, 11, True, True, True),
    ("experts.down-b40", "fp8", 4096, 2048, 40, True, True, False),  # gemm: items of 16, 16 and 8 pairs
    ("kda.q_proj-b5-bigscale", "fp8", 1000, 4096, 5, False, False, True),
    ("f32-b3", "f32", 256, 1024, 3, False, False, False),
]
LINEAR_EMU_CASES = [
    ("emu-fp8", "fp8", 130, 192, 1, False, True, True),
    ("emu-bf16", "bf16", 40, 320, 1, False, True, False),
    ("emu-mxfp4-experts", "mxfp4", 48, 256, 3, True, True, True),
    ("emu-f32", "f32", 24, 128, 1, False, True, False),
    ("emu-width-96", "bf16", 20, 96, 1, False, False, True),
    ("emu-fp8-bigscale", "fp8", 260, 256, 1, False, True, True),
    ("emu-mxfp4-bigscale", "mxfp4", 36, 320, 1, False, True, True),
    ("emu-fp8-long", "fp8", 40, 1088, 1, False, True, True),  # 17 chunks: a full batch and the rest
    ("emu-fp8-wide", "fp8", 24, 2560, 1, False, True, True),  # 40 chunks: the wide kernel's batch of 32 and the rest
    ("emu-bf16-wide", "bf16", 12, 1152, 1, False, True, False),  # 18 chunks: its BF16 batch of 16 and the rest
    ("emu-fp8-tiled", "fp8", 70, 192, 5, False, False, True),
    ("emu-bf16-tiled", "bf16", 40, 320, 3, False, False, False),
    ("emu-mxfp4-experts-tiled", "mxfp4", 48, 256, 11, True, True, True),
    # the register-tiled kernel (auto from 16 tokens): rows not a multiple of its 32-row tile, tokens not
    # of its 16, a last slab of fewer than its 4 chunks; expert items of 8 pairs (64-row tiles) and fewer.
    # Unrounded (a changed FMA order shows in the f32 bits; BF16 rounding hides most of it)
    ("emu-fp8-gemm", "fp8", 70, 320, 21, False, False, False),
    ("emu-bf16-gemm", "bf16", 40, 576, 17, False, False, False),
    ("emu-mxfp4-gemm", "mxfp4", 33, 512, 35, False, False, False),
    ("emu-f32-gemm", "f32", 20, 128, 16, False, False, False),
    ("emu-fp8-experts-gemm", "fp8", 130, 448, 13, True, True, False),
    ("emu-bf16-gemm-round", "bf16", 36, 256, 18, False, False, True),
    ("emu-fp8-gemm-32", "fp8", 20, 704, 45, False, False, False),  # three token tiles, the last of 13; 11 chunks
    # expert items of 16 pairs (32-row tiles; the engine's from 16 pairs an expert on average): two full
    # items and a short one, 7 chunks (a last slab of 3)
    ("emu-fp8-experts-gemm16", "fp8", 70, 448, 37, True, True, False),
    ("emu-mxfp4-experts-gemm16", "mxfp4", 33, 256, 19, True, True, False),
    # the branch-free steady-state slabs (FP8 and MXFP4 tiles of 16, while a slab's refill is whole) and
    # the general loop after them: 25 chunks (6 whole slabs and one of 1), 20 (5 whole), 17 (4 and 1)
    ("emu-fp8-gemm-steady", "fp8", 70, 1600, 21, False, False, False),
    ("emu-mxfp4-gemm-steady", "mxfp4", 33, 1280, 18, False, False, False),
    ("emu-fp8-experts-gemm16-steady", "fp8", 40, 1088, 37, True, True, False),
    ("emu-bf16-gemm-long", "bf16", 40, 1152, 17, False, False, False),  # BF16: the general loop, 18 chunks
    # expert items of 4 and 3 pairs (64-row tiles of 8 slots): three row blocks, the last partial; FP8 17
    # chunks (slabs of 2: 6 steady, then the general loop)
    ("emu-fp8-experts-gemm4", "fp8", 130, 1088, 4, True, True, False),
    # the few-pair kernel's items of 8 and 1, 2, 3, 4 and 5 pairs (computed as 8 and 1, 2, 3, 4, 6 slots:
    # each count's fold): three 64-row blocks (the last of 2 rows), 9 chunks (a whole slab of 8 and one of
    # 1, an odd 128-column scale block)
    ("emu-fp8-experts-pairs9", "fp8", 130, 576, 9, True, True, True),
    ("emu-fp8-experts-pairs2", "fp8", 130, 576, 2, True, True, False),
    ("emu-fp8-experts-pairs3", "fp8", 130, 576, 3, True, True, False),
    ("emu-fp8-experts-pairs12", "fp8", 130, 576, 12, True, True, False),
    ("emu-fp8-experts-pairs13", "fp8", 130, 576, 13, True, True, False),
    # and blocks of several items: 12 items (11 of 8, one of 2) for three 64-row blocks in the emulation's
    # 4 SMs (10 blocks of items), 25 chunks (4 slabs, the last of 1; each item's first slabs requested
    # before the previous one folds)
    ("emu-fp8-experts-pairs-items", "fp8", 130, 1600, 90, True, True, False),
    # the same items with 5 slabs (the last of 2 chunks: each item's slabs start one stage on) and with 2
    # (fewer than the stages: each item's first slabs requested at its start, after a barrier)
    ("emu-fp8-experts-pairs-items5", "fp8", 130, 2176, 90, True, True, False),
    ("emu-fp8-experts-pairs-items2", "fp8", 130, 576, 90, True, True, False),
    # MXFP4 through it: items of 3 pairs over two slabs (fewer than the stages), and 12 items over five
    # (each item's first slabs requested before the previous one folds), three 64-row blocks
    ("emu-mxfp4-experts-pairs3", "mxfp4", 130, 1024, 3, True, True, False),
    ("emu-mxfp4-experts-pairs-items5", "mxfp4", 130, 2560, 90, True, True, False),
    ("emu-bf16-experts-gemm3", "bf16", 40, 320, 3, True, True, False),
    # items of 8 computing their pairs rounded up to a power of two: 8 + 2, 8 + 1, 8 + 3 (as 4), 8 + 5 (as 8)
    # and 8 + 7 pairs
    ("emu-fp8-experts-gemm10", "fp8", 70, 320, 10, True, True, False),
    ("emu-mxfp4-experts-gemm9", "mxfp4", 33, 256, 9, True, True, False),
    ("emu-fp8-experts-gemm11", "fp8", 70, 320, 11, True, True, False),
    ("emu-fp8-experts-gemm13", "fp8", 64, 256, 13, True, True, False),
    ("emu-mxfp4-experts-gemm15", "mxfp4", 33, 256, 15, True, True, False),
    # blocks of several expert items (300 pairs: 38 items of 8 for one 64-row block in the emulation's 4 SMs,
    # whose launches give a 64-row matrix 32 blocks; 19 items of 16 for two 32-row blocks, 16 each):
    # FP8 items of 8 copy the next item in while they fold, items of 16 fold first; MXFP4 both overlap
    ("emu-fp8-experts-gemm-items", "fp8", 64, 320, 300, True, True, False),
    ("emu-mxfp4-experts-gemm-items", "mxfp4", 33, 256, 300, True, True, False),
    # the lane-pass kernel at 128 tokens and more (32 rows x 128 tokens a block: two token tiles, the
    # last of few; 5 chunks: a slab of 4 and one of 1 in every lane pass)
    ("emu-fp8-lanes-128", "fp8", 40, 320, 130, False, False, True),
    # FP8 at 128 tokens takes slabs of 8 chunks (three stages): 13 chunks, a slab of 8 and one of 5
    ("emu-fp8-lanes-128-slab8", "fp8", 40, 832, 130, False, False, False),
    # 17 chunks: two whole slabs of 8, the first computed beside the second's decode (compute_decode), and one of 1
    ("emu-fp8-lanes-128-join", "fp8", 40, 1088, 130, False, False, False),
    ("emu-bf16-lanes-128", "bf16", 36, 256, 129, False, False, False),
    ("emu-mxfp4-lanes-128", "mxfp4", 33, 576, 140, False, False, True),
    # expert items of 64 pairs through it (x re-laid per item): two items, the second of 36 (FP8), of 6
    # (BF16, MXFP4); FP8 and MXFP4 take slabs of 8 chunks, BF16 of 4: 5 chunks (one slab of 5), 13 (8 and
    # 5), 16 (two whole slabs), 9 (8 and 1), 4 (one whole slab)
    ("emu-fp8-experts-lanes", "fp8", 70, 320, 100, True, True, True),
    ("emu-fp8-experts-lanes-13", "fp8", 70, 832, 100, True, True, False),
    ("emu-fp8-experts-lanes-16", "fp8", 64, 1024, 70, True, True, False),
    ("emu-bf16-experts-lanes", "bf16", 40, 256, 70, True, True, False),
    ("emu-mxfp4-experts-lanes", "mxfp4", 33, 576, 70, True, True, False),
]


def random_weights(release: str, R: int, C: int, rng):
    if release == "bf16":
        w = rng.standard_normal((R, C), dtype=np.float32) * 0.05
        return (w.view(np.uint32) >> 16).astype(np.uint16), None
    if release == "f32":
        return rng.standard_normal((R, C), dtype=np.float32) * 0.05, None
    if release == "fp8":
        q = rng.integers(0, 256, (R, C), dtype=np.uint8)
        q[(q & 0x7F) == 0x7F] = 0x7E  # no NaN codes
        s = (rng.random(((R + 127) // 128, (C + 127) // 128), dtype=np.float32) + 0.5) * np.float32(2.0 ** -7)
        return q, s.astype(np.float32)
    packed = rng.integers(0, 256, (R, C // 2), dtype=np.uint8)
    scale = rng.integers(118, 128, (R, C // 32), dtype=np.uint8)
    return packed, scale


def cpu_linear(release, data, scale, X, rnd):
    """The CPU engine's Lin: its matvec kernels for one row (the engine's path), linear() for several."""
    from fast import _core
    if X.shape[0] == 1 and release != "f32":
        y = {"bf16": lambda: _core.matvec_bf16(data, X[0], threads=1),
             "fp8": lambda: _core.matvec_fp8(data, scale, X[0], threads=1),
             "mxfp4": lambda: _core.matvec_mxfp4(data, scale, X[0], threads=1)}[release]()
        if rnd:
            y = (_core.bf16_from_f32(y).astype(np.uint32) << 16).view(np.float32)
        return y[None, :]
    return _core.linear(release, data, scale, X, round=rnd, threads=1)


# Head-blocked launches (MLA's W_UK^T and W_UV: output row r is weight row (r / rh) hstride + woff + r % rh
# times x columns (r / rh) xhs + [0, C)) through the register-tiled and lane-pass kernels: (name, release,
# heads, rh, hstride, woff, C, xhs, extra x columns, T). W_UK^T-like (heads' rows one after another, x heads
# side by side) at 130 tokens (lane-pass: 32 x 128 blocks, slabs of 8 with a last one of 5 chunks);
# W_UV-like (each head's rows past woff, every second 128 rows) at 70 tokens (64 x 64 blocks) with x wider
# than its heads; BF16 heads of 64 rows whose x lie apart.
LINEAR_HEAD_CASES = [
    ("heads-fp8-uk", "fp8", 2, 128, 128, 0, 320, 320, 0, 130),
    ("heads-fp8-uv", "fp8", 2, 128, 256, 128, 576, 576, 64, 70),
    ("heads-bf16", "bf16", 3, 64, 64, 0, 128, 192, 0, 129),
]


@pytest.mark.parametrize("case", LINEAR_HEAD_CASES, ids=lambda c: c[0])
def test_head_blocked_linear_matches_cpu(case):
    name, release, nh, rh, hstride, woff, C, xhs, extra, T = case
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    data, scale = random_weights(release, (nh - 1) * hstride + woff + rh, C, rng)
    X = rng.standard_normal((T, (nh - 1) * xhs + C + extra), dtype=np.float32)
    want = np.empty((T, nh * rh), np.float32)
    for h in range(nh):  # each head on its own (FP8: heads of whole 128-row scale blocks)
        r0 = h * hstride + woff
        sh = None if scale is None else scale[r0 // 128:(r0 + rh + 127) // 128]
        want[:, h * rh:(h + 1) * rh] = cpu_linear(release, data[r0:r0 + rh], sh,
                                                  np.ascontiguousarray(X[:, h * xhs:h * xhs + C]), True)
    cu = cuda_module()
    for kernel in ("auto", "gemm", "lanes"):
        got = cu.linear(release, data, scale, X, round=True, kernel=kernel, heads=(nh * rh, rh, hstride, woff, xhs))
        diff = np.flatnonzero(bits(got) != bits(want))
        assert diff.size == 0, f"{kernel}: {diff.size} of {want.size} differ, first at {np.unravel_index(diff[0], want.shape)}"
    with pytest.raises(ValueError, match="heads"):  # a head past the weights
        cu.linear(release, data, scale, X, round=True, kernel="lanes", heads=((nh + 1) * rh, rh, hstride, woff, xhs))


@pytest.mark.parametrize("case", [pytest.param(c, marks=needs_gpu) for c in LINEAR_CASES] + LINEAR_EMU_CASES,
                         ids=lambda c: c[0])
def test_linear_kernels_match_cpu(case):
    name, release, R, C, T, expert, staged, rnd = case
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    data, scale = random_weights(release, R, C, rng)
    if "bigscale" in name:  # scales past the placement decodes' fold: FP8 >= 2^8, MXFP4 E8M0 > 240
        if release == "fp8":
            scale[::2] *= np.float32(2.0 ** 16)
        else:
            scale[::2] = 245
    X = rng.standard_normal((T, C), dtype=np.float32)
    want = cpu_linear(release, data, scale, X, rnd)
    cu = cuda_module()
    # every staged variant: 8, 4 or 2 lanes per thread, x through L1 or staged, and a forced small
    # block (3 rows) with 2-chunk stages (several stages, a partial last one)
    variants = ["staged"] + [f"staged:{lpt}:{xs}" for lpt in (8, 4, 2) for xs in (0, 1)] + ["staged:4:1:3:2", "staged:2:0:5:3"]
    # the tiled kernel (experts: work items of 4 or 8 pairs, or of one with tiled:1; dense: tiles of
    # tokens, or one token) wherever rows are whole chunks
    tiled = (["tiled"] + (["tiled:1"] if expert and T > 1 else [])) if C % 64 == 0 else []
    # one token per launch row (T = 1, or experts' one-pair items): the register-bounded register kernel
    occ = ["register:occ5", "register:occ6"] if T == 1 or expert else []
    # the streaming kernel (persistent warps, bulk copies) at 1, 2 and 3 blocks per SM, one token or one-pair items
    stream = ["stream:1", "stream:2", "stream:3"] if (T == 1 or expert) and C % 64 == 0 else []
    stream += ["stream:1x", "stream:2x"] if T == 1 and C % 64 == 0 and C <= 4096 else []  # x staged per block
    # the wide register kernel (16 or 32 threads per row): one token, dense, FP8 or BF16 rows of whole chunks
    wide = ["register:w4", "register:w2"] if T == 1 and not expert and release in ("fp8", "bf16") and C % 64 == 0 else []
    # the register-tiled kernel: several tokens (experts: items of 4 or 8 pairs, 16 from 16) of rows of whole chunks
    gemm = ["gemm"] if C % 64 == 0 and T > 1 else []
    # experts: items of 8 pairs whatever T (gemm:8), so that blocks take several items in turn (the next
    # item's first slabs copied in while a block folds, where its fold buffer fits past the stages)
    gemm += ["gemm:8"] if gemm and expert else []
    # the lane-pass kernel: several tokens, BF16 / FP8 / MXFP4 rows of whole chunks (dense: 64 x 64 tiles
    # below 128 tokens, 32 x 128 from there; experts: items of 64 pairs, their x re-laid per item; lanes:1
    # re-lays and launches one item at a time, as launches past kLanesItemsGroup floats of x do in groups);
    # lanes8, lanes16: the same tiles with 8 tokens a thread (512 threads a block) or 16 (256), where lanes
    # takes the engine's rule (option lanes_tn, weights.cu's lanes_tn_for)
    lanes = ["lanes", "lanes8", "lanes16"] if C % 64 == 0 and T > 1 and release != "f32" else []
    lanes += ["lanes:1", "lanes8:1", "lanes16:1"] if lanes and expert else []
    # the few-pair kernel: FP8 and MXFP4 expert items of up to 8 pairs (the test's items of 8: a last one of
    # T % 8); MXFP4 rows of whole slabs (C a multiple of 512: a slab's scales one 16-byte copy)
    pairs = ["pairs"] if expert and C % 64 == 0 and (release == "fp8" or (release == "mxfp4" and C % 512 == 0)) else []
    kernels = ["auto", "register"] + occ + wide + stream + tiled + gemm + lanes + pairs + (variants if staged else [])
    # FP8: the software decode, the hardware conversion and the integer bit placement (NaN-free data);
    # MXFP4: the software decode and the f16-pair placement (scales <= 240)
    # (scales past the fold exclude the placement: auto takes the other, 'int' is refused)
    placement = () if "bigscale" in name else ("int",)
    decodes = {"fp8": ("auto", "sw", "hw") + placement, "mxfp4": ("auto", "sw") + placement}.get(release, ("auto",))
    if "bigscale" in name:
        with pytest.raises(ValueError, match="scales (below 2|of at most 240)"):
            cuda_module().linear(release, data, scale, X, round=rnd, decode="int")
    for kernel in kernels:
        full = ("auto", "register", "register:occ5", "register:occ6", "register:w4", "register:w2", "stream:1", "stream:2",
                "stream:3", "stream:1x",
                "stream:2x", "tiled", "tiled:1", "gemm", "gemm:8", "lanes", "lanes:1", "lanes8", "lanes8:1", "lanes16",
                "lanes16:1", "pairs",
                "staged:4:1", "staged:2:0")
        for decode in decodes if kernel in full else ("auto",):
            got = cu.linear(release, data, scale, X, round=rnd, kernel=kernel, expert=expert, decode=decode)
            assert got.shape == want.shape
            diff = np.flatnonzero(bits(got) != bits(want))
            assert diff.size == 0, (f"{kernel}/{decode}: {diff.size} of {want.size} differ, "
                                    f"first at {np.unravel_index(diff[0], want.shape)}")
    if not staged:
        with pytest.raises(ValueError, match="staged kernel does not apply"):
            cu.linear(release, data, scale, X, round=rnd, kernel="staged", expert=expert)
    if not tiled:
        with pytest.raises(ValueError, match="tiled kernel does not apply"):
            cu.linear(release, data, scale, X, round=rnd, kernel="tiled", expert=expert)
    if not gemm:
        with pytest.raises(ValueError, match="gemm kernel does not apply"):
            cu.linear(release, data, scale, X, round=rnd, kernel="gemm", expert=expert)
    if not lanes:
        with pytest.raises(ValueError, match="lanes kernel does not apply"):
            cu.linear(release, data, scale, X, round=rnd, kernel="lanes", expert=expert)
    if not pairs:
        with pytest.raises(ValueError, match="pairs kernel does not apply"):
            cu.linear(release, data, scale, X, round=rnd, kernel="pairs", expert=expert)
    if not wide:
        with pytest.raises(ValueError, match="wide register kernel does not apply"):
            cu.linear(release, data, scale, X, round=rnd, kernel="register:w4", expert=expert)
    if not stream:
        with pytest.raises(ValueError, match="stream kernel does not apply"):
            cu.linear(release, data, scale, X, round=rnd, kernel="stream:2", expert=expert)
    if release == "fp8":  # a NaN code: the integer placement is refused, the engine's choice decodes it
        data = data.copy()
        data[0, 0] = 0x7F
        with pytest.raises(ValueError, match="without NaN codes"):
            cu.linear(release, data, scale, X, round=rnd, decode="int", expert=expert)
        want = cpu_linear(release, data, scale, X, rnd)
        got = cu.linear(release, data, scale, X, round=rnd, expert=expert)
        assert np.isnan(got[:, 0]).all() and np.array_equal(bits(got[:, 1:]), bits(want[:, 1:]))


# ---------------------------------------------------------------------------------------------
# slice (real GLM-5.3-Flash widths): one short prompt and a few decode steps, against the CPU engine


@needs_gpu
@pytest.mark.skipif(not os.environ.get("GLM_SLICE_DIR"), reason="GLM_SLICE_DIR (a slice checkpoint) not given")
def test_slice_matches_cpu():
    root = os.environ["GLM_SLICE_DIR"]
    dirs = [os.path.join(root, d) for d in sorted(os.listdir(root)) if os.path.isfile(os.path.join(root, d, "config.json"))]
    assert dirs
    from oracle.checkpoint import open_checkpoint
    for path in dirs:
        ck = open_checkpoint(path, verify=False)  # scanned once, on first use, for both engines
        cpu = fast.Engine(ck, device="cpu")
        ids = prompt(cpu.config.vocab_size, 6, 11)
        want = Capture()
        toks, logits = cpu.generate(ids, 3, capture=want, return_logits=True)
        del cpu
        eng = CudaEngine(ck)
        got = Capture()
        gtoks, glogits = eng.generate(ids, 3, capture=got, return_logits=True)
        assert_same_capture(eng.config, want, got, range(len(ids) + 2))
        assert gtoks == toks
        assert np.array_equal(bits(glogits), bits(logits))
        del eng


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
@pytest.mark.parametrize("model", ["tiny", "wide-selection"])
def test_prefill_attention_kernels_equal_the_cpu_engine(golden_dir, tmp_path, tiled, model):
    """attn_tiled=True: prefill-sized steps (16 rows or more) take the tiled mla.scores and mla.o_lat
    kernels (k_mla_scores_tiled: 32 heads x 64 selected positions a block; k_mla_olat_tiled: 32 heads x 64
    latent columns, the positions staged eight partials at a time; each dot walked leaf by leaf), the
    default; attn_tiled=False: the per-warp and group kernels. Every stage of every position = the CPU engine's, for one
    sequence in one step and for a step of two sequences. tiny: kv_lora_rank 40 (zero-padded to one
    chunk), 3 heads in a tile of 32, at most 11 selected positions (one chunk); wide-selection: tiny with
    index_topk 256, so rows attend up to 259 positions (five chunks of the o_lat dot)."""
    if model == "tiny":
        path, n = str(golden_dir / "tiny-fp8"), 60
    else:
        from tools.zoo import make_checkpoint
        path, n = str(make_checkpoint("tiny", "fp8", tmp_path / "wide", index_topk=256)), 300
    cpu, eng = fast.Engine(path, device="cpu"), CudaEngine(path, cuda_options={"attn_tiled": tiled})
    V = eng.config.vocab_size
    ids = prompt(V, n, 7)
    want, got = Capture(), Capture()
    assert np.array_equal(bits(cpu.prefill(ids, capture=want)), bits(eng.prefill(ids, capture=got)))
    assert_same_capture(eng.config, want, got, range(n))
    a, b = prompt(V, 30, 8), prompt(V, 41, 9)
    ca, cb = eng.new_cache(), eng.new_cache()
    eng.prefill(a[:10], ca)
    eng.prefill(b[:15], cb)
    mixed = eng.step([(ca, a[10:], None, "all"), (cb, b[15:], None, "all")])
    for ids2, lg in ((a, mixed[0]), (b, mixed[1])):
        assert np.array_equal(bits(lg), bits(cpu.prefill(ids2)[-lg.shape[0]:]))


@needs_gpu
def test_gemm_expert_items_and_heads_equal_the_cpu_engine(tmp_path):
    """The register-tiled and lane-pass kernels' engine paths at widths of whole chunks (tiny at hidden 128,
    expert width 64, MLA latent, nope and value widths 64). A 200-token prefill (400 pairs over 8 experts)
    in one step: the routed experts average 50 pairs, so their work items hold 16 pairs through the
    register-tiled kernel (T k >= 16 E; 32 rows x 16 pairs a block), and so do the dense projections (at
    these widths the lane-pass kernel's blocks would not fill half the SMs, and 200 tokens would leave its
    second 128-token tile mostly empty: weights.cu, lanes_chosen; its dense engine path at real widths:
    tests/test_long_context.py's 8K slice prefill), and beside them lane items (the engine's rule: an
    expert's whole 64s of pairs and a remainder of at least lanes_items=32 take items of 64 through the
    lane-pass kernel, x re-laid per item), with lanes_items=1 every pair in lane items (no item of
    16 left), 64 only the whole 64s (the shared expert's 200 pairs: three, its remainder in items of 16),
    0 none; with expert_tile=64 every item holds 64 pairs through the lane-pass kernel (the engine's rule
    gives FP8 expert items 16 tokens a thread, 256-thread blocks; both also with lanes_tn=8, 512-thread
    blocks, and with 16 forced); the option lanes
    off changes nothing here. MLA's head-blocked W_UK^T and W_UV (heads of whole 32-row
    blocks, each block's x its head's) take the register-tiled kernel from 16 rows. Every stage of every
    position = the CPU engine's, each way. A 40-token step (10 pairs an expert: the rule's items of 8) takes
    items of 16 beside them (an expert's whole 16s and a remainder of at least items16=13; the shared
    expert's 40 pairs: two, its 8 left in items of 8), with items16=1 every pair in items of 16, 16 only the
    whole 16s, 0 none; expert_tile=16 forces items of 16 there, expert_tile=8 items of 8 (64 rows x 8
    pairs), and with the option gemm off the tiled kernel's: the same logits each way."""
    from tools.zoo import make_checkpoint
    path = str(make_checkpoint("tiny", "fp8", tmp_path / "w128", hidden_size=128, moe_intermediate_size=64,
                               kv_lora_rank=64, qk_nope_head_dim=64, v_head_dim=64))
    cpu = fast.Engine(path, device="cpu")
    ids = prompt(cpu.config.vocab_size, 200, 11)
    want = Capture()
    logits = cpu.prefill(ids, capture=want)
    for opts in ({}, {"expert_tile": 64}, {"lanes": False}, {"lanes_items": 1}, {"lanes_items": 64},
                 {"lanes_items": 0}, {"expert_tile": 64, "lanes_tn": 8}, {"lanes_items": 1, "lanes_tn": 8},
                 {"lanes_items": 1, "lanes_tn": 16}):
        eng, got = CudaEngine(path, cuda_options=opts), Capture()
        assert np.array_equal(bits(logits), bits(eng.prefill(ids, capture=got)))
        assert_same_capture(eng.config, want, got, range(len(ids)))
    ref = cpu.prefill(ids[:40])
    for opts in ({}, {"items16": 1}, {"items16": 16}, {"items16": 0}, {"expert_tile": 16}, {"expert_tile": 8},
                 {"expert_tile": 8, "gemm": False}):
        forced = CudaEngine(path, cuda_options=opts)
        assert np.array_equal(bits(forced.prefill(ids[:40])), bits(ref)), opts


# (heads, latent rank, tokens, chunk, options): the emulation runs the first (~35 s there), the GPU all
MLA_LANES_CASES = [
    pytest.param(4, 128, 100, None, ({},), id="h4-r128-100"),
    pytest.param(4, 128, 170, 100, ({}, {"attn_tiled": False}), id="h4-r128-170-chunked", marks=needs_gpu),
    pytest.param(68, 64, 170, 100, ({}, {"attn_tiled": False}), id="h68-r64-170-chunked", marks=needs_gpu),
    pytest.param(4, 512, 600, None, ({},), id="h4-r512-600", marks=needs_gpu),
]


@pytest.mark.parametrize("heads,rank,n,chunk,options", MLA_LANES_CASES)
def test_mla_attention_lanes_equal_the_cpu_engine(tmp_path, heads, rank, n, chunk, options):
    """mla.scores and mla.o_lat of one sequence's prefill over a dense selection (every row sees every
    position before it: index_topk 256 here) as lane-pass products (k_mla_attn_lanes: q_abs and the
    latent rows re-laid by x_lanes, the probabilities by k_probs_lanes): 4 heads over 2 latent chunks (one
    head tile of 4, rows of other positions' heads computed and not stored) and 68 heads over 1 (two head
    tiles, the second of 4). A 100-token prefill (two position tiles, the second partial), and on the GPU a
    second chunk of 70 at positions 100-169 (its rows see the cached positions too), and a 600-token
    prefill over 8 latent chunks (scores' slabs of 8 chunks; o_lat's rows of up to 10 chunks of positions:
    several slabs a lane pass, the last partial); the shared MLA layer reuses the full layer's selection.
    Every stage of every position = the CPU engine's, and with the option attn_tiled off (the per-row
    kernels)."""
    from tools.zoo import make_checkpoint
    path = str(make_checkpoint("tiny", "fp8", tmp_path / f"h{heads}", hidden_size=128, num_attention_heads=heads,
                               num_key_value_heads=heads, kv_lora_rank=rank, index_topk=max(256, n + 24)))
    cpu = fast.Engine(path, device="cpu")
    ids = prompt(cpu.config.vocab_size, n, 5)
    want = Capture()
    logits = cpu.prefill(ids, chunk=chunk, capture=want)
    for opts in options:
        eng, got = CudaEngine(path, cuda_options=opts), Capture()
        assert np.array_equal(bits(logits), bits(eng.prefill(ids, chunk=chunk, capture=got))), opts
        assert_same_capture(eng.config, want, got, range(len(ids)))


def test_engine_options(tmp_path, monkeypatch):
    """The runtime knobs (EngineOptions) are options given at construction, shown with every value in
    the engine's options and repr, defaulted from the environment's A/B variables; no setting changes a
    logit (batches decode the CPU engine's bits with every knob flipped); bad options are refused."""
    from tools.zoo import make_checkpoint
    path = str(tmp_path / "w128-fp8")
    make_checkpoint("tiny", "fp8", path, hidden_size=128)
    from fast.cuda import _ENV_OPTIONS
    defaults = {"pdl": True, "tune": True, "stream_early": False, "hc_fuse": True, "expert_tile": 0, "lanes_items": 32,
                "items16": 13, "pinned_logits": True, "gemm": True, "lanes": True, "idx_tiled": True, "attn_tiled": True,
                "head_bound": True, "pairs": True, "lanes_tn": 0}
    assert sorted(name for name, _ in _ENV_OPTIONS.values()) == sorted(defaults)   # (an A/B variable each)
    for var in _ENV_OPTIONS:
        monkeypatch.delenv(var, raising=False)
    assert CudaEngine(path).options["cuda"] == defaults
    flipped = {"pdl": False, "tune": False, "stream_early": True, "hc_fuse": False, "expert_tile": 8, "lanes_items": 0,
               "items16": 0, "pinned_logits": False, "gemm": False, "lanes": False, "idx_tiled": False, "attn_tiled": False,
               "head_bound": False, "pairs": False, "lanes_tn": 16}
    eng, ref = CudaEngine(path, cuda_options=flipped), fast.Engine(path, device="cpu")
    assert eng.options["cuda"] == flipped and "'expert_tile': 8" in repr(eng)
    V = eng.config.vocab_size
    prompts = [prompt(V, 6 + i, 40 + i) for i in range(3)]
    # flipped, and the defaults (the 21-token prefill's projections take the register-tiled kernel)
    for e in (eng, CudaEngine(path)):
        outs, lgs = e.generate(prompts, 3, max_batch=3, return_logits=True)
        for p, out, lg in zip(prompts, outs, lgs):
            toks, logits = ref.generate(p, 3, return_logits=True)
            assert out == toks and np.array_equal(bits(lg), bits(logits))
    monkeypatch.setenv("GLM_HC_FUSE", "0")
    monkeypatch.setenv("GLM_EXPERT_TILE", "4")
    assert CudaEngine(path).options["cuda"] == dict(defaults, hc_fuse=False, expert_tile=4)
    assert CudaEngine(path, cuda_options={"hc_fuse": True}).options["cuda"] == dict(defaults, expert_tile=4)
    with pytest.raises(fast.EngineInputError, match="unknown option 'fuse'"):
        CudaEngine(path, cuda_options={"fuse": True})
    with pytest.raises(fast.EngineInputError, match="expert_tile must be 0"):
        CudaEngine(path, cuda_options={"expert_tile": 3})
    with pytest.raises(fast.EngineInputError, match="lanes_items must be 0"):
        CudaEngine(path, cuda_options={"lanes_items": 65})
    with pytest.raises(fast.EngineInputError, match="items16 must be 0"):
        CudaEngine(path, cuda_options={"items16": 17})
    with pytest.raises(fast.EngineInputError, match="lanes_tn must be 0"):
        CudaEngine(path, cuda_options={"lanes_tn": 12})
    monkeypatch.setenv("GLM_LANES_ITEMS", "many")
    with pytest.raises(fast.EngineInputError, match="lanes_items must be an int"):
        CudaEngine(path)
    monkeypatch.delenv("GLM_LANES_ITEMS")
    with pytest.raises(fast.EngineInputError, match="pdl must be True or False"):
        CudaEngine(path, cuda_options={"pdl": 1})
