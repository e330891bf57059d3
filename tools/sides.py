"""SPEC strings and the "sides" that `oracle diff` and `oracle trace` run (docs/contract.md §7).

A SPEC names an engine and options after a colon, comma-separated:

    oracle                          the oracle, canonical
    oracle:chunk=7                  prefill in chunks of 7 tokens
    oracle:precision=float64        every rounding removed (not canonical; for the peer check)
    cpu:threads=2,batch=4           the fast CPU engine, 2 threads, the request in a batch of 4
    cpu:prefix-cache                the prompt's first half computed on a cache that is then forked
    cpu:speculate=4                 speculative decoding: up to 4 n-gram drafts verified per step (fast/speculate.py)
    cpu:inject=15,45,mla.scores,3,1 one value perturbed by 1 ULP (L,P,STAGE,ELEM,ULPS)
    cuda:expf=native                a non-canonical switch of an engine
    cpu:ranks=2,memory-limit=N      expert parallelism over 2 ranks (docs/ep.md); verify-ranks, max-context

Every command that takes a SPEC (run, bench, golden, diff, trace) parses it here, so an option an
engine does not take is refused the same way everywhere. A list of SPECs (`bench --engines`) splits
on commas only directly before an engine name (split_specs).

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
    "speculate": ("int", ("cpu", "cuda")),
    "threads": ("int", ("cpu", "cuda")),
    "inject": ("inject", ("oracle", "cpu", "cuda")),
    "precision": (("canonical", "float64"), ("oracle",)),
    "dot": (("canonical", "sequential"), ("cpu", "cuda")),
    "expf": (("canonical", "native"), ("cpu", "cuda")),
    # expert parallelism and memory of the engines (docs/ep.md): passed to fast.Engine as keywords
    "ranks": ("int", ("cpu", "cuda")),
    "memory-limit": ("int", ("cpu", "cuda")),
    "verify-ranks": ("flag", ("cpu", "cuda")),
    "max-context": ("int", ("cpu", "cuda")),
}
ENGINE_KEYWORDS = ("threads", "dot", "expf", "ranks", "memory-limit", "verify-ranks", "max-context")


class SideError(ValueError):
    """A SPEC that cannot be parsed or run (unknown engine or option, engine not available)."""


@dataclass
class SideSpec:
    engine: str
    options: dict = field(default_factory=dict)
    text: str = ""

    def __str__(self) -> str:
        return self.text or self.engine


def options_help() -> str:
    """The SPEC grammar for --help texts, from OPTIONS (so a new option is documented where it is defined)."""
    def form(k, kind):
        if kind == "int":
            return f"{k}=N"
        if kind == "flag":
            return k
        if kind == "flag-or-int":
            return f"{k}[=N]"
        if kind == "inject":
            return f"{k}=L,P,STAGE,ELEM,ULPS"
        return f"{k}={'|'.join(kind)}"
    parts = []
    for k, (kind, engines) in OPTIONS.items():
        who = "" if len(engines) == len(ENGINES) else f" ({', '.join(engines)})"
        parts.append(form(k, kind) + who)
    return "SPEC: oracle | cpu | cuda, with options after a colon, comma-separated: " + "; ".join(parts)


def engine_options(engine: str) -> list[str]:
    """The options `engine` takes, in the order of OPTIONS."""
    return [k for k, (_, engines) in OPTIONS.items() if engine in engines]


def _takes(engine: str, only=None) -> str:
    names = [k for k in engine_options(engine) if only is None or k in only]
    return ", ".join(names) if names else "no options"


def split_specs(items) -> list[str]:
    """SPEC lists as `--engines` takes them: separate arguments, or commas directly before an engine name.

    `oracle,cpu:threads=2,batch=3 cuda` -> ['oracle', 'cpu:threads=2,batch=3', 'cuda']: a comma splits
    only where the next field is an engine name (alone or followed by a colon), so the commas inside
    an engine's options (batch=3, inject=L,P,STAGE,ELEM,ULPS) never split it.
    """
    if isinstance(items, str):
        items = [items]
    specs: list[str] = []
    for item in items:
        current: list[str] = []
        for f in item.split(","):
            head = f.strip().partition(":")[0]
            if current and head in ENGINES:
                specs.append(",".join(current))
                current = []
            current.append(f)
        if current:
            specs.append(",".join(current))
    return [s.strip() for s in specs]


def with_precision(spec: SideSpec, precision: str | None) -> SideSpec:
    """`--precision` of `oracle run`: the oracle's precision= option, refused for the engines."""
    if precision is None or precision == spec.options.get("precision", "canonical"):
        return spec
    if spec.engine != "oracle":
        raise SideError(f"--precision {precision}: only the oracle has a float64 mode; the {spec.engine} engine "
                        f"is canonical only (use --engine oracle --precision {precision})")
    if "precision" in spec.options:
        raise SideError(f"--precision {precision} contradicts {spec.text!r}")
    opts = dict(spec.options, precision=precision)
    if precision == "canonical":
        return SideSpec(spec.engine, opts, spec.text)
    return SideSpec(spec.engine, opts, spec.text + ("," if ":" in spec.text else ":") + f"precision={precision}")


