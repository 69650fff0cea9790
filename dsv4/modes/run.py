"""`mode=run`: the workload through the paged caches, graded against the oracle; in a multirun one cell of
the sweep, whose failure is its row, not the end of the sweep."""
from __future__ import annotations

import sys

from dsv4.errors import ResultMismatch
from dsv4.job import Job, problems_for, raise_if, settings
from dsv4.report import error_row, result_row, sweep_cell_failed, write_row


def run_mode(job: Job, *, multirun: bool) -> float | None:
    """The run: an `incompatible` row for a combination check() refuses, else the layer run against the
    oracle (its row written by the run; an `error` row if it fails). In a multirun a failed cell says so and
    returns, so that the sweep goes on."""
    problems = problems_for(job, running=True)
    if problems:
        path = write_row(job.out_dir, result_row(status="incompatible", problems=problems, choices=job.choices,
                                                 device=job.device, settings=settings(job)))
        if multirun:                # a cell of the sweep's matrix, not a failed sweep
            print(f"incompatible (row: {path}):\n  " + "\n  ".join(p.line() for p in problems), file=sys.stderr)
            return None
        raise_if(job, problems)
    from dsv4.parallel import run_ranks
    from dsv4.runner import execute

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
