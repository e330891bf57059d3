"""The HTTP side of `oracle serve`: OpenAI-compatible routes on FastAPI (docs/serve.md).

Request bodies are checked here by hand, field by field, so every bad request gets a 4xx with an
OpenAI-style error object naming the field ({"error": {"message", "type", "param", "code"}}) and
never reaches the engine. Generation happens on the scheduler's thread; its events come back to the
request's coroutine through an asyncio queue.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import secrets
import time
import uuid
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fast.core import human_bytes
from fast.speculate import close_drafter, open_drafter
from oracle.sampling import SAMPLING_VERSION, SamplingParams

from .metrics import Metrics
from .prefix import PrefixCache
from .prefix_disk import DiskTier
from .scheduler import QueueFull, Request, Scheduler

MAX_TOP_LOGPROBS = 20
MAX_STOP = 4
DEFAULT_MAX_TOKENS = 16



def plain_chat_prompt(messages: list[dict]) -> str:
    """The chat template used when the checkpoint has none (docs/serve.md): each message as
    "<|role|>\\n" + content + "\\n", then "<|assistant|>\\n"."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def _hash12(values, dtype: str) -> str:
    return hashlib.sha256(np.ascontiguousarray(values, dtype=dtype).tobytes()).hexdigest()[:12]


def checkpoint_identity(path) -> str:
    """12 hex digits over config.json and the safetensors headers (names, dtypes, shapes, offsets):
    which weights without reading them."""
    h = hashlib.sha256()
    p = Path(path)
    h.update((p / "config.json").read_bytes())
    for f in sorted(p.glob("*.safetensors")):
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(f.name.encode() + head + fh.read(min(n, 1 << 26)))
    return h.hexdigest()[:12]


def _project_version() -> str:
    try:
        from importlib.metadata import version
        return version("glm-exact")
    except Exception:  # noqa: BLE001 - running from a checkout that was never installed
        return "dev"


