"""Every engine, one set of checks: the cases of tests/cases.py run against every side (cpu, cuda, cpu-ranks,
cuda-ranks), as llama.cpp's test-backend-ops runs one list of operations against every backend. Every
captured stage of every position, the logits and the tokens are bit-identical to the side's reference
(cpu: the oracle; any other side: the single-process CPU engine), for tiny (golden/) and small (generated
here) in every release: generate, prefill in chunks then decode, batches, fault injection, config corners
the zoo does not ship, F32-stored weights; the non-canonical switches depart.

A side that cannot run here skips with the reason: the CUDA sides without fast._cuda and a device (or the
CPU emulation, GLM_CUDA_EMU=1 with fast._cuda_emu built, which runs the tiny cases), ranks > 1 without
torch's gloo, cuda-ranks with fewer GPUs than ranks. Where a case does not apply to a side, tests/cases.py
says why and the test skips with that reason.

Ranks > 1 run in driver mode (this process is rank 0, workers spawned once per rank count and reused: the
rank cases are ordered by rank count) with verify_ranks=True: after every step each rank's digest of its
logits and captured rows is compared with rank 0's, so every rank's capture is checked.

Comparisons are on bits (stage rows: sha256 of their canonical bytes; logits: uint32 views), never a
tolerance. Engine-specific checks (kernels, the device greedy loop, the memory plan, the launcher) stay in
test_fast_cpu.py, test_fast_cuda.py, test_ep.py and test_ep_cuda.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import tests.cases as C
from fast import distributed as D
from oracle.capture import Capture
from oracle.inject import Injection
from tests.engine_checks import assert_same_capture, bits, case_id, first_divergence, make_engine, prompt, side_param


@pytest.fixture(scope="module", autouse=True)
def _stop_workers():
    yield
    D.shutdown()


@pytest.fixture(scope="session")
def reference(oracle_runs, cpu_runs):
    """(side, case) -> (ids, tokens, logits, capture) of the side's reference run of a CASES tuple."""
    return lambda side, case: (oracle_runs if side == "cpu" else cpu_runs)(case)


@pytest.fixture(scope="session")
def single_engines(engines, cuda_engines):
    """(side, name, **options) -> the cached engine of a single-process side."""
    return lambda side, name, **kw: (engines if side == "cpu" else cuda_engines)(name, **kw)


@pytest.fixture(scope="session")
def generated(tmp_path_factory, golden_dir):
    """name -> the path of a checkpoint generated once per test process: a variant of CONFIG_VARIANTS, or
    'f32' (F32_SOURCE with its weights stored as F32)."""
    cache = {}
    variants = {v.name: v for v in C.CONFIG_VARIANTS}

    def get(name):
        if name not in cache:
            root = tmp_path_factory.mktemp("generated")
            if name == "f32":
                _write_f32(golden_dir / C.F32_SOURCE, root)
                cache[name] = str(root)
            else:
                from tools.zoo import make_checkpoint
                v = variants[name]
                cache[name] = str(root / name)
                make_checkpoint("tiny", v.release, cache[name], **v.overrides)
        return cache[name]
    return get


@pytest.fixture(scope="session")
def generated_reference():
    """(side, path, ids, new) -> (tokens, logits, capture) of the side's reference generate on a generated
    checkpoint: the oracle for cpu, the CPU engine for any other side."""
    cache = {}

    def get(side, path, ids, new):
        kind = "oracle" if side == "cpu" else "cpu"
        key = (kind, path, tuple(ids), new)
        if key not in cache:
            if kind == "oracle":
                import oracle
                model = oracle.load(path)
            else:
                model = make_engine("cpu", path)
            cap = Capture()
            toks, logits = model.generate(list(ids), new, capture=cap, return_logits=True)
            cache[key] = (toks, logits, cap)
        return cache[key]
    return get


