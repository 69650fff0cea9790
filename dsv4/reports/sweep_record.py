"""What Hydra recorded about a sweep, read back for its summary: the whole matrix of cells from the
sweep folder's `multirun.yaml`, and each job's choices, settings and command-line overrides from its
`.hydra/` folder.

The matrix matters for an interrupted sweep: its job folders are only the cells that started, while
`multirun.yaml` (written before the first job) holds the sweeper's params and the command line, from
which the basic sweeper's cartesian product is rebuilt here in its order (job numbers). The overrides
matter for every row: a field override (`mqa_kernel.chunk=0,64`) changes neither a choice nor a setting,
so without it two cells of a sweep read the same.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4.values.errors import ConfigError

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
# config keys a row carries as `settings.<key>` (app.settings() writes the first three; the weights and the
# checkpoint's path are read from the job's config, so that a checkpoint run never reads as random weights)
TOP_SETTINGS = ("tp_size", "dtype", "seed", "weights")
SETTING_KEYS = TOP_SETTINGS + ("checkpoint.path",)


@dataclass(frozen=True, slots=True, kw_only=True)
class Cell:
    """One job of the matrix: its number and the overrides the sweeper gives it (`key=value`)."""
    num: int
    overrides: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Matrix:
    cells: tuple[Cell, ...]
    groups: frozenset[str]          # config groups of the composition (their overrides are choices)
    subdir: str                     # hydra.sweep.subdir, e.g. ${hydra.job.num}

    def folder(self, cell: Cell) -> str:
        """The job folder's name relative to the sweep folder, where Hydra's default names it."""
        return str(cell.num) if self.subdir == "${hydra.job.num}" else f"job #{cell.num}"


def load_yaml(path: Path) -> Any:
    import yaml  # PyYAML, a dependency of omegaconf

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _parse(overrides: list[str], where: Path) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(f"{where}: unreadable override ({e})") from None


def _group_options(group: str, config_dirs: list[Path]) -> list[str]:
    return sorted({p.stem for d in config_dirs for p in (d / group).glob("*.yaml")})


def _config_dirs(hydra_cfg: dict) -> list[Path]:
    """The file config sources the sweep composed from; this package's configs if they are gone."""
    import importlib.util

    dirs = []
    for src in (hydra_cfg.get("runtime") or {}).get("config_sources") or []:
        path = str(src.get("path"))
        if src.get("schema") == "pkg":              # pkg://dsv4.configs: the package's folder
            try:
                spec = importlib.util.find_spec(path)
            except (ImportError, ValueError):
                spec = None
            path = next(iter(spec.submodule_search_locations), "") if spec and spec.submodule_search_locations else ""
        elif src.get("schema") != "file":
            continue
        if path and Path(path).is_dir():
            dirs.append(Path(path))
    from dsv4.checks.catalogue import config_dir

    return dirs or [config_dir()]


def matrix(sweep_dir: Path) -> Matrix | None:
    """The cells of the sweep `multirun.yaml` records, numbered as the basic sweeper numbers its jobs
    (params first, then the command line; a key given twice keeps its first place, the last value);
    None without a multirun.yaml or for another sweeper (whose cells are not a fixed product)."""
    from hydra.core.override_parser.types import Glob

    path = sweep_dir / "multirun.yaml"
    recorded = load_yaml(path) if path.exists() else None
    hydra_cfg = (recorded or {}).get("hydra") if isinstance(recorded, dict) else None
    if not isinstance(hydra_cfg, dict):
        return None
    sweeper = hydra_cfg.get("sweeper") or {}
    if sweeper.get("_target_") != BASIC_SWEEPER:
        return None
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    command = list((hydra_cfg.get("overrides") or {}).get("task") or [])
    dirs = _config_dirs(hydra_cfg)
    axes: dict[str, list[str]] = {}
    for o in _parse(params + command, path):
        key = o.get_key_element()
        if isinstance(o.value(), Glob):
            axes[key] = [f"{key}={v}" for v in o.value().filter(_group_options(o.key_or_group, dirs))]
        elif o.is_sweep_override():
            axes[key] = [f"{key}={v}" for v in o.sweep_string_iterator()]
        else:
            axes[key] = [f"{key}={o.get_value_element_as_str()}"]
    cells = tuple(Cell(num=i, overrides=tuple(c)) for i, c in enumerate(itertools.product(*axes.values())))
    groups = frozenset(k for k in (hydra_cfg.get("runtime") or {}).get("choices") or {} if not k.startswith("hydra"))
    return Matrix(cells=cells, groups=groups, subdir=str((hydra_cfg.get("sweep") or {}).get("subdir")))


def override_fields(overrides: list[str] | tuple[str, ...], groups: frozenset[str], where: Path) -> dict[str, Any]:
    """A job's overrides as row fields: a group's as `choices.<group>`, a setting's as `settings.<key>`,
    any other (a field of an option, the workload, the checkpoint path...) as `overrides.<key>`."""
    out: dict[str, Any] = {}
    for o in _parse(list(overrides), where):
        key = o.key_or_group
        value = "<deleted>" if o.is_delete() else o.value()
        prefix = "choices" if key in groups else "settings" if key in SETTING_KEYS else "overrides"
        out[f"{prefix}.{key}"] = value
    return out


def job_fields(job: Path) -> dict[str, Any]:
    """What Hydra recorded for a job when it started: its choices, settings (the weights, and the
    checkpoint's path when they are a checkpoint's) and command-line overrides, as flat row fields."""
    hydra_cfg = ((load_yaml(job / ".hydra" / "hydra.yaml") or {}).get("hydra")) or {}
    choices = (hydra_cfg.get("runtime") or {}).get("choices") or {}
    groups = frozenset(k for k in choices if not k.startswith("hydra"))
    out: dict[str, Any] = {f"choices.{k}": v for k, v in choices.items() if k in groups and v is not None}
    task = load_yaml(job / ".hydra" / "config.yaml") or {}
    out |= {f"settings.{k}": task[k] for k in TOP_SETTINGS if k in task}
    if task.get("weights") == "checkpoint":
        out["settings.checkpoint.path"] = (task.get("checkpoint") or {}).get("path")
    overrides = load_yaml(job / ".hydra" / "overrides.yaml") or []
    return out | {k: v for k, v in override_fields(overrides, groups, job).items() if k not in out}


def job_overrides(job: Path) -> tuple[str, ...] | None:
    """The overrides Hydra gave a job (`.hydra/overrides.yaml`), None when it recorded none."""
    got = load_yaml(job / ".hydra" / "overrides.yaml")
    return tuple(str(o) for o in got) if isinstance(got, list) else None
