"""`mode=bench`: GPU timings of the sparse MQA kernels, the output projections, the dense projections, the
whole layer step and the indexer, every option available on this machine side by side in one process (the
tables: dsv4/speed/). Every table's rows are also appended, stamped, to a file of rows (dsv4/speed/rows.py):
in the run's folder, or in the folder `+bench_rows=PATH` names (docs/bench/rows: the rows docs/benchmarks.md's
tables are made from, by bench/tables.py)."""
from __future__ import annotations

from pathlib import Path

from dsv4.values.errors import ConfigError
from dsv4.app.job import Job, problems_for, raise_if


def bench_mode(job: Job, *, multirun: bool) -> None:
    from dsv4.app import parallel

    raise_if(job, problems_for(job, running=True))
    ranks = None
    if job.combo.world_size is not None:
        ranks = parallel.init(platform=job.device.platform, tp_size=job.combo.tp_size, config=job.parallel)
    run_bench(job, ranks)
    if ranks is not None:
        parallel.shutdown()


def rows_folder(job: Job) -> Path:
    """Where the run's rows go: `+bench_rows=PATH`, else the run's own folder."""
    return Path(job.run.bench_rows or job.out_dir)


def run_bench(job, ranks=None) -> None:
    """Every table, printed as it is measured (on rank 0 alone under torchrun: the tensor-parallel step), its
    rows appended to the run's file of rows."""
    from dsv4.app.targets import unwritable

    folder = rows_folder(job)
    problem = unwritable(folder)            # judged before any table is measured, as a run's folder is
    if problem:
        raise ConfigError(f"bench_rows={folder}: {problem}; fix: +bench_rows=<a folder this process can write>")
    import torch

    from dsv4.speed.cases import SERVING_STEP, available_options
    from dsv4.speed.grid import bench_grid, preset_label
    from dsv4.checks.catalogue import backend_presets
    from dsv4.speed.peers import MODELS
    from dsv4.speed.scorers import CONTEXTS, NREQ, TOKENS, bench_indexer
    from dsv4.speed.kernels import bench_linear, bench_mqa, bench_o_proj
    from dsv4.speed.layer import bench_layer_step
    from dsv4.speed.padding import bench_padding
    from dsv4.speed.tp_step import bench_tp_step
    from dsv4.speed.rows import open_rows

    if job.device.platform != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"mode=bench times GPU kernels: deployment gives {job.device.describe()} and this "
                          f"machine has {'a' if torch.cuda.is_available() else 'no'} CUDA GPU")
    record = open_rows(folder)
    if ranks is not None and ranks.distributed:
        t = bench_tp_step(job, ranks, record=record)
        if t is not None:
            print(f"dsv4 bench on {ranks.world_size} x {job.device.describe()}, torch {torch.__version__}; "
                  " ".join(f"{k}={v}" for k, v in job.choices.items()))
            n, tokens, context = SERVING_STEP
            heads = job.spec.num_attention_heads // ranks.world_size
            print(f"\nwhole layer, decode steps of {n} requests x {tokens} tokens at {context} context, CUDA-graph "
                  f"replay, tp_size={ranks.world_size} (one process per GPU, {heads} heads per rank padded to "
                  f"{job.combo.head_padding.padded_heads(heads)}, all-reduce between the layers' graphs) beside "
                  f"tp_size=1, medians:\n{t}\n\nrows: {record.path}")
        return
    print(f"dsv4 bench on {job.device.describe()}, torch {torch.__version__}; model={job.spec.name}")
    print("\nsparse MQA decode, fp8_ds_mla pages (153 MB per cache), full index lists:\n"
          + bench_mqa(job, record=record))
    print("\no_proj, G=8 groups of 8 heads, 4096 -> 1024 per group:\n" + bench_o_proj(job, record=record))
    print("\nthe dense projections (linear), each option on the layer's products, bf16 first:\n"
          + bench_linear(job, record=record))
    print("\nwhole layer, one layer of each type:\n" + bench_layer_step(job, record=record))
    n, tokens, context = SERVING_STEP
    print(f"\nhead padding: one tensor-parallel rank's decode step ({n} requests x {tokens} tokens, {context} "
          "context), CUDA-graph replay, per kernel and padding:\n" + bench_padding(job, record=record))
    indexers = available_options(job, "indexer")
    print(f"\nthe indexer: scores and top-{job.spec.index_topk} of {NREQ} requests x {TOKENS} tokens by each option, "
          "in CUDA graphs:\n" + bench_indexer(job, indexers, record=record))
    print("\nthe ratio-4 layer with each indexer option:\n"
          + bench_layer_step(job, [(NREQ, TOKENS, c) for c in CONTEXTS[::2]], indexers=[ix.name for ix in indexers],
                             layer_types=("c4a",), prefill=False, record=record))
    if job.spec.name in MODELS:
        print("\nthe layer grid: every point where vLLM and SGLang publish their layer on the H200, the backend "
              "presets:\n" + bench_grid(job, labels=[preset_label(p) for p in backend_presets()], record=record))
    print(f"\nrows: {record.path}")
