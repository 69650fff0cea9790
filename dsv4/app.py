"""The app behind `run.py`: compose -> instantiate -> device -> check -> (only then) build and run.

Modes: `run` (workload through the paged caches, compared with the oracle), `check` (validate the
combination for the device, allocate nothing), `info` (every option's verdict on the device), `bench`
(kernels on a GPU), `summarize` (a sweep folder's rows -> summary.csv/.md/.png). Every mode but
`summarize` is a function of the validated job, in `JOB_MODES`.

In a multirun (`python run.py -m ...`) a job is one cell of a sweep: a combination that cannot run
here is written as an `incompatible` row and the job returns normally; a real error is written as an
`error` row, its traceback printed to stderr, and the job returns normally too, so every cell gets
its row and the end-of-sweep summary is written (the summary callback then exits with status 1).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dsv4.catalogue import CONFIG_DIR, GROUPS, instantiate_group, options  # noqa: F401  (the app's names too)
from dsv4.compat import Combination, check
from dsv4.components.kv_pool import PoolConfig, page_groups, shortfall
from dsv4.device import DeviceInfo, local_platform
from dsv4.errors import USER_ERRORS, ConfigError, IncompatibleCombination, Problem, ResultMismatch
from dsv4.graph import GraphConfig
from dsv4.memory import indexer_kind, memory_table
from dsv4.parallel import ParallelConfig, torchrun_world_size
from dsv4.report import result_row, table, write_row
from dsv4.settings import MODES, SECTIONS, RunSettings  # noqa: F401  (MODES: the app's modes)
from dsv4.spec import ModelSpec
from dsv4.workload import Workload

RANK_ERROR_GRACE_S = 5.0     # how long a torchrun rank other than 0 waits before exiting on a user error


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A composed config turned into values; nothing allocated yet."""
    cfg: Any
    spec: ModelSpec
    device: DeviceInfo
    combo: Combination
    choices: dict[str, str]
    out_dir: Path
    parallel: ParallelConfig
    graphs: GraphConfig
    run: RunSettings
    workload: Workload
    pool: PoolConfig


def run_settings(cfg: DictConfig) -> RunSettings:
    """The config's top-level settings, validated (unknown keys included)."""
    return RunSettings.from_config({k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                                    for k, v in cfg.items() if k not in SECTIONS})


def make_job(cfg: DictConfig, *, choices: dict[str, str] | None = None, out_dir: str | Path | None = None) -> Job:
    """Every setting read and validated (dsv4.settings), then the values; nothing allocated."""
    run = run_settings(cfg)
    spec = ModelSpec.from_config(OmegaConf.to_container(cfg.model, resolve=True))
    device = DeviceInfo.from_config(OmegaConf.to_container(cfg.device, resolve=True))
    strategies = {g: instantiate_group(cfg[g], g) for g in GROUPS}
    par = ParallelConfig.from_config(OmegaConf.to_container(cfg.parallel, resolve=True) if cfg.get("parallel") else None)
    graphs = GraphConfig.from_config(OmegaConf.to_container(cfg.graph, resolve=True) if cfg.get("graph") else None)
    wl = OmegaConf.to_container(cfg.workload, resolve=True)
    workload, pool = Workload.from_config(wl), PoolConfig.from_config(wl.get("kv_pool"))
    if cfg.get("summary") is not None:          # read when a sweep is summarized; refused here if it is bad
        from dsv4.summary_metrics import SummaryView
        SummaryView.from_config(OmegaConf.to_container(cfg.summary, resolve=True))
    combo = Combination(spec=spec, tp_size=run.tp_size, dtype=run.dtype, **strategies,
                        world_size=torchrun_world_size() if par.launcher == "auto" else None, graphs=graphs.enabled,
                        index_page_keys=pool.compressed_block_size(4))
    if choices is None:
        choices = {g: getattr(strategies[g], "name", "?") for g in GROUPS} | {"model": spec.name}
    return Job(cfg=cfg, spec=spec, device=device, combo=combo, choices=dict(choices), parallel=par, graphs=graphs,
               out_dir=Path(out_dir) if out_dir is not None else Path.cwd(), run=run, workload=workload, pool=pool)


