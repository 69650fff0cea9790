"""A job: the composed config read once into typed values -- model, device, the strategies, workload, pools,
graphs, parallel and run settings -- and what judges it before anything runs. No torch; nothing below the
modes sees the Hydra config (a job is a plain picklable value)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dsv4.catalogue import GROUPS, instantiate_group
from dsv4.compat import Combination, check
from dsv4.components.kv_pool import PoolConfig, page_groups, shortfall
from dsv4.device import DeviceInfo, local_platform
from dsv4.errors import IncompatibleCombination, Problem
from dsv4.graph import GraphConfig
from dsv4.parallel import ParallelConfig, processes, torchrun_world_size
from dsv4.settings import SECTIONS, RunSettings
from dsv4.spec import ModelSpec
from dsv4.workload import Workload


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A composed config turned into values; nothing allocated yet (and nothing of Hydra kept: a job is
    what a spawned rank process receives)."""
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
    return Job(spec=spec, device=device, combo=combo, choices=dict(choices), parallel=par, graphs=graphs,
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
    in (pages its requests hold at their end, at least), a dump folder that cannot be written or already holds
    files, and (for `run`) an output folder that already holds a job's result."""
    wl, spec = job.workload, job.spec
    out = []
    bad = [l for l in wl.layers or () if l >= spec.num_hidden_layers]
    if bad:
        return [Problem(group="workload.layers", value=str(list(wl.layers)),
                        reason=f"model={spec.name} has layers 0..{spec.num_hidden_layers - 1}",
                        fix="workload.layers=null")]
    lengths = [wl.total_len(i) for i in range(len(wl.prompt_lens))]
    if max(lengths, default=0) > spec.max_position_embeddings:
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        out.append(Problem(group="workload.prompt_lens", value=str(list(wl.prompt_lens)),
                           reason=f"request {longest} reaches position {lengths[longest] - 1} with its decode steps; "
                                  f"model={spec.name} has positions 0..{spec.max_position_embeddings - 1} "
                                  f"(max_position_embeddings)",
                           fix=f"shorter prompts (request {longest}: at most "
                               f"{spec.max_position_embeddings - lengths[longest] + wl.prompt_lens[longest]} tokens)"))
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
        dump = Path(job.run.dump_dir)
        reason = unwritable(dump)
        if reason:
            out.append(Problem(group="dump_dir", value=job.run.dump_dir, reason=reason))
        elif not job.run.dump_overwrite and dump.is_dir() and any(dump.iterdir()):
            out.append(Problem(group="dump_dir", value=job.run.dump_dir,
                               reason="already holds files, which the dump would replace",
                               fix="dump_dir=<a new folder> (or dump_overwrite=true to replace them)"))
    if job.run.mode == "run" and (job.out_dir / "result.json").exists():
        out.append(Problem(group="hydra.run.dir", value=str(job.out_dir),
                           reason="already holds a job's result.json, which this run would replace",
                           fix="hydra.run.dir=<a new folder> (or leave it out: every run gets a folder of its own)"))
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
