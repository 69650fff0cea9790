"""Measurements as rows: every figure `mode=bench` and `bench/layer_table.py` measure is also appended, one
JSON line a row, to a file of rows stamped with when, at which commit, on which card and with which packages
it was measured. docs/benchmarks.md's tables are made from such files (dsv4/speed/tables.py), so a figure
in the document is always one a run wrote down, never one copied by hand.

A row (one JSON object):
  table    the table's name, e.g. "grid/dsv4_flash/decode"
  case     {column: value}: what was measured (the point, the option, the shape)
  ours     {column: value}: our figures, and what is computed from them (ratios, checks)
  peers    {column: value}: the figures of others beside them (the engines, the vendors' kernels)
  columns  the table's columns in order: the case's, then ours and the peers' interleaved as printed
  unit     the unit of the figures whose column does not name its own (e.g. "µs"), or null
  fastest  optional: columns that time the same work by different means; the table marks the least
  stamp    {"date": "YYYY-MM-DD", "time": "HH:MM:SS" (UTC; absent where a row was taken from a document),
            "commit": a short hash, or "dsv4 <version>" outside a git checkout,
            "card": {"name", "sm", "sms"} (a CPU: {"name": "CPU", "cores"}),
            "packages": {distribution: version} of those installed}
A value is a number, a string, a list of them (a table shows it as "a / b"), true/false or null (no figure).
A measured float keeps 4 significant digits (and a tenth at least): no timing here is steadier than that.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

PACKAGES = ("torch", "triton", "sgl-flash-mla", "sgl-deep-gemm", "flashinfer-python")
FIELDS = ("table", "case", "ours", "peers", "columns", "unit", "stamp")
DIGITS = 4                                    # significant digits a measured float keeps


# ---- a row ----------------------------------------------------------------------------------------
def value(v: Any) -> Any:
    """A cell as a row keeps it: numbers (a float to DIGITS significant digits, a tenth at least; a printed
    number read back), strings, lists of them, booleans, None (also for "", "-" and a float that is not finite)."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, (list, tuple)):
        return [value(x) for x in v]
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        text = v.strip()
        if text in ("", "-"):
            return None
        if re.fullmatch(r"-?\d+", text):
            return int(text)
        if re.fullmatch(r"-?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", text, re.I):
            return float(text)
        return text
    f = float(v)                              # a Python, numpy or 0-d torch number
    if not math.isfinite(f):
        return None
    return round(f, max(1, DIGITS - 1 - math.floor(math.log10(abs(f))))) if f else 0.0


def measurement(table: str, *, case: dict, ours: dict, peers: dict | None = None,
                columns: Iterable[str] | None = None, unit: str | None = "µs", fastest: Iterable[str] = ()) -> dict:
    """One measurement as a row (no stamp yet: the file it is written to adds it). `columns` default: the
    case's, ours, then the peers'."""
    peers = peers or {}
    out = {"table": table, "case": {k: value(v) for k, v in case.items()},
           "ours": {k: value(v) for k, v in ours.items()}, "peers": {k: value(v) for k, v in peers.items()},
           "columns": list(columns) if columns is not None else [*case, *ours, *peers], "unit": unit}
    if fastest:
        out["fastest"] = list(fastest)
    return out


def printed_rows(table: str, headers: list[str], cells: list[list], *, keys: int, peers: Iterable[str] = (),
                 unit: str | None = "µs", given: dict | None = None) -> list[dict]:
    """The rows of a printed table (headers, cells as `dsv4.reports.report.table` takes them): its first
    `keys` columns are the case, the columns named in `peers` the peers' figures, the rest ours; a line
    without a figure (a heading inside the table) is no row. `given`: case columns every row shares that
    the printed table leaves out (the step it was measured at)."""
    given, peers = given or {}, set(peers)
    out = []
    for cell in cells:
        named = list(zip(headers, cell))
        figures = named[keys:]
        if all(value(v) is None for _, v in figures):
            continue
        out.append(measurement(table, case=given | dict(named[:keys]), unit=unit,
                               ours={h: v for h, v in figures if h not in peers},
                               peers={h: v for h, v in figures if h in peers}, columns=[*given, *headers]))
    return out


