"""`oracle serve` on the CPU engine (golden/tiny-fp8), started in this process on 127.0.0.1, talked to
with the openai client and httpx.

The heart: every answer (token ids, logprob bits, hashes) equals the batch-1 reference loop
(oracle.sampling.sample_loop on a separate engine), whatever else the server is doing: concurrency
1, 4 and 16, other requests of other lengths arriving at random times, some of them abandoned by
their clients, greedy and seeded, streamed and not. Bad requests get 4xx with an OpenAI error object
and change nobody's bits.
"""
from __future__ import annotations

import argparse
import json
import random
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fast._core")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from oracle.sampling import SamplingParams, sample_loop  # noqa: E402
from tests.serving import engine_spec, start_server  # noqa: E402
from tools.serve.app import _hash12, plain_chat_prompt  # noqa: E402

CTX = 4096
MODEL = "tiny-fp8"


def _start(golden_dir, *extra, ctx=CTX):
    # the server's engine: GLM_SERVE_ENGINE (tests/serving.py); the reference stays the CPU engine
    return start_server(golden_dir / MODEL, engine_spec(ctx), *extra)


@pytest.fixture(scope="module")
def server(golden_dir):
    # a small step budget, so prompts are split into chunks that share steps with other requests' decodes
    srv, uv, url = _start(golden_dir, "--max-batch", "16", "--max-queue", "64", "--max-step-tokens", "16")
    yield srv, url
    uv.should_exit = True
    uv.thread.join(10)
    srv.close()


@pytest.fixture(scope="module")
def reference(golden_dir):
    """(prompt ids, max_tokens, params, eos) -> (tokens, logprobs): the batch-1 loop on its own engine."""
    import fast
    eng = fast.Engine(str(golden_dir / MODEL), threads=1)
    memo = {}

    def ref(ids, n, params):
        key = (tuple(ids), n, params)
        if key not in memo:
            memo[key] = sample_loop(eng, ids, n, params)
        return memo[key]
    return ref


def _bits(lps) -> list[int]:
    return np.array(lps, np.float32).view(np.uint32).tolist()


def _params(body) -> SamplingParams:
    return SamplingParams(float(body.get("temperature", 1.0)), int(body.get("top_k") or 0),
                          float(body.get("top_p", 1.0)), int(body["seed"]))


def _check(result, ids, body, reference):
    """A finished answer {token_ids, logprobs, output_hash, logprobs_hash, seed} against the reference."""
    body = dict(body, seed=result["seed"])
    tokens, lps = reference(ids, body["max_tokens"], _params(body))
    assert result["token_ids"] == tokens
    assert _bits(result["logprobs"]) == _bits(lps)
    assert result["output_hash"] == _hash12(np.array(tokens), "<i4")
    assert result["logprobs_hash"] == _hash12(np.array(lps, np.float32), "<f4")


# -- talking to the server: httpx (raw JSON, streamed or not) and the openai client ----------------------

def _post(client, path, body):
    """-> the answer as {token_ids, logprobs, output_hash, logprobs_hash, seed, text, finish_reason}."""
    if not body.get("stream"):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        lp = c["logprobs"]
        lps = ([t["logprob"] for t in lp["content"]] if "content" in (lp or {}) else
               (lp["token_logprobs"] if lp else None))
        return dict(c, logprobs=lps, text=c.get("text", (c.get("message") or {}).get("content")))
    ids, lps, text, last = [], [], "", None
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])["choices"][0]
            ids += c["token_ids"]
            lp = c["logprobs"]
            if lp:
                lps += [t["logprob"] for t in lp["content"]] if "content" in lp else lp["token_logprobs"]
            text += c.get("text", (c.get("delta") or {}).get("content") or "")
            last = c
    assert last["finish_reason"] in ("length", "stop") and last["token_ids"] == []
    return dict(last, token_ids=ids, logprobs=lps, text=text)