class Server:
    """The engine, its scheduler, the tokenizer and the routes (app)."""

    def __init__(self, engine, checkpoint, engine_spec: str = "cpu", *, model_name: str | None = None,
                 max_batch: int = 16, max_queue: int = 64, max_step_tokens: int = 512, tokenizer=None,
                 chat_template: str | None = None, prefix_cache_mb: float = 0, prefix_block: int = 16,
                 prefix_cache_dir=None, prefix_cache_disk_mb: float = 1024, speculate=None):
        self.engine = engine
        self.config = engine.config
        self.checkpoint = Path(checkpoint)
        self.model_name = model_name or self.checkpoint.name
        self.engine_spec = engine_spec
        self.max_context = int(getattr(engine, "max_context", self.config.max_position_embeddings))
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(self.checkpoint)
        self.chat_template, self.chat_template_source = _chat_template(self.checkpoint, chat_template)
        eos = self.config.eos_token_id
        self.eos = frozenset(() if eos is None else (eos if isinstance(eos, tuple) else (eos,)))
        self.fingerprint = (f"glm-exact-{_project_version()}:sampling-v{SAMPLING_VERSION}:{engine_spec}:"
                            f"{self.checkpoint.name}-{checkpoint_identity(self.checkpoint)}")
        self.metrics = Metrics()
        disk = (DiskTier(prefix_cache_dir, int(prefix_cache_disk_mb * (1 << 20)), self.fingerprint, prefix_block)
                if prefix_cache_dir is not None and prefix_cache_mb else None)
        self.prefix = (PrefixCache(engine, int(prefix_cache_mb * (1 << 20)), prefix_block, self.metrics, disk)
                       if prefix_cache_mb else None)
        # speculation changes no answer, so the fingerprint does not name it
        self.drafter = open_drafter(speculate, engine) if speculate is not None else None
        self.scheduler = Scheduler(engine, max_batch=max_batch, max_queue=max_queue,
                                   max_step_tokens=max_step_tokens, tokenizer=self.tokenizer, metrics=self.metrics,
                                   prefix_cache=self.prefix, drafter=self.drafter)
        self.app = self._make_app()

    # -- lifecycle ---------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Compile the sampler (Numba) before the first request."""
        from oracle.sampling import log_softmax, sample
        row = np.zeros(self.config.vocab_size, np.float32)
        sample(row, SamplingParams(temperature=1.0, top_k=2, top_p=0.5, seed=1), 0)
        log_softmax(row)

    def start(self) -> "Server":
        self.warm_up()
        self.scheduler.start()
        return self

    def close(self) -> None:
        stopped = self.scheduler.close()
        # a step still running past the join's timeout (a slow engine: the CUDA emulation) may be
        # stepping the drafter: its engine is then left to the garbage collector, never freed under it
        if self.drafter is not None and stopped:
            close_drafter(self.drafter)

    # -- request parsing ----------------------------------------------------------------------------
    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None:
            raise ApiError(400, "you must provide a model parameter", "model", "missing_required_parameter")
        if model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def _encode(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, f"{self.checkpoint.name} has no tokenizer.json: give the prompt as token ids",
                           param, "no_tokenizer")
        return list(self.tokenizer.encode(text).ids)

    def _check_ids(self, ids, param: str) -> list[int]:
        V = self.config.vocab_size
        for i, t in enumerate(ids):
            if not _is_int(t):
                raise ApiError(400, f"{param}[{i}] must be an integer token id, got {t!r}", param)
            if not 0 <= t < V:
                raise ApiError(400, f"token id {t} at {param}[{i}] is outside the vocabulary [0, {V})",
                               param, "token_out_of_range")
        return [int(t) for t in ids]

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]   # a batch of one
        if isinstance(prompt, str):
            ids = self._encode(prompt, "prompt")
        elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            ids = self._check_ids(prompt, "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError(400, "one prompt per request (a list of prompts is not supported)", "prompt")
        elif prompt is None:
            raise ApiError(400, "you must provide a prompt", "prompt", "missing_required_parameter")
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        return ids

    def _chat_ids(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", "messages")
        norm = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a role", f"messages[{i}]")
            content = m.get("content")
            if isinstance(content, list):   # content parts: text only
                parts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                                       f"messages[{i}].content")
                    parts.append(part["text"])
                content = "".join(parts)
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                               f"messages[{i}].content")
            norm.append({"role": m["role"], "content": content})
        if self.chat_template is None:
            text = plain_chat_prompt(norm)
        else:
            text = self.chat_template.render(messages=norm, add_generation_prompt=True, bos_token="", eos_token="")
        ids = self._encode(text, "messages")
        if not ids:
            raise ApiError(400, "the chat template gave an empty prompt", "messages")
        return ids

    def _common(self, body: dict, ids: list[int], chat: bool) -> Request:
        for name, ok in (("n", 1), ("best_of", 1)):
            v = body.get(name)
            if v is not None and v != ok:
                raise ApiError(400, f"{name} must be 1: one choice per request", name, "unsupported_parameter")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = body.get(name)
            if v is not None and v not in (0, 0.0) and not (name == "repetition_penalty" and v == 1):
                raise ApiError(400, f"{name} is not supported", name, "unsupported_parameter")
        if body.get("logit_bias"):
            raise ApiError(400, "logit_bias is not supported", "logit_bias", "unsupported_parameter")
        if body.get("echo"):
            raise ApiError(400, "echo is not supported", "echo", "unsupported_parameter")
        if body.get("suffix"):
            raise ApiError(400, "suffix is not supported", "suffix", "unsupported_parameter")

        mt_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(mt_name)
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if not _is_int(max_tokens) or max_tokens < 1:
            raise ApiError(400, f"{mt_name} must be an integer >= 1, got {max_tokens!r}", mt_name)
        if len(ids) > self.max_context:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; the maximum context is {self.max_context}",
                           "messages" if chat else "prompt", "context_length_exceeded")
        if len(ids) + max_tokens - 1 > self.max_context:
            raise ApiError(400, f"{len(ids)} prompt tokens + {max_tokens} new tokens need "
                                f"{len(ids) + max_tokens - 1} positions; the maximum context is {self.max_context}",
                           mt_name, "context_length_exceeded")
        need, left = self.engine.sequence_bytes(len(ids) + max_tokens - 1), self.engine.available_memory()
        if need > left:  # (what the sequence's state takes against what is free now: fast.Engine.sequence_memory)
            raise ApiError(400, f"{len(ids) + max_tokens - 1} positions need {human_bytes(need)} of state; "
                                f"{human_bytes(left)} are free", mt_name, "context_length_exceeded")

        temperature = _number(body, "temperature", 1.0)
        if temperature < 0:
            raise ApiError(400, f"temperature must be >= 0, got {temperature}", "temperature")
        top_p = _number(body, "top_p", 1.0)
        if not 0 < top_p <= 1 or np.float32(top_p) <= 0:
            raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
        top_k = body.get("top_k")
        if top_k is None or top_k == -1:
            top_k = 0
        if not _is_int(top_k) or top_k < 0:
            raise ApiError(400, f"top_k must be an integer >= 0 (0 or -1: no limit), got {top_k!r}", "top_k")
        seed = body.get("seed")
        if seed is None:
            seed = secrets.randbits(63)   # drawn here and returned, so the answer can be reproduced
        if not _is_int(seed) or not 0 <= seed < 2 ** 64:
            raise ApiError(400, f"seed must be an integer in [0, 2^64), got {seed!r}", "seed")

        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if (not isinstance(stop, list) or len(stop) > MAX_STOP
                or any(not isinstance(s, str) or not s for s in stop)):
            raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
        if stop and self.tokenizer is None:
            raise ApiError(400, "stop strings need the checkpoint's tokenizer.json", "stop", "no_tokenizer")

        if chat:
            lp = body.get("logprobs")
            if lp is not None and not isinstance(lp, bool):
                raise ApiError(400, "logprobs must be a boolean", "logprobs")
            top = body.get("top_logprobs")
            if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
                raise ApiError(400, f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
            if top and not lp:
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            want_lp, top = bool(lp), int(top or 0)
        else:
            lp = body.get("logprobs")
            if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS):
                raise ApiError(400, f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
            want_lp, top = lp is not None, int(lp or 0)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "stream must be a boolean", "stream")
        so = body.get("stream_options")
        if so is not None and (not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool)):
            raise ApiError(400, "stream_options must be an object with a boolean include_usage", "stream_options")
        include_usage = bool(so and so.get("include_usage"))
        if include_usage and not stream:
            raise ApiError(400, "stream_options is only for stream: true", "stream_options")
        params = SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=int(seed))
        req = Request(prompt=np.asarray(ids, np.int32), max_tokens=int(max_tokens), params=params,
                      top_logprobs=top, eos=self.eos, stop=tuple(stop))
        req.want_logprobs, req.stream, req.include_usage = want_lp, stream, include_usage
        return req

    # -- generation ---------------------------------------------------------------------------------
    def _token_text(self, t: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([t])

    def _submit(self, req: Request) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        req.sink = (loop, q.put_nowait)
        try:
            self.scheduler.submit(req)
        except QueueFull as e:
            raise ApiError(429, f"the server is full: {e}; retry later", None, "rate_limit_exceeded",
                           "rate_limit_error") from None
        return q

    def _result(self, req: Request, tokens: list[int], lps: list[float]) -> dict:
        return {"token_ids": tokens, "output_hash": _hash12(np.array(tokens, np.int64), "<i4"),
                "logprobs_hash": _hash12(np.array(lps, np.float32), "<f4"), "seed": req.params.seed}

    def _text(self, tokens: list[int], text_end) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(tokens)
        return text if text_end is None else text[:text_end]

    def _watch(self, http: HttpRequest, req: Request) -> asyncio.Task:
        """A task that cancels `req` when its client disconnects (the scheduler then frees the sequence
        before its next step and sends the request a "cancelled" event)."""
        async def watch():
            while True:
                msg = await http.receive()
                if msg["type"] == "http.disconnect":
                    req.cancel()
                    self.scheduler.wake()
                    return
        return asyncio.create_task(watch())

    async def _collect(self, http: HttpRequest, req: Request, q: asyncio.Queue):
        """Wait for the whole answer; a client that disconnects cancels its sequence."""
        watcher = self._watch(http, req)
        events = []
        try:
            while True:
                ev = await q.get()
                events.append(ev)
                if ev["type"] == "done":
                    return events
        finally:
            watcher.cancel()
            if not req.finished:
                req.cancel()
                self.scheduler.wake()

    def _lp_completion(self, toks, evs, text_offset0=0):
        tokens = [self._token_text(t) for t in toks]
        offsets, off = [], text_offset0
        for s in tokens:
            offsets.append(off)
            off += len(s)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in evs],
                "top_logprobs": [None if e["top"] is None else {self._token_text(i): v for i, v in e["top"]}
                                 for e in evs],
                "text_offset": offsets}

    def _lp_chat(self, toks, evs):
        def item(t, v):
            s = self._token_text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8")), "token_id": t}
        out = []
        for t, e in zip(toks, evs):
            d = item(t, e["logprob"])
            d["top_logprobs"] = [item(i, v) for i, v in (e["top"] or [])]
            out.append(d)
        return {"content": out}

    async def _complete(self, http: HttpRequest, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            body = await _json_body(http)
            self._check_model(body)
            ids = self._chat_ids(body.get("messages")) if chat else self._prompt_ids(body.get("prompt"))
            req = self._common(body, ids, chat)
            q = self._submit(req)
        except ApiError as e:
            self.metrics.request(endpoint, e.status)
            return e.response()
        self.metrics.request(endpoint, 200)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_name, "system_fingerprint": self.fingerprint}
        if req.stream:
            return StreamingResponse(self._stream(http, req, q, head, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        events = await self._collect(http, req, q)
        done = events[-1]
        toks = [e["token"] for e in events if e["type"] == "token"]
        tev = [e for e in events if e["type"] == "token"]
        if done["reason"] == "error":
            raise_err = ApiError(500, f"the engine failed: {done['error']}", None, "engine_error", "server_error")
            return raise_err.response()
        extra = self._result(req, toks, [e["logprob"] for e in tev])
        text = self._text(toks, done["text_end"])
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self._lp_chat(toks, tev) if req.want_logprobs else None,
                      "finish_reason": done["reason"], **extra}
        else:
            choice = {"index": 0, "text": text,
                      "logprobs": self._lp_completion(toks, tev) if req.want_logprobs else None,
                      "finish_reason": done["reason"], **extra}
        usage = {"prompt_tokens": int(req.prompt.size), "completion_tokens": len(toks),
                 "total_tokens": int(req.prompt.size) + len(toks)}
        return JSONResponse({**head, "choices": [choice], "usage": usage})

    async def _stream(self, http: HttpRequest, req: Request, q: asyncio.Queue, head: dict, chat: bool):
        """Server-sent events: one chunk per token (its token_ids: [id], and the text that became safe to
        show), a last chunk with finish_reason, token_ids [], the rest of the text, the hashes of the
        whole answer and its seed, then [DONE]."""
        head = dict(head, object="chat.completion.chunk" if chat else "text_completion")
        hold = max((len(s) for s in req.stop), default=1) - 1   # text that may still become a stop string
        toks, lps, sent = [], [], 0
        text, prefix, read = "", 0, 0   # the text decoded so far; toks[prefix:read]: its last window
        first = True

        def chunk(text, ev_toks, evs, finish=None, extra=None):
            nonlocal first
            if chat:
                delta = {"content": text}
                if first:
                    delta["role"] = "assistant"
                c = {"index": 0, "delta": delta,
                     "logprobs": self._lp_chat(ev_toks, evs) if req.want_logprobs and evs else None}
            else:
                c = {"index": 0, "text": text,
                     "logprobs": self._lp_completion(ev_toks, evs, sent) if req.want_logprobs and evs else None}
            first = False
            c["finish_reason"] = finish
            c["token_ids"] = ev_toks
            if extra:
                c.update(extra)
            return "data: " + json.dumps({**head, "choices": [c]}) + "\n\n"

        watcher = self._watch(http, req)
        try:
            while True:
                ev = await q.get()
                if req.cancelled:   # the client is gone: nothing more to write
                    if ev["type"] == "done":
                        return
                    continue
                if ev["type"] == "token":
                    toks.append(ev["token"])
                    lps.append(ev["logprob"])
                    if self.tokenizer is not None:
                        # incremental detokenization: decode a short window, so a token costs the same
                        # at position 10 and 10,000 (a window that ends inside a UTF-8 sequence waits)
                        before = self.tokenizer.decode(toks[prefix:read])
                        now = self.tokenizer.decode(toks[prefix:])
                        if len(now) > len(before) and not now.endswith("\ufffd"):
                            text += now[len(before):]
                            prefix, read = read, len(toks)
                    safe = len(text) - hold
                    piece = text[sent:safe] if safe > sent else ""
                    out = chunk(piece, [ev["token"]], [ev])
                    sent += len(piece)
                    yield out
                    continue
                if ev["reason"] == "error":
                    err = {"error": {"message": f"the engine failed: {ev['error']}", "type": "server_error",
                                     "param": None, "code": "engine_error"}}
                    yield "data: " + json.dumps(err) + "\n\n"
                    return
                if ev["reason"] == "cancelled":
                    return
                text = self._text(toks, ev["text_end"])
                extra = self._result(req, toks, lps)
                del extra["token_ids"]
                yield chunk(text[sent:], [], [], finish=ev["reason"], extra=extra)
                if req.include_usage:   # OpenAI's form: one more chunk, no choices, the usage
                    usage = {"prompt_tokens": int(req.prompt.size), "completion_tokens": len(toks),
                             "total_tokens": int(req.prompt.size) + len(toks)}
                    yield "data: " + json.dumps({**head, "choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            watcher.cancel()
            if not req.finished:
                req.cancel()
                self.scheduler.wake()

    # -- the app ------------------------------------------------------------------------------------
    def _make_app(self) -> FastAPI:
        app = FastAPI(title="glm-exact", version=_project_version())
        server = self

        @app.exception_handler(ApiError)
        async def _api_error(request, exc: ApiError):
            return exc.response()

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request, exc: StarletteHTTPException):
            code = "not_found" if exc.status_code == 404 else None
            return ApiError(exc.status_code, str(exc.detail), None, code).response()

        @app.exception_handler(RequestValidationError)
        async def _validation_error(request, exc: RequestValidationError):
            return ApiError(400, str(exc), None).response()

        @app.exception_handler(Exception)
        async def _unexpected(request, exc: Exception):
            return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error",
                            "server_error").response()

        @app.get("/health")
        async def health():
            active, waiting = server.scheduler.load
            return {"status": "ok", "model": server.model_name, "engine": server.engine_spec,
                    "checkpoint": str(server.checkpoint), "system_fingerprint": server.fingerprint,
                    "active": active, "waiting": waiting, "max_context": server.max_context,
                    "speculate": None if server.drafter is None else str(server.drafter)}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{
                "id": server.model_name, "object": "model", "created": 0, "owned_by": "glm-exact",
                "max_model_len": server.max_context, "system_fingerprint": server.fingerprint,
                "chat_template": server.chat_template_source}]}

        @app.get("/metrics")
        async def metrics():
            active, waiting = server.scheduler.load
            return PlainTextResponse(server.metrics.render(active, waiting),
                                     media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.post("/v1/completions")
        async def completions(request: HttpRequest):
            return await server._complete(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: HttpRequest):
            return await server._complete(request, chat=True)

        return app


async def _json_body(http: HttpRequest) -> dict:
    raw = await http.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", None, "invalid_json")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(400, f"{name} must be a finite number, got {v!r}", name)
    return float(v)


def _load_tokenizer(path: Path):
    f = path / "tokenizer.json"
    if not f.exists():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(f))


def _chat_template(path: Path, override: str | None):
    """The Jinja chat template: --chat-template FILE, else the checkpoint's chat_template.jinja or
    tokenizer_config.json's chat_template -> (compiled template, where it came from); (None, "plain"):
    none, plain_chat_prompt is used."""
    src, where = None, "plain"
    if override is not None:
        src, where = Path(override).read_text(), str(override)
    elif (path / "chat_template.jinja").exists():
        src, where = (path / "chat_template.jinja").read_text(), "chat_template.jinja"
    elif (path / "tokenizer_config.json").exists():
        tpl = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
        if isinstance(tpl, str):
            src, where = tpl, "tokenizer_config.json"
    if src is None:
        return None, where
    import jinja2.sandbox
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(src), where