def problems_for(job: Job, *, running: bool) -> list[Problem]:
    here = local_platform()
    problems = check(job.combo, job.device, here=here)
    if running and job.device.platform not in ("cpu", here):     # every machine has a CPU
        problems.append(Problem(group="deployment", value=job.choices.get("deployment", "?"),
                                reason=f"describes a {job.device.describe()} machine; this machine's platform is {here}",
                                supported=tuple(sorted({"cpu", here})), fix="deployment=cpu"))
    return problems + workload_problems(job)


def workload_problems(job: Job) -> list[Problem]:
    """What `run` would find only after the work: layers the model lacks, a pool the workload cannot fit
    in (pages its requests hold at their end, at least), a dump folder that cannot be written."""
    wl, spec = job.workload, job.spec
    out = []
    bad = [l for l in wl.layers or () if l >= spec.num_hidden_layers]
    if bad:
        return [Problem(group="workload.layers", value=str(list(wl.layers)),
                        reason=f"model={spec.name} has layers 0..{spec.num_hidden_layers - 1}",
                        fix="workload.layers=null")]
    lengths = [wl.total_len(i) for i in range(len(wl.prompt_lens))]
    if len(lengths) > job.pool.max_requests:
        out.append(Problem(group="workload.kv_pool.max_requests", value=str(job.pool.max_requests),
                           reason=f"the workload holds {len(lengths)} requests at once",
                           fix=f"workload.kv_pool.max_requests={len(lengths)}"))
    groups = page_groups(window=spec.sliding_window, ratios={spec.compress_ratio(l) for l in wl.layer_indices(spec)},
                         pool=job.pool)
    short: dict[str, tuple] = {}           # knob -> (pages needed, group): the largest need of the groups it sizes
    for g, need in shortfall(groups, lengths):
        if g.knob != "max_requests" and need > short.get(g.knob, (0,))[0]:    # state pages: max_requests above
            short[g.knob] = (need, g)
    for knob, (need, g) in short.items():
        out.append(Problem(group=f"workload.kv_pool.{knob}", value=str(getattr(job.pool, knob)),
                           reason=f"the workload's requests ({max(lengths)} positions at most) hold at least {need} "
                                  f"pages of {g.block_size} rows of the {g.name} cache at their end; the pool has "
                                  f"{g.num_blocks}", fix=f"workload.kv_pool.{knob}={need + len(lengths)} "
                                  f"(or shorter prompts)"))
    if job.run.dump_dir:
        reason = unwritable(Path(job.run.dump_dir))
        if reason:
            out.append(Problem(group="dump_dir", value=job.run.dump_dir, reason=reason))
    return out


def unwritable(path: Path) -> str | None:
    """Why a folder cannot be created or written at `path`, or None."""
    if path.exists() and not path.is_dir():
        return "exists and is not a folder"
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not a writable folder"
    return None


def raise_if(job: Job, problems: list[Problem]) -> None:
    if problems:
        order = ("model", "backend", "deployment") + GROUPS
        shown = " ".join(f"{k}={job.choices[k]}" for k in order if k in job.choices)
        shown += f" tp_size={job.combo.tp_size} dtype={job.combo.dtype}"
        raise IncompatibleCombination(
            problems, header=f"Incompatible attention combination for model={job.spec.name} on {job.device.describe()}:",
            choices=shown)


def settings(job: Job) -> dict[str, Any]:
    return {"tp_size": job.combo.tp_size, "dtype": job.combo.dtype, "seed": job.run.seed,
            "processes": processes(job)}


def processes(job: Job) -> int:
    """How many processes run the job's ranks: one per rank under torchrun or parallel.launcher=spawn."""
    if job.combo.world_size is not None:
        return job.combo.world_size
    return job.combo.tp_size if job.parallel.launcher == "spawn" and job.combo.tp_size > 1 else 1