def _post_openai(oc, kind, body):
    extra = {k: body[k] for k in ("top_k",) if k in body}
    if "stream_options" in body:
        extra["stream_options"] = body["stream_options"]
    common = dict(model=MODEL, max_tokens=body["max_tokens"], temperature=body.get("temperature"),
                  top_p=body.get("top_p"), seed=body.get("seed"), extra_body=extra or None)
    if kind == "completions":
        resp = oc.completions.create(prompt=body["prompt"], logprobs=0, stream=body.get("stream", False), **common)
    else:
        resp = oc.chat.completions.create(messages=body["messages"], logprobs=True,
                                          stream=body.get("stream", False), **common)
    if not body.get("stream"):
        c = resp.choices[0]
        lps = (c.logprobs.token_logprobs if kind == "completions" else [t.logprob for t in c.logprobs.content])
        return {"token_ids": c.token_ids, "logprobs": lps, "output_hash": c.output_hash,
                "logprobs_hash": c.logprobs_hash, "seed": c.seed, "finish_reason": c.finish_reason,
                "system_fingerprint": resp.system_fingerprint}
    ids, lps, last, usage = [], [], None, None
    for ch in resp:
        if not ch.choices:   # stream_options.include_usage: the usage chunk
            usage = ch.usage
            continue
        c = ch.choices[0]
        ids += c.token_ids
        if c.logprobs:
            lps += c.logprobs.token_logprobs if kind == "completions" else [t.logprob for t in c.logprobs.content]
        last = c
    if "stream_options" in body:
        assert usage is not None and usage.completion_tokens == len(ids)
    return {"token_ids": ids, "logprobs": lps, "output_hash": last.output_hash,
            "logprobs_hash": last.logprobs_hash, "seed": last.seed, "finish_reason": last.finish_reason}


# -- the probes: the requests whose bits are checked under every load -----------------------------------

PROBES = [
    ("completions", {"prompt": [5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125, 137], "max_tokens": 12,
                     "temperature": 0, "logprobs": 0}),
    ("completions", {"prompt": [3, 1, 4, 1, 5, 9, 2, 6], "max_tokens": 10, "temperature": 0.8, "top_k": 40,
                     "top_p": 0.9, "seed": 1234, "logprobs": 0, "stream": True}),
    ("chat", {"messages": [{"role": "user", "content": "what is exact inference?"}], "max_tokens": 9,
              "temperature": 1.2, "seed": 77, "logprobs": True}),
    ("chat", {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
              "max_tokens": 7, "temperature": 0, "logprobs": True, "stream": True}),
    ("openai-completions", {"prompt": [250, 3, 99, 7], "max_tokens": 8, "temperature": 0.7, "seed": 2 ** 40 + 3}),
    ("openai-chat", {"messages": [{"role": "user", "content": "tiny"}], "max_tokens": 6, "temperature": 0.9,
                     "top_p": 0.8, "seed": 5, "stream": True, "stream_options": {"include_usage": True}}),
]


def _prompt_ids(srv, kind, body):
    if "messages" in body:
        return srv.tokenizer.encode(plain_chat_prompt(body["messages"])).ids
    return list(body["prompt"])


def _run_probe(srv, client, oc, kind, body):
    body = dict(body, model=MODEL)
    if kind.startswith("openai-"):
        return _post_openai(oc, kind[7:], body)
    return _post(client, "/v1/completions" if kind == "completions" else "/v1/chat/completions", body)


def _noise(url, rng, done, errors):
    """Requests of random lengths and parameters, at random times, some abandoned midway."""
    with httpx.Client(base_url=url, timeout=120) as c:
        while not done.is_set():
            time.sleep(rng.uniform(0, 0.03))
            body = {"model": MODEL, "prompt": [rng.randrange(300) for _ in range(rng.randint(1, 40))],
                    "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.5, 1.0]),
                    "top_k": rng.choice([0, 3, 50]), "seed": rng.randrange(2 ** 32)}
            try:
                if rng.random() < 0.2:   # a client that goes away after the first chunk
                    with c.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
                        next(r.iter_lines())
                    continue
                r = c.post("/v1/completions", json=dict(body, stream=rng.random() < 0.5))
                if r.status_code != 200:
                    errors.append(r.text)
            except Exception as e:  # noqa: BLE001 - reported by the test
                errors.append(repr(e))


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_answers_do_not_depend_on_concurrency(server, reference, concurrency):
    srv, url = server
    mixed0 = srv.metrics.mixed_steps
    rng = random.Random(concurrency)
    errors: list[str] = []
    probe_workers = min(concurrency, 3)       # the probes' own clients, the rest is noise
    done = threading.Event()
    threads = [threading.Thread(target=_noise, args=(url, random.Random(i), done, errors), daemon=True)
               for i in range(concurrency - probe_workers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while threads and srv.scheduler.load[0] < len(threads) // 2 and time.monotonic() < deadline:
        time.sleep(0.01)   # the probes arrive into a busy server
    results = [None] * len(PROBES)

    def worker(k):
        with httpx.Client(base_url=url, timeout=120) as client:
            oc = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            for i in range(k, len(PROBES), probe_workers):
                time.sleep(rng.uniform(0, 0.05))
                try:
                    results[i] = _run_probe(srv, client, oc, *PROBES[i])
                except Exception as e:  # noqa: BLE001 - reported by the test
                    errors.append(f"probe {i}: {e!r}")
    workers = [threading.Thread(target=worker, args=(k,)) for k in range(probe_workers)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(300)
    done.set()
    for t in threads:
        t.join(60)
    for (kind, body), res in zip(PROBES, results):
        assert res is not None, (kind, body)
        _check(res, _prompt_ids(srv, kind, body), body, reference)
        if "seed" not in body:   # drawn by the server and returned: replaying it gives the same answer
            assert isinstance(res["seed"], int)
    assert not errors, errors[:3]
    if concurrency == 16:   # the load really was concurrent: big steps, prompt chunks next to decodes
        assert srv.metrics.peak_batch >= 8 and srv.metrics.mixed_steps > mixed0


# -- bad requests: 4xx with an OpenAI error object, nothing else disturbed ------------------------------

BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "gpt-4", "prompt": [1, 2]}, 404, "model"),
    ("/v1/completions", {"prompt": [1, 2]}, 400, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 300]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, -1]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2.5]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], [3]]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * (CTX + 1), "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": CTX}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "top_p": 1.01}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "top_k": -3}, 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "seed": -1}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "seed": 2 ** 64}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "n": 2}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "echo": True}, 400, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": CTX + 5}, 400, "max_completion_tokens"),
    ("/v1/nothing", {}, 404, None),
]


