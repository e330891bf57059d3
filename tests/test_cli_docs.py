"""docs/cli.md's examples are run and their output compared: a documented command that no longer prints
what the page says fails here.

An example is a fenced block marked ```console whose first line is `$ oracle ...`; the rest of the block
is the expected output (stdout and stderr together, in the order they were written, as a terminal
shows them). Before comparing, both
sides are normalized for what legitimately varies between runs and machines: timings (numbers followed by
s, ms, tok/s, tokens/s), table borders and runs of blank space; and a value the page writes as `…` (a
bare timing in a table cell, say) matches any one word. Hashes, token ids, stage names, ULP counts and
verdicts are compared exactly. A block marked ```console-unchecked is shown but not run (e.g. it
needs a GPU or writes gigabytes); the test counts them so that most examples stay checked."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cli.md"

BLOCK = re.compile(r"^```console\n(.*?)^```", re.S | re.M)
TIMING = re.compile(r"\d[\d,]*(\.\d+)?\s*(tok/s|tokens/s|ms|s)\b")
BORDERS = re.compile(r"[\u2500-\u257f\u2580-\u259f]+")


def normalize(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        line = TIMING.sub("<T>", line)
        line = BORDERS.sub(" ", line)
        line = " ".join(line.split())
        if line:
            out.append(line)
    return out


def matches(expected_line: str, line: str) -> bool:
    """Equal, where each `…` word of the expected line stands for any one word."""
    pattern = r"\S+".join(re.escape(part) for part in expected_line.split("…"))
    return re.fullmatch(pattern, line) is not None


def examples() -> list[tuple[str, str]]:
    doc = DOC.read_text()
    found = []
    for m in BLOCK.finditer(doc):
        lines = m.group(1).splitlines()
        assert lines and lines[0].startswith("$ oracle "), f"a console block must start with `$ oracle`: {lines[:1]}"
        found.append((lines[0][2:], "\n".join(lines[1:])))
    return found


def test_the_page_has_examples():
    assert len(examples()) >= 3


def run_example(command: str, scratch: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(command.replace("/tmp/glm-", f"{scratch}/glm-"))
    assert argv[0] == "oracle"
    # one pipe for stdout and stderr, unbuffered: the lines come in the order they were written, as a
    # terminal shows them (a warning before the table it belongs to, progress before the verdict)
    env = dict(os.environ, COLUMNS="100", NO_COLOR="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "tools", *argv[1:]], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)


def test_examples_print_what_the_page_shows():
    # One test, the examples in page order: later examples read what earlier ones wrote (trace files),
    # which separate tests spread over xdist workers could not guarantee. Files the page writes under
    # /tmp/glm-* go to this test's own folder, so concurrent runs do not share them.
    # a short folder name: the page's lines must not grow past the pipe's width because of it
    scratch = Path(tempfile.mkdtemp(prefix="gd", dir="/tmp"))
    failures = []
    try:
        for command, expected in examples():
            r = run_example(command, scratch)
            got = normalize(r.stdout.replace(f"{scratch}/glm-", "/tmp/glm-"))
            want = normalize(expected)
            if not (len(got) == len(want) and all(matches(w, g) for w, g in zip(want, got))):
                failures.append(f"`{command}` (exit {r.returncode}) printed:\n{r.stdout}\ndocs/cli.md shows:\n{expected}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert not failures, f"{len(failures)} of {len(examples())} examples differ:\n\n" + "\n\n".join(failures)


def test_normalize_keeps_what_matters():
    a = normalize("│ cpu │ 18 253 │ fb8bb4369008 │ 3067.2 │ 0.53 s\n\n")
    b = normalize("| cpu   | 18 253 | fb8bb4369008 | 12.5 | 9.99 s")
    assert a != b  # borders differ in kind ('|' is kept): a real change of layout is seen
    assert normalize("│ cpu │ 18 253 │ fb8bb4369008 │ 3067.2 tok/s") == normalize("│ cpu  │ 18 253 │ fb8bb4369008 │ 1.0 tok/s")
    assert normalize("hash fb8bb4369008") != normalize("hash fb8bb4369009")
    assert matches("seconds …", "seconds 0.011") and not matches("seconds …", "seconds 0.011 extra")
    assert not matches("hash fb8bb4369008", "hash fb8bb4369009")
