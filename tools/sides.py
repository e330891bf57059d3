"""SPEC strings and the "sides" that `oracle diff` and `oracle trace` run (SPEC 7).

A SPEC names an engine and options after a colon, comma-separated:

    oracle                          the oracle, canonical
    oracle:chunk=7                  prefill in chunks of 7 tokens
    oracle:precision=float64        every rounding removed (not canonical; for the peer check)
    cpu:threads=2,batch=4           the fast CPU engine, 2 threads, the request in a batch of 4
    cpu:prefix-cache                the prompt's first half computed on a cache that is then forked
    cpu:inject=15,45,mla.scores,3,1 one value perturbed by 1 ULP (L,P,STAGE,ELEM,ULPS)
    cuda:expf=native                a non-canonical switch of an engine

`inject=` takes the next five comma-separated fields (the spec itself holds commas).

A side is an object with `generate(ids, n, capture=None) -> (tokens, logits)`: greedy decoding of one
request of interest, recording its stage values into `capture` (an `oracle.capture.Capture`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from oracle.capture import Capture
from oracle.inject import Injection
from oracle.stages import model_stages

ENGINES = ("oracle", "cpu", "cuda")

# option -> (kind of value, engines that take it)
OPTIONS = {
    "batch": ("int", ("cpu", "cuda")),
    "chunk": ("int", ("oracle", "cpu", "cuda")),
    "prefix-cache": ("flag-or-int", ("oracle", "cpu", "cuda")),
    "threads": ("int", ("cpu", "cuda")),
    "inject": ("inject", ("oracle", "cpu", "cuda")),
    "precision": (("canonical", "float64"), ("oracle",)),
    "dot": (("canonical", "sequential"), ("cpu", "cuda")),
    "expf": (("canonical", "native"), ("cpu", "cuda")),
}


class SideError(ValueError):
    """A SPEC that cannot be parsed or run (unknown engine or option, engine not available)."""


@dataclass
class SideSpec:
    engine: str
    options: dict = field(default_factory=dict)
    text: str = ""

    def __str__(self) -> str:
        return self.text or self.engine


def parse_spec(text: str) -> SideSpec:
    """'cpu:chunk=7,inject=1,2,kda.o,3,4' -> SideSpec('cpu', {'chunk': 7, 'inject': Injection(...)})."""
    if not isinstance(text, str) or not text.strip():
        raise SideError("empty SPEC: expected oracle, cpu or cuda, with options after a colon")
    text = text.strip()
    engine, _, rest = text.partition(":")
    if engine not in ENGINES:
        raise SideError(f"SPEC {text!r}: unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    fields = [f.strip() for f in rest.split(",")] if rest else []
    opts: dict = {}
    i = 0
    while i < len(fields):
        part = fields[i]
        i += 1
        if not part:
            raise SideError(f"SPEC {text!r}: empty option (two commas in a row?)")
        key, eq, value = part.partition("=")
        if key not in OPTIONS:
            raise SideError(f"SPEC {text!r}: unknown option {key!r}; known options: {', '.join(OPTIONS)}")
        kind, engines = OPTIONS[key]
        if engine not in engines:
            raise SideError(f"SPEC {text!r}: option {key!r} is not supported by the {engine} side "
                            f"(only by {', '.join(engines)})")
        if key in opts:
            raise SideError(f"SPEC {text!r}: option {key!r} given twice")
        if kind == "inject":
            if i + 4 > len(fields):
                raise SideError(f"SPEC {text!r}: inject= takes five comma-separated fields L,P,STAGE,ELEM,ULPS")
            spec = ",".join([value] + fields[i:i + 4])
            i += 4
            try:
                opts[key] = Injection.parse(spec)
            except KeyError as e:
                raise SideError(f"SPEC {text!r}: inject: {e.args[0]}") from None
            except ValueError as e:
                raise SideError(f"SPEC {text!r}: {e}") from None
        elif kind == "int" or (kind == "flag-or-int" and eq):
            if not value.isdigit() or int(value) < 1:
                raise SideError(f"SPEC {text!r}: option {key!r} needs an integer >= 1, got {value!r}")
            opts[key] = int(value)
        elif kind == "flag-or-int":
            opts[key] = True
        else:                                   # a choice
            if value not in kind:
                raise SideError(f"SPEC {text!r}: option {key!r} must be one of {', '.join(kind)}, got {value!r}")
            opts[key] = value
    return SideSpec(engine, opts, text)


def check_injection(inj: Injection, config) -> None:
    """Refuse an injection naming a layer or a stage the model does not have (it would never fire)."""
    L = config.num_hidden_layers
    if inj.layer > L:
        raise SideError(f"inject: layer {inj.layer} out of range [0, {L}] (layer {L} holds the head stages)")
    stages = {s for l, s, _ in model_stages(config) if l == inj.layer}
    if inj.stage not in stages:
        raise SideError(f"inject: stage {inj.stage!r} does not exist at layer {inj.layer}; "
                        f"it has {', '.join(sorted(stages))}")


# -- sides -------------------------------------------------------------------------------------------

_MODELS: dict = {}


def _oracle_model(checkpoint, precision: str):
    import oracle
    key = (str(checkpoint), precision)
    if key not in _MODELS:
        _MODELS[key] = oracle.load(checkpoint, precision)
    return _MODELS[key]


def filler_prompts(ids, count: int, vocab: int) -> list[list[int]]:
    """Other requests for `batch=N`: deterministic, different lengths and contents."""
    out = []
    for j in range(count):
        n = max(1, len(ids) - 3 * (j + 1) % max(len(ids), 1))
        out.append([(int(t) * (2 * j + 3) + 7 * (j + 1)) % vocab for t in list(ids)[:n]])
    return out


class Side:
    """One configured engine: `generate(ids, n, capture)` -> (new tokens, logits of every position)."""

    def __init__(self, spec: SideSpec, checkpoint):
        self.spec, self.checkpoint = spec, checkpoint
        self.options = dict(spec.options)
        self.engine = self._open()
        self.config = self.engine.config
        if "inject" in self.options:
            check_injection(self.options["inject"], self.config)

    def __str__(self) -> str:
        return str(self.spec)

    # -- opening -------------------------------------------------------------------------------
    def _open(self):
        o, name = self.options, self.spec.engine
        if name == "oracle":
            return _oracle_model(self.checkpoint, o.get("precision", "canonical"))
        try:
            from fast.engine import Engine
        except ImportError as e:
            raise SideError(f"{name} engine not available: {e}") from None
        if name == "cuda":
            try:
                import fast._cuda  # noqa: F401
            except ImportError as e:
                raise SideError(f"cuda engine not available: the CUDA extension fast._cuda is not built or "
                                f"cannot load ({e})") from None
        kwargs = {}
        if "threads" in o:
            kwargs["threads"] = o["threads"]
        for k in ("dot", "expf"):
            if k in o:
                kwargs[k] = o[k]
        if "inject" in o:
            kwargs["inject"] = str(o["inject"])
        try:
            return Engine(self.checkpoint, device=name, **kwargs)
        except ImportError as e:
            raise SideError(f"{name} engine not available: {e}") from None
        except TypeError as e:                       # an option the engine's API does not take
            raise SideError(f"{name} engine does not take these options ({e})") from None
        except ValueError as e:
            if name == "cuda" and "device" in str(e):
                raise SideError(f"cuda engine not available: {e}") from None
            raise

    # -- running -------------------------------------------------------------------------------
    def generate(self, ids, n: int, capture: Capture | None = None, inject: Injection | None = None,
                 chunk: int | None = None):
        """Greedy: the prompt then n new tokens -> (tokens: list[int], logits f32 [positions, V])."""
        o = self.options
        ids = [int(t) for t in ids]
        inject = inject if inject is not None else o.get("inject")
        chunk = chunk if chunk is not None else o.get("chunk")
        if inject is not None:
            check_injection(inject, self.config)
        if self.spec.engine == "oracle":
            if o.get("prefix-cache"):
                return self._generate_prefix(ids, n, capture, chunk, inject)
            return self.engine.generate(ids, n, chunk=chunk, capture=capture, return_logits=True, inject=inject)
        if inject is not None and inject != o.get("inject"):
            self.engine.inject = str(inject)
        if o.get("prefix-cache"):
            return self._generate_prefix(ids, n, capture, chunk, None)
        batch = o.get("batch", 1)
        prompts = [ids] + filler_prompts(ids, batch - 1, self.config.vocab_size)
        caps = [capture] + [None] * (batch - 1)
        outs, logits = self.engine.generate(prompts, n, capture=caps, chunk=chunk, return_logits=True)
        return list(outs[0]), logits[0]

    def _generate_prefix(self, ids, n, capture, chunk, inject):
        """prefix-cache: the prompt's first k tokens on one cache, forked; the rest on the fork."""
        e = self.engine
        k = self.options["prefix-cache"]
        k = len(ids) // 2 if k is True else min(k, len(ids) - 1)
        extra = {} if inject is None else {"inject": inject}
        warm = e.new_cache()
        logits = []
        if k > 0:
            logits.append(e.prefill(ids[:k], warm, chunk=chunk, capture=capture, **extra))
        cache = warm.copy()
        logits.append(e.prefill(ids[k:], cache, chunk=chunk, capture=capture, **extra))
        out = []
        for i in range(n):
            tok = int(np.argmax(logits[-1][-1]))
            out.append(tok)
            if i + 1 == n:
                break
            logits.append(e.forward([tok], cache, capture, **extra))
        return out, np.concatenate(logits)


def open_side(text: str, checkpoint) -> Side:
    return Side(parse_spec(text), checkpoint)


def make_engine(spec: str, checkpoint, precision: str = "canonical"):
    """An object with .config, .generate(ids, n, return_logits=...), .prefill, .forward: oracle | cpu | cuda."""
    name, _, opts = spec.partition(":")
    if name == "oracle":
        import oracle
        return oracle.load(checkpoint, precision)
    if name in ("cpu", "cuda"):
        from fast import Engine
        return Engine(checkpoint, device=name, **_parse_opts(opts))
    raise ValueError(f"unknown engine {spec!r}: expected oracle, cpu or cuda")


def _parse_opts(opts: str) -> dict:
    out = {}
    for part in filter(None, opts.split(",")):
        k, _, v = part.partition("=")
        out[k.replace("-", "_")] = int(v) if v.isdigit() else (v or True)
    return out
