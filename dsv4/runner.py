"""`mode=run`: build the workload's layers, run it through the paged caches, grade it with the oracle."""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import OmegaConf

from dsv4 import reference as ref
from dsv4.components.builders import PoolConfig, Strategies, build_layer, build_layer_kv
from dsv4.components.checkpoint import load_or_random
from dsv4.components.engine import Engine
from dsv4.dump import write_dump
from dsv4.memory import GIB, layer_memory, model_memory, summary_lines
from dsv4.report import result_row, table, tty_progress, write_row
from dsv4.workload import Workload, run_workload


def build_engine(job, weights: dict[int, dict], pool: PoolConfig, wo_a_fp8: dict | None = None) -> Engine:
    c, spec, dev = job.combo, job.spec, job.device
    strategies = Strategies(mqa_kernel=c.mqa_kernel, o_proj=c.o_proj, head_padding=c.head_padding,
                            cache_layout=c.cache_layout)
    layers = {l: [build_layer(spec=spec, layer=l, weights=w, rank=r, tp_size=c.tp_size, strategies=strategies,
                              device=dev, dtype=c.dtype, wo_a_fp8=(wo_a_fp8 or {}).get(l))
                  for r in range(c.tp_size)] for l, w in weights.items()}
    kvs = {l: [build_layer_kv(spec=spec, layer=l, layout=c.cache_layout, pool=pool, device=dev)
               for _ in range(c.tp_size)] for l in weights}
    return Engine(spec=spec, layers=layers, kvs=kvs, device=dev.torch_device)


def layer_names(spec, layers) -> dict[int, str]:
    types = [spec.layer_type(l) for l in layers]
    return {l: t if types.count(t) == 1 else f"{t}@{l}" for l, t in zip(layers, types)}


def execute(job) -> float:
    cfg, spec, c = job.cfg, job.spec, job.combo
    wl = Workload.from_config(OmegaConf.to_container(cfg.workload, resolve=True))
    pool = PoolConfig.from_config(OmegaConf.to_container(cfg.workload.kv_pool, resolve=True))
    layers = wl.layer_indices(spec)
    seed = int(cfg.seed)
    torch.manual_seed(seed)
    weights, wo_a_fp8 = load_or_random(job, layers, seed)
    engine = build_engine(job, weights, pool, wo_a_fp8)
    rec_raw = run_workload(engine, wl, hidden_size=spec.hidden_size, seed=seed, progress=tty_progress())
    rec = rec_raw.cat()

    row_dtype = c.cache_layout.kv_row_dtype
    kv_scale = getattr(c.cache_layout, "kv_scale", None) if row_dtype == "fp8_per_tensor" else None
    names = layer_names(spec, layers)
    metrics: dict[str, Any] = {}
    rows = []
    model = spec.to_dump()
    for l in layers:
        R = spec.compress_ratio(l)
        topk = rec["topk"].get(l)
        given = None if topk is None else topk.long()
        args = (model, R, weights[l], rec["hidden"], rec["positions"], rec["request_index"])
        o = ref.oracle_outputs(*args, kv_row_dtype=row_dtype, kv_scale=kv_scale, topk=given)
        out = rec["outputs"][l]
        m: dict[str, Any] = {"layer": l, "compress_ratio": R, "rel_err": ref.rel_err(out, o["out"]),
                             "cosine": ref.cosine(out, o["out"])}
        if row_dtype != "float32":      # what the cache's rounding costs against exact float32 rows
            m["rel_err_vs_f32_kv"] = ref.rel_err(out, ref.oracle_outputs(*args, kv_row_dtype="float32", topk=given)["out"])
        if topk is not None:
            g = [ref.grade_selection(topk[rows_], sc, spec.index_topk) for rows_, sc in o["scores"].values()]
            m["topk_exact"] = sum(x["exact"] for x in g) / len(g)
            m["topk_max_gap"] = max(x["max_gap"] for x in g)
            m["topk_count_ok"] = min(x["count_ok"] for x in g) == 1.0
        pre_s, dec_s = rec_raw.seconds.get(("prefill", l), 0.0), rec_raw.seconds.get(("decode", l), 0.0)
        m["prefill_tok_s"] = rec_raw.tokens.get("prefill", 0) / pre_s if pre_s else None
        m["decode_ms_step"] = 1e3 * dec_s / rec_raw.steps["decode"] if rec_raw.steps.get("decode") else None
        m |= layer_memory(spec, R, c.cache_layout).as_dict()
        m["pool_bytes_at_end"] = rec_raw.pool_bytes[l]
        metrics[names[l]] = m
        rows.append([names[l], l, m["rel_err"], f"{m['cosine']:.7f}", m.get("rel_err_vs_f32_kv"), m.get("topk_exact"),
                     m["prefill_tok_s"], m["decode_ms_step"], m["kv_bytes_per_token"] + m["indexer_bytes_per_token"],
                     m["swa_bytes_per_request"] / 1024])
    metrics["max_rel_err"] = max(m["rel_err"] for m in metrics.values())
    metrics["kv_gib_per_1m_tokens"] = model_memory(spec, c.cache_layout)["total_bytes"] / GIB

    wdict = {"prompt_lens": list(wl.prompt_lens), "prefill_chunk": wl.prefill_chunk, "decode_steps": wl.decode_steps,
             "decode_tokens": wl.decode_tokens, "layers": list(layers), "tokens": int(rec["positions"].numel())}
    print(f"dsv4 run  model={spec.name} on {job.device.describe()}  dtype={c.dtype} tp_size={c.tp_size} "
          f"kv_row_dtype={row_dtype}")
    print("  " + " ".join(f"{k}={v}" for k, v in job.choices.items()))
    print(f"  workload: {len(wl.prompt_lens)} requests, prompts {list(wl.prompt_lens)}, prefill chunk "
          f"{wl.prefill_chunk}, {wl.decode_steps} decode steps x {wl.decode_tokens} tokens/request; "
          f"{wdict['tokens']} tokens; errors vs the whole-sequence float32 oracle")
    print(table(["layer", "idx", "rel_err", "cosine", "rel_err f32 KV", "topk exact", "prefill tok/s",
                 "decode ms/step", "KV B/token", "SWA KiB/req"], rows))
    print("\n".join(summary_lines(spec, c.cache_layout)))
    if cfg.get("dump_dir"):
        path = write_dump(cfg.dump_dir, spec=spec, layers=weights, record=rec, kv_row_dtype=row_dtype,
                          choices=job.choices, kv_scale=kv_scale)
        print(f"  dump written to {path} (spec.json, tensors.safetensors)")
    path = write_row(job.out_dir, result_row(status="ok", problems=[], choices=job.choices, device=job.device,
                                             settings={"tp_size": c.tp_size, "dtype": c.dtype, "seed": seed},
                                             workload=wdict, metrics=metrics))
    print(f"  result: {path}")
    return metrics["max_rel_err"]
