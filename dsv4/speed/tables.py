"""docs/benchmarks.md's tables made from files of rows (dsv4/speed/rows.py): each table of the document
sits between `<!-- table: NAME -->` and `<!-- end table -->`, and everything between those two lines is
this module's -- a stamp line said from the rows (date, commit, card, packages, unit), then the table.
The text around the tables is written by hand.

A table's rows are those of its name in every file, oldest first (by stamp date and time, then file name,
then line). Rows of the same case make one line of the table: a newer row's figure replaces an older
one's in its column, and a column only an older row has keeps that row's figure, so a table may hold
figures of several runs; its stamp line then says which rows or columns each run gave. Columns appear
as the rows list them; a row's `fastest` columns show their least figure in bold.
"""
from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any

from dsv4.speed.rows import read

BLOCK = re.compile(r"(?P<open><!-- table: (?P<name>[^>]*?) -->\n)(?P<body>.*?)(?P<close><!-- end table -->)", re.S)


def load(folder: str | Path) -> list[dict]:
    """Every row of every `*.jsonl` file under `folder`, oldest first."""
    rows = [r for p in sorted(Path(folder).rglob("*.jsonl")) for r in read(p)]
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["stamp"]["date"], rows[i]["stamp"].get("time", ""), i))
    return [rows[i] for i in order]


# ---- one table ------------------------------------------------------------------------------------
def merge(rows: list[dict]) -> tuple[list[str], list[dict], list[dict]]:
    """(columns, lines, made_by): per case, the line {column: value} and {column: the row that gave it}."""
    columns: list[str] = []
    lines: dict[str, dict] = {}
    given: dict[str, dict] = {}
    for r in rows:
        for i, c in enumerate(r["columns"]):          # a new column goes before the next one the table has
            if c not in columns:
                after = [columns.index(d) for d in r["columns"][i + 1:] if d in columns]
                columns.insert(after[0] if after else len(columns), c)
        key = json.dumps(r["case"], sort_keys=True)
        lines.setdefault(key, dict(r["case"])).update(r["ours"] | r["peers"])
        given.setdefault(key, {}).update({c: r for c in [*r["ours"], *r["peers"]]})
    return columns, list(lines.values()), list(given.values())


def cell(v: Any) -> str:
    """A value as a table shows it: numbers as stored, a list as "a / b", no figure as "-"."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, list):
        return " / ".join(cell(x) for x in v)
    if isinstance(v, float) and v != 0 and abs(v) < 1e-3:
        return f"{v:.3g}"
    return str(v).replace("|", "\\|")


def least(line: dict, made_by: dict) -> set[str]:
    """The columns of a line to show in bold: the least figure of the `fastest` columns its rows name."""
    names = {c for r in made_by.values() for c in r.get("fastest", ())}
    figures = {c: line[c] for c in names if isinstance(line.get(c), (int, float)) and not isinstance(line[c], bool)}
    low = min(figures.values(), default=None)
    return {c for c, v in figures.items() if v == low}


def markdown(columns: list[str], lines: list[dict], made_by: list[dict]) -> str:
    out = ["| " + " | ".join(c.replace("|", "\\|") for c in columns) + " |", "|" + "---|" * len(columns)]
    for line, by in zip(lines, made_by):
        bold = least(line, by)
        out.append("| " + " | ".join(f"**{cell(line.get(c))}**" if c in bold else cell(line.get(c))
                                     for c in columns) + " |")
    return "\n".join(out)


def card_said(card: dict) -> str:
    what = [card.get("sm"), f"{card['sms']} SMs" if card.get("sms") else None,
            f"{card['cores']} cores" if card.get("cores") else None]
    what = ", ".join(w for w in what if w)
    return f"{card['name']}{f' ({what})' if what else ''}"


def place(s: dict) -> str:
    """A stamp's card and packages in words."""
    packages = ", ".join(f"{k} {v}" for k, v in s["packages"].items())
    return card_said(s["card"]) + (f" with {packages}" if packages else "")


def said(s: dict, *, placed: bool = True) -> str:
    """A stamp in words: its date and commit, and (`placed`) its card and packages."""
    return f"{s['date']} at {s['commit']}" + (f" on {place(s)}" if placed else "")


