"""`mode=run`: build the workload's layers, run it through the paged caches, grade it with the oracle."""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from dsv4 import oracle as ref
from dsv4.compat import DTYPE_ERROR_BUDGET, selection_gap
from dsv4.formats.row_format import RowKind
from dsv4.components.builders import Strategies, build_layer, build_pool
from dsv4.components.kv_pool import PoolConfig
from dsv4.components.checkpoint import load_or_random
from dsv4.components.weights import random_layer_weights
from dsv4.formats.fp8_blocks import LinearNumerics
from dsv4.components.engine import Engine
from dsv4.components.graphs import StepGraphs
from dsv4.graph import GraphConfig
from dsv4.dump import write_dump
from dsv4.errors import ResultMismatch
from dsv4.job import memory_line, settings
from dsv4.job_memory import estimate
from dsv4.memory import GIB, indexer_kind, layer_memory, model_memory, summary_lines
from dsv4.parallel import Ranks
from dsv4.report import result_row, table, step_progress, write_row
from dsv4.workload import run_workload


def build_engine(job, weights: dict[int, dict], pool: PoolConfig, fp8: dict | None = None,
                 ranks: Ranks | None = None, graphs: GraphConfig | None = None) -> Engine:
    """The engine of this process's ranks: all tp_size of them (simulated), or its one rank (distributed).
    `fp8`: per layer the linears stored as fp8 blocks (`load_or_random`); `graphs`: CUDA-graph decode
    (default: the job's `graph` config when it is enabled)."""
    c, spec, dev = job.combo, job.spec, job.device
    ranks = ranks or Ranks(tp_size=c.tp_size)
    strategies = Strategies(mqa_kernel=c.mqa_kernel, o_proj=c.o_proj, head_padding=c.head_padding,
                            cache_layout=c.cache_layout, indexer=c.indexer, linear=c.linear)
    layers = {l: [build_layer(spec=spec, layer=l, weights=w, rank=r, tp_size=c.tp_size, strategies=strategies,
                              device=dev, dtype=c.dtype, fp8=(fp8 or {}).get(l), overlap=job.run.overlap,
                              batch_invariant=c.batch_invariant)
                  for r in ranks.local] for l, w in weights.items()}
    pools = [build_pool(spec=spec, layers=list(weights), layout=c.cache_layout, pool=pool, device=dev,
                         dtype=c.dtype, indexer=c.indexer)
             for _ in ranks.local]
    graphs = graphs if graphs is not None else job.graphs
    return Engine(spec=spec, layers=layers, pools=pools, device=dev.torch_device,
                  all_reduce=ranks.all_reduce if ranks.distributed else None,
                  graphs=StepGraphs(graphs) if graphs.enabled else None)


def layer_names(spec, layers) -> dict[int, str]:
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
    from dsv4.dtypes import torch_dtype

    heads = spec.num_attention_heads // combo.tp_size
    padded = combo.head_padding.padded_heads(heads)
    return {"heads_per_rank": heads, "padded_heads_per_rank": padded,
            "padding_bytes_per_token": 2 * (padded - heads) * spec.head_dim * torch_dtype(combo.dtype).itemsize}


def output_stats(out) -> dict[str, Any]:
    """What says whether a layer's output is degenerate, whatever an oracle rounding rows the same way says:
    its count of non-finite values, its largest |value| (of the finite ones), and how far it is from constant
    (the largest difference from the first token's row; with one token, from its first value)."""
    finite = torch.isfinite(out)
    vals = torch.where(finite, out.double(), 0.0)
    if not vals.numel():
        return {"out_nonfinite": 0, "out_max_abs": None, "out_spread": None}
    first = vals[:1] if vals.shape[0] > 1 else vals[:1, :1]
    return {"out_nonfinite": int((~finite).sum()), "out_max_abs": float(vals.abs().max()),
            "out_spread": float((vals - first).abs().max())}


