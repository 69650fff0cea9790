"""A job: the composed config read once into typed values -- model, device, the strategies, workload, pools,
graphs, parallel and run settings -- and what judges it before anything runs. No torch; nothing below the
modes sees the Hydra config (a job is a plain picklable value)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dsv4.checks.catalogue import GROUPS, default_override, instantiate_group
from dsv4.checks.compat import Combination, check
from dsv4.strategies.choice import Strategies
from dsv4.components.kv_pool import PagePeak, PoolConfig, bound_pages, peak_pages
from dsv4.values.device import DeviceInfo, local_platform
from dsv4.values.errors import IncompatibleCombination, Problem
from dsv4.values.graph_config import GraphConfig
from dsv4.app.job_memory import GIB, JobMemory, estimate, host_available, job_page_groups, step_parts
from dsv4.app.parallel import ParallelConfig, backend_problems, processes, torchrun_world_size
from dsv4.values.settings import SECTIONS, RunSettings, section
from dsv4.values.spec import ModelSpec
from dsv4.app.targets import dump_bytes, replaced_bytes, short_of_space, unwritable
from dsv4.app.workload import Workload


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
    """Every setting read and validated (dsv4.values.settings), then the values; nothing allocated."""
    def needed(key: str) -> dict[str, Any]:
        return section(cfg, key, fix=default_override(key) if key not in cfg else None)

    run = run_settings(cfg)
    spec = ModelSpec.from_config(needed("model"))
    device = DeviceInfo.from_config(needed("device"))
    strategies = Strategies(**{g: instantiate_group(needed(g), g) for g in GROUPS})
    par = ParallelConfig.from_config(section(cfg, "parallel", needed=False))
    graphs = GraphConfig.from_config(section(cfg, "graph", needed=False))
    wl = needed("workload")
    workload, pool = Workload.from_config(wl), PoolConfig.from_config(wl.get("kv_pool"))
    if cfg.get("summary") is not None:          # read when a sweep is summarized; refused here if it is bad
        from dsv4.reports.summary_metrics import SummaryView
        SummaryView.from_config(OmegaConf.to_container(cfg.summary, resolve=True))
    combo = Combination(spec=spec, strategies=strategies, tp_size=run.tp_size, dtype=run.dtype,
                        world_size=torchrun_world_size() if par.launcher == "auto" else None, graphs=graphs.enabled,
                        capture_tokens=max(graphs.capture_sizes) if graphs.enabled else 0,
                        index_page_keys=pool.compressed_block_size(4), batch_invariant=run.batch_invariant)
    if choices is None:
        choices = {g: getattr(combo.choice(g), "name", "?") for g in GROUPS} | {"model": spec.name}
    return Job(spec=spec, device=device, combo=combo, choices=dict(choices), parallel=par, graphs=graphs,
               out_dir=Path(out_dir) if out_dir is not None else Path.cwd(), run=run, workload=workload, pool=pool)


def problems_for(job: Job, *, running: bool) -> list[Problem]:
    here = local_platform()
    problems = check(job.combo, job.device, here=here)
    if running and job.device.platform not in ("cpu", here):     # every machine has a CPU
        problems.append(Problem(group="deployment", value=job.choices.get("deployment", "?"),
                                reason=f"describes a {job.device.describe()} machine; this machine's platform is {here}",
                                supported=tuple(sorted({"cpu", here})), fix="deployment=cpu"))
    problems += workload_problems(job) + backend_problems(job)
    if problems:
        return problems
    # the memory in closed form first: a job that cannot fit is refused before the pool's dry run
    return memory_problems(job, running=running) or pool_problems(job)


def workload_problems(job: Job) -> list[Problem]:
    """What `run` would find only after the work: layers the model lacks, positions past the model's, more
    requests than the pool holds, a dump folder that cannot be written or already holds files, and (for
    `run`) an output folder that already holds a job's result. (The pool's pages: `pool_problems`.)"""
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
    if job.run.dump_dir is not None:
        out += dump_problems(job)
    if job.run.mode == "run" and (job.out_dir / "result.json").exists():
        out.append(Problem(group="hydra.run.dir", value=str(job.out_dir),
                           reason="already holds a job's result.json, which this run would replace",
                           fix="hydra.run.dir=<a new folder> (or leave it out: every run gets a folder of its own)"))
    return out


def pool_problems(job: Job) -> list[Problem]:
    """A pool the workload cannot fit in: the pages its steps hold at once (`knob_peaks`) per size of the pool."""
    out = []
    for knob, peak in knob_peaks(job).items():
        g = peak.group
        if peak.pages <= g.num_blocks:
            continue
        when = (f"step {peak.step} of {job.workload.num_steps()}, {_phase(job.workload, peak.step)}" if peak.step
                else "at most, counted per request")
        out.append(Problem(group=f"workload.kv_pool.{knob}", value=str(getattr(job.pool, knob)),
                           reason=f"the workload's steps hold up to {peak.pages} pages of {g.block_size} rows of the "
                                  f"{g.name} cache at once ({when}); the pool has {g.num_blocks}",
                           fix=f"workload.kv_pool.{knob}={peak.pages} (or shorter prompts or prefill chunks)"))
    return out


def _phase(workload: Workload, step: int) -> str:
    """The phase of step `step` (1-based): the prefill steps come first."""
    return "prefill" if step <= workload.num_steps() - workload.decode_steps else "decode"


def memory_budgets(job: Job, mem: JobMemory, *, running: bool) -> list[tuple[int, int, str, str]]:
    """(need, have, what has it, which memory) for each memory the job's peak is judged against: the
    host's -- this machine's free memory -- for a CPU deployment or a job about to run here, and the
    device's (`device.memory_gib`) for an accelerator deployment."""
    out = []
    if job.device.platform == "cpu" or running:
        have, source = host_available()
        out.append((mem.device if mem.on_host else mem.host, have, f"this machine has {have / GIB:.1f} GiB free "
                    f"({source})", "memory" if mem.on_host else "host memory"))
    if not mem.on_host and job.device.memory_gib:
        out.append((mem.device, int(job.device.memory_gib * GIB),
                    f"the {job.device.describe()} has {job.device.memory_gib:g} GiB (device.memory_gib)",
                    "device memory"))
    return out