def test_bad_requests_get_an_openai_error_and_change_no_bits(server, reference):
    srv, url = server
    good = ("completions", {"prompt": [9, 8, 7, 6], "max_tokens": 6, "temperature": 0.9, "seed": 31, "logprobs": 0})
    with httpx.Client(base_url=url, timeout=60) as c:
        before = _run_probe(srv, c, None, *good)
        for path, body, status, param in BAD:
            r = (c.post(path, content=body, headers={"content-type": "application/json"})
                 if isinstance(body, bytes) else c.post(path, json=body))
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert isinstance(err["message"], str) and err["message"] and err["type"], (body, err)
            assert err["param"] == param, (body, err)
        r = c.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()
        assert c.get("/health").json()["status"] == "ok"
        after = _run_probe(srv, c, None, *good)
    assert after == before
    _check(after, good[1]["prompt"], good[1], reference)


def test_the_openai_client_sees_the_errors(server):
    srv, url = server
    oc = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        oc.completions.create(model="nope", prompt=[1, 2], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        oc.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature"


# -- admission, disconnects, seeds, stop strings, the small routes --------------------------------------

def _wait(cond, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_full_server_answers_429_and_a_client_that_leaves_frees_its_sequence(golden_dir, reference):
    big = 1 << 17   # requests that would run for minutes: only a cancellation ends them in time
    srv, uv, url = _start(golden_dir, "--max-batch", "1", "--max-queue", "1", ctx=big)
    caches, new_cache = [], srv.engine.new_cache

    def tracked():
        caches.append(new_cache())
        return caches[-1]
    srv.engine.new_cache = tracked   # the scheduler's thread is the only caller
    try:
        long = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": big - 3, "temperature": 0, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as a, httpx.Client(base_url=url, timeout=60) as b:
            with a.stream("POST", "/v1/completions", json=long) as ra:
                lines = ra.iter_lines()   # kept: a dropped iterator closes the response
                next(lines)                                             # running
                with b.stream("POST", "/v1/completions", json=long) as rb:
                    assert rb.status_code == 200                        # waiting
                    _wait(lambda: srv.scheduler.load == (1, 1))
                    r = httpx.post(url + "/v1/completions", json=dict(long, stream=False), timeout=60)
                    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            # both clients went away long before their last tokens: both sequences are freed
            _wait(lambda: srv.scheduler.load == (0, 0))
            assert srv.metrics.finished_by["cancelled"] == 2 and srv.metrics.generated_tokens < big
            # a non-streamed request whose client gives up is cancelled too
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json=dict(long, stream=False), timeout=0.5)
            _wait(lambda: srv.metrics.finished_by["cancelled"] == 3 and srv.scheduler.load == (0, 0))
            # the running request and the non-streamed one had caches; the waiting one gets one only if
            # it was admitted (when the first left) before its own disconnect was seen (a busy machine):
            # whatever ran, every cache is freed in the engine
            assert len(caches) in (2, 3) and not any(c._finalizer.alive for c in caches)
            body = {"prompt": [4, 4, 4], "max_tokens": 5, "temperature": 1.0, "seed": 8, "logprobs": 0}
            _check(_post(a, "/v1/completions", dict(body, model=MODEL)), body["prompt"], body, reference)
        metrics = httpx.get(url + "/metrics").text
        assert 'glm_requests_total{endpoint="completions",code="429"} 1' in metrics
        assert 'glm_sequences_finished_total{reason="cancelled"} 3' in metrics
    finally:
        uv.should_exit = True
        uv.thread.join(10)
        srv.close()


def test_no_seed_draws_one_and_returns_it_so_the_answer_replays(server, reference):
    srv, url = server
    body = {"model": MODEL, "prompt": [11, 22, 33], "max_tokens": 8, "temperature": 1.0, "logprobs": 0}
    with httpx.Client(base_url=url, timeout=60) as c:
        a, b = _post(c, "/v1/completions", body), _post(c, "/v1/completions", body)
        assert a["seed"] != b["seed"]
        replay = _post(c, "/v1/completions", dict(body, seed=a["seed"], stream=True))
    assert replay["token_ids"] == a["token_ids"] and replay["output_hash"] == a["output_hash"]
    _check(a, body["prompt"], body, reference)
    _check(b, body["prompt"], body, reference)


def test_stop_strings_cut_the_text_and_end_the_sequence(server, reference):
    srv, url = server
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 30, "temperature": 0, "logprobs": 0}
    with httpx.Client(base_url=url, timeout=60) as c:
        full = _post(c, "/v1/completions", body)
        text = full["text"]
        k = len(srv.tokenizer.decode(full["token_ids"][:6]))   # a stop string inside the 7th token's text
        stop = text[k - 1:k + 1] if k > 0 else text[:2]
        first = text.find(stop)
        for stream in (False, True):
            cut = _post(c, "/v1/completions", dict(body, stop=[stop, "\x00never"], stream=stream))
            assert cut["finish_reason"] == "stop" and cut["text"] == text[:first]
            n = len(cut["token_ids"])
            assert cut["token_ids"] == full["token_ids"][:n] and n < 30
            assert stop in srv.tokenizer.decode(cut["token_ids"]) and stop not in srv.tokenizer.decode(cut["token_ids"][:-1])
            assert _bits(cut["logprobs"]) == _bits(full["logprobs"][:n])


