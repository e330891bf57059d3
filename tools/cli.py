"""The `oracle` command: demo, run, golden, bench, diff, trace, census, make-checkpoint.

Exit codes: 0 identical / passed, 1 differ / failed, 2 error (bad input, bad checkpoint, bad usage),
130 interrupted (Ctrl-C). Errors go to stderr; under --json an error is one JSON object {"error": ...}
on stdout, so a script parsing the output always gets JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

from . import term
from .prompts import DEFAULT_NEW, load_tokenizer, max_new, prompt_ids
from .sides import options_help

SPEC_HELP = options_help()   # from the one parser's table (tools/sides.py)


def golden_root() -> Path:
    """The bundled golden/ folder: $GLM_GOLDEN, ./golden of a checkout, or the copy installed with the package."""
    candidates = [os.environ.get("GLM_GOLDEN"), Path.cwd() / "golden",
                  Path(__file__).resolve().parent.parent / "golden", Path(__file__).resolve().parent / "_golden"]
    for c in candidates:
        if c and (Path(c) / "tiny-bf16" / "config.json").exists():
            return Path(c)
    raise FileNotFoundError("no golden/ folder with tiny-bf16 found (set GLM_GOLDEN or run from the repository)")


def version() -> str:
    """The version of the code that runs: the checkout's pyproject.toml when run from a checkout (an
    installed copy may be older), else the installed package's metadata."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.exists():
        import tomllib
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == "glm-exact" and "version" in project:
            return project["version"]
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed
    try:
        return installed("glm-exact")
    except PackageNotFoundError:
        return "unknown"


# -- the parser --------------------------------------------------------------------------------------

class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it has none (None, False) or says it already."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if ("default" in text or d is None or d is False or d is argparse.SUPPRESS or not action.option_strings
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        shown = ",".join(map(str, d)) if isinstance(d, (list, tuple)) else d
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


class CliParser(argparse.ArgumentParser):
    """argparse with one error rule: usage and message on stderr, exit 2, and under --json also the
    {"error": ...} object on stdout."""

    json_errors = False           # set by main() when --json is on the command line

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        if CliParser.json_errors:
            term.error(f"{self.prog}: {message}", as_json=True)
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


# -- commands --------------------------------------------------------------------------------------

class _Stream:
    """run's tokens as they come: text (or ids) on stdout in a terminal; a progress line on stderr when
    stdout is a pipe or file and stderr a terminal; nothing otherwise (the table follows at the end)."""

    def __init__(self, tokenizer, total: int):
        self.tokenizer, self.total, self.tokens, self.shown = tokenizer, total, [], ""
        self.to_stdout = term.out().is_terminal
        self.progress = not self.to_stdout and term.err().is_terminal

    def __call__(self, i: int, token: int) -> None:
        self.tokens.append(token)
        if self.to_stdout:
            if self.tokenizer is not None:
                text = term.printable(self.tokenizer.decode(self.tokens))
                piece, self.shown = text[len(self.shown):] if text.startswith(self.shown) else " " + text, text
            else:
                piece = f"{token} "
            sys.stdout.write(piece)
            sys.stdout.flush()
        elif self.progress:
            sys.stderr.write(f"\rgenerating: token {i + 1}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.to_stdout and self.tokens:
            sys.stdout.write("\n")
            sys.stdout.flush()
        elif self.progress and self.tokens:
            sys.stderr.write("\n")
            sys.stderr.flush()


# the SPEC options a sampled run honours: sample_loop feeds the engine one forward at a time on one
# cache, so batch, chunk, prefix-cache and inject (which shape the greedy run's calls) are refused
SAMPLED_OPTIONS = ("threads", "dot", "expf", "precision", "ranks", "memory-limit", "verify-ranks", "max-context")


class _Recorder:
    """An engine seen through sample_loop: keeps every logits row (for logits_hash) and reports each
    token as it is fed back (streaming); the last token, never fed, is reported by the caller."""

    def __init__(self, engine, on_token):
        self.engine, self.on_token, self.rows, self.fed = engine, on_token, [], 0

    def new_cache(self):
        return self.engine.new_cache()

    def forward(self, ids, cache):
        if self.rows and self.on_token is not None:
            self.on_token(self.fed, int(ids[0]))
            self.fed += 1
        out = self.engine.forward(ids, cache)
        self.rows.append(out)
        return out


def cmd_run(args) -> int:
    import secrets

    import numpy as np

    from oracle.sampling import SamplingParams, log_softmax, sample_loop

    from .golden import hash12
    from .sides import open_side, parse_spec, refuse_options, unfired_warning, with_precision
    spec = with_precision(parse_spec(args.engine), args.precision)
    seed = args.seed if args.seed is not None else secrets.randbits(63)   # drawn and printed: reproducible
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed)
    if not params.greedy:
        refuse_options(spec, SAMPLED_OPTIONS, "run with --temperature > 0")
        if spec.options.get("precision", "canonical") != "canonical":
            raise ValueError(f"--temperature > 0: sampling is defined on the canonical float32 logits; "
                             f"{spec} has {spec.options['precision']} logits (run it greedily, or canonical)")
    side = open_side(spec, args.checkpoint)
    ids, n = prompt_ids(args, side)
    tokenizer = load_tokenizer(args.checkpoint)
    stream = None if args.json else _Stream(tokenizer, n)
    t0 = time.perf_counter()
    try:
        if params.greedy:
            tokens, logits = side.generate(ids, n, on_token=stream)
            # log-probabilities are defined on f32 logits only: a float64 oracle run reports none
            lps = ([log_softmax(logits[len(ids) - 1 + i])[t] for i, t in enumerate(tokens)]
                   if logits.dtype == np.float32 else None)
        else:
            rec = _Recorder(side.engine, stream)
            tokens, lps = sample_loop(rec, ids, n, params)
            if stream is not None:
                stream(len(tokens) - 1, tokens[-1])
            logits = np.concatenate(rec.rows)
    finally:
        if stream is not None:
            stream.close()
    dt = time.perf_counter() - t0
    result = {"engine": str(spec), "prompt_ids": ids, "tokens": tokens,
              "output_hash": hash12(np.array(tokens), "<i4"), "logits_hash": hash12(logits, "<f4")}
    if lps is not None:
        result["logprobs_hash"] = hash12(np.array(lps, np.float32), "<f4")
    if not params.greedy:
        result.update(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed)
    result["seconds"] = round(dt, 3)
    if tokenizer is not None:
        result["text"] = tokenizer.decode(tokens)
    msg = unfired_warning(side)
    if msg:
        result["warnings"] = [msg]
        term.warn(msg)
    if args.json:
        print(json.dumps(result))
        return 0
    t = term.table("field", "value", title=f"oracle run: {args.checkpoint} ({spec})")
    for k, v in result.items():
        if k == "warnings":
            continue
        t.add_row(k, term.printable(v) if k == "text" else str(v))
    term.out().print(t)
    return 0


