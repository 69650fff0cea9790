"""`mode=run`: the workload through the paged caches, graded against the oracle; in a multirun one cell of
the sweep, whose failure is its row, not the end of the sweep."""
from __future__ import annotations

import os
import sys
from contextlib import ExitStack
from pathlib import Path

from dsv4.values.errors import Problem, ResultMismatch
from dsv4.app.job import Job, dump_problems, problems_for, raise_if, settings
from dsv4.app.parallel import torchrun_world_size
from dsv4.reports.report import error_row, result_row, sweep_cell_failed, write_row
from dsv4.app.targets import FolderBusy, hold


def run_mode(job: Job, *, multirun: bool) -> float | None:
    """The run, holding its folder and its dump folder (dsv4.app.targets.hold) so that a second run on either is
    refused before its work: under torchrun the ranks share the folders, and rank 0 holds them."""
    with ExitStack() as held:
        if holds_folders():
            held.enter_context(hold(job.out_dir, what="hydra.run.dir"))     # refused: no row, the other writes it
        return judged_run(job, multirun=multirun, held=held)


def holds_folders() -> bool:
    """Whether this process holds the job's folders: every process but torchrun's ranks other than 0."""
    return torchrun_world_size() is None or int(os.environ["RANK"]) == 0


def judged_run(job: Job, *, multirun: bool, held: ExitStack) -> float | None:
    """An `incompatible` row for a combination check() refuses (or a dump folder another run holds), else
    the layer run against the oracle (its row written by the run; an `error` row if it fails). In a multirun
    a failed cell says so and returns, so that the sweep goes on."""
    problems = problems_for(job, running=True)
    dump = Path(job.run.dump_dir) if job.run.dump_dir else None
    if not problems and dump is not None and holds_folders() and dump.resolve() != job.out_dir.resolve():
        try:
            held.enter_context(hold(dump, what="dump_dir"))
            problems = dump_problems(job)        # again, held: a run that ended since the check left its files
        except FolderBusy as e:
            problems = [Problem(group=e.what, value=job.run.dump_dir, reason=e.reason, fix=e.fix)]
    if problems:
        path = write_row(job.out_dir, result_row(status="incompatible", problems=problems, choices=job.choices,
                                                 device=job.device, settings=settings(job)))
        if multirun:                # a cell of the sweep's matrix, not a failed sweep
            print(f"incompatible (row: {path}):\n  " + "\n  ".join(p.line() for p in problems), file=sys.stderr)
            return None
        raise_if(job, problems)
    from dsv4.app.parallel import run_ranks
    from dsv4.app.runner import execute

    try:
        return run_ranks(job, execute)
    except ResultMismatch as e:         # its row (status mismatch) is written
        if multirun:
            print(f"mismatch: {e}", file=sys.stderr)
            return None
        raise
    except Exception as e:
        path = error_row(job.out_dir, e, choices=job.choices, device=job.device, settings=settings(job))
        if multirun:
            return sweep_cell_failed(e, path)
        raise