def test_chat_uses_the_plain_template_when_the_checkpoint_has_none(server):
    srv, url = server
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert srv.chat_template is None
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2}).json()
    ids = srv.tokenizer.encode("<|system|>\ns\n<|user|>\nhi\n<|assistant|>\n").ids
    assert r["usage"]["prompt_tokens"] == len(ids) and r["choices"][0]["message"]["role"] == "assistant"


def test_health_models_and_metrics(server):
    srv, url = server
    with httpx.Client(base_url=url, timeout=60) as c:
        h = c.get("/health").json()
        models = openai.OpenAI(base_url=url + "/v1", api_key="none").models.list()
        m = c.get("/metrics")
    assert h["status"] == "ok" and h["max_context"] == CTX
    fp = h["system_fingerprint"]
    assert engine_spec(CTX) in fp and MODEL in fp and "sampling-v1" in fp
    assert [x.id for x in models.data] == [MODEL]
    assert m.headers["content-type"].startswith("text/plain")
    names = {line.split()[2] for line in m.text.splitlines() if line.startswith("# TYPE")}
    assert {"glm_requests_total", "glm_generation_tokens_total", "glm_sequences_waiting",
            "glm_sequences_active", "glm_engine_step_seconds"} <= names
    assert 'glm_engine_step_seconds_bucket{le="+Inf"}' in m.text


def test_the_command_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from tools.serve import register
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"), console=None)
    args = parser.parse_args(["serve", "--checkpoint", "x", "--engine", "cuda:threads=1", "--max-batch", "3"])
    assert (args.checkpoint, args.engine, args.max_batch, args.max_queue, args.port) == ("x", "cuda:threads=1", 3, 64, 8000)
    assert callable(args.func)
    root = Path(__file__).resolve().parent.parent
    for argv, says in ((["--checkpoint", str(tmp_path / "none")], "none"),
                       (["--checkpoint", str(root / "golden" / MODEL), "--engine", "oracle"], "fast engine"),
                       (["--checkpoint", str(root / "golden" / MODEL), "--max-batch", "0"], "--max-batch")):
        r = subprocess.run([sys.executable, "-m", "tools.serve", *argv], cwd=root, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and says in r.stderr, (argv, r.stderr[-500:])


def test_an_eos_token_ends_the_answer_and_is_kept_in_token_ids(server):
    srv, url = server
    body = {"model": MODEL, "prompt": [2, 71, 13], "max_tokens": 12, "temperature": 0.8, "seed": 99, "logprobs": 0}
    with httpx.Client(base_url=url, timeout=60) as c:
        full = _post(c, "/v1/completions", body)
        eos = full["token_ids"][4]
        first = full["token_ids"].index(eos)
        old = srv.eos
        srv.eos = frozenset({eos})   # as if config.json named it
        try:
            for stream in (False, True):
                cut = _post(c, "/v1/completions", dict(body, stream=stream))
                assert cut["finish_reason"] == "stop" and cut["token_ids"] == full["token_ids"][:first + 1]
                assert _bits(cut["logprobs"]) == _bits(full["logprobs"][:first + 1])
        finally:
            srv.eos = old