def degenerate(m: dict[str, Any]) -> str | None:
    """Why a layer's output (its `output_stats`) says it no longer computes attention, or None."""
    if m.get("out_nonfinite"):
        return f"{m['out_nonfinite']} outputs are not finite (NaN or inf)"
    if m.get("out_max_abs") == 0:
        return "every output is 0"
    if m.get("out_spread") == 0:
        return "its output is constant"
    return None


def verdict(metrics: dict[str, dict], *, budget: float, gap: float, f32_budget: float) -> list[str]:
    """What is wrong with a run's layers (empty: nothing): an output that is degenerate (non-finite, all zero,
    constant), an error against the oracle past `budget` (NaN included) or, where rows are rounded, against
    exact float32 rows past `f32_budget` -- an oracle rounding as the cache does cannot see rows rounded
    away --, a top-k list of the wrong size, or a selected entry scoring more than `gap` (relative) below the
    oracle's k-th best -- more than a near-tie."""
    wrong = []
    for n, m in metrics.items():
        bad = [b] if (b := degenerate(m)) else []
        if not m.get("out_nonfinite"):      # (a non-finite output's errors are NaN: said once already)
            if not m["rel_err"] <= budget:
                bad.append(f"rel_err {m['rel_err']:.3g} > budget {budget:.3g}")
            f32 = m.get("rel_err_vs_f32_kv")
            if f32 is not None and not f32 <= f32_budget:
                bad.append(f"rel_err f32 KV {f32:.3g} > f32 KV budget {f32_budget:.3g}")
        if m.get("topk_count_ok") is False:
            bad.append("a top-k list of the wrong size")
        elif m.get("topk_max_gap") is not None and not m["topk_max_gap"] <= gap:
            bad.append(f"a top-k entry {m['topk_max_gap']:.3g} below the oracle's k-th score (allowed: {gap:.0e})")
        if bad:
            wrong.append(f"layer {n} (idx {m['layer']}): {', '.join(bad)}")
    return wrong


def start_line(job, layers) -> str:
    """What a run is about to do, in one line: the model and layers, the device, the combination, the workload."""
    from dsv4.catalogue import GROUPS

    wl, c = job.workload, job.combo
    chosen = " ".join(f"{g}={job.choices[g]}" for g in GROUPS if g in job.choices)
    return (f"run: model={job.spec.name} layers {list(layers)} on {job.device.describe()}, tp_size={c.tp_size} "
            f"dtype={c.dtype}; {chosen}; {len(wl.prompt_lens)} requests of {list(wl.prompt_lens)} tokens "
            f"(prefill chunks of {wl.prefill_chunk}), then {wl.decode_steps} decode steps of {wl.decode_tokens} "
            f"token(s) each")


