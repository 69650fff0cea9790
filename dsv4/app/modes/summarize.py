"""`mode=summarize`: a sweep folder's rows -> summary.csv/.md/.png (reads the folder, not a job)."""
from __future__ import annotations

from omegaconf import DictConfig

from dsv4.values.errors import ConfigError


def summarize_mode(cfg: DictConfig) -> None:
    from dsv4.reports.sweep_summary import summarize

    sweep_dir = cfg.get("sweep_dir")
    if not sweep_dir:
        raise ConfigError("mode=summarize needs the sweep folder: +sweep_dir=PATH "
                          "(e.g. +sweep_dir=multirun/cache_by_kernel/<date_time>)")
    s = summarize(str(sweep_dir))
    s.show()