def _sampling_value(field: str, parse):
    """An argparse type for one sampling option: the text parsed, then the range checked by the one
    definition of the sampler's parameters (oracle.sampling.SamplingParams), whose reason is given."""
    from oracle.sampling import SamplingError, SamplingParams

    def check(text: str):
        try:
            v = parse(text)
            SamplingParams(**{field: v})
        except (ValueError, SamplingError) as e:
            reason = str(e) if isinstance(e, SamplingError) else ("not an integer" if parse is int else "not a number")
            raise argparse.ArgumentTypeError(f"got {text!r}: {reason}") from None
        return v
    return check


def cmd_golden(args) -> int:
    from . import golden
    from .sides import open_side, parse_spec
    spec = parse_spec(args.engine)               # a bad SPEC fails before any checkpoint loads
    root = golden_root()
    golden.GOLDEN_DIR, golden.HASHES = root, root / "hashes.json"
    expected = golden.load_hashes() if args.action == "check" else None
    errc = term.err()
    got = golden.compute_all(lambda p: open_side(spec, p), progress=lambda k: errc.print(f"  ran {k}"))
    console = term.out()
    if args.action == "update":
        old = golden.load_hashes() if golden.HASHES.exists() else {}
        changes = golden.compare(old, got)
        golden.save_hashes(got)
        if changes:
            term.warn("golden hashes changed: the commit must say which numerics changed and why the new values "
                      "are the canonical ones")
        if args.json:
            print(json.dumps({"action": "update", "engine": str(spec), "wrote": str(golden.HASHES),
                              "cases": len(got), "changed": changes}))
            return 0
        console.print(f"wrote {golden.HASHES}")
        for line in changes:
            console.print(f"  changed: {line}")
        return 0
    diffs = golden.compare(expected, got)
    if args.json:
        print(json.dumps({"action": "check", "engine": str(spec), "passed": not diffs, "cases": len(got),
                          "mismatches": diffs}))
        return 1 if diffs else 0
    if diffs:
        for line in diffs:
            console.print(f"[red]MISMATCH[/red] {line}")
        return 1
    console.print(f"[green]golden check passed[/green]: {len(got)} cases identical ({spec})")
    return 0