def problems(r: Any) -> list[str]:
    """What is wrong with a row read back (nothing for a well-formed, stamped row)."""
    if not isinstance(r, dict):
        return ["not a JSON object"]
    out = [f"no {k}" for k in FIELDS if k not in r]
    if out:
        return out
    if not isinstance(r["table"], str) or not r["table"]:
        out.append("table: not a name")
    parts = [r["case"], r["ours"], r["peers"]]
    if not all(isinstance(p, dict) for p in parts):
        return out + ["case, ours and peers: not objects"]
    figures = [*r["ours"], *r["peers"]]
    if len(set(figures)) != len(figures) or set(figures) & set(r["case"]):
        out.append("a column is in two of case, ours and peers")
    if r["columns"] != [*r["case"], *[c for c in r["columns"] if c in figures]] or \
            sorted(r["columns"]) != sorted([*r["case"], *figures]):
        out.append("columns: not the case's columns followed by ours and the peers'")
    if not set(r.get("fastest", ())) <= set(figures):
        out.append("fastest: names a column that is not a figure")
    return out + stamp_problems(r["stamp"])


# ---- the stamp ------------------------------------------------------------------------------------
def stamp(*, date: str, commit: str, card: dict, packages: dict, time: str | None = None) -> dict:
    """When, at which commit, on which card and with which packages a row was measured."""
    out = {"date": date, "commit": commit, "card": dict(card), "packages": dict(packages)}
    if time is not None:
        out["time"] = time
    return out


def stamp_problems(s: Any) -> list[str]:
    if not isinstance(s, dict):
        return ["stamp: not an object"]
    out = [f"stamp: no {k}" for k in ("date", "commit", "card", "packages") if k not in s]
    if not out and not re.fullmatch(r"\d{4}-\d\d-\d\d", str(s["date"])):
        out.append(f"stamp: date {s['date']!r} is not YYYY-MM-DD")
    if not out and not (isinstance(s["card"], dict) and s["card"].get("name")):
        out.append("stamp: card has no name")
    return out


def commit_here() -> str:
    """The checkout's short commit (`git rev-parse --short HEAD`), or the installed package's version."""
    import subprocess
    from importlib import metadata

    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parents[2],
                           capture_output=True, text=True, timeout=10)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return f"dsv4 {metadata.version('dsv4')}"
    except metadata.PackageNotFoundError:
        return "dsv4"


def card_here() -> dict:
    """This machine's first CUDA card (name, sm, SM count), or its CPU (cores)."""
    import os

    import torch

    if not torch.cuda.is_available():
        return {"name": "CPU", "cores": os.cpu_count()}
    major, minor = torch.cuda.get_device_capability()
    return {"name": torch.cuda.get_device_name(), "sm": f"sm{major}{minor}",
            "sms": torch.cuda.get_device_properties(0).multi_processor_count}


def packages_here(names: Iterable[str] = PACKAGES) -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def stamp_here(now: datetime | None = None) -> dict:
    now = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return stamp(date=now.strftime("%Y-%m-%d"), time=now.strftime("%H:%M:%S"), commit=commit_here(),
                 card=card_here(), packages=packages_here())


# ---- files of rows --------------------------------------------------------------------------------
def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "x"


def file_name(s: dict) -> str:
    """<date>_<commit>_<card>.jsonl: one file per day, commit and card."""
    return f"{s['date']}_{slug(s['commit'])}_{slug(s['card']['name'])}.jsonl"


@dataclass(frozen=True, slots=True, kw_only=True)
class RowFile:
    """A file of rows under `folder`, named by its stamp; calling it appends rows (the folder is made at the
    first row, so a run that measures nothing leaves nothing)."""
    folder: Path
    stamp: dict

    @property
    def path(self) -> Path:
        return Path(self.folder) / file_name(self.stamp)

    def __call__(self, rows: list[dict]) -> None:
        if not rows:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r | {"stamp": self.stamp}, ensure_ascii=False) + "\n")


def open_rows(folder: str | Path, now: datetime | None = None) -> RowFile:
    """The rows of this run, stamped here and now (its card and packages read from this machine)."""
    return RowFile(folder=Path(folder), stamp=stamp_here(now))


def read(path: str | Path) -> list[dict]:
    """The rows of one file; a line that is not a well-formed row is refused, naming its file and line."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        bad = problems(r)
        if bad:
            raise ValueError(f"{path}:{n}: {'; '.join(bad)}")
        out.append(r)
    return out
