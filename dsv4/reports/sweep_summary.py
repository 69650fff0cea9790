"""`mode=summarize` and the end-of-sweep summary: a sweep folder's result rows -> `summary.csv`,
`summary.md` (pivot tables) and `summary.png` (heatmaps), written into the sweep folder.

Reads files, writes files; no torch (Hydra only parses the overrides it recorded). Every cell of the matrix `multirun.yaml` records gets a row: a job
that started without writing `result.json` and a cell that never started are `missing` rows carrying
the choices and overrides Hydra recorded for them, so an interrupted sweep shows what is left. Each row
carries its job's command-line overrides (`overrides.<key>`), so cells that differ only in a field of
an option still read apart.

The pivot's axes are the keys the sweep varies (first down, the last across; keys that vary only with
them, e.g. processes with tp_size, are named, and the rest listed as fixed), so every experiment
summarizes with no per-experiment code; which numbers it shows is the sweep's `summary:` config
(dsv4/reports/summary_metrics.py).
"""
from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4.values.errors import ConfigError
from dsv4.reports.report import Status
from dsv4.reports.summary_metrics import DEFAULT_VIEW, Metric, SummaryView, versus
from dsv4.reports.sweep_record import job_fields, job_overrides, load_yaml, matrix, override_fields

Row = dict[str, Any]
# Axis order when several keys vary: strategies first, then presets, then run-level settings, then overrides.
AXIS_ORDER = ("choices.mqa_kernel", "choices.o_proj", "choices.head_padding", "choices.cache_layout",
              "choices.indexer", "choices.backend", "choices.deployment", "choices.model", "choices.workload",
              "settings.tp_size", "settings.dtype", "settings.seed", "settings.weights", "settings.checkpoint.path")
AXIS_PREFIXES = ("choices.", "settings.", "overrides.")
COLUMN_ORDER = ("job", "status", "missing", "error", "problems", "choices.", "settings.", "overrides.", "device.",
                "workload.", "metrics.", "versions.", "schema")
STARTED = "no result.json (interrupted or still running)"
NEVER_STARTED = "never started"


@dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
    rows: list[Row]
    counts: dict[Status, int]
    markdown: str
    csv_path: Path
    md_path: Path
    png_path: Path | None

    def show(self) -> None:
        """The table, then where it was written."""
        print(self.markdown)
        print(f"summary: {self.md_path}, {self.csv_path}" + (f", {self.png_path}" if self.png_path else ""))

    @property
    def failure(self) -> str | None:
        """Why the sweep as a whole failed (None when it did not), naming where the reasons are."""
        reason = failure(self.counts, len(self.rows))
        return f"{reason} (rows and reasons: {self.md_path})" if reason else None


def failure(n: dict[Status, int], total: int) -> str | None:
    """Some job failed with an error or gave wrong outputs, or no cell ran at all (every one incompatible
    with the device, or missing); None when neither."""
    bad = [f"{n[k]} of {total} jobs {what}" for k, what in ((Status.ERROR, "failed with an error"),
                                                           (Status.MISMATCH, "gave outputs outside their error budget"))
           if n[k]]
    if bad:
        return "; ".join(bad)
    if n[Status.OK]:
        return None
    if n[Status.INCOMPATIBLE] == total:
        return f"no cell of the sweep ran: all {total} are incompatible"
    return f"no cell of the sweep ran ({_counts_text(n)})"


