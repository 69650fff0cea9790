"""`mode=summarize`: a sweep folder's result rows -> `summary.csv`, `summary.md` (pivot tables) and
`summary.png` (heatmaps), written into the sweep folder.

Pure: reads files, writes files; no torch, no Hydra. An interrupted sweep summarizes too: a job
folder (one Hydra made, with `.hydra/`) that has no `result.json` becomes a `missing` row carrying the
choices Hydra recorded for it, shown as such in every table and in the plot.

The pivot's axes are the choices and settings that vary across the rows (first varying key down,
the last across; the rest are listed as fixed), so every experiment summarizes with no per-experiment
code.
"""
from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4.errors import ConfigError

STATUSES = ("ok", "incompatible", "error", "missing")
# Axis order when several keys vary: strategies first, then presets, then run-level settings.
AXIS_ORDER = ("choices.mqa_kernel", "choices.o_proj", "choices.head_padding", "choices.cache_layout",
              "choices.backend", "choices.deployment", "choices.model", "choices.workload",
              "settings.tp_size", "settings.dtype", "settings.seed")
COLUMN_ORDER = ("job", "status", "error", "problems", "choices.", "settings.", "device.", "workload.",
                "metrics.", "versions.", "schema")


@dataclass(frozen=True, slots=True, kw_only=True)
class Metric:
    title: str
    value: Callable[[dict[str, Any]], float | None]
    log: bool = False          # color scale in the plot


def _decode_ms_step(row: dict[str, Any]) -> float | None:
    vals = [v for k, v in row.items() if re.fullmatch(r"metrics\.[^.]+\.decode_ms_step", k) and v is not None]
    return sum(vals) if vals else None


