"""The `oracle` command's front as a new user meets it: one SPEC parser, errors on stderr (or one JSON
object under --json) with exit 2 and no traceback, one --max-new rule, help with defaults, tables and
hashes never cut in a pipe, streamed tokens with the same bits as a plain run.

The commands run as subprocesses of this worktree's code (`python -m tools`), stdout and stderr piped.
They use the CPU engine and 2-3 new tokens where the oracle is not the point, to stay fast.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "golden" / "tiny-bf16")


def _have_cpu() -> bool:
    return importlib.util.find_spec("fast._core") is not None


needs_cpu = pytest.mark.skipif(not _have_cpu(), reason="the CPU engine (fast._core) is not built")


def oracle(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "tools", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


def assert_error(p, *words, as_json=False):
    """Exit 2, no traceback; the message (naming `words`) on stderr, or as one JSON object on stdout."""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    if as_json:
        doc = json.loads(p.stdout)                    # the whole of stdout is one JSON object
        assert "error" in doc, doc
        text = doc["error"]
    else:
        assert p.stdout == "", p.stdout               # errors never go to stdout
        text = p.stderr
    for w in words:
        assert w in text, (w, text)
    return text


def run_json(*args):
    p = oracle("run", "--checkpoint", TINY, "--json", *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


# -- one SPEC parser --------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, option, listed, as_json", [
    ("cpu:bogus=3", "bogus", "threads", False),               # unknown: the cpu engine's options listed
    ("oracle:bogus=3", "bogus", "precision", True),           # was silently ignored
    ("cpu:precision=float64", "precision", "oracle", False),  # another engine's option: who takes it
])
def test_run_refuses_an_option_the_engine_does_not_take(spec, option, listed, as_json):
    args = ["run", "--checkpoint", TINY, "--engine", spec, "--max-new", "2"] + (["--json"] if as_json else [])
    assert_error(oracle(*args), option, listed, as_json=as_json)


@needs_cpu
def test_run_honours_chunk_prefix_cache_and_batch_with_the_same_bits():
    plain = run_json("--engine", "cpu", "--max-new", "3")
    for spec in ("cpu:chunk=5", "cpu:prefix-cache=7", "cpu:batch=2"):
        other = run_json("--engine", spec, "--max-new", "3")
        assert other["engine"] == spec
        assert (other["output_hash"], other["logits_hash"]) == (plain["output_hash"], plain["logits_hash"]), spec


def test_precision_float64_is_the_oracles_only():
    assert_error(oracle("run", "--checkpoint", TINY, "--engine", "cpu", "--precision", "float64"),
                 "--precision float64", "oracle")
    assert_error(oracle("run", "--checkpoint", TINY, "--engine", "oracle:precision=float64", "--precision",
                        "canonical", "--json"), "contradicts", as_json=True)


def test_precision_float64_is_honoured_and_labelled():
    from tools import bench
    from tools.sides import parse_spec, with_precision
    spec = with_precision(parse_spec("oracle"), "float64")
    assert spec.options["precision"] == "float64" and str(spec) == "oracle:precision=float64"
    side, = bench.open_engines(TINY, ["oracle:precision=float64"])
    assert side.engine.P.name == "float64" and str(side.spec) == "oracle:precision=float64"


def test_engine_lists_split_only_before_an_engine_name():
    from tools.sides import split_specs
    assert split_specs(["oracle,cpu:threads=2,batch=3", "cuda"]) == ["oracle", "cpu:threads=2,batch=3", "cuda"]
    assert split_specs("cpu:inject=1,3,kda.o,0,1,chunk=4,oracle:chunk=2") == [
        "cpu:inject=1,3,kda.o,0,1,chunk=4", "oracle:chunk=2"]


def test_the_engines_keywords_of_the_docs_parse():
    from tools.sides import SideError, parse_spec
    assert parse_spec("cpu:ranks=2,verify-ranks,memory-limit=1024").options == {
        "ranks": 2, "verify-ranks": True, "memory-limit": 1024}           # docs/ep.md: --engine cpu:ranks=2
    for bad in ("oracle:ranks=2", "cpu:verify-ranks=1", "cpu:ranks=0"):
        with pytest.raises(SideError):
            parse_spec(bad)


@needs_cpu
def test_engine_keywords_reach_the_engine():
    from tools.sides import open_side
    assert open_side("cpu:max-context=64,threads=1", TINY).engine.max_context == 64


@needs_cpu
def test_bench_keeps_each_spec_whole_and_prints_it_uncut_into_a_pipe():
    long_spec = "cpu:threads=1,chunk=4,dot=canonical,expf=canonical"
    p = oracle("bench", "--checkpoint", TINY, "--engines", f"cpu,{long_spec}", "--prompt-len", "12", "--new", "3")
    assert p.returncode == 0, p.stderr
    assert long_spec in p.stdout and "\u2026" not in p.stdout
    p = oracle("bench", "--checkpoint", TINY, "--engines", "cpu", long_spec, "--prompt-len", "12", "--new", "3",
               "--json")
    assert [e["engine"] for e in json.loads(p.stdout)["engines"]] == ["cpu", long_spec]


def test_bench_refuses_what_it_cannot_honour():
    assert_error(oracle("bench", "--checkpoint", TINY, "--engines", "cpu:batch=3"), "batch", "threads")
    assert_error(oracle("bench", "--checkpoint", TINY, "--prompt", "12"), "--prompt-len")


def test_golden_and_trace_use_the_same_parser(tmp_path):
    assert_error(oracle("golden", "check", "--engine", "cpu:chunk=0", "--json"), "chunk", as_json=True)
    assert_error(oracle("trace", "--checkpoint", TINY, "--a", "cpu:bogus", "--out", str(tmp_path / "t.json")),
                 "bogus", "threads")


# -- errors -----------------------------------------------------------------------------------------

def test_errors_go_to_stderr_or_json_never_prose_on_stdout(tmp_path):
    missing = str(tmp_path / "nothing-here")
    assert_error(oracle("run", "--checkpoint", missing, "--engine", "cpu", "--ids", "1,2"), "nothing-here")
    assert_error(oracle("run", "--checkpoint", TINY, "--engine", "cpu", "--ids", "1,x", "--json"),
                 "--ids", as_json=True)


def test_usage_errors_exit_2_and_are_json_under_json():
    p = oracle("run", "--checkpoint", TINY, "--max-new", "many", "--json")
    assert_error(p, "--max-new", as_json=True)
    assert "usage:" in p.stderr
    p = oracle("bench", "--no-such-flag")
    assert p.returncode == 2 and p.stdout == "" and "usage:" in p.stderr


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    from tools import cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "cmd_run", interrupted)
    assert cli.main(["run", "--checkpoint", TINY]) == 130
    got = capsys.readouterr()
    assert got.err.strip() == "interrupted" and got.out == ""


def test_a_bug_is_reported_as_an_internal_error_with_its_traceback(monkeypatch, capsys):
    from tools import cli

    def broken(args):
        raise RuntimeError("a bug")
    monkeypatch.setattr(cli, "cmd_run", broken)
    assert cli.main(["run", "--checkpoint", TINY, "--json"]) == 2
    got = capsys.readouterr()
    assert json.loads(got.out) == {"error": "internal error: RuntimeError: a bug"} and "Traceback" in got.err


# -- one --max-new rule, inputs that would do nothing -----------------------------------------------

@pytest.mark.parametrize("command, n", [(["run", "--engine", "cpu"], "0"), (["run", "--engine", "oracle"], "-1"),
                                        (["diff", "--a", "cpu", "--b", "cpu"], "0"),
                                        (["trace", "--a", "cpu", "--out", "unused.json"], "-1")])
def test_max_new_must_be_at_least_one_everywhere(command, n):
    p = oracle(*command, "--checkpoint", TINY, "--max-new", n)
    assert_error(p, "--max-new", ">= 1")
    assert "usage:" in p.stderr


def test_max_new_defaults_to_the_same_number_everywhere():
    from tools.cli import build_parser
    from tools.prompts import DEFAULT_NEW, prompt_ids
    side = SimpleNamespace(config=SimpleNamespace(vocab_size=300))
    p = build_parser()
    for argv in (["run"], ["diff", "--a", "cpu", "--b", "cpu"], ["trace", "--a", "cpu"]):
        args = p.parse_args(argv + ["--checkpoint", TINY, "--ids", "1,2"])
        assert prompt_ids(args, side) == ([1, 2], DEFAULT_NEW), argv
        args = p.parse_args(argv + ["--checkpoint", TINY])          # the canonical prompt
        assert prompt_ids(args, side)[1] == DEFAULT_NEW, argv


@pytest.mark.parametrize("command", [["run", "--engine", "cpu"], ["diff", "--a", "cpu", "--b", "cpu"]])
def test_ids_and_prompt_together_are_refused(command):
    assert_error(oracle(*command, "--checkpoint", TINY, "--ids", "1", "--prompt", "hi"), "--ids", "--prompt")


@needs_cpu
def test_an_injection_that_never_fires_warns():
    far = "cpu:inject=0,100,embed,0,1"               # position 100 of a 40-token prompt + 2 new
    p = oracle("run", "--checkpoint", TINY, "--engine", far, "--max-new", "2")
    assert p.returncode == 0 and "did not fire" in p.stderr and "did not fire" not in p.stdout
    doc = run_json("--engine", far, "--max-new", "2")
    assert any("did not fire" in w for w in doc["warnings"])
    near = run_json("--engine", "cpu:inject=0,3,embed,0,1", "--max-new", "2")   # fires: no warning
    assert "warnings" not in near and near["logits_hash"] != doc["logits_hash"]
    d = oracle("diff", "--checkpoint", TINY, "--a", "cpu", "--b", far, "--max-new", "2", "--json")
    assert d.returncode == 0, d.stderr
    assert any("did not fire" in w for w in json.loads(d.stdout)["warnings"])
    text = oracle("diff", "--checkpoint", TINY, "--a", "cpu", "--b", far, "--max-new", "2")
    verdict = [line for line in text.stdout.splitlines() if line.startswith("IDENTICAL")]
    assert text.returncode == 0 and verdict and "did not fire" in verdict[0], text.stdout


@needs_cpu
def test_a_prefix_cache_as_long_as_the_prompt_is_refused():
    assert_error(oracle("run", "--checkpoint", TINY, "--engine", "cpu:prefix-cache=100", "--max-new", "2"),
                 "prefix-cache=100", "40")
    assert_error(oracle("run", "--checkpoint", TINY, "--engine", "cpu:prefix-cache=3", "--ids", "1,2,3",
                        "--max-new", "2", "--json"), "prefix-cache=3", as_json=True)


# -- help, version ----------------------------------------------------------------------------------

def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_option_has_help_and_shows_its_default():
    from tools.cli import build_parser
    for name, sp in _subparsers(build_parser()):
        if name == "make-checkpoint":                  # its own parser (tools.zoo)
            continue
        text = " ".join(sp.format_help().split())
        for a in sp._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
                continue
            assert a.help, f"oracle {name} {a.option_strings[0]} has no help"
            if a.default not in (None, False, argparse.SUPPRESS):
                shown = ",".join(map(str, a.default)) if isinstance(a.default, list) else str(a.default)
                assert f"default: {shown}" in text or "default" in a.help, (name, a.option_strings[0])
    run_help = oracle("run", "--help")
    assert run_help.returncode == 0 and "(default: 8)" in " ".join(run_help.stdout.split())


def test_version_is_the_packages():
    want = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    p = oracle("--version")
    assert p.returncode == 0 and want in p.stdout.split()


# -- what run prints --------------------------------------------------------------------------------

def _table_hashes(stdout: str) -> tuple[str, str]:
    found = dict(re.findall(r"(output_hash|logits_hash)\s*\S\s*([0-9a-f]{12})\b", stdout))
    return found.get("output_hash"), found.get("logits_hash")


@needs_cpu
def test_run_in_a_pipe_streams_the_same_bits_and_prints_full_hashes_and_safe_text():
    doc = run_json("--engine", "cpu", "--max-new", "2")
    # the canonical prompt's 2 new tokens decode to a control byte: the table must not print it raw
    assert any(not ch.isprintable() for ch in doc["text"])
    p = oracle("run", "--checkpoint", TINY, "--engine", "cpu", "--max-new", "2")
    assert p.returncode == 0, p.stderr
    assert _table_hashes(p.stdout) == (doc["output_hash"], doc["logits_hash"])
    assert all(ch == "\n" or ch.isprintable() for ch in p.stdout), repr(p.stdout)


def test_streaming_gives_the_bits_of_the_engines_generate():
    from tools.sides import open_side
    ids = [1, 2, 3, 4]
    for spec in ("oracle", "cpu") if _have_cpu() else ("oracle",):
        side = open_side(spec, TINY)
        tokens, logits = side.generate(ids, 3)
        seen: list = []
        t2, l2 = side.generate(ids, 3, on_token=lambda i, t, seen=seen: seen.append((i, t)))
        assert tokens == t2 and seen == list(enumerate(tokens)), spec
        assert np.array_equal(np.asarray(logits).view(np.uint32), np.asarray(l2).view(np.uint32)), spec


# -- golden --------------------------------------------------------------------------------------------

@needs_cpu
def test_golden_progress_goes_to_stderr():
    p = oracle("golden", "check", "--engine", "cpu", "--json")
    assert p.returncode == 0, p.stderr
    assert "ran tiny-bf16/short" in p.stderr
    cases = len(json.loads((REPO / "golden" / "hashes.json").read_text())["cases"])
    assert json.loads(p.stdout) == {"action": "check", "engine": "cpu", "passed": True, "cases": cases,
                                    "mismatches": []}


# -- run: sampling (docs/sampling.md) ------------------------------------------------------------------

SAMPLED = ("--ids", "1,2,3", "--max-new", "6", "--temperature", "1.5", "--top-k", "40", "--top-p", "0.95")


def _reference(ids, n, **params):
    """oracle.sampling.sample_loop on the oracle itself, hashed as run hashes."""
    import oracle
    from oracle.sampling import SamplingParams, sample_loop
    from tools.golden import hash12
    tokens, lps = sample_loop(oracle.load(TINY), ids, n, SamplingParams(**params))
    return tokens, hash12(np.array(lps, np.float32), "<f4")


@needs_cpu
def test_run_sampled_is_the_oracles_sample_loop_on_every_engine_and_reproducible():
    docs = {e: run_json("--engine", e, "--seed", "7", *SAMPLED) for e in ("oracle", "cpu")}
    keys = ("tokens", "output_hash", "logits_hash", "logprobs_hash", "seed")
    assert {k: docs["oracle"][k] for k in keys} == {k: docs["cpu"][k] for k in keys}
    assert docs["cpu"]["seed"] == 7
    again = run_json("--engine", "cpu", "--seed", "7", *SAMPLED)
    assert {k: again[k] for k in keys} == {k: docs["cpu"][k] for k in keys}
    ref_tokens, ref_lp_hash = _reference([1, 2, 3], 6, temperature=1.5, top_k=40, top_p=0.95, seed=7)
    assert (docs["cpu"]["tokens"], docs["cpu"]["logprobs_hash"]) == (ref_tokens, ref_lp_hash)
    greedy = run_json("--engine", "cpu", "--ids", "1,2,3", "--max-new", "6")
    assert greedy["tokens"] != docs["cpu"]["tokens"]
    other = run_json("--engine", "cpu", "--seed", "8", *SAMPLED)
    assert other["tokens"] != docs["cpu"]["tokens"]


@needs_cpu
def test_run_without_a_seed_draws_one_that_reproduces_the_answer():
    first = run_json("--engine", "cpu", *SAMPLED)
    assert isinstance(first["seed"], int) and 0 <= first["seed"] < 2 ** 64
    again = run_json("--engine", "cpu", "--seed", str(first["seed"]), *SAMPLED)
    assert (again["tokens"], again["logprobs_hash"]) == (first["tokens"], first["logprobs_hash"])
    p = oracle("run", "--checkpoint", TINY, "--engine", "cpu", *SAMPLED)    # the table shows it too
    assert p.returncode == 0, p.stderr
    assert re.search(r"seed\s*\S\s*\d+", p.stdout), p.stdout


def test_run_greedy_reports_the_logprobs_of_the_sampling_definition():
    doc = run_json("--ids", "1,2,3", "--max-new", "4")
    assert "seed" not in doc                      # greedy uses no seed
    tokens, lp_hash = _reference([1, 2, 3], 4, temperature=0.0)
    assert (doc["tokens"], doc["logprobs_hash"]) == (tokens, lp_hash)


@pytest.mark.parametrize("option, value", [
    ("--temperature", "-0.5"), ("--temperature", "nan"), ("--temperature", "inf"),
    ("--top-p", "0"), ("--top-p", "1.5"), ("--top-p", "1e-50"), ("--top-k", "-1"), ("--top-k", "2.5"),
    ("--seed", "-1"), ("--seed", str(2 ** 64)),
])
@pytest.mark.parametrize("as_json", [False, True])
def test_run_refuses_bad_sampling_values_naming_the_option(option, value, as_json):
    p = oracle("run", "--checkpoint", TINY, "--temperature", "1", f"{option}={value}", *(["--json"] if as_json else []))
    assert_error(p, option, value, as_json=as_json)


@needs_cpu
def test_run_sampled_refuses_the_options_it_cannot_honour():
    for spec in ("cpu:batch=2", "cpu:chunk=2", "cpu:prefix-cache"):
        p = oracle("run", "--checkpoint", TINY, "--engine", spec, "--temperature", "1", "--seed", "1")
        assert_error(p, spec, "--temperature > 0")


def test_run_float64_stays_greedy_only_and_reports_no_logprobs():
    doc = run_json("--ids", "1,2,3", "--max-new", "2", "--precision", "float64")
    assert "logprobs_hash" not in doc and len(doc["tokens"]) == 2     # logprobs are defined on f32 logits
    p = oracle("run", "--checkpoint", TINY, "--precision", "float64", "--temperature", "1", "--seed", "3")
    assert_error(p, "--temperature > 0", "float64")
