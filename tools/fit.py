"""Tables that fit the width without cutting a cell: too many columns -> the table continues below.

A cell a user needs whole (a stage name, a 16-digit hash, a value with all its digits) is never
folded or shortened: when the columns do not fit the console's width, the leading key columns (what
identifies a row: the stage, or layer/pos/stage) are repeated and the other columns go on in a
second (third, ...) table, with a note saying so. A continuation may list only the rows that have
something to show there (`detail`), with a note too.
"""
from __future__ import annotations

from rich.table import Table
from rich.text import Text


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 row', '2 rows' (or `many` for irregular words)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def _cell_len(cell: str) -> int:
    return max((Text.from_markup(line).cell_len for line in str(cell).split("\n")), default=0)


def table_width(widths) -> int:
    """A rich Table's width (default box, padding 1 on each side, a border between columns)."""
    return sum(widths) + 3 * len(widths) + 1


def split_columns(widths: list[int], key: int, width: int) -> list[list[int]]:
    """Column indices of each part: the `key` first columns in every part, the rest packed in order."""
    parts: list[list[int]] = []
    cur = list(range(key))
    for i in range(key, len(widths)):
        if len(cur) > key and table_width([widths[j] for j in cur + [i]]) > width:
            parts.append(cur)
            cur = list(range(key))
        cur.append(i)
    parts.append(cur)
    return parts


def fit_tables(width: int, title: str, columns, rows, key: int = 1, detail=None,
               detail_what: tuple = ("row", "rows")) -> list:
    """Renderables (Tables and notes) showing `rows` under `columns` within `width` cells.

    columns: [(name, justify)]; rows: [[cell text (rich markup)]]; key: how many leading columns
    identify a row (repeated in every part); detail: per row, whether continuation tables list it
    (None: every row), described in the note as `detail_what` (singular, plural), e.g.
    ("stage that differs", "stages that differ"). With no detail row at all, the continuation
    columns are left out with a note (they would be empty).
    """
    names = [c[0] for c in columns]
    widths = [max([_cell_len(n) for n in [names[i]]] + [_cell_len(r[i]) for r in rows]) for i in range(len(names))]
    parts = split_columns(widths, key, width)
    out: list = []
    if detail is not None and not any(detail) and len(parts) > 1:
        dropped = [names[i] for p in parts[1:] for i in p[key:]]
        parts = parts[:1]
        note = f"(columns {', '.join(dropped)} left out: no {detail_what[1]})"
    else:
        note = None
    for k, cols in enumerate(parts):
        if k == 0:
            t = Table(title=title)
        else:
            t = Table(title=f"{title}, continued: {', '.join(names[i] for i in cols[key:])}")
        for i in cols:
            t.add_column(names[i], justify=columns[i][1], overflow="fold")
        keep = rows if k == 0 or detail is None else [r for r, d in zip(rows, detail) if d]
        for r in keep:
            t.add_row(*[r[i] for i in cols])
        out.append(t)
        if k + 1 < len(parts):
            nxt = parts[k + 1][key:]
            nd = sum(map(bool, detail or []))
            shown = "" if detail is None else f" (only the {nd} {detail_what[0] if nd == 1 else detail_what[1]})"
            out.append(Text(f"(too wide for {width} columns: {', '.join(names[i] for i in nxt)} in the next "
                            f"table{shown})", style="dim"))
    if note:
        out.append(Text(note, style="dim"))
    return out