def refuse_options(spec: SideSpec, allowed, what: str) -> None:
    """Refuse the options `what` (a command) does not honour, naming them and the ones it takes."""
    bad = [k for k in spec.options if k not in allowed]
    if bad:
        raise SideError(f"SPEC {spec.text!r}: {what} does not take option {bad[0]!r}; with the {spec.engine} "
                        f"engine it takes {_takes(spec.engine, allowed)}")


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
            raise SideError(f"SPEC {text!r}: unknown option {key!r}; the {engine} engine takes "
                            f"{_takes(engine)}")
        kind, engines = OPTIONS[key]
        if engine not in engines:
            raise SideError(f"SPEC {text!r}: option {key!r} is not supported by the {engine} engine "
                            f"(only by {', '.join(engines)}); the {engine} engine takes {_takes(engine)}")
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
        elif kind == "flag":
            if eq:
                raise SideError(f"SPEC {text!r}: option {key!r} is a switch and takes no value")
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
        self.fired = None                # after generate: did the injection hit (None: no injection)
        self.positions = 0               # after generate: the positions the run processed
        self.speculation = None          # after generate with speculate=K: fast.speculate.SpecStats
        if "inject" in self.options:
            check_injection(self.options["inject"], self.config)
        if "speculate" in self.options and "prefix-cache" in self.options:
            raise SideError(f"SPEC {spec.text!r}: speculate and prefix-cache do not go together in one side")

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
                from fast.cuda import cuda_module
                cuda_module()                        # fast._cuda (fast._cuda_emu under GLM_CUDA_EMU=1)
            except ImportError as e:
                raise SideError(f"cuda engine not available: the CUDA extension fast._cuda is not built or "
                                f"cannot load ({e.__cause__ or e})") from None
        kwargs = {k.replace("-", "_"): o[k] for k in ENGINE_KEYWORDS if k in o}
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
                 chunk: int | None = None, on_token=None, return_logits: bool = True):
        """Greedy: the prompt then n new tokens -> (tokens: list[int], logits f32 [positions, V]).

        on_token(i, token) is called as each token is chosen (streaming); the tokens and logits are
        the same bits either way. After the call, `fired` says whether the injection (if any) hit.
        """
        o = self.options
        ids = [int(t) for t in ids]
        inject = inject if inject is not None else o.get("inject")
        chunk = chunk if chunk is not None else o.get("chunk")
        if inject is not None:
            check_injection(inject, self.config)
        k = self._prefix_len(ids)
        counted = getattr(self.engine, "injected", None)
        if self.spec.engine == "oracle":
            if k is not None or on_token is not None:
                tokens, logits = self._loop(ids, n, capture, chunk, inject, k, on_token)
            else:
                tokens, logits = self.engine.generate(ids, n, chunk=chunk, capture=capture, return_logits=True,
                                                      inject=inject)
        else:
            if inject is not None and inject != o.get("inject"):
                self.engine.inject = str(inject)
            batch = o.get("batch", 1)
            # speculate=K: greedy with up to K n-gram drafts per step; rows of rejected drafts never reach
            # the logits or the capture (fast/speculate.py)
            speculate = f"ngram:{o['speculate']}" if "speculate" in o else None
            if k is not None or (on_token is not None and batch == 1 and speculate is None):
                tokens, logits = self._loop(ids, n, capture, chunk, None, k, on_token)
            else:
                prompts = [ids] + filler_prompts(ids, batch - 1, self.config.vocab_size)
                caps = [capture] + [None] * (batch - 1)
                outs, all_logits = self.engine.generate(prompts, n, capture=caps, chunk=chunk, return_logits=True,
                                                        speculate=speculate)
                self.speculation = self.engine.speculation if speculate else None
                tokens, logits = list(outs[0]), all_logits[0]
                for i, t in enumerate(tokens if on_token is not None else []):
                    on_token(i, int(t))
        positions = self.positions = len(ids) + max(n - 1, 0)
        if inject is None:
            self.fired = None
        elif counted is not None:                      # the engines count the elements they perturbed
            self.fired = self.engine.injected > counted
        else:                                          # the oracle perturbs whenever the position runs
            self.fired = inject.pos < positions
        return (tokens, logits) if return_logits else tokens

    def _prefix_len(self, ids) -> int | None:
        """prefix-cache: how many prompt tokens go on the cache that is then forked (None: no prefix cache)."""
        k = self.options.get("prefix-cache")
        if not k:
            return None
        if k is True:
            return len(ids) // 2
        if k >= len(ids):
            raise SideError(f"{self.spec}: prefix-cache={k} needs a prompt longer than {k} tokens (this one has "
                            f"{len(ids)}); the cached prefix must leave at least one prompt token to run on the fork")
        return k

    def _loop(self, ids, n, capture, chunk, inject, k, on_token):
        """The prompt (its first k tokens on a cache then forked, when k is given), then n greedy tokens one
        forward at a time: the same calls the engines' generate makes, so the same bits."""
        e = self.engine
        extra = {} if inject is None else {"inject": inject}
        cache = e.new_cache()
        logits = []
        if k:
            logits.append(e.prefill(ids[:k], cache, chunk=chunk, capture=capture, **extra))
            cache = cache.copy()
            rest = ids[k:]
        else:
            rest = ids
        logits.append(e.prefill(rest, cache, chunk=chunk, capture=capture, **extra))
        out = []
        for i in range(n):
            tok = int(np.argmax(logits[-1][-1]))
            out.append(tok)
            if on_token is not None:
                on_token(i, tok)
            if i + 1 == n:
                break
            logits.append(e.forward([tok], cache, capture, **extra))
        return out, np.concatenate(logits)


def unfired_warning(side: Side, name: str | None = None) -> str | None:
    """The warning for a side whose injection never fired in its last run (None when it fired or has none)."""
    if side.fired is not False:
        return None
    who = f"side {name} ({side.spec})" if name else str(side.spec)
    inj = side.options["inject"]
    return (f"{who}: the injection did not fire: the run never reached layer {inj.layer}, position {inj.pos} "
            f"(the prompt and the generated tokens fill positions 0..{side.positions - 1})")


def open_side(spec, checkpoint) -> Side:
    """A Side from a SPEC string or a parsed SideSpec."""
    return Side(spec if isinstance(spec, SideSpec) else parse_spec(spec), checkpoint)