def summarize_sweep(cfg: DictConfig) -> None:
    from dsv4.summarize import summarize

    sweep_dir = cfg.get("sweep_dir")
    if not sweep_dir:
        raise ConfigError("mode=summarize needs the sweep folder: +sweep_dir=PATH "
                          "(e.g. +sweep_dir=multirun/cache_by_kernel/<date_time>)")
    s = summarize(str(sweep_dir))
    s.show()


def error_row(out_dir, e: Exception, *, choices: dict[str, str], device, settings: dict[str, Any]) -> Path:
    """The `error` result row of a job that failed (or could not be made), written into out_dir."""
    return write_row(Path(out_dir), result_row(status="error", problems=[], choices=dict(choices), device=device,
                                               settings=settings, error=f"{type(e).__name__}: {e}"))


def info_mode(job: Job, *, multirun: bool) -> None:
    print(info(job))


def check_mode(job: Job, *, multirun: bool) -> None:
    raise_if(job, problems_for(job, running=False))
    heads = job.spec.num_attention_heads // job.combo.tp_size
    print(f"OK: model={job.spec.name} on {job.device.describe()}, tp_size={job.combo.tp_size}, "
          f"{heads} heads per rank padded to {job.combo.head_padding.padded_heads(heads)}")
    print("  " + " ".join(f"{k}={v}" for k, v in job.choices.items()))


def bench_mode(job: Job, *, multirun: bool) -> None:
    from dsv4 import parallel
    from dsv4.bench import run_bench

    raise_if(job, problems_for(job, running=True))
    ranks = None
    if job.combo.world_size is not None:
        ranks = parallel.init(platform=job.device.platform, tp_size=job.combo.tp_size, config=job.parallel)
    run_bench(job, ranks)
    if ranks is not None:
        parallel.shutdown()


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
    try:
        return run_ranks(job)
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


# the modes that run a job (mode=summarize reads a sweep's folder instead: `main`)
JOB_MODES = {"run": run_mode, "check": check_mode, "info": info_mode, "bench": bench_mode}


def main(cfg: DictConfig, *, choices: dict[str, str] | None = None, out_dir: str | Path | None = None,
         multirun: bool = False) -> float | None:
    mode = cfg.get("mode", "run")
    try:
        mode = run_settings(cfg).mode
        if mode == "summarize":
            summarize_sweep(cfg)
            return None
        job = make_job(cfg, choices=choices, out_dir=out_dir)
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


def run_ranks(job: Job) -> float | None:
    """`mode=run` on this process's ranks: launched by torchrun, this process is one rank; with
    parallel.launcher=spawn and tp_size > 1 it starts the tp_size rank processes and waits for them;
    otherwise the ranks are simulated here."""
    from dsv4 import parallel
    from dsv4.runner import execute

    if job.combo.world_size is not None:
        return _run_rank(job)
    if processes(job) > 1:
        try:
            parallel.spawn(rank_main, job.combo.tp_size, job.cfg, job.choices, str(job.out_dir))
        except Exception as e:        # the failing rank printed its message; this one names the job
            row = job.out_dir / "result.json"
            if row.exists() and json.loads(row.read_text()).get("status") == "mismatch":   # rank 0 judged it
                raise ResultMismatch(json.loads(row.read_text()).get("error") or "outputs outside the error "
                                     f"budget (row: {row})") from None
            raise RuntimeError(f"a rank of the tp_size={job.combo.tp_size} job failed ({e}); its message is above") from None
        return _result_value(job.out_dir)
    return execute(job)


def rank_main(cfg: DictConfig, choices: dict[str, str], out_dir: str) -> None:
    """A spawned rank process (picklable arguments)."""
    from dsv4 import parallel

    try:
        job = make_job(cfg, choices=choices, out_dir=out_dir)
    except Exception as e:
        parallel.fail_rank(int(os.environ["RANK"]), e)
    _run_rank(job)