# ---- reading -------------------------------------------------------------------------------------------
def _natural(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Folders with a result.json or a .hydra/ (a job Hydra started), in job order."""
    found = {p.parent for p in sweep_dir.rglob("result.json")}
    found |= {p.parent for p in sweep_dir.rglob(".hydra") if p.is_dir() and (p / "overrides.yaml").exists()}
    return sorted(found, key=_natural)


def job_row(job: Path, root: Path) -> Row:
    """The job's result.json (or a `missing` row) with what Hydra recorded for it underneath."""
    name = str(job.relative_to(root)) if job != root else "."
    recorded = job_fields(job)
    path = job / "result.json"
    if not path.exists():
        return {"job": name, "status": Status.MISSING, "missing": STARTED} | recorded
    try:
        return {"job": name} | recorded | json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return {"job": name, "status": Status.MISSING, "missing": f"unreadable result.json: {e}"} | recorded


def load_rows(sweep_dir: str | Path) -> list[Row]:
    """One flat row per cell of the recorded matrix (in job order), then one per job folder no cell
    names; without a multirun.yaml, one per job folder. `job` = the folder relative to the sweep folder."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise ConfigError(f"sweep_dir={sweep_dir}: no such directory (give the multirun folder, "
                          f"e.g. multirun/cache_by_kernel/<date_time>)")
    jobs = {job: job_row(job, root) for job in job_dirs(root)}
    grid = matrix(root)
    if grid is None:
        rows = list(jobs.values())
    else:
        by_overrides = {tuple(sorted(o)): job for job in jobs if (o := job_overrides(job)) is not None}
        by_folder = {str(job.relative_to(root)): job for job in jobs}
        rows, used = [], set()
        for cell in grid.cells:
            job = by_overrides.get(tuple(sorted(cell.overrides))) or by_folder.get(grid.folder(cell))
            if job is None or job in used:
                rows.append({"job": grid.folder(cell), "status": Status.MISSING, "missing": NEVER_STARTED}
                            | override_fields(cell.overrides, grid.groups, root / "multirun.yaml"))
            else:
                rows.append(jobs[job])
                used.add(job)
        rows += [row for job, row in jobs.items() if job not in used]
    if not rows:
        raise ConfigError(f"sweep_dir={sweep_dir}: no job folders (none has result.json or .hydra/) and no "
                          f"multirun.yaml")
    return rows


def view_of(sweep_dir: Path) -> SummaryView:
    """The `summary:` config the sweep ran with (multirun.yaml), else the default."""
    recorded = load_yaml(sweep_dir / "multirun.yaml") if (sweep_dir / "multirun.yaml").exists() else None
    return SummaryView.from_config(recorded.get("summary") if isinstance(recorded, dict) else None)


# ---- pivot ---------------------------------------------------------------------------------------------
def _sort_key(v: Any) -> tuple:
    return (0, float(v), "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0.0, str(v))


@dataclass(frozen=True, slots=True, kw_only=True)
class Axes:
    varying: list[str]          # the pivot's keys: first down ... last across
    fixed: dict[str, Any]       # one value in every row that has the key
    derived: list[str]          # vary, but only as the varying keys do (processes with tp_size): no axis


def _values(rows: list[Row], k: str) -> dict[str, Any]:
    return {json.dumps(r[k], default=str): r[k] for r in rows if r.get(k) is not None}


def _follows(rows: list[Row], k: str, keys: list[str]) -> bool:
    """Whether `k` takes one value for each combination of `keys` (it adds no cells to their pivot)."""
    seen: dict[tuple, str] = {}
    for r in rows:
        if r.get(k) is not None:
            v = json.dumps(r[k], default=str)
            if seen.setdefault(tuple(json.dumps(r.get(x), default=str) for x in keys), v) != v:
                return False
    return True


def axes(rows: list[Row], swept: list[str] | None = None) -> Axes:
    """The pivot's axes: the `swept` keys that vary (the sweep's own axes, when its matrix is known),
    else every varying key in AXIS_ORDER that does not follow the ones before it. A row without a key (a
    job that failed early, a cell that never started) does not make it vary."""
    keys = {k for r in rows for k in r if k.startswith(AXIS_PREFIXES)}
    ordered = [k for k in AXIS_ORDER if k in keys] + sorted(keys - set(AXIS_ORDER))
    varying = [k for k in swept if len(_values(rows, k)) > 1] if swept else []
    fixed, derived = {}, []
    for k in ordered:
        values = _values(rows, k)
        if k in varying:
            continue
        if len(values) == 1:
            fixed[k] = next(iter(values.values()))
        elif values and (swept or _follows(rows, k, varying)):
            derived.append(k)
        elif values:
            varying.append(k)
    return Axes(varying=varying, fixed=fixed, derived=derived)


def swept_keys(sweep_dir: Path) -> list[str] | None:
    """The row fields of the overrides whose values differ between cells of the recorded matrix, in
    the sweeper's order; None without a recorded matrix."""
    grid = matrix(sweep_dir)
    if grid is None:
        return None
    cells = [override_fields(c.overrides, grid.groups, sweep_dir / "multirun.yaml") for c in grid.cells]
    keys = list(dict.fromkeys(k for c in cells for k in c))
    return [k for k in keys if len({json.dumps(c.get(k), default=str) for c in cells}) > 1]


