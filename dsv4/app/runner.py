"""`mode=run`: build -> run -> grade -> report. Build the job's engine (its ranks in this process), run the
workload through its paged caches, grade every layer against the oracle (dsv4.app.grades), then print the table,
write result.json and the dump; a verdict that finds a layer wrong raises after its row is written."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import torch

from dsv4.checks.compat import DTYPE_ERROR_BUDGET, selection_gap
from dsv4.components.builders import build_engine
from dsv4.components.checkpoint import load_or_random
from dsv4.components.engine import Engine
from dsv4.components.kv_pool import PoolConfig
from dsv4.components.weights import random_layer_weights
from dsv4.app.dump import write_dump
from dsv4.values.errors import ResultMismatch
from dsv4.formats.fp8_blocks import LinearNumerics
from dsv4.formats.row_format import RowKind
from dsv4.app.grades import LayerMetrics, LayerSpeed, OracleCase, RunMetrics, grade_layer, verdict
from dsv4.values.graph_config import GraphConfig
from dsv4.app.job import memory_line, settings
from dsv4.app.job_memory import JobMemory, estimate
from dsv4.app.kv_memory import GIB, indexer_kind, layer_memory, model_memory, summary_lines
from dsv4.app.parallel import Ranks
from dsv4.reports.report import result_row, step_progress, table, write_row
from dsv4.app.workload import RunRecord, run_workload


def job_engine(job, weights: dict[int, dict], pool: PoolConfig, fp8: dict | None = None,
               ranks: Ranks | None = None, graphs: GraphConfig | None = None) -> Engine:
    """The job's engine (builders.build_engine with the job's values) on this process's ranks: all tp_size of
    them (simulated), or its one rank (distributed). `fp8`: per layer the linears stored as fp8 blocks
    (`load_or_random`); `graphs`: CUDA-graph decode (default: the job's `graph` config)."""
    c = job.combo
    ranks = ranks or Ranks(tp_size=c.tp_size)
    return build_engine(spec=job.spec, weights=weights, strategies=c.strategies, pool=pool, device=job.device,
                        dtype=c.dtype, tp_size=c.tp_size, graphs=graphs if graphs is not None else job.graphs,
                        fp8=fp8, overlap=job.run.overlap, batch_invariant=c.batch_invariant, ranks=ranks.local,
                        all_reduce=ranks.all_reduce if ranks.distributed else None)


# ---- build -> run -> grade -> report ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Built:
    """What the build made: the workload's layers, their weights (float, and the fp8 blocks of those stored
    so), the engine over them, and the process's resident bytes before any of it."""
    layers: Sequence[int]
    weights: dict[int, dict]
    fp8: dict
    engine: Engine
    rss_at_start: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Ran:
    """What running the workload left: its record (the main rank's holds the outputs), the warm-up's
    seconds, and every rank's memory (`rank_memory`, gathered from every process)."""
    record: RunRecord
    warm_up_s: float
    ranks: list[dict[str, Any]]


def execute(job, ranks: Ranks | None = None) -> float | None:
    """Run the workload on this process's ranks; the main rank grades it, prints and writes result.json
    (other ranks return None)."""
    ranks = ranks or Ranks(tp_size=job.combo.tp_size)
    mem = estimate(job)             # the job's peak, estimated before the work
    if ranks.is_main:               # before the work, flushed: a log or a pipe hears at once what runs
        print(start_line(job, job.workload.layer_indices(job.spec)), flush=True)
        print("  " + memory_line(job, running=True, mem=mem), flush=True)
    built = build(job, ranks)
    ran = run(job, built, ranks)
    if not ranks.is_main:
        return None
    tokens = ran.record.cat()
    metrics = grade(job, built, ran, tokens, mem, distributed=ranks.distributed)
    report(job, metrics, built=built, tokens=tokens, mem=mem, ranks=ranks)
    return metrics.max_rel_err


def build(job, ranks: Ranks) -> Built:
    """The workload's layers' weights (a checkpoint's, or random ones of the run's seed) and the engine of
    this process's ranks over them."""
    layers = job.workload.layer_indices(job.spec)
    rss_at_start = process_rss()
    torch.manual_seed(job.run.seed)
    weights, fp8 = load_or_random(job, layers, job.run.seed)
    return Built(layers=layers, weights=weights, fp8=fp8, engine=job_engine(job, weights, job.pool, fp8, ranks),
                 rss_at_start=rss_at_start)


def run(job, built: Built, ranks: Ranks) -> Ran:
    """The engine warmed up (timed: CUDA graphs are captured there), then the workload through it (the main
    rank records the outputs and shows the steps), then every rank's memory, gathered."""
    t0 = time.perf_counter()
    built.engine.warm_up(job.graphs.capture_sizes)
    warm_up_s = time.perf_counter() - t0
    record = run_workload(built.engine, job.workload, hidden_size=job.spec.hidden_size, seed=job.run.seed,
                          progress=step_progress() if ranks.is_main else None, record=ranks.is_main)
    per_rank = [m for part in ranks.gather(rank_memory(built.engine, ranks, job.device)) for m in part]
    return Ran(record=record, warm_up_s=warm_up_s, ranks=per_rank)


def grade(job, built: Built, ran: Ran, tokens: dict[str, Any], mem: JobMemory, *, distributed: bool) -> RunMetrics:
    """Every layer's outputs (`tokens`: the record's, `RunRecord.cat`) against the oracle, beside its speed
    and its cache's bytes; then the whole run's, its memory measured after the grading (the job's peak)."""
    spec, c = job.spec, job.combo
    case = oracle_case(job, tokens)
    floats = float_weights(job, built)
    names = layer_names(spec, built.layers)
    indexer = indexer_kind(c.dtype, c.indexer)
    layers = {}
    for l in built.layers:
        ratio = spec.compress_ratio(l)
        g = grade_layer(case, layer=l, ratio=ratio, weights=built.weights[l], out=tokens["outputs"][l],
                        topk=tokens["topk"].get(l), float_weights=None if floats is None else floats[l])
        layers[names[l]] = LayerMetrics(grade=g, speed=layer_speed(ran.record, l, distributed=distributed),
                                        memory=layer_memory(spec, ratio, c.cache_layout, indexer=indexer),
                                        pool_bytes_at_end=ran.record.pool_bytes[l])
    return run_metrics(job, layers, ran, mem, rss_at_start=built.rss_at_start)


def report(job, metrics: RunMetrics, *, built: Built, tokens: dict[str, Any], mem: JobMemory, ranks: Ranks) -> None:
    """The verdict on the layers; the run printed, its row written (status ok or mismatch), its dump (if
    asked for); then a ResultMismatch if the verdict found a layer wrong."""
    c = job.combo
    wrong = verdict({n: m.grade for n, m in metrics.layers.items()}, budget=c.error_budget, gap=selection_gap(c),
                    f32_budget=c.f32_kv_budget)
    workload = workload_row(job, built.layers, tokens)
    print_run(job, metrics, workload=workload, distributed=ranks.distributed, world_size=ranks.world_size)
    print_measured(job, metrics, engine=built.engine, mem=mem)
    print(verdict_line(c, wrong))
    path = write_row(job.out_dir, result_row(status="mismatch" if wrong else "ok", problems=[], choices=job.choices,
                                             device=job.device, settings=settings(job), workload=workload,
                                             metrics=metrics.as_dict(), error="; ".join(wrong) or None))
    print(f"  result: {path}")
    if job.run.dump_dir:
        dump(job, built, tokens)
    if wrong:
        raise ResultMismatch(f"the layers' outputs failed the verdict: {'; '.join(wrong)} (row: {path})")


# ---- grading's parts ------------------------------------------------------------------------------------
def oracle_case(job, tokens: dict[str, Any]) -> OracleCase:
    """What the oracle replays for every layer: the model, the run's tokens, its options' numerics."""
    c = job.combo
    row_format = c.cache_layout.row_format
    return OracleCase(model=job.spec.to_dump(), hidden=tokens["hidden"], positions=tokens["positions"],
                      request_index=tokens["request_index"], row_format=row_format.label,
                      kv_scale=kv_scale(row_format), exact_rows=row_format.exact,
                      indexer_numerics=c.indexer.numerics.value, linear_numerics=c.linear.numerics.value)


def kv_scale(row_format) -> float | None:
    """The per-tensor fp8 rows' scale, which the oracle and the dump need (None: rows of another kind)."""
    return row_format.kv_scale if row_format.kind is RowKind.FP8_PER_TENSOR else None


def float_weights(job, built: Built) -> dict[int, dict] | None:
    """Where the linears are fp8: the float weights the fp8 ones were made from (random weights), or their
    values (a checkpoint's), to grade what the fp8 projections cost; None where they are float."""
    if job.combo.linear.numerics is not LinearNumerics.FP8:
        return None
    if job.run.weights == "random":
        return {l: random_layer_weights(job.spec, l, job.run.seed) for l in built.layers}
    return built.weights


def layer_speed(record: RunRecord, layer: int, *, distributed: bool) -> LayerSpeed:
    """A layer's prefill tokens per second and decode milliseconds per step, as the run timed them; with
    distributed ranks, its all-reduce's share of a decode step."""
    prefill_s = record.seconds.get(("prefill", layer), 0.0)
    decode_s = record.seconds.get(("decode", layer), 0.0)
    steps = record.steps.get("decode")
    reduce_s = record.reduce_seconds.get(("decode", layer), 0.0)
    return LayerSpeed(prefill_tok_s=record.tokens.get("prefill", 0) / prefill_s if prefill_s else None,
                      decode_ms_step=1e3 * decode_s / steps if steps else None, reduced=distributed,
                      decode_allreduce_ms_step=1e3 * reduce_s / steps if distributed and steps else None)


def run_metrics(job, layers: dict[str, LayerMetrics], ran: Ran, mem: JobMemory, *, rss_at_start: int) -> RunMetrics:
    """The whole run's metrics around its layers': the budgets, every rank's bytes, head padding's cost, the
    model's KV bytes per million tokens, and the job's peak -- estimated before it started, and measured now
    (the process's max RSS: every part on a CPU deployment, the grading's beside an accelerator; and the GPU
    allocator's peak)."""
    spec, c = job.spec, job.combo
    totals = mem.parts() | {"device": mem.device, "host": mem.host}
    kv_bytes = model_memory(spec, c.cache_layout, indexer=indexer_kind(c.dtype, c.indexer))["total_bytes"]
    return RunMetrics(layers=layers, error_budget=c.error_budget, f32_kv_budget=c.f32_kv_budget, ranks=ran.ranks,
                      padding=padding_metrics(spec, c), kv_gib_per_1m_tokens=kv_bytes / GIB,
                      estimated_peak={f"{k}_bytes": v for k, v in totals.items()}, peak_rss_bytes=peak_rss(),
                      rss_at_start_bytes=rss_at_start,
                      peak_device_bytes=torch.cuda.max_memory_allocated() if job.device.platform != "cpu" else None,
                      warm_up_s=ran.warm_up_s, decode_step_ms=[1e3 * s for s in ran.record.decode_step_s])


# ---- reporting's parts ----------------------------------------------------------------------------------
def start_line(job, layers) -> str:
    """What a run is about to do, in one line: the model and layers, the device, the combination, the workload."""
    from dsv4.checks.catalogue import GROUPS

    wl, c = job.workload, job.combo
    chosen = " ".join(f"{g}={job.choices[g]}" for g in GROUPS if g in job.choices)
    return (f"run: model={job.spec.name} layers {list(layers)} on {job.device.describe()}, tp_size={c.tp_size} "
            f"dtype={c.dtype}; {chosen}; {len(wl.prompt_lens)} requests of {list(wl.prompt_lens)} tokens "
            f"(prefill chunks of {wl.prefill_chunk}), then {wl.decode_steps} decode steps of {wl.decode_tokens} "
            f"token(s) each")


def workload_row(job, layers: Sequence[int], tokens: dict[str, Any]) -> dict[str, Any]:
    """The row's `workload.*`: what ran, and how many tokens it processed."""
    wl = job.workload
    return {"prompt_lens": list(wl.prompt_lens), "prefill_chunk": wl.prefill_chunk, "decode_steps": wl.decode_steps,
            "decode_tokens": wl.decode_tokens, "layers": list(layers), "tokens": int(tokens["positions"].numel())}


def print_run(job, metrics: RunMetrics, *, workload: dict[str, Any], distributed: bool, world_size: int) -> None:
    """The run's header (where and how it ran, the choices, the workload), its table of layers, what the
    table's columns mean, and the model's KV memory for a long sequence."""
    c, wl = job.combo, job.workload
    float_linear = c.linear.numerics is LinearNumerics.FP8
    how = f"{world_size} processes ({job.device.platform} ranks, torch.distributed)" if distributed \
        else "ranks simulated in one process" if c.tp_size > 1 else "one process"
    print(f"dsv4 run  model={job.spec.name} on {job.device.describe()}  dtype={c.dtype} tp_size={c.tp_size} "
          f"({how}) row_format={c.cache_layout.row_format.label} linear={c.linear.numerics.value}")
    print("  " + " ".join(f"{k}={v}" for k, v in job.choices.items()))
    print(f"  workload: {len(wl.prompt_lens)} requests, prompts {list(wl.prompt_lens)}, prefill chunk "
          f"{wl.prefill_chunk}, {wl.decode_steps} decode steps x {wl.decode_tokens} tokens/request; "
          f"{workload['tokens']} tokens; errors vs the whole-sequence float32 oracle")
    print(layer_table(metrics, float_linear=float_linear, distributed=distributed))
    print("  swa: sliding window only; c4a: + ratio-4 entries the indexer chose; c128a: + every ratio-128 entry\n"
          "  rel_err: against the oracle rounding rows as this cache stores them; rel_err f32 KV: against exact "
          "float32 rows\n"
          + ("  rel_err float linear: against the oracle with the float weights the fp8 ones were made from, "
             "multiplied in float32\n" if float_linear else "")
          + "  topk exact: share of tokens whose top-k set is the oracle's; KV B/token: compressed rows "
          "and indexer keys per context token (the SWA window is bounded: SWA KiB/req)")
    print("\n".join(summary_lines(job.spec, c.cache_layout, c.dtype, c.indexer)))


def layer_table(metrics: RunMetrics, *, float_linear: bool, distributed: bool) -> str:
    """One row per layer: its errors, selection, speed and cache bytes (a column for the float-linear error
    where the linears are fp8, one for the all-reduce where ranks are distributed)."""
    headers = (["layer", "idx", "rel_err", "cosine", "rel_err f32 KV"]
               + (["rel_err float linear"] if float_linear else []) + ["topk exact", "prefill tok/s", "decode ms/step"]
               + (["of which all-reduce"] if distributed else []) + ["KV B/token", "SWA KiB/req"])
    rows = []
    for name, m in metrics.layers.items():
        g, s, mem = m.grade, m.speed, m.memory
        rows.append([name, g.layer, g.rel_err, f"{g.cosine:.7f}", g.rel_err_vs_f32_kv]
                    + ([g.rel_err_vs_float_linear] if float_linear else [])
                    + [None if g.selection is None else g.selection.exact, s.prefill_tok_s, s.decode_ms_step]
                    + ([s.decode_allreduce_ms_step] if distributed else [])
                    + [mem.kv_bytes_per_token + mem.indexer_bytes_per_token, mem.swa_bytes_per_request / 1024])
    return table(headers, rows)


def print_measured(job, metrics: RunMetrics, *, engine: Engine, mem: JobMemory) -> None:
    """The decode steps' times, and the job's memory: estimated before the work, measured (the process, the
    GPU allocator), and each rank's."""
    steps_ms = metrics.decode_step_ms
    if steps_ms:
        print(f"  decode steps, every layer: first {steps_ms[0]:.2f} ms, median {metrics.decode_ms_median_step:.2f} "
              f"ms of {len(steps_ms)}" + (f" (warm-up before them: {metrics.warm_up_s:.1f} s, "
                                          f"{engine.graphs.describe()})" if engine.graphs is not None else ""))
    measured = (f"process max RSS {metrics.peak_rss_bytes / 2**20:,.0f} MiB "
                f"({metrics.rss_at_start_bytes / 2**20:,.0f} at the start)")
    if metrics.peak_device_bytes is not None:
        measured += f", GPU allocator peak {metrics.peak_device_bytes / 2**20:,.0f} MiB"
    print(f"  memory: estimated {mem.describe()}; measured {measured}")
    print(f"  per rank ({metrics.ranks[0]['peak_of']} peak, before the grading): " + "; ".join(
        f"rank {m['rank']}: KV pools {m['kv_pool_bytes'] / 2**20:.1f} MiB, "
        f"weights {m['weight_bytes'] / 2**20:.1f} MiB, peak {m['peak_bytes'] / 2**20:.0f} MiB" for m in metrics.ranks))


def verdict_line(c, wrong: list[str]) -> str:
    """The verdict, and the budgets the layers were judged by (each option's part of them)."""
    parts = ", ".join(f"{g}={getattr(c, g).name} {getattr(c, g).error_budget:.0e}"
                      for g in ("cache_layout", "mqa_kernel", "o_proj", "linear"))
    how_judged = (f"error budget {c.error_budget:.3g} (dtype={c.dtype} {DTYPE_ERROR_BUDGET[c.dtype]:.0e}, {parts}); "
                  f"f32 KV budget {c.f32_kv_budget:.3g} (that + cache_layout={c.cache_layout.name}'s rounding budget "
                  f"{c.cache_layout.rounding_budget:.0e})")
    return (f"  verdict: MISMATCH: {'; '.join(wrong)}; {how_judged}" if wrong
            else f"  verdict: ok, no output zero, constant or non-finite; every layer within the {how_judged}")


def dump(job, built: Built, tokens: dict[str, Any]) -> None:
    """The run's weights, tokens and outputs written to `dump_dir` for bench/compare_dumps.py."""
    c = job.combo
    row_format = c.cache_layout.row_format
    path = write_dump(job.run.dump_dir, spec=job.spec, layers=built.weights, record=tokens, row_format=row_format.label,
                      choices=job.choices, kv_scale=kv_scale(row_format), indexer_numerics=c.indexer.numerics.value,
                      fp8=built.fp8, linear_numerics=c.linear.numerics.value)
    print(f"  dump written to {path} (spec.json, tensors.safetensors)")


# ---- what a run measures beside the grades --------------------------------------------------------------
def layer_names(spec, layers) -> dict[int, str]:
    """Each layer's name in the table and the row: its type, with its index where two share a type."""
    types = [spec.layer_type(l) for l in layers]
    return {l: t if types.count(t) == 1 else f"{t}@{l}" for l, t in zip(layers, types)}


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in obj (a tensor, or dicts / lists / tuples / dataclass values of them: a
    strategy's prepared state)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def process_rss() -> int:
    """The process's resident bytes now (Linux /proc/self/statm; 0 where there is none)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss() -> int:
    """The process's most resident bytes so far: VmHWM of /proc/self/status (getrusage's ru_maxrss survives
    an exec, so a process started by a larger one would report its parent's peak)."""
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_memory(engine: Engine, ranks: Ranks, device) -> list[dict[str, Any]]:
    """Bytes held by each of this process's ranks: its KV pools, its weights (module buffers and the
    o_proj's prepared tensors), and the process's peak (GPU allocator peak, or the CPU process's max RSS;
    shared by all ranks when they are simulated in one process)."""
    peak = torch.cuda.max_memory_allocated() if device.platform != "cpu" else peak_rss()
    out = []
    for i, r in enumerate(ranks.local):
        kv = sum(tensor_bytes(list(c.tensors())) for c in engine.pools[i].layers.values())
        w = sum(tensor_bytes(list(m[i].buffers())) + tensor_bytes(m[i].o_proj_prepared) for m in engine.layers.values())
        out.append({"rank": r, "kv_pool_bytes": kv, "weight_bytes": w, "peak_bytes": peak,
                    "peak_of": "gpu allocator" if device.platform != "cpu" else "process max RSS"})
    return out


def padding_metrics(spec, combo) -> dict[str, int]:
    """What head padding costs each rank: its heads, the count its q/out buffers hold, and the bytes per
    token and layer of the padded heads' rows (the q rows written and the kernel's output, activation dtype)."""
    from dsv4.values.dtypes import torch_dtype

    heads = spec.num_attention_heads // combo.tp_size
    padded = combo.head_padding.padded_heads(heads)
    return {"heads_per_rank": heads, "padded_heads_per_rank": padded,
            "padding_bytes_per_token": 2 * (padded - heads) * spec.head_dim * torch_dtype(combo.dtype).itemsize}