def memory_line(job: Job, *, running: bool, mem: JobMemory | None = None) -> str:
    """The job's estimated peak (`mem`, if the caller has it) and what it is judged against, in one line
    (check, info, run)."""
    mem = mem or estimate(job)
    judged = "; ".join(f"{what}" for _, _, what, _ in memory_budgets(job, mem, running=running))
    return f"memory: {mem.describe()}" + (f"; {judged}" if judged else "; the device's memory is not known "
                                                                         "(device.memory_gib)")


def memory_problems(job: Job, *, running: bool) -> list[Problem]:
    """A job whose estimated peak (dsv4/app/job_memory.py) is more than a memory it is judged against
    (`memory_budgets`). The fix names what to shrink: the largest part of that peak."""
    mem = estimate(job)
    return [Problem(group="memory", value=f"~{need / GIB:.1f} GiB",
                    reason=f"the job's estimated {mem.describe()} is more than the {which} it has: {what}",
                    fix=memory_fix(job, mem, host=which == "host memory"))
            for need, have, what, which in memory_budgets(job, mem, running=running) if need > have]


# request-steps up to which the pool's dry run walks the steps (about a second of pure Python); past it the
# pages are bounded per request in closed form (`kv_pool.bound_pages`: never fewer than the dry run's)
DRY_RUN_STEPS = 2 ** 18


def knob_peaks(job: Job) -> dict[str, PagePeak]:
    """Per size of the pool (`workload.kv_pool.<knob>`; the state pages' max_requests is checked apart) the
    largest page peak of the groups it sizes over the workload's steps (the groups a knob sizes share it).
    The dry run is pure Python over every step and request: a job's checks ask it again (compose, then a
    build; the memory fix), so it is kept per page groups and workload. Its work grows with the steps, never
    with the pool's pages; past DRY_RUN_STEPS it is a closed-form bound."""
    return dict(_knob_peaks(tuple(job_page_groups(job).items()), job.workload))