@dataclass(frozen=True, slots=True, kw_only=True)
class Pivot:
    row_keys: list[str]
    col_key: str | None
    row_labels: list[str]
    col_labels: list[str]
    cells: dict[tuple[str, str], Row]      # (row label, col label) -> result row

    @property
    def row_title(self) -> str:
        return " / ".join(_short(k) for k in self.row_keys) or "job"

    @property
    def col_title(self) -> str:
        return _short(self.col_key) if self.col_key else ""

    @property
    def keys(self) -> list[str]:
        return self.row_keys + ([self.col_key] if self.col_key else [])


def _label(row: Row, keys: list[str]) -> str:
    return " / ".join(str(row.get(k, "-")) for k in keys) if keys else "all"


def pivot(rows: list[Row], swept: list[str] | None = None) -> Pivot:
    varying = axes(rows, swept).varying
    col_key = varying[-1] if len(varying) >= 2 else None
    row_keys = varying[:-1] if col_key else varying

    def order(keys):
        return lambda r: tuple(_sort_key(r.get(k)) for k in keys)
    row_labels = list(dict.fromkeys(_label(r, row_keys) for r in sorted(rows, key=order(row_keys))))
    col_labels = (list(dict.fromkeys(str(r.get(col_key)) for r in sorted(rows, key=order([col_key]))))
                  if col_key else ["value"])
    cells = {}
    for r in rows:          # a later job of the same cell (a re-run) wins
        cells[(_label(r, row_keys), str(r.get(col_key)) if col_key else "value")] = r
    return Pivot(row_keys=row_keys, col_key=col_key, row_labels=row_labels, col_labels=col_labels, cells=cells)


def _short(k: str) -> str:
    return k.split(".", 1)[1] if "." in k else k


def why(row: Row) -> str:
    """A short reason for a cell that has no numbers."""
    status = row.get("status")
    if status == Status.INCOMPATIBLE:
        culprits = list(dict.fromkeys(f"{p.get('group')}={p.get('value')}" for p in row.get("problems") or []))
        return "incompatible: " + ", ".join(culprits) if culprits else "incompatible"
    if status == Status.ERROR:
        msg = str(row.get("error") or "").splitlines()[0] if row.get("error") else ""
        return "error: " + (msg[:60] + "…" if len(msg) > 60 else msg)
    if status == Status.MISSING:
        return "missing: " + str(row.get("missing") or STARTED)
    return str(status)


def cell_text(row: Row | None, metric: Metric) -> str:
    if row is None:
        return "not run"
    if row.get("status") in (Status.OK, Status.MISMATCH):      # a mismatch has numbers, marked wrong
        text = metric.text(row) if metric.text is not None else None
        text = text if text is not None else metric.format(metric.value(row))
        return text if row.get("status") == Status.OK else f"✗ {text} (mismatch)"
    mark = "✗ " if row.get("status") == Status.INCOMPATIBLE else ""
    return mark + why(row)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


# ---- writing -------------------------------------------------------------------------------------------
def counts(rows: list[Row]) -> dict[Status, int]:
    out = {s: 0 for s in Status}
    for r in rows:
        try:
            out[Status(r.get("status"))] += 1
        except ValueError:                      # a row of a newer schema: counted as an error
            out[Status.ERROR] += 1
    return out


