"""The app's modes, one module each. JOB_MODES maps `mode=` to the function that runs it on a validated job,
`fn(job, *, multirun) -> value`; `mode=summarize` reads a sweep's folder instead (summarize.summarize_mode)."""
from __future__ import annotations

from dsv4.app.modes.bench import bench_mode
from dsv4.app.modes.check import check_mode
from dsv4.app.modes.info import info_mode
from dsv4.app.modes.run import run_mode

JOB_MODES = {"run": run_mode, "check": check_mode, "info": info_mode, "bench": bench_mode}
