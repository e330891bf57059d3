"""Where the tools' words go: results to stdout, errors and progress to stderr, tables never cut.

Every command of the `oracle` CLI prints through these helpers, so one rule holds everywhere:
- `out()` is stdout; into a pipe or a file it is drawn wide (no terminal width to respect) and without
  colour codes; in a terminal it keeps the terminal's width.
- `err()` is stderr (errors, warnings, progress bars); a progress bar is drawn only on a terminal.
- `table(...)` makes a rich Table whose columns fold long cells onto more lines instead of cutting
  them with an ellipsis: nothing a user needs (a stage name, a hash) is ever shortened.
- `error(msg, as_json)` reports a failure: prose on stderr, or under `--json` one JSON object
  {"error": msg} on stdout (a script parsing the JSON gets JSON); the caller returns exit code 2.
"""
from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

PIPE_WIDTH = 240   # a pipe has no width; wide enough for every table the tools draw


def _console(stream_is_err: bool) -> Console:
    stream = sys.stderr if stream_is_err else sys.stdout
    c = Console(stderr=stream_is_err, file=stream, highlight=False)
    if not c.is_terminal:
        c = Console(stderr=stream_is_err, file=stream, width=PIPE_WIDTH, no_color=True, highlight=False,
                    soft_wrap=False)
    return c


def out() -> Console:
    """stdout (looked up at each call, so a test's captured stdout is honoured)."""
    return _console(False)


def err() -> Console:
    """stderr: errors, warnings, progress."""
    return _console(True)


def table(*columns: str, title: str | None = None, **kwargs) -> Table:
    """A rich Table whose cells fold instead of being cut ("cpu:threa…" never happens)."""
    t = Table(title=title, **kwargs)
    for name in columns:
        t.add_column(name, overflow="fold")
    return t


def add_column(t: Table, name: str, **kwargs) -> None:
    """add_column with folding as the default overflow."""
    kwargs.setdefault("overflow", "fold")
    t.add_column(name, **kwargs)


def error(message: str, as_json: bool = False, **fields) -> int:
    """Report an error the one way: stderr prose, or a JSON object under --json. Returns 2 (the exit code)."""
    if as_json:
        sys.stdout.write(json.dumps({"error": message, **fields}) + "\n")
        sys.stdout.flush()
    else:
        err().print(f"[red]error[/red]: {message}", markup=True, highlight=False, soft_wrap=True)
    return 2


def warn(message: str) -> None:
    err().print(f"[yellow]warning[/yellow]: {message}", highlight=False, soft_wrap=True)


def printable(text: str) -> str:
    """Decoded model text made safe for a table: control characters shown as escapes (\\x07, \\n)."""
    outs = []
    for ch in text:
        if ch == " " or (ch.isprintable() and ch not in "\x0b\x0c"):
            outs.append(ch)
        else:
            outs.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(outs)


def wide(console: Console) -> Console:
    """In a terminal, the console; into a pipe or file, one wide enough not to cut the tables."""
    if console.is_terminal:
        return console
    return Console(width=PIPE_WIDTH, no_color=True, highlight=False)
