"""Result rows (`result.json`, one flat object per job) and the table `run` prints."""
from __future__ import annotations

import json
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA = 1
DISTRIBUTIONS = {"torch": "torch", "hydra": "hydra-core", "omegaconf": "omegaconf", "flash_mla": "sgl-flash-mla",
                 "deep_gemm": "sgl-deep-gemm", "flashinfer": "flashinfer-python", "aiter": "amd-aiter",
                 "triton": "triton"}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for key, dist in DISTRIBUTIONS.items():
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
    row |= flatten("device", {"platform": device.platform, "arch": device.arch, "name": device.name})
    row |= flatten("versions", versions())
    row |= flatten("workload", workload or {})
    row |= flatten("metrics", metrics or {})
    return row


def write_row(out_dir: str | Path, row: dict[str, Any]) -> Path:
    path = Path(out_dir) / "result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=2, default=str) + "\n")
    return path


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
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


def tty_progress(stream=sys.stderr):
    """A progress printer for long runs, or None when output is not a terminal."""
    if not stream.isatty():
        return None

    def show(i: int, n: int, phase: str) -> None:
        stream.write(f"\r  step {i}/{n} ({phase})" + ("\n" if i == n else ""))
        stream.flush()
    return show
