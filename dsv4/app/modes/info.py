"""`mode=info`: every option of every strategy group (nested ones included), swapped into the job's combination,
with its verdict."""
from __future__ import annotations

from dsv4.checks.catalogue import GROUPS, NESTED_GROUPS, options
from dsv4.checks.compat import check
from dsv4.values.device import local_platform
from dsv4.app.job import Job, memory_line
from dsv4.app.kv_memory import indexer_kind, memory_table
from dsv4.reports.report import table


def info_mode(job: Job, *, multirun: bool) -> None:
    print(info(job))


def info(job: Job) -> str:
    """Every option of every strategy group and nested group (`indexer.top_k`), swapped into the current
    combination, with its verdict.
    For a deployment of another platform than this machine's (`deployment=h200 mode=info` on a CPU),
    the Python packages an option needs are listed as unknown: they can be looked for only there."""
    from importlib.util import find_spec

    here = local_platform()
    local = job.device.platform == here

    def row(option: str, combo, strat, current: bool) -> list:
        probs = check(combo, job.device, here=here)
        verdict = "ok" if not probs else "no"
        reason = "; ".join(f"{p.group}={p.value}: {p.reason}" for p in probs)
        needs = strat.needs(job.device) if hasattr(strat, "needs") else None
        modules = [m for m, _ in needs.modules] if needs is not None else []
        # head paddings have no needs: they choose a count of heads, which no step changes
        invariant = "yes" if needs is None or needs.batch_invariant else f"no: {needs.variance}"
        if not modules:
            packages = None
        elif local:
            packages = ", ".join(f"{m} {'found' if find_spec(m.partition('.')[0]) else 'missing'}" for m in modules)
        else:
            packages = ", ".join(f"{m} unknown" for m in modules)
        return [f"{option}{'*' if current else ''}", verdict, packages, invariant, reason]

    rows = []
    for group in GROUPS + NESTED_GROUPS:
        for name, strat in options(group).items():
            rows.append(row(f"{group}={name}", job.combo.with_choice(group, strat), strat,
                            job.combo.choice(group).name == strat.name))
    where = ("packages looked for here" if local else
             f"packages unknown: looked for only on a {job.device.platform} machine")
    head = (f"dsv4 info: model={job.spec.name}, tp_size={job.combo.tp_size}, dtype={job.combo.dtype}, "
            f"device {job.device.describe()} (this machine: {here}; {where})\n"
            f"* = current choice\n")
    layouts = list(options("cache_layout").values())
    return (head + table(["option", "verdict", "packages", "batch-invariant", "why not"], rows, left=(0, 2, 3, 4))
            + f"\n\nKV bytes per rank, model={job.spec.name} (B/tok: per context token, compressed rows + "
              f"{indexer_kind(job.combo.dtype, job.combo.indexer)} indexer keys):\n"
            + memory_table(job.spec, layouts, job.combo.dtype, job.combo.indexer)
            + f"\n\nThis job's {memory_line(job, running=False)}")