@functools.lru_cache(maxsize=8)
def _knob_peaks(groups: tuple, workload: Workload) -> dict[str, PagePeak]:
    out: dict[str, PagePeak] = {}
    n = len(workload.prompt_lens)
    if workload.num_steps() * n <= DRY_RUN_STEPS:
        peaks = peak_pages(dict(groups), workload.iter_steps())
    else:
        decode = workload.decode_tokens if workload.decode_steps else 0
        peaks = bound_pages(dict(groups), [(workload.total_len(i), max(min(workload.prefill_chunk, p), decode))
                                           for i, p in enumerate(workload.prompt_lens)])
    for peak in peaks:
        knob = peak.group.knob
        if knob != "max_requests" and peak.pages > getattr(out.get(knob), "pages", -1):
            out[knob] = peak
    return out


def memory_fix(job: Job, mem: JobMemory, *, host: bool) -> str:
    """What to change to shrink the largest part of a peak that does not fit."""
    parts = {"record": mem.record, "oracle": mem.oracle, "float_weights": mem.float_weights} if host else \
        {k: v for k, v in mem.parts().items() if mem.on_host or k in ("kv_pools", "weights", "step")}
    largest = max(parts, key=parts.__getitem__)
    if largest == "kv_pools":
        need = {knob: max(1, peak.pages) for knob, peak in knob_peaks(job).items()}
        need["max_requests"] = len(job.workload.prompt_lens)            # the state pages: requests held at once
        knob = max(need, key=lambda k: getattr(job.pool, k) / need[k])     # the most oversized
        if need[knob] < getattr(job.pool, knob):
            held = "the requests this workload holds at once" if knob == "max_requests" else \
                "the pages this workload's steps hold at most"
            return f"workload.kv_pool.{knob}={need[knob]} ({held})"
        return "shorter prompts or fewer requests"
    if largest == "step":
        return step_fix(job)
    if largest in ("weights", "float_weights"):
        fewer = "fewer layers (workload.layers=[...])"
        if largest == "weights" and not mem.on_host and job.combo.tp_size > 1 and processes(job) == 1:
            return (f"{fewer}, or one GPU per rank: torchrun --nproc-per-node {job.combo.tp_size} "
                    f"(the ranks now share this process's device)")
        return fewer
    return "shorter prompts (the grading keeps every token's rows: memory grows with the prompts' length)"


def step_fix(job: Job) -> str:
    """What to change to shrink a step's workspaces: the setting behind their largest part."""
    parts = step_parts(job)
    largest = max(parts, key=parts.__getitem__)
    spec, wl = job.spec, job.workload
    fewer = f"a smaller workload.prefill_chunk (now {wl.prefill_chunk}) or fewer requests per step"
    return {"plan": f"a smaller model.sliding_window (now {spec.sliding_window}) or {fewer}",
            "indexer": f"a smaller model.index_topk (now {spec.index_topk}), shorter prompts or {fewer}",
            "mqa": f"a smaller model.index_topk (now {spec.index_topk}) or model.sliding_window (now "
                   f"{spec.sliding_window}), " + (f"a smaller mqa_kernel.chunk (now {job.combo.mqa_kernel.chunk}) "
                                                  if hasattr(job.combo.mqa_kernel, "chunk") else "") + f"or {fewer}",
            }.get(largest, fewer)


def dump_problems(job: Job) -> list[Problem]:
    """A dump folder that is empty text, cannot be made or written, lacks the room for the dump
    (dsv4.app.targets), or already holds files the dump would replace (unless dump_overwrite says so)."""
    value = job.run.dump_dir
    if not value.strip():
        return [Problem(group="dump_dir", value="", reason="is empty (no folder named)",
                        fix="dump_dir=PATH, or leave it out for no dump")]
    dump = Path(value)
    reason = unwritable(dump)
    if reason:
        return [Problem(group="dump_dir", value=value, reason=reason, fix="dump_dir=<a writable folder>")]
    if not job.run.dump_overwrite and dump.is_dir() and any(dump.iterdir()):
        return [Problem(group="dump_dir", value=value, reason="already holds files, which the dump would replace",
                        fix="dump_dir=<a new folder> (or dump_overwrite=true to replace them)")]
    short = short_of_space(dump, dump_bytes(job), reused=replaced_bytes(dump) if job.run.dump_overwrite else 0)
    if short:
        return [Problem(group="dump_dir", value=value, reason=f"the dump (weights, inputs, outputs): {short}",
                        fix="dump_dir=<a folder on a disk with more room> (or fewer layers: workload.layers=[...], "
                            "or shorter prompts)")]
    return []


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