def execute(job, ranks: Ranks | None = None) -> float | None:
    """Run the workload on this process's ranks; the main rank grades it, prints and writes result.json
    (other ranks return None)."""
    ranks = ranks or Ranks(tp_size=job.combo.tp_size)
    spec, c = job.spec, job.combo
    wl, pool = job.workload, job.pool
    layers = wl.layer_indices(spec)
    seed = job.run.seed
    mem = estimate(job)             # the job's peak, estimated before the work
    if ranks.is_main:               # before the work, flushed: a log or a pipe hears at once what runs
        print(start_line(job, layers), flush=True)
        print("  " + memory_line(job, running=True, mem=mem), flush=True)
    rss_at_start = process_rss()
    torch.manual_seed(seed)
    weights, fp8 = load_or_random(job, layers, seed)
    engine = build_engine(job, weights, pool, fp8, ranks)
    t0 = time.perf_counter()
    engine.warm_up(job.graphs.capture_sizes)
    warm_up_s = time.perf_counter() - t0
    rec_raw = run_workload(engine, wl, hidden_size=spec.hidden_size, seed=seed,
                           progress=step_progress() if ranks.is_main else None, record=ranks.is_main)
    per_rank = [m for part in ranks.gather(rank_memory(engine, ranks, job.device)) for m in part]
    if not ranks.is_main:
        return None
    rec = rec_raw.cat()

    row_format = c.cache_layout.row_format
    row_label = row_format.label
    kv_scale = row_format.kv_scale if row_format.kind is RowKind.FP8_PER_TENSOR else None
    names = layer_names(spec, layers)
    linear, indexer_numerics = c.linear.numerics.value, c.indexer.numerics.value
    # the float weights the fp8 ones were made from (random weights), or their values (a checkpoint's)
    float_weights = None
    if c.linear.numerics is LinearNumerics.FP8:
        float_weights = ({l: random_layer_weights(spec, l, seed) for l in layers} if job.run.weights == "random"
                         else weights)
    metrics: dict[str, Any] = {}
    rows = []
    model = spec.to_dump()
    for l in layers:
        R = spec.compress_ratio(l)
        topk = rec["topk"].get(l)
        given = None if topk is None else topk.long()
        args = (model, R, weights[l], rec["hidden"], rec["positions"], rec["request_index"])
        o = ref.oracle_outputs(*args, row_format=row_label, kv_scale=kv_scale, topk=given,
                               indexer_numerics=indexer_numerics, linear_numerics=linear, keep_scores=False,
                               grade=True)
        out = rec["outputs"][l]
        m: dict[str, Any] = {"layer": l, "compress_ratio": R, "rel_err": ref.rel_err(out, o["out"]),
                             "cosine": ref.cosine(out, o["out"])} | output_stats(out)
        if not row_format.exact:        # what the cache's rounding costs against exact float32 rows
            m["rel_err_vs_f32_kv"] = ref.rel_err(out, ref.oracle_outputs(
                *args, row_format="float32", topk=given, indexer_numerics=indexer_numerics,
                linear_numerics=linear, keep_scores=False)["out"])
        if float_weights is not None:   # what the fp8 projections cost against float weights and products
            m["rel_err_vs_float_linear"] = ref.rel_err(out, ref.oracle_outputs(
                model, R, float_weights[l], *args[3:], row_format=row_label, kv_scale=kv_scale, topk=given,
                indexer_numerics=indexer_numerics, keep_scores=False)["out"])
        if topk is not None:
            g = list(o["grades"][indexer_numerics].values())        # one per request
            m["topk_exact"] = sum(x["exact"] for x in g) / len(g)
            m["topk_max_gap"] = max(x["max_gap"] for x in g)
            m["topk_count_ok"] = min(x["count_ok"] for x in g) == 1.0
            # the selection against each numerics the oracle offers: the model's weights as computed
            # (exact) and the published FP4 numerics
            for numerics in ref.INDEXER_NUMERICS:
                grades = list(o["grades"][numerics].values())
                m[f"topk_recall_vs_{numerics}"] = sum(x["recall"] for x in grades) / len(grades)
        pre_s, dec_s = rec_raw.seconds.get(("prefill", l), 0.0), rec_raw.seconds.get(("decode", l), 0.0)
        m["prefill_tok_s"] = rec_raw.tokens.get("prefill", 0) / pre_s if pre_s else None
        m["decode_ms_step"] = 1e3 * dec_s / rec_raw.steps["decode"] if rec_raw.steps.get("decode") else None
        if ranks.distributed:
            red = rec_raw.reduce_seconds.get(("decode", l), 0.0)
            m["decode_allreduce_ms_step"] = 1e3 * red / rec_raw.steps["decode"] if rec_raw.steps.get("decode") else None
        m |= layer_memory(spec, R, c.cache_layout, indexer=indexer_kind(c.dtype, c.indexer)).as_dict()
        m["pool_bytes_at_end"] = rec_raw.pool_bytes[l]
        metrics[names[l]] = m
        rows.append([names[l], l, m["rel_err"], f"{m['cosine']:.7f}", m.get("rel_err_vs_f32_kv")]
                    + ([m["rel_err_vs_float_linear"]] if float_weights is not None else []) + [m.get("topk_exact"),
                     m["prefill_tok_s"], m["decode_ms_step"]]
                    + ([m["decode_allreduce_ms_step"]] if ranks.distributed else [])
                    + [m["kv_bytes_per_token"] + m["indexer_bytes_per_token"], m["swa_bytes_per_request"] / 1024])
    per_layer = list(metrics.values())
    budget, f32_budget = c.error_budget, c.f32_kv_budget
    wrong = verdict(metrics, budget=budget, gap=selection_gap(c), f32_budget=f32_budget)
    errs = [m["rel_err"] for m in per_layer]
    metrics["max_rel_err"] = float("nan") if any(e != e for e in errs) else max(errs)
    metrics["error_budget"] = budget
    metrics["f32_kv_budget"] = f32_budget
    # against exact float32 rows: what the cache's rounding costs (a float32 cache's oracle is that already)
    metrics["max_rel_err_vs_f32_kv"] = max(m.get("rel_err_vs_f32_kv", m["rel_err"]) for m in per_layer)
    metrics["max_rel_err_vs_float_linear"] = max(m.get("rel_err_vs_float_linear", m["rel_err"]) for m in per_layer)
    metrics["weight_bytes_per_rank"] = per_rank[0]["weight_bytes"]
    for numerics in ref.INDEXER_NUMERICS:      # the lowest of the ratio-4 layers' (None without one)
        recalls = [m[f"topk_recall_vs_{numerics}"] for m in per_layer if f"topk_recall_vs_{numerics}" in m]
        metrics[f"topk_recall_vs_{numerics}"] = min(recalls) if recalls else None
    metrics |= padding_metrics(spec, c)
    metrics["kv_gib_per_1m_tokens"] = model_memory(spec, c.cache_layout,
                                                   indexer=indexer_kind(c.dtype, c.indexer))["total_bytes"] / GIB
    metrics["ranks"] = per_rank
    # the job's peak (after the grading): estimated before it started, and measured -- the process's max RSS
    # (every part, on a CPU deployment; the grading's, beside an accelerator) and the GPU allocator's peak
    totals = mem.parts() | {"device": mem.device, "host": mem.host}
    metrics["estimated_peak"] = {f"{k}_bytes": v for k, v in totals.items()}
    metrics["peak_rss_bytes"] = peak_rss()
    metrics["rss_at_start_bytes"] = rss_at_start
    if job.device.platform != "cpu":
        metrics["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    metrics["warm_up_s"] = warm_up_s
    steps_ms = [1e3 * s for s in rec_raw.decode_step_s]
    metrics["decode_ms_first_step"] = steps_ms[0] if steps_ms else None
    metrics["decode_ms_median_step"] = statistics.median(steps_ms) if steps_ms else None

    wdict = {"prompt_lens": list(wl.prompt_lens), "prefill_chunk": wl.prefill_chunk, "decode_steps": wl.decode_steps,
             "decode_tokens": wl.decode_tokens, "layers": list(layers), "tokens": int(rec["positions"].numel())}
    how = f"{ranks.world_size} processes ({job.device.platform} ranks, torch.distributed)" if ranks.distributed \
        else "ranks simulated in one process" if c.tp_size > 1 else "one process"
    print(f"dsv4 run  model={spec.name} on {job.device.describe()}  dtype={c.dtype} tp_size={c.tp_size} "
          f"({how}) row_format={row_label} linear={linear}")
    print("  " + " ".join(f"{k}={v}" for k, v in job.choices.items()))
    print(f"  workload: {len(wl.prompt_lens)} requests, prompts {list(wl.prompt_lens)}, prefill chunk "
          f"{wl.prefill_chunk}, {wl.decode_steps} decode steps x {wl.decode_tokens} tokens/request; "
          f"{wdict['tokens']} tokens; errors vs the whole-sequence float32 oracle")
    print(table(["layer", "idx", "rel_err", "cosine", "rel_err f32 KV"]
                + (["rel_err float linear"] if float_weights is not None else []) + ["topk exact", "prefill tok/s",
                 "decode ms/step"] + (["of which all-reduce"] if ranks.distributed else [])
                + ["KV B/token", "SWA KiB/req"], rows))
    print("  swa: sliding window only; c4a: + ratio-4 entries the indexer chose; c128a: + every ratio-128 entry\n"
          "  rel_err: against the oracle rounding rows as this cache stores them; rel_err f32 KV: against exact "
          "float32 rows\n"
          + ("  rel_err float linear: against the oracle with the float weights the fp8 ones were made from, "
             "multiplied in float32\n" if float_weights is not None else "")
          + "  topk exact: share of tokens whose top-k set is the oracle's; KV B/token: compressed rows "
          "and indexer keys per context token (the SWA window is bounded: SWA KiB/req)")
    print("\n".join(summary_lines(spec, c.cache_layout, c.dtype, c.indexer)))
    if steps_ms:
        print(f"  decode steps, every layer: first {steps_ms[0]:.2f} ms, median {metrics['decode_ms_median_step']:.2f} "
              f"ms of {len(steps_ms)}" + (f" (warm-up before them: {warm_up_s:.1f} s, {engine.graphs.describe()})"
                                         if engine.graphs is not None else ""))
    measured = (f"process max RSS {metrics['peak_rss_bytes'] / 2**20:,.0f} MiB "
                f"({rss_at_start / 2**20:,.0f} at the start)")
    if "peak_device_bytes" in metrics:
        measured += f", GPU allocator peak {metrics['peak_device_bytes'] / 2**20:,.0f} MiB"
    print(f"  memory: estimated {mem.describe()}; measured {measured}")
    print(f"  per rank ({per_rank[0]['peak_of']} peak, before the grading): " + "; ".join(
        f"rank {m['rank']}: KV pools {m['kv_pool_bytes'] / 2**20:.1f} MiB, weights {m['weight_bytes'] / 2**20:.1f} MiB, "
        f"peak {m['peak_bytes'] / 2**20:.0f} MiB" for m in per_rank))
    parts = ", ".join(f"{g}={getattr(c, g).name} {getattr(c, g).error_budget:.0e}"
                      for g in ("cache_layout", "mqa_kernel", "o_proj", "linear"))
    how_judged = (f"error budget {budget:.3g} (dtype={c.dtype} {DTYPE_ERROR_BUDGET[c.dtype]:.0e}, {parts}); "
                  f"f32 KV budget {f32_budget:.3g} (that + cache_layout={c.cache_layout.name}'s rounding budget "
                  f"{c.cache_layout.rounding_budget:.0e})")
    print(f"  verdict: MISMATCH: {'; '.join(wrong)}; {how_judged}" if wrong
          else f"  verdict: ok, no output zero, constant or non-finite; every layer within the {how_judged}")
    path = write_row(job.out_dir, result_row(status="mismatch" if wrong else "ok", problems=[], choices=job.choices,
                                             device=job.device, settings=settings(job), workload=wdict,
                                             metrics=metrics, error="; ".join(wrong) or None))
    print(f"  result: {path}")
    if job.run.dump_dir:
        dump = write_dump(job.run.dump_dir, spec=spec, layers=weights, record=rec, row_format=row_label,
                          choices=job.choices, kv_scale=kv_scale, indexer_numerics=indexer_numerics,
                          fp8=fp8, linear_numerics=linear)
        print(f"  dump written to {dump} (spec.json, tensors.safetensors)")
    if wrong:
        raise ResultMismatch(f"the layers' outputs failed the verdict: {'; '.join(wrong)} (row: {path})")
    return metrics["max_rel_err"]