def _write_f32(src, dst):
    import shutil

    from safetensors.numpy import save_file

    from oracle import names as N
    from oracle.checkpoint import open_checkpoint
    ck = open_checkpoint(str(src))
    tensors = {}
    for entry in N.expected(ck.config):
        raw = ck.raw(entry.spec.role, entry.layer, entry.expert)
        a = np.asarray(raw.data)
        tensors[raw.stored_key] = (a.astype(np.uint32) << 16).view(np.float32) if raw.release == "bf16" else a
    save_file(tensors, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")


# ---------------------------------------------------------------------------------------------
# every stage, prefill (one chunk) then decode, via generate; over ranks also chunked prefill, what each
# rank read and the exchanges it made


_GENERATE = ([side_param(s, c, None, checkpoint=c[0], id=case_id(c)) for s in C.SINGLE_SIDES for c in C.CASES]
             + [side_param(s, rc.case, rc, checkpoint=rc.checkpoint, ranks=rc.ranks, id=rc.id)
                for s in C.RANK_SIDES for rc in C.RANK_CASES])


@pytest.mark.parametrize("side,case,rc", _GENERATE)
def test_generate_bit_identical(side, case, rc, ckpt_path, single_engines, reference):
    ids, toks, logits, cap = reference(side, case)
    if rc is None:
        eng = single_engines(side, case[0])
    else:
        eng = make_engine(side, ckpt_path(case[0]), ranks=rc.ranks, ranges=rc.ranges)
    got = Capture()
    got_toks, got_logits = eng.generate(ids, case[3], capture=got, return_logits=True)
    assert_same_capture(eng.config, cap, got, range(len(ids) + case[3] - 1))
    assert got_toks == toks
    assert np.array_equal(bits(got_logits), bits(logits))
    if rc is not None:
        check_ranks(eng, rc, ids, toks, logits, cap)


def check_ranks(eng, rc, ids, toks, logits, cap):
    """Over ranks: the expert ranges asked for; prefill in chunks then decode through the low-level API;
    each rank read exactly its own routed experts; one exchange per MoE layer per step; the device loop
    (greedy) where the engine has one."""
    cfg = eng.config
    assert eng.ranks == rc.ranks
    want_ranges = rc.ranges or D.even_ranges(cfg.n_routed_experts, rc.ranks)
    assert eng.expert_ranges == [tuple(r) for r in want_ranges]

    got = Capture(keep_values=False)
    cache = eng.new_cache()
    outs = [eng.prefill(ids, cache, chunk=rc.chunk, capture=got)]
    for t in toks[:-1]:
        outs.append(eng.decode([cache], [t], capture=got))
    assert np.array_equal(bits(np.concatenate(outs)), bits(logits))
    assert_same_capture(cfg, cap, got, range(len(ids) + len(toks) - 1))

    info = eng.ep_info()
    assert [i["rank"] for i in info] == list(range(rc.ranks))
    for i, (a, b) in zip(info, want_ranges):
        assert tuple(i["experts"]) == (a, b)
        assert i["experts_read"] == list(range(a, b)), i
        assert i["experts_touched"] == list(range(a, b)), i
        assert i["verify_at_open"] is False
    n_moe = sum(cfg.is_moe(l) for l in range(cfg.num_hidden_layers))
    per_step = 0 if rc.ranks == 1 else n_moe
    stats = eng.ep_stats()
    assert len(stats) == rc.ranks
    for s in stats:
        assert s["exchanges"] == s["steps"] * per_step
        assert s.get("desync", []) == []

    if hasattr(eng, "greedy"):  # the device-resident greedy loop, from the prompt's first token on
        c2 = eng.new_cache()
        first = int(np.argmax(eng.prefill(ids, c2)[-1]))
        assert [first] + eng.greedy(c2, first, len(toks) - 1) == toks

    eng.reset_ep_stats()
    c3 = eng.new_cache()
    eng.prefill(ids[:4], c3)
    eng.decode([c3], [toks[0]])
    assert [s["exchanges"] for s in eng.ep_stats()] == [2 * per_step] * rc.ranks


# ---------------------------------------------------------------------------------------------
# chunked prefill then decode through the low-level API


@pytest.mark.parametrize("side,case,chunk", [side_param(s, c, k, checkpoint=c[0], id=f"{case_id(c)}-c{k}")
                                             for s in C.SINGLE_SIDES for c in C.CHUNK_CASES for k in C.CHUNKS])
def test_chunked_prefill_and_decode(side, case, chunk, single_engines, reference):
    ids, toks, logits, cap = reference(side, case)
    eng = single_engines(side, case[0])
    got = Capture()
    cache = eng.new_cache()
    outs = [eng.prefill(ids, cache, chunk=chunk, capture=got)]
    for tok in toks[:-1]:
        outs.append(eng.decode([cache], [tok], capture=got))
    assert cache.length == len(ids) + len(toks) - 1
    assert_same_capture(eng.config, cap, got, range(len(ids) + len(toks) - 1))
    assert np.array_equal(bits(np.concatenate(outs)), bits(logits))


# ---------------------------------------------------------------------------------------------
# batches: requests of different lengths joining mid-run, each against its reference run alone


@pytest.mark.parametrize("side,name,requests,max_batch", [
    side_param(s, n, r, m, checkpoint=n, ranks=C.BATCH_RANKS, id=f"{n}-b{r}-max{m}", skip=C.batch_skip(s, n))
    for s in C.SIDES for n in C.BATCH_CHECKPOINTS for r, m in C.BATCHES])
def test_batched_generate(side, name, requests, max_batch, ckpt_path, single_engines, reference):
    cases = C.batch_cases(name, requests)
    runs = [reference(side, c) for c in cases]
    eng = make_engine(side, ckpt_path(name), ranks=C.BATCH_RANKS) if side in C.RANK_SIDES else \
        single_engines(side, name)
    new = C.BATCH_NEW
    caps = [Capture(keep_values=False) for _ in cases]
    outs, lgs = eng.generate([r[0] for r in runs], new, capture=caps, chunk=C.BATCH_CHUNK, max_batch=max_batch,
                             arrivals=C.batch_arrivals(requests), return_logits=True)
    for (ids, toks, logits, cap), out, lg, got in zip(runs, outs, lgs, caps):
        npos = len(ids) + new - 1  # a reference of more tokens holds these positions as its prefix
        assert out == toks[:new]
        assert np.array_equal(bits(lg), bits(logits[:npos]))
        assert got.hashes == {k: v for k, v in cap.hashes.items() if k[2] < npos}


@pytest.mark.parametrize("side,name,requests,max_batch", [
    side_param(s, n, r, m, checkpoint=n, ranks=C.BATCH_RANKS, id=f"{n}-b{r}-max{m}", skip=C.batch_skip(s, n))
    for s in C.SIDES for n in C.BATCH_CHECKPOINTS for r, m in C.BATCHES])
def test_batched_generate_tokens_chosen_in_engine(side, name, requests, max_batch, ckpt_path, single_engines,
                                                  reference):
    """Without logits or captures asked, generate's steps ask the engine for each row's greedy token
    ("argmax": on the GPU for the CUDA engine, no logits copied): the reference's tokens."""
    cases = C.batch_cases(name, requests)
    runs = [reference(side, c) for c in cases]
    eng = make_engine(side, ckpt_path(name), ranks=C.BATCH_RANKS) if side in C.RANK_SIDES else \
        single_engines(side, name)
    outs = eng.generate([r[0] for r in runs], C.BATCH_NEW, chunk=C.BATCH_CHUNK, max_batch=max_batch,
                        arrivals=C.batch_arrivals(requests))
    assert outs == [toks[:C.BATCH_NEW] for _, toks, _, _ in runs]


# ---------------------------------------------------------------------------------------------
# fault injection: the same value perturbed as in the reference, propagated the same way


@pytest.mark.parametrize("side,spec", [
    side_param(s, spec, checkpoint=C.INJECTION_CASE[0], ranks=C.INJECTION_RANKS, id=spec,
               skip=C.injection_skip(spec, s))
    for s in C.SIDES for spec in C.INJECTIONS])
def test_injection_matches_reference(side, spec, ckpt_path, models, reference):
    name = C.INJECTION_CASE[0]
    path = ckpt_path(name)
    ids, _, _, clean = reference(side, C.INJECTION_CASE)
    ids = ids[:C.INJECTION_TOKENS]
    want = Capture(keep_values=False)
    if side == "cpu":
        m = models(name)
        m.prefill(ids, m.new_cache(), C.INJECTION_CHUNK, want, Injection.parse(spec))
        injected = None
    else:
        ref = make_engine("cpu", path, inject=spec)
        ref.prefill(ids, ref.new_cache(), chunk=C.INJECTION_CHUNK, capture=want)
        injected = ref.injected
    eng = make_engine(side, path, ranks=C.INJECTION_RANKS, inject=spec)
    got = Capture(keep_values=False)
    eng.prefill(ids, eng.new_cache(), chunk=C.INJECTION_CHUNK, capture=got)
    assert eng.injected >= 1
    assert injected is None or eng.injected == injected
    assert got.hashes == want.hashes
    # and the injection did change something
    assert any(got.hashes[k] != clean.hashes[k] for k in got.hashes)


# ---------------------------------------------------------------------------------------------
# the non-canonical switches depart from the canonical run; dot='sequential' is the CPU engine's exactly


@pytest.mark.parametrize("side", [side_param(s, checkpoint=C.SWITCH_CASE[0], skip=C.SWITCH_SKIP.get(s))
                                  for s in C.SIDES])
def test_noncanonical_switches(side, ckpt_path, single_engines, reference, engines):
    ids, _, _, clean = reference(side, C.SWITCH_CASE)
    name = C.SWITCH_CASE[0]
    for opts in C.SWITCHES:
        eng = single_engines(side, name, **opts)
        got = Capture()
        eng.forward(ids, eng.new_cache(), got)
        assert any(got.hashes[k] != clean.hashes[k] for k in got.hashes), opts
        assert first_divergence(eng.config, clean, got, range(len(ids))) is not None, opts
        if side != "cpu" and opts.get("dot") == "sequential":
            want = Capture(keep_values=False)
            seq = engines(name, **opts)
            seq.forward(ids, seq.new_cache(), want)
            assert got.hashes == want.hashes


# ---------------------------------------------------------------------------------------------
# config corners the zoo does not ship (generated from the tiny recipe), and F32-stored weights


def _generate_matches(side, path, ids, new, generated_reference, chunk=None, ranks=None):
    toks, logits, want = generated_reference(side, path, ids, new)
    eng = make_engine(side, path, ranks=ranks)
    got = Capture()
    got_toks, got_logits = eng.generate(list(ids), new, capture=got, chunk=chunk, return_logits=True)
    assert_same_capture(eng.config, want, got, range(len(ids) + new - 1))
    assert got_toks == toks
    assert np.array_equal(bits(got_logits), bits(logits))
    return eng


@pytest.mark.parametrize("side,variant", [
    side_param(s, v, checkpoint="tiny-" + v.release, ranks=C.VARIANT_RANKS, id=v.name, skip=v.skip.get(s))
    for s in C.SIDES for v in C.CONFIG_VARIANTS])
def test_config_variants(side, variant, generated, generated_reference):
    path = generated(variant.name)
    from oracle.checkpoint import open_checkpoint
    vocab = open_checkpoint(path, verify=False).config.vocab_size
    ids = prompt(vocab, *C.VARIANT_PROMPT)
    _generate_matches(side, path, ids, C.VARIANT_NEW, generated_reference, chunk=C.VARIANT_CHUNK,
                      ranks=C.VARIANT_RANKS)


@pytest.mark.parametrize("side", [side_param(s, checkpoint=C.F32_SOURCE, ranks=C.F32_RANKS) for s in C.SIDES])
def test_f32_stored_checkpoint(side, generated, generated_reference):
    """Weights stored as F32 (what transformers' save_pretrained writes) take the engine's F32 path."""
    path = generated("f32")
    from oracle.checkpoint import open_checkpoint
    ids = prompt(open_checkpoint(path, verify=False).config.vocab_size, *C.F32_PROMPT)
    eng = _generate_matches(side, path, ids, C.F32_NEW, generated_reference, ranks=C.F32_RANKS)
    assert set(eng.release) == {"f32"}
