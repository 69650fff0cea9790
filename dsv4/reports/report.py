"""Result rows (`result.json`, one flat object per job) and the table `run` prints."""
from __future__ import annotations

import enum
import json
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA = 1


class Status(enum.StrEnum):
    """A row's `status`: the job ran, it ran but a layer's outputs left the combination's error budget,
    its combination cannot run on the device, it failed, or (in a summary only) the sweep has no row for it."""
    OK = "ok"
    MISMATCH = "mismatch"
    INCOMPATIBLE = "incompatible"
    ERROR = "error"
    MISSING = "missing"


BASE_DISTRIBUTIONS = {"torch": "torch", "hydra": "hydra-core", "omegaconf": "omegaconf"}


def distributions() -> dict[str, str]:
    """Import name -> pip distribution of what a row's versions record: the app's own packages and every
    kernel package a shipped option names in its Needs (read from the options, not restated here)."""
    import re

    from dsv4.checks.catalogue import options
    from dsv4.checks.compat import NEEDS_GROUPS
    from dsv4.values.device import DeviceInfo

    out = dict(BASE_DISTRIBUTIONS)
    for group in NEEDS_GROUPS:
        for opt in options(group).values():
            for module, dist in opt.needs(DeviceInfo(platform="cpu")).modules:
                out.setdefault(module.partition(".")[0], re.split(r"[<>=!~ ]", dist, maxsplit=1)[0])
    return out


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for key, dist in distributions().items():
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    return out


def flatten(prefix: str, d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out |= flatten(key, v)
        else:
            out[key] = v
    return out


def result_row(*, status: str, problems: list, choices: dict, device, settings: dict, workload: dict | None = None,
               metrics: dict | None = None, error: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"schema": SCHEMA, "status": status, "problems": [p.as_dict() for p in problems]}
    if error:
        row["error"] = error
    row |= flatten("choices", choices)
    row |= flatten("settings", settings)
    if device is not None:          # None: the job failed before its device was known
        row |= flatten("device", {"platform": device.platform, "arch": device.arch, "name": device.name})
    row |= flatten("versions", versions())
    row |= flatten("workload", workload or {})
    row |= flatten("metrics", metrics or {})
    return row


def write_row(out_dir: str | Path, row: dict[str, Any]) -> Path:
    """The job's `result.json`, written once and whole: into a temporary file renamed into place (a reader
    never sees half a row), and never over a row already there -- the first row a job writes is its result,
    and what fails after it (a closed stdout, a late print) cannot replace it."""
    import os
    import tempfile

    path = Path(out_dir) / "result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        print(f"note: {path} already holds this job's result; not replaced by a {row.get('status')} row",
              file=sys.stderr)
        return path
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".result-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(row, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def table(headers: list[str], rows: list[list[Any]], *, left: tuple[int, ...] = (0,)) -> str:
    """Columns right-aligned (numbers) except those in `left` (text)."""
    cells = [headers] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if v != 0 and abs(v) < 1e-2:
            return f"{v:.2e}"
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def step_progress(stream=None):
    """A progress printer for long runs (`run_workload`'s `progress`), `show(step, steps, phase, layer=None)`.

    On a terminal (`stream`, default stderr) it rewrites one line: the step and its phase, and while a step
    runs, the layer it is in ("layer 2 (c4a) 2/3"); the line ends after the last step. Elsewhere (a log, a
    pipe) it writes one line per finished step, flushed, so a reader sees the run advance."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if isatty is None or not isatty():
        def line(step: int, steps: int, phase: str, layer: str | None = None) -> None:
            if layer is None:
                stream.write(f"  {phase} step {step}/{steps} done\n")
                stream.flush()
        return line

    def show(step: int, steps: int, phase: str, layer: str | None = None) -> None:
        where = f", {layer}" if layer else ""
        stream.write(f"\r\x1b[K  {phase} step {step}/{steps}{where}")
        if step == steps and layer is None:
            stream.write("\n")
        stream.flush()
    return show


def error_row(out_dir, e: Exception, *, choices: dict[str, str], device, settings: dict[str, Any]) -> Path:
    """The `error` result row of a job that failed (or could not be made), written into out_dir."""
    return write_row(Path(out_dir), result_row(status="error", problems=[], choices=dict(choices), device=device,
                                               settings=settings, error=f"{type(e).__name__}: {e}"))


def sweep_cell_failed(e: Exception, row: Path) -> None:
    """A multirun job that failed: its `error` row is written; say so on stderr (with the traceback,
    unless it is a user error whose message says what to change) and return, so the other cells
    still run and the end-of-sweep summary is written (the summary callback then exits 1)."""
    import traceback

    from dsv4.values.errors import USER_ERRORS

    if not isinstance(e, USER_ERRORS):
        traceback.print_exception(e)
    print(f"error (row: {row}): {type(e).__name__}: {e}", file=sys.stderr)