METRICS = (
    Metric(title="max_rel_err (vs the whole-sequence float32 oracle, worst layer)",
           value=lambda r: r.get("metrics.max_rel_err"), log=True),
    Metric(title="decode ms/step (sum over the workload's layers, wall time)", value=_decode_ms_step),
    Metric(title="KV GiB per 1M-token sequence (per rank)", value=lambda r: r.get("metrics.kv_gib_per_1m_tokens")),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
    rows: list[dict[str, Any]]
    counts: dict[str, int]
    markdown: str
    csv_path: Path
    md_path: Path
    png_path: Path | None

    def show(self) -> None:
        """The table, then where it was written."""
        print(self.markdown)
        print(f"summary: {self.md_path}, {self.csv_path}" + (f", {self.png_path}" if self.png_path else ""))


# ---- reading -------------------------------------------------------------------------------------------
def _natural(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Folders with a result.json or a .hydra/ (a job Hydra started), in job order."""
    found = {p.parent for p in sweep_dir.rglob("result.json")}
    found |= {p.parent for p in sweep_dir.rglob(".hydra") if p.is_dir() and (p / "overrides.yaml").exists()}
    return sorted(found, key=_natural)


def _load_yaml(path: Path) -> Any:
    import yaml  # PyYAML, a dependency of omegaconf

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _recorded(job: Path) -> dict[str, Any]:
    """What Hydra recorded for a job before it ran: its choices and settings, flat."""
    out: dict[str, Any] = {}
    hydra_cfg = _load_yaml(job / ".hydra" / "hydra.yaml") or {}
    choices = ((hydra_cfg.get("hydra") or {}).get("runtime") or {}).get("choices") or {}
    out |= {f"choices.{k}": v for k, v in choices.items() if not k.startswith("hydra") and v is not None}
    task = _load_yaml(job / ".hydra" / "config.yaml") or {}
    out |= {f"settings.{k}": task[k] for k in ("tp_size", "dtype", "seed") if k in task}
    return out


def load_rows(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One flat row per job folder, `job` = its path relative to the sweep folder."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise ConfigError(f"sweep_dir={sweep_dir}: no such directory (give the multirun folder, "
                          f"e.g. multirun/cache_by_kernel/<date_time>)")
    rows = []
    for job in job_dirs(root):
        name = str(job.relative_to(root)) if job != root else "."
        path = job / "result.json"
        row: dict[str, Any] | None = None
        if path.exists():
            try:
                row = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                row = _recorded(job) | {"status": "missing", "error": f"unreadable result.json: {e}"}
        if row is None:
            row = _recorded(job) | {"status": "missing"}
        rows.append({"job": name} | row)
    if not rows:
        raise ConfigError(f"sweep_dir={sweep_dir}: no job folders (none has result.json or .hydra/)")
    return rows


# ---- pivot ---------------------------------------------------------------------------------------------
def _sort_key(v: Any) -> tuple:
    return (0, float(v), "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0.0, str(v))


def axes(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """(varying keys in AXIS_ORDER, {fixed key: its one value}); a row without a key (a job that
    failed early) does not make it vary."""
    keys = {k for r in rows for k in r if k.startswith(("choices.", "settings."))}
    ordered = [k for k in AXIS_ORDER if k in keys] + sorted(keys - set(AXIS_ORDER))
    varying, fixed = [], {}
    for k in ordered:
        values = {json.dumps(r[k], default=str): r[k] for r in rows if r.get(k) is not None}
        if len(values) > 1:
            varying.append(k)
        elif values:
            fixed[k] = next(iter(values.values()))
    return varying, fixed


@dataclass(frozen=True, slots=True, kw_only=True)
class Pivot:
    row_keys: list[str]
    col_key: str | None
    row_labels: list[str]
    col_labels: list[str]
    cells: dict[tuple[str, str], dict[str, Any]]      # (row label, col label) -> result row


def _label(row: dict[str, Any], keys: list[str]) -> str:
    return " / ".join(str(row.get(k, "-")) for k in keys) if keys else "all"


def pivot(rows: list[dict[str, Any]]) -> Pivot:
    varying, _ = axes(rows)
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


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e5):
        return f"{v:.2e}"
    return f"{v:.3g}"


def why(row: dict[str, Any]) -> str:
    """A short reason for a cell that has no numbers."""
    status = row.get("status")
    if status == "incompatible":
        culprits = list(dict.fromkeys(f"{p.get('group')}={p.get('value')}" for p in row.get("problems") or []))
        return "incompatible: " + ", ".join(culprits) if culprits else "incompatible"
    if status == "error":
        msg = str(row.get("error") or "").splitlines()[0] if row.get("error") else ""
        return "error: " + (msg[:60] + "…" if len(msg) > 60 else msg)
    if status == "missing":
        return "missing: " + (row.get("error") or "no result.json (interrupted or still running)")
    return str(status)


def cell_text(row: dict[str, Any] | None, metric: Metric) -> str:
    if row is None:
        return "not run"
    if row.get("status") == "ok":
        return _fmt(metric.value(row))
    mark = "✗ " if row.get("status") == "incompatible" else ""
    return mark + why(row)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


# ---- writing -------------------------------------------------------------------------------------------
def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    out = {s: 0 for s in STATUSES}
    for r in rows:
        out[str(r.get("status"))] = out.get(str(r.get("status")), 0) + 1
    return out


def markdown(rows: list[dict[str, Any]], sweep_dir: Path) -> str:
    pv = pivot(rows)
    _, fixed = axes(rows)
    n = counts(rows)
    lines = [f"# Sweep summary: {sweep_dir}", "",
             f"{len(rows)} jobs: " + ", ".join(f"{v} {k}" for k, v in n.items() if v or k in STATUSES[:3]) + "."]
    if n.get("missing"):
        lines.append(f"{n['missing']} job folders have no result.json (the sweep was interrupted or is still "
                     f"running); re-running those jobs and summarizing again fills them in.")
    fixed_txt = ", ".join(f"{_short(k)}={v}" for k, v in fixed.items() if v is not None and k != "choices.experiment")
    if fixed_txt:
        lines.append(f"Fixed: {fixed_txt}.")
    devices = sorted({"/".join(str(r[k]) for k in ("device.platform", "device.arch") if r.get(k))
                      + (f" ({r['device.name']})" if r.get("device.name") else "")
                      for r in rows if r.get("device.platform")})
    if devices:
        lines.append(f"Device: {', '.join(devices)}.")
    corner = " / ".join(_short(k) for k in pv.row_keys) or "job"
    if pv.col_key:
        corner += f" \\ {_short(pv.col_key)}"
    for metric in METRICS:
        if not any(r.get("status") == "ok" and metric.value(r) is not None for r in rows) and metric is not METRICS[0]:
            continue
        lines += ["", f"## {metric.title}", "",
                  "| " + " | ".join([corner] + [_md_escape(c) for c in pv.col_labels]) + " |",
                  "|" + "---|" * (len(pv.col_labels) + 1)]
        for rl in pv.row_labels:
            cells = [_md_escape(cell_text(pv.cells.get((rl, cl)), metric)) for cl in pv.col_labels]
            lines.append("| " + " | ".join([_md_escape(rl)] + cells) + " |")
    others = [r for r in rows if r.get("status") != "ok"]
    if others:
        lines += ["", "## Jobs without numbers", ""]
        for r in others:
            where = " ".join(f"{_short(k)}={r.get(k)}" for k in pv.row_keys + ([pv.col_key] if pv.col_key else []))
            lines.append(f"- job `{r['job']}` ({where}): **{r.get('status')}**")
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


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    seen = {k: i for i, k in enumerate(dict.fromkeys(k for r in rows for k in r))}
    rank = lambda k: next((i for i, p in enumerate(COLUMN_ORDER) if k == p or k.startswith(p)), len(COLUMN_ORDER))
    keys = sorted(seen, key=lambda k: (rank(k), seen[k]))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(k, r.get(k)) for k in keys})
    return path


def write_png(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """One heatmap per metric over the pivot; cells without numbers are grey and say why."""
    try:
        import matplotlib
        import numpy as np
        from matplotlib.colors import LogNorm, Normalize
        from matplotlib.figure import Figure  # no pyplot: no global backend state
    except ImportError:
        return None
    pv = pivot(rows)
    metrics = METRICS[:2]      # accuracy and latency
    nr, nc = len(pv.row_labels), len(pv.col_labels)
    fig = Figure(figsize=(max(6.0, 1.6 * nc + 2.5) * len(metrics), max(3.0, 0.6 * nr + 2.0)), layout="constrained")
    fig.suptitle(title, fontsize=11)
    for ax, metric in zip(fig.subplots(1, len(metrics), squeeze=False)[0], metrics):
        grid = np.full((nr, nc), np.nan)
        for i, rl in enumerate(pv.row_labels):
            for j, cl in enumerate(pv.col_labels):
                r = pv.cells.get((rl, cl))
                v = metric.value(r) if r is not None and r.get("status") == "ok" else None
                if v is not None:
                    grid[i, j] = v
        ok = grid[~np.isnan(grid)]
        if metric.log and ok.size and (ok > 0).all():
            norm = LogNorm(vmin=ok.min(), vmax=max(ok.max(), ok.min() * 1.0001))
        else:
            norm = Normalize(vmin=ok.min() if ok.size else 0, vmax=ok.max() if ok.size else 1)
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d9d9d9")
        im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
        for i, rl in enumerate(pv.row_labels):
            for j, cl in enumerate(pv.col_labels):
                r = pv.cells.get((rl, cl))
                if r is None:
                    text, color = "not run", "black"
                elif r.get("status") != "ok":
                    text, color = str(r.get("status")), "#b00000"
                elif np.isnan(grid[i, j]):
                    text, color = "-", "black"
                else:
                    text = _fmt(grid[i, j])
                    color = "white" if norm(grid[i, j]) < 0.5 else "black"
                ax.text(j, i, text, ha="center", va="center", fontsize=8, color=color)
        ax.set_xticks(range(nc), pv.col_labels, rotation=30, ha="right")
        ax.set_yticks(range(nr), pv.row_labels)
        ax.set_xlabel(_short(pv.col_key) if pv.col_key else "")
        ax.set_ylabel(" / ".join(_short(k) for k in pv.row_keys) or "job")
        ax.set_title(metric.title, fontsize=9)
        if ok.size:
            fig.colorbar(im, ax=ax, shrink=0.8)
    fig.savefig(path, dpi=120)
    return path


def summarize(sweep_dir: str | Path) -> Summary:
    """Read every job's row under `sweep_dir`; write summary.csv, summary.md and summary.png there."""
    root = Path(sweep_dir)
    rows = load_rows(root)
    md = markdown(rows, root)
    md_path = root / "summary.md"
    md_path.write_text(md)
    csv_path = write_csv(rows, root / "summary.csv")
    n = counts(rows)
    title = f"{root} — " + ", ".join(f"{v} {k}" for k, v in n.items() if v)
    png_path = write_png(rows, root / "summary.png", title)
    return Summary(rows=rows, counts=n, markdown=md, csv_path=csv_path, md_path=md_path, png_path=png_path)