def _run_rank(job: Job) -> float | None:
    """One rank's process: join the group, run, leave. A failure ends this process at once with the
    rank's message (dsv4.parallel.fail_rank); the launcher ends the others."""
    from dsv4 import parallel
    from dsv4.runner import execute

    try:
        ranks = parallel.init(platform=job.device.platform, tp_size=job.combo.tp_size, config=job.parallel)
        value = execute(job, ranks)       # its gather is the last collective: no barrier, so other ranks
        parallel.shutdown()               # do not wait (under the group's timeout) while rank 0 grades
        return value
    except Exception as e:
        parallel.fail_rank(int(os.environ["RANK"]), e)


def _result_value(out_dir) -> float | None:
    import json

    path = Path(out_dir) / "result.json"
    return json.loads(path.read_text()).get("metrics.max_rel_err") if path.exists() else None


def sweep_cell_failed(e: Exception, row: Path) -> None:
    """A multirun job that failed: its `error` row is written; say so on stderr (with the traceback,
    unless it is a user error whose message says what to change) and return, so the other cells
    still run and the end-of-sweep summary is written (the summary callback then exits 1)."""
    if not isinstance(e, USER_ERRORS):
        traceback.print_exception(e)
    print(f"error (row: {row}): {type(e).__name__}: {e}", file=sys.stderr)


def cli(cfg: DictConfig, *, choices: dict[str, str], out_dir: str, multirun: bool = False) -> float | None:
    """`main` for the command line: a user error becomes its message on stderr and exit status 1,
    without a traceback (the message says what to change; a traceback would bury it). In a multirun
    the message is printed and the job returns: SystemExit would end the whole sweep (Hydra's
    launcher catches only Exception), and the job's row, if it has one, is already written."""
    try:
        return main(cfg, choices=choices, out_dir=out_dir, multirun=multirun)
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


def info(job: Job) -> str:
    """Every option of every strategy group, swapped into the current combination, with its verdict.
    For a deployment of another platform than this machine's (`deployment=h200 mode=info` on a CPU),
    the Python packages an option needs are listed as unknown: they can be looked for only there."""
    from dataclasses import replace
    from importlib.util import find_spec

    from dsv4.strategies.top_k import TOP_K

    here = local_platform()
    local = job.device.platform == here

    def row(option: str, combo, strat, current: bool) -> list:
        probs = check(combo, job.device, here=here)
        verdict = "ok" if not probs else "no"
        reason = "; ".join(f"{p.group}={p.value}: {p.reason}" for p in probs)
        modules = [m for m, _ in strat.needs(job.device).modules] if hasattr(strat, "needs") else []
        if not modules:
            packages = None
        elif local:
            packages = ", ".join(f"{m} {'found' if find_spec(m.partition('.')[0]) else 'missing'}" for m in modules)
        else:
            packages = ", ".join(f"{m} unknown" for m in modules)
        return [f"{option}{'*' if current else ''}", verdict, packages, reason]

    rows = []
    for group in GROUPS:
        for name, strat in options(group).items():
            rows.append(row(f"{group}={name}", replace(job.combo, **{group: strat}), strat,
                            getattr(job.combo, group).name == strat.name))
    ix = job.combo.indexer
    for name, top_k in TOP_K.items():           # the indexer's own setting, with the job's indexer
        rows.append(row(f"indexer.top_k={name}", replace(job.combo, indexer=replace(ix, top_k=name)), top_k,
                        ix.top_k == name))
    where = ("packages looked for here" if local else
             f"packages unknown: looked for only on a {job.device.platform} machine")
    head = (f"dsv4 info: model={job.spec.name}, tp_size={job.combo.tp_size}, dtype={job.combo.dtype}, "
            f"device {job.device.describe()} (this machine: {here}; {where})\n"
            f"* = current choice\n")
    layouts = list(options("cache_layout").values())
    return (head + table(["option", "verdict", "packages", "why not"], rows, left=(0, 2, 3))
            + f"\n\nKV bytes per rank, model={job.spec.name} (B/tok: per context token, compressed rows + "
              f"{indexer_kind(job.combo.dtype, job.combo.indexer)} indexer keys):\n"
            + memory_table(job.spec, layouts, job.combo.dtype, job.combo.indexer))