def cmd_demo(args) -> int:
    from .demo import demo
    return demo(term.out(), golden_root())


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="oracle", description="GLM-5.3-Flash exact inference: the oracle, the engines and the tools "
                                             "that compare them. Exit codes: 0 identical/passed, 1 differ/failed, "
                                             "2 error, 130 interrupted.")
    p.add_argument("--version", action="version", version=f"oracle (glm-exact) {version()}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=CliParser)

    d = sub.add_parser("demo", help="run the bundled tiny checkpoint through the oracle and the CPU engine",
                       description="Run the bundled tiny-bf16 checkpoint through the oracle and the CPU engine and "
                                   "compare their hashes (exit 0 bit-identical, 1 differ). Takes no options.")
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("run", help="generate from a prompt, greedily or sampled",
                       description="Generate (greedily, or sampled with --temperature > 0 as docs/sampling.md defines "
                                   "it) and print the tokens, their text and the output, logits and logprobs "
                                   "hashes. Without --json the tokens stream as they are generated (on a terminal). "
                                   + SPEC_HELP + ".")
    r.add_argument("--checkpoint", required=True, help="checkpoint directory")
    prompt = r.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    prompt.add_argument("--ids", help="prompt token ids, comma-separated (default: the canonical 40-token `long` "
                                      "prompt)")
    r.add_argument("--max-new", type=max_new, default=DEFAULT_NEW, metavar="N", help="new tokens to generate, >= 1")
    r.add_argument("--engine", default="oracle", metavar="SPEC", help="the engine to run, e.g. oracle, cpu:threads=2")
    r.add_argument("--precision", default=None, choices=["canonical", "float64"],
                   help="the oracle's precision (same as oracle:precision=...; default canonical); float64 "
                        "removes every rounding and is the oracle's only")
    r.add_argument("--temperature", type=_sampling_value("temperature", float), default=0.0, metavar="T",
                   help="sampling temperature, >= 0; 0 is greedy (argmax)")
    r.add_argument("--top-p", type=_sampling_value("top_p", float), default=1.0, metavar="P", help="nucleus cut, in (0, 1]; 1 keeps every token")
    r.add_argument("--top-k", type=_sampling_value("top_k", int), default=0, metavar="K", help="keep the K likeliest tokens; 0 keeps every token")
    r.add_argument("--seed", type=_sampling_value("seed", int), default=None, metavar="S",
                   help="the sampler's seed, in [0, 2^64) (default: one drawn at random and printed)")
    r.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    r.set_defaults(func=cmd_run)

    g = sub.add_parser("golden", help="check or update golden/hashes.json",
                       description="Run the canonical prompts on the tiny checkpoints (tiny-bf16, -fp8, -mxfp4) and "
                                   "compare with golden/hashes.json (check: exit 0 identical, 1 a hash differs) or "
                                   "rewrite it (update). Progress goes to stderr. " + SPEC_HELP + ".")
    g.add_argument("action", choices=["check", "update"], help="check the hashes, or rewrite them")
    g.add_argument("--engine", default="oracle", metavar="SPEC", help="the engine to run, e.g. cpu or cuda")
    g.add_argument("--json", action="store_true", help="one JSON object on stdout instead of prose")
    g.set_defaults(func=cmd_golden)

    m = sub.add_parser("make-checkpoint", help="write a synthetic zoo checkpoint (see make-checkpoint --help)",
                       add_help=False)
    m.add_argument("rest", nargs=argparse.REMAINDER)
    m.set_defaults(func=lambda args: 0)

    from . import bench, census, diff, serve, trace  # the tools register their own parsers
    console = term.out()
    for tool in (diff, trace, census, bench, serve):
        tool.register(sub, console)
    return p


def _check_common(parser, args) -> None:
    """The rules every command shares, whichever module registered its parser."""
    for action in parser._subparsers._group_actions:            # report under the command's own usage
        parser = action.choices.get(args.command, parser)
    if getattr(args, "ids", None) is not None and getattr(args, "prompt", None) is not None:
        parser.error("argument --ids: not allowed with argument --prompt (give one)")
    n = getattr(args, "max_new", None)
    if n is not None and not isinstance(n, bool) and n < 1:
        parser.error(f"argument --max-new: must be >= 1 (the number of tokens to generate), got {n}")


def _user_errors() -> tuple:
    """Exceptions that are the input's fault: reported in one line (or one JSON object), exit 2."""
    return (ValueError, OSError, ImportError, KeyError)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["make-checkpoint"]:              # its own parser, --help included
        from .zoo import main_make_checkpoint
        return main_make_checkpoint(argv[1:]) or 0
    CliParser.json_errors = "--json" in argv
    as_json = CliParser.json_errors
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        _check_common(parser, args)
        return args.func(args)
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return 130
    except BrokenPipeError:                          # `oracle ... | head`: the reader left
        devnull = os.open(os.devnull, os.O_WRONLY)   # so the interpreter's last flush does not fail too
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except _user_errors() as e:
        msg = str(e) if not isinstance(e, KeyError) else f"{e.args[0] if e.args else e}"
        return term.error(msg or type(e).__name__, as_json)
    except Exception as e:  # noqa: BLE001 - a bug: the traceback for the report, and still one error object
        traceback.print_exc()
        return term.error(f"internal error: {type(e).__name__}: {e}", as_json)


if __name__ == "__main__":
    sys.exit(main())
