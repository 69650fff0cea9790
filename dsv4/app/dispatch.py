"""The app behind `run.py`: compose -> a typed job (dsv4/app/job.py) -> its mode (dsv4/app/modes/), which checks the
combination for the device before it builds or runs anything.

Modes: `run` (workload through the paged caches, compared with the oracle), `check` (validate the
combination for the device, allocate nothing), `info` (every option's verdict on the device), `bench`
(kernels on a GPU), `summarize` (a sweep folder's rows -> summary.csv/.md/.png). Every mode but
`summarize` is a function of the validated job, in `dsv4.app.modes.JOB_MODES`.

In a multirun (`python run.py -m ...`) a job is one cell of a sweep: a combination that cannot run
here is written as an `incompatible` row and the job returns normally; a real error is written as an
`error` row, its traceback printed to stderr, and the job returns normally too, so every cell gets
its row and the end-of-sweep summary is written (the summary callback then exits with status 1).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig

from dsv4.values.errors import USER_ERRORS
from dsv4.app.job import make_job, run_settings
from dsv4.app.modes import JOB_MODES
from dsv4.checks.no_effect import inert_settings
from dsv4.app.parallel import torchrun_world_size
from dsv4.reports.report import error_row, sweep_cell_failed
from dsv4.values.settings import resolved

RANK_ERROR_GRACE_S = 5.0     # how long a torchrun rank other than 0 waits before exiting on a user error


def run_config(cfg: DictConfig, *, choices: dict[str, str] | None = None, out_dir: str | Path | None = None,
         multirun: bool = False, overrides: Sequence[str] = ()) -> float | None:
    """Run the mode of the composed `cfg`; `overrides` (the command line's) are named on stderr, once each,
    where they have no effect in the job (dsv4/checks/no_effect.py)."""
    mode = resolved(cfg).get("mode", "run")
    try:
        mode = run_settings(cfg).mode
        if mode == "summarize":
            from dsv4.app.modes.summarize import summarize_mode

            summarize_mode(cfg)
            return None
        job = make_job(cfg, choices=choices, out_dir=out_dir)
        for line in inert_settings(job, overrides, multirun=multirun):
            print(f"warning: {line}", file=sys.stderr, flush=True)
    except Exception as e:
        if mode != "run":
            raise
        # the row says which cell could not even be made into a job (e.g. an option's invalid field)
        path = error_row(out_dir if out_dir is not None else Path.cwd(), e, choices=choices or {}, device=None,
                         settings={k: cfg.get(k) for k in ("tp_size", "dtype", "seed")})
        if multirun:
            return sweep_cell_failed(e, path)
        raise
    return JOB_MODES[mode](job, multirun=multirun)


def run_command(cfg: DictConfig, *, choices: dict[str, str], out_dir: str, multirun: bool = False,
        overrides: Sequence[str] = ()) -> float | None:
    """`run_config` for the command line: a user error becomes its message on stderr and exit status 1,
    without a traceback (the message says what to change; a traceback would bury it). In a multirun
    the message is printed and the job returns: SystemExit would end the whole sweep (Hydra's
    launcher catches only Exception), and the job's row, if it has one, is already written."""
    try:
        return run_config(cfg, choices=choices, out_dir=out_dir, multirun=multirun, overrides=overrides)
    except USER_ERRORS as e:
        if multirun:
            print(f"error: {e}", file=sys.stderr)
            return None
        if torchrun_world_size() is not None and int(os.environ["RANK"]) != 0:
            # every rank found the same problem and rank 0 says it: leave it the time to, since torchrun
            # stops the other ranks as soon as one exits with an error
            time.sleep(RANK_ERROR_GRACE_S)
            raise SystemExit(1) from None
        raise SystemExit(f"error: {e}") from None
