"""Speculative decoding (fast/speculate.py, `Engine.generate(speculate=)`, `oracle serve --speculate`,
the diff side option speculate=K) gives the bits of serial decoding: token ids, log-probabilities (as
f32 bits), every captured stage row, and the sequence's state afterwards (the logits of a further
step), for K = 1..8, greedy and seeded, with drafters forced to be all right, all wrong or
alternating, the n-gram drafter and a model drafter, on tiny-fp8, tiny-bf16 and tiny-mxfp4; through
the server under concurrent traffic; and the replay gate: a 4-turn conversation replayed 12 times
through one server with the prefix cache and speculation on, filler traffic arriving at random
times, byte-identical to a cold server with both off (on tiny, small, and on a GPU at real widths:
slice). The servers run GLM_SERVE_ENGINE (tests/serving.py); the references are CPU engines.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import threading
import types
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fast._core")

from fast.speculate import (ModelDrafter, NgramDrafter, ngram_propose, open_drafter, parse_speculate,  # noqa: E402
                            sample_loop as speculative_loop)
from oracle.capture import Capture  # noqa: E402
from oracle.sampling import SamplingParams, log_softmax, sample  # noqa: E402

MODELS = ["tiny-fp8", "tiny-bf16", "tiny-mxfp4"]
V = 300
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_k=50, seed=77)
# which drafts a Forced drafter gets right: (its call number n, the draft's index j) -> right?
PATTERNS = {
    "accept": lambda n, j: True,
    "reject": lambda n, j: False,
    "alternate": lambda n, j: j % 2 == 0,       # right, wrong, right, ...: one accepted per step
    "steps": lambda n, j: n % 2 == 0,           # a step all right, the next all wrong
}
CAPTURED = {0, 3, 6}                            # a KDA layer, an MLA layer with its indexer, the head
REPEAT = [5, 6, 7, 8] * 6 + [5, 6]              # a repetitive prompt (n-gram drafts)
RANDOM = [(37 * i + 11) % V for i in range(29)]  # longer than tiny's index_topk (8): the indexer selects


class Forced:
    """A drafter that knows each prompt's serial answer and proposes its next tokens, right or wrong
    (right + 1) as `pattern` says."""

    def __init__(self, k, answers: dict, pattern):
        self.k, self.answers, self.pattern = k, {tuple(p): a for p, a in answers.items()}, PATTERNS[pattern]

    def start(self):
        return {"n": 0}

    def draft(self, items):
        out = []
        for state, history, k in items:
            h = [int(t) for t in history]
            prompt = max((p for p in self.answers if tuple(h[:len(p)]) == p), key=len)
            done = len(h) - len(prompt)
            right = self.answers[prompt][done:done + k]
            out.append([t if self.pattern(state["n"], j) else (t + 1) % V for j, t in enumerate(right)])
            state["n"] += 1
        return out

    def settle(self, state, history):
        pass

    def release(self, state):
        pass


@pytest.fixture(scope="module")
def engines(one_thread_engines):
    """name -> a CPU engine with one thread (this module's runs are many and short)."""
    return one_thread_engines


def _bits(a) -> list[int]:
    return np.asarray(a, np.float32).view(np.uint32).tolist()


class Recording(Capture):
    """A capture that remembers every row ever put into it (a rejected row must never arrive)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.log = []

    def put(self, layer, stage, pos, value):
        super().put(layer, stage, pos, value)
        if self.wants(layer, stage):
            self.log.append((layer, stage, pos, self.hashes[(layer, stage, pos)]))


def serial(engine, prompt, n, params, capture=None):
    """The batch-1 serial loop (one token per step), keeping its cache -> (tokens, logprobs, cache)."""
    cache = engine.new_cache()
    row = engine.forward(prompt, cache, capture)[-1]
    tokens, lps = [], []
    for i in range(n):
        t = sample(row, params, len(prompt) + i)
        tokens.append(t)
        lps.append(float(log_softmax(row)[t]))
        if i == n - 1:
            break
        row = engine.forward([t], cache, capture)[-1]
    return tokens, lps, cache


def _same_state(engine, a, b, token):
    """Two caches hold the same state: the logits of one further step agree bit for bit."""
    x, y = engine.forward([token], a), engine.forward([token], b)
    assert np.array_equal(x.view(np.uint32), y.view(np.uint32))


# -- the library ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
def test_generate_with_forced_drafts_equals_serial(engines, model):
    """Greedy generate, two requests (one joins later, prompts in chunks), every K and pattern: the
    same tokens and the same logits of every position as without speculation."""
    eng = engines(model)
    prompts, n = [REPEAT, RANDOM], 21
    kw = dict(chunk=5, arrivals=[0, 2], return_logits=True)
    ref, ref_lg = eng.generate(prompts, n, **kw)
    for k in range(1, 9):
        for pattern in PATTERNS:
            out, lg = eng.generate(prompts, n, speculate=Forced(k, dict(zip(map(tuple, prompts), ref)), pattern), **kw)
            assert out == ref, (k, pattern)
            assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(lg, ref_lg)), (k, pattern)
            st = eng.speculation
            assert st.drafted > 0 and st.emitted == 2 * (n - 1)   # (the first tokens come from the prompts)
            if pattern == "accept":
                assert st.accepted == st.drafted
            elif pattern == "reject":
                assert st.accepted == 0


@pytest.mark.parametrize("model", MODELS)
def test_sampled_speculation_equals_serial_with_its_state_and_capture(engines, model):
    """The batch-1 loop, greedy and seeded: tokens, logprob bits, the captured rows of every stage (and
    no rejected row ever reaching the capture), and the cache afterwards."""
    eng = engines(model)
    n = 17
    for params in (GREEDY, SEEDED):
        cap0 = Capture(layers=CAPTURED)
        ref, ref_lp, ref_cache = serial(eng, RANDOM, n, params, cap0)
        for k in range(1, 9):
            for pattern in PATTERNS:
                cap = Recording(layers=CAPTURED) if k in (1, 3, 8) else None
                toks, lps, st, cache = speculative_loop(eng, RANDOM, n, params, Forced(k, {tuple(RANDOM): ref}, pattern),
                                                        capture=cap, keep_cache=True)
                assert toks == ref and _bits(lps) == _bits(ref_lp), (params, k, pattern)
                assert st.emitted == n - 1 and st.drafted > 0
                assert cache.length == ref_cache.length == len(RANDOM) + n - 1
                _same_state(eng, cache.fork(), ref_cache.fork(), ref[-1])
                if cap is not None:
                    assert cap.hashes == cap0.hashes, (params, k, pattern)
                    assert all(cap0.hashes[(l, s, p)] == h for l, s, p, h in cap.log), (params, k, pattern)
                cache.close()
        ref_cache.close()


def test_generate_with_a_capture_equals_serial(engines):
    eng = engines("tiny-fp8")
    caps0 = [Capture(), Capture()]
    ref = eng.generate([REPEAT, RANDOM], 12, capture=caps0)
    for pattern in PATTERNS:
        caps = [Recording(), Recording()]
        out = eng.generate([REPEAT, RANDOM], 12, capture=caps,
                           speculate=Forced(4, {tuple(REPEAT): ref[0], tuple(RANDOM): ref[1]}, pattern))
        assert out == ref
        for c, c0 in zip(caps, caps0):
            assert c.hashes == c0.hashes
            assert all(c0.hashes[(l, s, p)] == h for l, s, p, h in c.log)


def test_an_eos_ends_the_answer_as_serially(engines):
    """An EOS among the chosen tokens ends the answer there; the drafts are cut before an EOS, so the
    cache never holds tokens serial would not have fed."""
    eng = engines("tiny-fp8")
    ref, _, ref_cache = serial(eng, REPEAT, 12, SEEDED)
    eos = {ref[6]}
    stop = ref.index(ref[6]) + 1
    for pattern in PATTERNS:
        toks, lps, _, cache = speculative_loop(eng, REPEAT, 12, SEEDED, Forced(5, {tuple(REPEAT): ref}, pattern),
                                               eos=eos, keep_cache=True)
        assert toks == ref[:stop]
        assert cache.length == len(REPEAT) + stop - 1
        ser, _, sc = serial(eng, REPEAT, stop, SEEDED)
        _same_state(eng, cache, sc, ser[-1])
    ref_cache.close()


def test_the_ngram_rule():
    assert ngram_propose([1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]           # after the earlier "1 2"
    assert ngram_propose([7, 7, 7], 3) == [7, 7, 7]                    # an overlapping copy
    assert ngram_propose([1, 2, 9, 5, 2, 8, 1, 2], 2) == [9, 5]        # the longest match, not the latest
    assert ngram_propose([4, 1, 4, 2, 4], 3) == [2, 4, 2]              # on a tie the latest
    assert ngram_propose([1, 2, 3], 3) == []                           # the last token never came before
    assert ngram_propose([1, 1], 0) == []
    assert NgramDrafter(2).draft([(None, np.array([3, 4, 3]), 2), (None, np.array([3, 4, 3]), 0)]) == [[4, 3], []]


@pytest.mark.parametrize("model", MODELS)
def test_ngram_speculation_equals_serial(engines, model):
    eng = engines(model)
    ref = eng.generate([REPEAT, RANDOM, [9] * 12], 30)
    for k in range(1, 9):
        assert eng.generate([REPEAT, RANDOM, [9] * 12], 30, speculate=f"ngram:{k}", max_batch=2) == ref, k
    for params in (GREEDY, SEEDED):
        toks, lps, c = serial(eng, REPEAT, 25, params)
        c.close()
        got, glp, st = speculative_loop(eng, REPEAT, 25, params, "ngram:4")
        assert got == toks and _bits(glp) == _bits(lps) and st.verifies == 24


def test_a_model_drafter(engines, golden_dir):
    """tiny-bf16 drafting for tiny-fp8 (same vocabulary, other weights), and tiny-fp8 for itself (greedy:
    every draft right, which also shows its cache was rolled back and caught up exactly)."""
    eng = engines("tiny-fp8")
    ref = eng.generate([REPEAT, RANDOM], 24)
    for k in (1, 2, 5):
        other = open_drafter(f"model:{golden_dir / 'tiny-bf16'}:{k}", eng)
        assert eng.generate([REPEAT, RANDOM], 24, speculate=other) == ref
        assert eng.speculation.drafted > 0
        itself = open_drafter(f"model:{golden_dir / 'tiny-fp8'}:{k}", eng)
        assert eng.generate([REPEAT, RANDOM], 24, speculate=itself) == ref
        assert eng.speculation.accepted == eng.speculation.drafted > 0
        toks, lps, c = serial(eng, RANDOM, 20, SEEDED)
        c.close()
        got, glp, st = speculative_loop(eng, RANDOM, 20, SEEDED, other)
        assert got == toks and _bits(glp) == _bits(lps) and st.drafted > 0
        other.engine.close()
        itself.engine.close()


def test_bad_speculate_values_are_refused(engines, tmp_path):
    eng = engines("tiny-fp8")
    for bad, word in [("ngram:0", "K"), ("ngram:x", "K"), ("beam:3", "ngram:K"), ("model:3", "DIR"),
                      (f"model:{tmp_path}:3", "config.json")]:
        with pytest.raises(ValueError, match=word):
            open_drafter(bad, eng)
    assert parse_speculate("model:/a:b/c:4") == ("model", "/a:b/c", 4)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=V + 1))
    with pytest.raises(ValueError, match="vocab_size"):
        ModelDrafter(fake, 3, eng)


# -- oracle diff --------------------------------------------------------------------------------------

def test_the_diff_side_option(golden_dir):
    from tools.diff import run_diff
    from tools.sides import SideError, open_side, parse_spec
    path = golden_dir / "tiny-fp8"
    for spec in ("cpu:speculate=4", "cpu:speculate=2,batch=3", "cpu:speculate=8,chunk=5"):
        res = run_diff(open_side("cpu", path), open_side(spec, path), REPEAT, 20)
        assert res.identical, (spec, res.first)
    side = open_side("cpu:speculate=3", path)
    side.generate(REPEAT, 20)
    assert side.speculation.drafted > 0
    with pytest.raises(SideError, match="speculate"):
        parse_spec("oracle:speculate=4")
    with pytest.raises(SideError, match="prefix-cache"):
        open_side("cpu:speculate=4,prefix-cache", path)


# -- the server -----------------------------------------------------------------------------------------

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.serving import SERVE_ENGINE, engine_spec, metric, start_server, stop_server  # noqa: E402
from tools.serve import add_arguments, build_server  # noqa: E402


def _start(root, *extra, model="tiny-fp8", engine=None):
    """A server on root/model; its engine GLM_SERVE_ENGINE (tests/serving.py) unless `engine` is given."""
    return start_server(root / model, engine_spec(2048, engine), *extra)


_stop = stop_server
_metric = metric


def _ask(client, body) -> dict:
    if body.get("stream"):
        ids, lps, last = [], [], None
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    c = json.loads(line[6:])["choices"][0]
                    ids += c["token_ids"]
                    lps += (c.get("logprobs") or {}).get("token_logprobs") or []
                    last = c
        return {"token_ids": ids, "logprobs": _bits(lps), "logprobs_hash": last["logprobs_hash"]}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return {"token_ids": c["token_ids"], "logprobs": _bits(c["logprobs"]["token_logprobs"]),
            "logprobs_hash": c["logprobs_hash"], "text": c["text"]}


def _body(ids, i, n):
    b = {"model": "tiny-fp8", "prompt": list(ids), "max_tokens": n, "logprobs": 0, "stream": i % 3 == 2}
    return dict(b, temperature=0) if i % 2 == 0 else dict(b, temperature=0.9, top_k=50, seed=500 + i)


def _params(body):
    return SamplingParams(float(body["temperature"]), int(body.get("top_k") or 0), 1.0, int(body.get("seed", 0)))


def _prompts(rng, count):
    out = []
    for i in range(count):
        if i % 2:
            unit = [rng.randrange(V) for _ in range(rng.randrange(2, 6))]
            out.append([200 + i] + unit * rng.randrange(3, 8))
        else:
            out.append([200 + i] + [rng.randrange(V) for _ in range(rng.randrange(3, 40))])
    return out


def test_the_server_speculates_under_concurrent_traffic(engines, golden_dir):
    """n-gram, model and forced drafters (all wrong, alternating) behind one server each, 12 clients at
    once, greedy and seeded, streamed and not: every answer equals the serial loop's bits. The forced
    drafters run with the prefix cache (block 5): alternating drafts pile up accepted tokens not yet
    fed faster than a step may feed them before the next block boundary (a step that only feeds)."""
    eng = engines("tiny-fp8")
    rng = random.Random(21)
    prompts = _prompts(rng, 12)
    bodies = [_body(p, i, 6 + i % 11) for i, p in enumerate(prompts)]
    want = [serial(eng, b["prompt"], b["max_tokens"], _params(b))[:2] for b in bodies]
    answers = {tuple(b["prompt"]): t for b, (t, _) in zip(bodies, want)}
    setups = [("--speculate", "ngram:4"), ("--speculate", f"model:{golden_dir / 'tiny-bf16'}:3"),
              ("--speculate", "ngram:1", "--prefix-cache-mb", "16", "--prefix-block", "5"), "reject", "alternate"]
    for setup in setups:
        forced = isinstance(setup, str)
        srv, uv, url = _start(golden_dir, "--max-step-tokens", "16",
                              *(("--speculate", "ngram:2", "--prefix-cache-mb", "16", "--prefix-block", "5")
                                if forced else setup))
        if forced:   # (the scheduler reads its drafter at every step)
            srv.scheduler.drafter = Forced(6, answers, setup)
        got, errors = [None] * len(bodies), []

        def client(i):
            try:
                with httpx.Client(base_url=url, timeout=120) as c:
                    got[i] = _ask(c, bodies[i])
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
        try:
            ts = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
            for t in ts:
                t.start()
            for t in ts:
                t.join(120)
            assert not errors, errors
            for g, (t, lps), b in zip(got, want, bodies):
                assert g["token_ids"] == t and g["logprobs"] == _bits(lps), (setup, b)
            with httpx.Client(base_url=url, timeout=30) as c:
                drafted, accepted = _metric(c, "glm_spec_draft_tokens_total"), _metric(c, "glm_spec_accepted_tokens_total")
            assert drafted > 0
            if setup == "reject":
                assert accepted == 0
            elif setup == "alternate" or "model" in setup[1]:
                assert 0 < accepted < drafted
        finally:
            _stop(srv, uv)


def test_bad_speculate_options_of_the_server(golden_dir):
    p = argparse.ArgumentParser()
    add_arguments(p)
    for bad in ("ngram", "ngram:0", "model:/nowhere:2"):
        with pytest.raises(ValueError, match="speculate"):
            build_server(p.parse_args(["--checkpoint", str(golden_dir / "tiny-fp8"), "--speculate", bad]))


def _conversation(c, model, vocab, turns, rng_seed, sampled):
    """Turn k's prompt = the transcript so far (prompt + answer token ids) + a new user message."""
    rng = random.Random(rng_seed)
    ids, transcript = [1, 2, 3] + [rng.randrange(vocab) for _ in range(9)], []
    for turn in range(turns):
        unit = [rng.randrange(vocab) for _ in range(3)]
        ids = ids + [250 + turn] + unit * 4              # a new, repetitive user message
        body = {"model": model, "prompt": ids, "max_tokens": 9 + 3 * turn, "logprobs": 0}
        body.update({"temperature": 0.8, "seed": 40 + turn} if sampled and turn % 2 else {"temperature": 0})
        got = _ask(c, body)
        transcript.append(got)
        ids = ids + got["token_ids"]
    return json.dumps(transcript, sort_keys=True).encode()


def _replay_gate(root, model, drafter, engine=None):
    """A 4-turn conversation replayed 12 times through one server with the prefix cache and speculation
    on, with filler requests arriving at random times: every transcript byte-identical to a cold server's
    with both off. The drafter (a checkpoint under root) is another release of the same master weights:
    its drafts are right at times and wrong more often (the zoo's random models rarely repeat
    themselves, so n-gram drafts are rarely right). `engine`: both servers' SPEC (default
    GLM_SERVE_ENGINE). The vocabulary is the checkpoint's."""
    vocab = json.loads((root / model / "config.json").read_text())["vocab_size"]
    srv, uv, url = _start(root, "--max-step-tokens", "7", model=model, engine=engine)
    # room for 64 snapshots of the longest transcript (~160 positions), at least 32 MB: the filler's
    # snapshots must not evict the conversation's before it comes back (at real widths a snapshot is MBs)
    cache_mb = max(32, -(-64 * srv.engine.sequence_bytes(160) // (1 << 20)))
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            cold = [_conversation(c, model, vocab, 4, 9, sampled) for sampled in (False, True)]
    finally:
        _stop(srv, uv)
    srv, uv, url = _start(root, "--max-step-tokens", "7", "--prefix-cache-mb", str(cache_mb), "--prefix-block", "6",
                          "--speculate", f"model:{root / drafter}:4", model=model, engine=engine)
    stop, errors = threading.Event(), []

    def filler(seed):
        rng = random.Random(seed)
        try:
            with httpx.Client(base_url=url, timeout=120) as c:
                while not stop.is_set():
                    stop.wait(rng.random() * 0.05)
                    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
                    _ask(c, {"model": model, "prompt": ids, "max_tokens": rng.randrange(1, 12),
                             "temperature": rng.choice([0, 1.0]), "stream": rng.random() < 0.3, "logprobs": 0})
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
    ts = [threading.Thread(target=filler, args=(s,)) for s in range(2)]
    try:
        for t in ts:
            t.start()
        with httpx.Client(base_url=url, timeout=120) as c:
            for replay in range(12):
                sampled = replay % 2 == 1
                assert _conversation(c, model, vocab, 4, 9, sampled) == cold[sampled], replay
            stop.set()
            for t in ts:
                t.join(60)
            assert not errors, errors
            assert _metric(c, "glm_prefix_cache_hits_total") > 0
            assert 0 < _metric(c, "glm_spec_accepted_tokens_total") < _metric(c, "glm_spec_draft_tokens_total")
    finally:
        stop.set()
        _stop(srv, uv)


def test_the_replay_gate(golden_dir):
    _replay_gate(golden_dir, "tiny-fp8", "tiny-bf16")


@pytest.mark.slow
def test_the_replay_gate_on_small(small_zoo):
    _replay_gate(small_zoo, "small-fp8", "small-bf16")


def _slice_skip() -> str | None:
    from tests.engine_checks import EMU_SLOW, NO_CUDA, cuda_state
    ok, emu, _ = cuda_state()
    if not ok:
        return NO_CUDA
    if emu:
        return EMU_SLOW
    if not (Path(os.environ.get("GLM_SLICE_DIR", "/nonexistent")) / "slice-fp8" / "config.json").is_file():
        return "GLM_SLICE_DIR (a directory holding slice-fp8) not given"
    return None


@pytest.mark.gpu
def test_the_replay_gate_on_slice():
    """The replay gate on the CUDA engine at real widths ($GLM_SLICE_DIR/slice-fp8; tools/gpu_check.sh
    SERVE=1). The drafter is slice-mxfp4 where it was made (another release of the same master weights,
    as on tiny and small: drafts right at times, wrong at others, both within one answer; on a 2-layer,
    8-expert slice its greedy token was slice-fp8's at 31 of 40 positions of an answer). Where only
    slice-fp8 exists, slice-fp8 drafts for itself: on the greedy turns every draft is right, on the
    seeded ones and the filler's temperature-1 requests most are wrong. n-gram drafts would leave the
    gate's "some accepted" to chance: a random model's answers rarely repeat the prompt. The servers'
    engine is GLM_SERVE_ENGINE where that names the CUDA engine (its options), else `cuda`."""
    why = _slice_skip()
    if why:
        pytest.skip(why)
    root = Path(os.environ["GLM_SLICE_DIR"])
    drafter = "slice-mxfp4" if (root / "slice-mxfp4" / "config.json").is_file() else "slice-fp8"
    engine = SERVE_ENGINE if SERVE_ENGINE.startswith("cuda") else "cuda"
    _replay_gate(root, "slice-fp8", drafter, engine=engine)
