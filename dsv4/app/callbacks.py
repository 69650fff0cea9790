"""Hydra callbacks (configured in configs/config.yaml under `hydra.callbacks`).

Hydra 1.3.8 instantiates each callback from its `_target_` and calls every hook through `getattr`
(hydra/_internal/callbacks.py), for single runs too, so a callback is a plain class that defines all
six hooks; it needs no base class. This module imports nothing heavy: it is loaded by every
`python run.py`, including `mode=check`, which must not import torch.
"""
from __future__ import annotations

from typing import Any


class SummarizeCallback:
    """At the end of a multirun, the sweep folder's summary (`dsv4.reports.sweep_summary`, the code behind
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
        from dsv4.values.errors import ConfigError
        from dsv4.reports.sweep_summary import summarize

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

    from dsv4.values.errors import ConfigError
    from dsv4.reports.summary_metrics import SummaryView

    node = config.get("summary")
    try:
        return SummaryView.from_config(OmegaConf.to_container(node, resolve=True) if node is not None else None)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


class FoldersCallback:
    """Before Hydra makes a folder or writes in it, the folder a run or a sweep writes judged
    (dsv4.app.targets): named (not empty: that is the current folder), a folder that can be made and written,
    on a disk with room; a sweep's folder must not already hold a sweep (a second one would mix its rows
    with the first's in one summary), and it is held (locked) from the sweep's start to its end, so that a
    second sweep started on it at the same time is refused. Each failure ends the command with its one line
    (SystemExit: Hydra's callback wrapper turns an Exception into a warning)."""

    def __init__(self) -> None:
        from contextlib import ExitStack

        self._held = ExitStack()            # the sweep's folder, from its start to its end

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        _refuse_if(_folder_problem("hydra.run.dir", config.hydra.run.dir))

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from pathlib import Path

        from dsv4.app.targets import FolderBusy, held_sweep, hold

        value = config.hydra.sweep.dir
        _refuse_if(_folder_problem("hydra.sweep.dir", value))
        try:
            self._held.enter_context(hold(Path(str(value)), what="hydra.sweep.dir"))
        except FolderBusy as e:
            raise SystemExit(f"error: {e}") from None
        held = held_sweep(Path(str(value)))
        if held:
            raise SystemExit(f"error: hydra.sweep.dir={value} already holds a sweep ({held}): a second sweep "
                             f"would mix its rows with those; fix: hydra.sweep.dir=<a new folder> (or leave it "
                             f"out: every sweep gets a folder of its own), or summarize this one again: "
                             f"python run.py mode=summarize +sweep_dir={value}")

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_job_end(self, config: Any, **kwargs: Any) -> None:
        pass

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self._held.close()


def _folder_problem(key: str, value: Any) -> str | None:
    """Why the folder `key`=`value` cannot take a job's outputs, or None."""
    from pathlib import Path

    from dsv4.app.targets import RUN_FOLDER_BYTES, judge

    if value is None or not str(value).strip():
        return (f"{key} is empty: the job's files would land in the current folder; fix: {key}=PATH (or leave it "
                f"out: each run and sweep gets a folder of its own)")
    reason = judge(Path(str(value)), RUN_FOLDER_BYTES)
    return f"{key}={value}: {reason}; fix: {key}=<a writable folder>" if reason else None


def _refuse_if(problem: str | None) -> None:
    if problem:
        raise SystemExit(f"error: {problem}")
