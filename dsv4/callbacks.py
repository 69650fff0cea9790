"""Hydra callbacks (configured in configs/config.yaml under `hydra.callbacks`).

Hydra 1.3.8 instantiates each callback from its `_target_` and calls every hook through `getattr`
(hydra/_internal/callbacks.py), for single runs too, so a callback is a plain class that defines all
six hooks; it needs no base class. This module imports nothing heavy: it is loaded by every
`python run.py`, including `mode=check`, which must not import torch.
"""
from __future__ import annotations

from typing import Any


class SummarizeCallback:
    """At the end of a multirun, the sweep folder's summary (`dsv4.summarize`, the code behind
    `mode=summarize`): summary.csv, summary.md, summary.png, showing what the sweep's `summary:` config
    names (checked before the first job, so a typo there costs no sweep). A sweep in which some job
    failed with a real error (an `error` row, not `incompatible`), or in which no cell ran at all (every
    one incompatible with the device), then exits with status 1, after the summary is written. An
    interrupted sweep never reaches this hook: `mode=summarize +sweep_dir=PATH` summarizes it.

    Hydra's callback wrapper turns an exception into a warning (it catches Exception only), so the
    failures that must stop the sweep or set its status are raised as SystemExit."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        if _writes_rows(config):
            _view(config)

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_job_end(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if not _writes_rows(config):
            return
        from dsv4.errors import ConfigError
        from dsv4.summarize import summarize

        try:
            s = summarize(str(config.hydra.sweep.dir), _view(config))
        except ConfigError as e:
            raise SystemExit(f"error: {e}") from None
        s.show()
        if s.failure:
            raise SystemExit(f"error: {s.failure}")


def _writes_rows(config: Any) -> bool:
    return str(config.get("mode", "run")) == "run"      # only `run` jobs write result rows


def _view(config: Any):
    """The sweep's `summary:` config as a SummaryView; a bad one ends the sweep with its message."""
    from omegaconf import OmegaConf

    from dsv4.errors import ConfigError
    from dsv4.summary_metrics import SummaryView

    node = config.get("summary")
    try:
        return SummaryView.from_config(OmegaConf.to_container(node, resolve=True) if node is not None else None)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