def spans(numbers: list[int]) -> str:
    """[1, 2, 3, 5] -> "1–3, 5"."""
    out, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}–{n}")
            start = None
    return ", ".join(out)


def stamp_line(made_by: list[dict], columns: list[str]) -> str:
    """Which run measured what: one stamp for the whole table, or each with the rows or columns it gave (the
    card and packages said once where every run shares them)."""
    runs: dict[str, dict] = {}
    for i, by in enumerate(made_by, 1):
        for c, r in by.items():
            run = runs.setdefault(json.dumps(r["stamp"], sort_keys=True), {"stamp": r["stamp"], "cells": set()})
            run["cells"].add((i, c))
    units = list(dict.fromkeys(r["unit"] for by in made_by for r in by.values() if r["unit"]))
    unit = f"; figures in {', '.join(units)}" if units else ""
    runs = dict(sorted(runs.items(), key=lambda kv: (kv[1]["stamp"]["date"], kv[1]["stamp"].get("time", ""))))
    stamps = [run["stamp"] for run in runs.values()]
    if len(stamps) == 1:
        return wrap(f"Measured {said(stamps[0])}{unit}.")
    shared = all((s["card"], s["packages"]) == (stamps[0]["card"], stamps[0]["packages"]) for s in stamps)
    every = {(i, c) for i, by in enumerate(made_by, 1) for c in by}
    parts = [f"{cells_said(run['cells'], every, columns)} measured {said(run['stamp'], placed=not shared)}"
             for run in runs.values()]
    text = "; ".join(parts) + (f"; all on {place(stamps[0])}" if shared else "")
    return wrap(f"{text[0].upper()}{text[1:]}{unit}.")


def cells_said(cells: set, every: set, columns: list[str]) -> str:
    """The cells (row, column) a run gave, in words: rows 1–3; column "x"; rows 2–3 and row 1's "x", "y"."""
    rows = sorted({i for i, _ in cells})
    cols = [c for c in columns if any(c == d for _, d in cells)]
    whole = [i for i in rows if {ic for ic in every if ic[0] == i} <= cells]
    if whole == rows:
        return f"row{'s' if len(rows) > 1 else ''} {spans(rows)}"
    if {ic for ic in every if ic[1] in cols} == cells:
        return f"column{'s' if len(cols) > 1 else ''} " + ", ".join(f'"{c}"' for c in cols)
    parts = [f"row{'s' if len(whole) > 1 else ''} {spans(whole)}"] if whole else []
    parts += [f"row {i}'s " + ", ".join(f'"{c}"' for c in cols if (i, c) in cells) for i in rows if i not in whole]
    return " and ".join(parts)


def wrap(text: str, width: int = 118) -> str:
    import textwrap

    return textwrap.fill(text, width=width, break_long_words=False, break_on_hyphens=False)


def render(name: str, rows: list[dict]) -> str:
    """The body of table `name`'s block: its stamp line, a blank line, the table."""
    mine = [r for r in rows if r["table"] == name]
    if not mine:
        raise ValueError(f"no rows of the table {name!r}")
    columns, lines, made_by = merge(mine)
    return f"{stamp_line(made_by, columns)}\n\n{markdown(columns, lines, made_by)}\n"


# ---- the document ---------------------------------------------------------------------------------
def names(text: str) -> list[str]:
    return [m["name"] for m in BLOCK.finditer(text)]


def regenerate(text: str, rows: list[dict]) -> str:
    """`text` with every table block's body made from `rows`; a block whose table has no rows is refused."""
    missing = sorted({n for n in names(text) if not any(r["table"] == n for r in rows)})
    if missing:
        raise ValueError(f"the document's tables {missing} have no rows; the rows hold "
                         f"{sorted({r['table'] for r in rows})}")
    return BLOCK.sub(lambda m: m["open"] + render(m["name"], rows) + m["close"], text)


def differences(text: str, rows: list[dict]) -> dict[str, str]:
    """Per table whose block differs from what the rows make: a unified diff, document first."""
    out = {}
    for m in BLOCK.finditer(text):
        want = render(m["name"], rows)
        if m["body"] != want:
            out[m["name"]] = "".join(difflib.unified_diff(m["body"].splitlines(True), want.splitlines(True),
                                                          "the document", "the rows"))
    return out
