"""`mode=bench` under torchrun: the layer step as tp_size processes beside the same step in one process.

One layer of each type, its requests filled to the context directly (as the whole-layer table fills
them), decode steps of SERVING_STEP's requests x tokens replayed from CUDA graphs where the device has
them. A layer's time is its graph replay plus wo_b's all-reduce over the group, which runs between the
layers' graphs (eagerly: the partial sums of every rank meet there); both are read from CUDA events.
Beside the times, each rank's memory: its weights, its KV pools, the allocator's peak.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from dsv4.speed.cases import SERVING_STEP
from dsv4.reports.report import table
from dsv4.speed.rows import printed_rows

STEPS, KEPT = 8, 6              # decode steps timed, of which the last KEPT count


def _engine(job, ranks, nreq: int, tokens: int, context: int):
    """An engine of this process's ranks holding one layer of each type, its requests filled to `context`
    and its decode graphs captured."""
    from dsv4.speed.layer import Backend, engine_for, fill

    eng = engine_for(job, Backend(label="tp", combo=job.combo), job.spec.one_layer_per_type(), nreq=nreq,
                     tokens=tokens, context=context, graphs=job.device.platform != "cpu", steps=STEPS, ranks=ranks)
    fill(eng, list(range(nreq)), context, seed=1)
    eng.warm_up()
    return eng


def step_times(job, ranks, step=SERVING_STEP) -> tuple[dict[int, tuple[float, float]], list[dict]]:
    """Per layer, the median µs of a decode step and of the all-reduce within it; and this process's
    ranks' memory (runner.rank_memory), the peak being this engine's alone."""
    from dsv4.components.engine import timer_for
    from dsv4.app.runner import rank_memory

    nreq, tokens, context = step
    cuda = job.device.platform != "cpu"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    eng = _engine(job, ranks, nreq, tokens, context)
    g = torch.Generator().manual_seed(2)
    rids = [r for r in range(nreq) for _ in range(tokens)]
    times: dict[int, list] = {layer: [] for layer in eng.layers}
    for i in range(STEPS):
        x = torch.randn(nreq * tokens, job.spec.hidden_size, generator=g)
        p0 = context + tokens * i
        out = eng.step(x, torch.arange(p0, p0 + tokens).repeat(nreq), rids, timer=timer_for(job.device.platform))
        for layer in times:
            times[layer].append((out.seconds[layer] * 1e6, out.reduce_seconds.get(layer, 0.0) * 1e6))
    memory = rank_memory(eng, ranks, job.device)
    del eng
    med = {layer: (statistics.median(t for t, _ in v[-KEPT:]), statistics.median(a for _, a in v[-KEPT:]))
           for layer, v in times.items()}
    return med, memory


def bench_tp_step(job, ranks, step=SERVING_STEP, *, record=None) -> str | None:
    """Under torchrun: the job's combination as tp_size processes (all-reduce over the group), then the
    same combination in one process at tp_size=1 (rank 0 alone, after the others have finished). Rank 0
    returns the table; every rank's memory is in it (the largest of the ranks). Rank 0 hands the rows to
    `record` (dsv4/speed/rows.py)."""
    from dsv4.app.parallel import Ranks

    tp, mem = step_times(job, ranks, step)
    mem = [m for part in ranks.gather(mem) for m in part]
    if not ranks.is_main:
        return None
    one, mem1 = step_times(replace(job, combo=replace(job.combo, tp_size=1, world_size=None)), Ranks(), step)

    def mib(ms, key):
        return max(m[key] for m in ms) / 2**20

    n = ranks.world_size
    headers = ["layer", "tp_size=1 µs/step", f"tp_size={n} µs/step", "of which all-reduce µs", "all-reduce share",
               "speed-up"]
    rows = [[job.spec.layer_type(layer), f"{one[layer][0]:.1f}", f"{t:.1f}", f"{a:.1f}", f"{a / t:.1%}",
             f"{one[layer][0] / t:.2f}"] for layer, (t, a) in tp.items()]
    peak = f"peak ({mem[0]['peak_of']})"
    memory = [[name, f"{mib(mem1, key):.0f}", f"{mib(mem, key):.0f}"]
              for key, name in (("weight_bytes", "weights"), ("kv_pool_bytes", "KV pools"), ("peak_bytes", peak))]
    if record is not None:
        given = {"step": f"{step[0]}x{step[1]}@{step[2]}"}
        record(printed_rows("bench/tp_step", headers, rows, keys=1, unit=None, given=given)
               + printed_rows("bench/tp_step/memory", ["memory per rank", "tp_size=1", f"tp_size={n}"], memory,
                              keys=1, unit="MiB", given=given))
    rows.append(["memory per rank (MiB)", "", "", "", "", ""])
    rows += [[f"  {name}", one_rank, n_ranks, "", "", ""] for name, one_rank, n_ranks in memory]
    return table(headers, rows, left=(0,))