def _counts_text(n: dict[Status, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in n.items() if v or k not in (Status.MISSING, Status.MISMATCH))


def _table(pv: Pivot, metric: Metric) -> list[str]:
    corner = pv.row_title + (f" \\ {pv.col_title}" if pv.col_key else "")
    lines = ["", f"## {metric.title}", "",
             "| " + " | ".join([corner] + [_md_escape(c) for c in pv.col_labels]) + " |",
             "|" + "---|" * (len(pv.col_labels) + 1)]
    for rl in pv.row_labels:
        cells = [_md_escape(cell_text(pv.cells.get((rl, cl)), metric)) for cl in pv.col_labels]
        lines.append("| " + " | ".join([_md_escape(rl)] + cells) + " |")
    return lines


def _has_numbers(rows: list[Row], metric: Metric) -> bool:
    return any(r.get("status") == Status.OK and metric.value(r) is not None for r in rows)


def tables(rows: list[Row], view: SummaryView, varying: list[str]) -> list[Metric]:
    """The view's table metrics that some row has numbers for (the first always, to show the matrix),
    each cost followed by its ratio to the baseline cell when the view names one."""
    out = []
    for i, metric in enumerate(view.tables):
        if i and not _has_numbers(rows, metric):
            continue
        out.append(metric)
        rel = versus(metric, rows, view.baseline, varying) if view.baseline and metric.cost else None
        if rel is not None and _has_numbers(rows, rel):
            out.append(rel)
    return out


def markdown(rows: list[Row], sweep_dir: Path, view: SummaryView = DEFAULT_VIEW, swept: list[str] | None = None) -> str:
    """summary.md; `swept`: the sweep's own axes (swept_keys), when known."""
    pv = pivot(rows, swept)
    ax = axes(rows, swept)
    n = counts(rows)
    lines = [f"# Sweep summary: {sweep_dir}", "", f"{len(rows)} jobs: {_counts_text(n)}."]
    if n[Status.MISSING]:
        never = sum(r.get("missing") == NEVER_STARTED for r in rows)
        lines.append(f"{n[Status.MISSING]} jobs have no result.json ({n[Status.MISSING] - never} started, {never} "
                     f"never started: the sweep was interrupted or is still running); re-running those cells and "
                     f"summarizing again fills them in.")
    if not n[Status.OK] and not n[Status.ERROR]:
        lines.append(f"**{failure(n, len(rows)).capitalize()}**; each cell's reasons are below.")
    fixed_txt = ", ".join(f"{_short(k)}={v}" for k, v in ax.fixed.items()
                          if v is not None and k != "choices.experiment")
    if fixed_txt:
        lines.append(f"Fixed: {fixed_txt}.")
    if ax.derived:
        lines.append(f"Varying with {pv.row_title}{' / ' + pv.col_title if pv.col_key else ''}: "
                     f"{', '.join(_short(k) for k in ax.derived)} (in summary.csv).")
    devices = sorted({"/".join(str(r[k]) for k in ("device.platform", "device.arch") if r.get(k))
                      + (f" ({r['device.name']})" if r.get("device.name") else "")
                      for r in rows if r.get("device.platform")})
    if devices:
        lines.append(f"Device: {', '.join(devices)}.")
    for metric in tables(rows, view, ax.varying):
        lines += _table(pv, metric)
    others = [r for r in rows if r.get("status") != Status.OK]
    if others:
        lines += ["", "## Jobs without numbers", ""]
        for r in others:
            where = " ".join(f"{_short(k)}={r.get(k)}" for k in pv.keys)
            lines.append(f"- job `{r['job']}` ({where}): **{r.get('status')}**"
                         + (f" ({r['missing']})" if r.get("missing") else ""))
            for p in r.get("problems") or []:
                fix = f" — fix: `{p['fix']}`" if p.get("fix") else ""
                lines.append(f"  - {p.get('group')}={p.get('value')}: {p.get('reason')}{fix}")
            if r.get("error"):
                lines.append(f"  - {_md_escape(str(r['error']))}")
    return "\n".join(lines) + "\n"


def _csv_value(key: str, v: Any) -> Any:
    if v is None:
        return ""
    if key == "problems" and isinstance(v, list):
        return "; ".join(f"{p.get('group')}={p.get('value')}: {p.get('reason')}"
                         + (f" (fix: {p['fix']})" if p.get("fix") else "") for p in v)
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return v


def write_csv(rows: list[Row], path: Path) -> Path:
    seen = {k: i for i, k in enumerate(dict.fromkeys(k for r in rows for k in r))}
    rank = lambda k: next((i for i, p in enumerate(COLUMN_ORDER) if k == p or k.startswith(p)), len(COLUMN_ORDER))
    keys = sorted(seen, key=lambda k: (rank(k), seen[k]))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(k, r.get(k)) for k in keys})
    return path


def summarize(sweep_dir: str | Path, view: SummaryView | None = None) -> Summary:
    """Read every row of the sweep under `sweep_dir`; write summary.csv, summary.md and summary.png there.
    `view`: what to show (default: the sweep's recorded `summary:` config)."""
    from dsv4.reports.heatmaps import write_png

    root = Path(sweep_dir)
    rows = load_rows(root)
    view = view if view is not None else view_of(root)
    swept = swept_keys(root)
    md = markdown(rows, root, view, swept)
    md_path = root / "summary.md"
    md_path.write_text(md)
    csv_path = write_csv(rows, root / "summary.csv")
    n = counts(rows)
    title = f"{root} — " + ", ".join(f"{v} {k}" for k, v in n.items() if v)
    png_path = write_png(pivot(rows, swept), view.heatmaps, root / "summary.png", title)
    return Summary(rows=rows, counts=n, markdown=md, csv_path=csv_path, md_path=md_path, png_path=png_path)
