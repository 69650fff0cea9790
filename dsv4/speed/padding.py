"""`mode=bench`'s head-padding table: what padding a tensor-parallel rank's heads costs, measured.

At tp_size=N a rank holds num_attention_heads / N heads (DSV4-Flash at TP8: 8). FlashMLA's sparse decode
takes 64 or 128 heads, so `head_padding=buckets_64_128` pads the rank's queries and outputs to 64;
triton_sparse takes any count. Per tp_size, layer type and (mqa_kernel, head_padding), one rank's
decode step: the layer graph of rank 0 of an engine that simulates the tp_size ranks in this process
(no all-reduce; the step of each rank is the same work), replayed as layer.py times a step, with its
MQA kernel alone beside it. The rest of the combination (o_proj, cache layout, indexer) is the job's,
the same in every row, so the rows differ only by kernel and padding.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from dsv4.speed.cases import SERVING_STEP
from dsv4.speed.layer import Backend, decode_row
from dsv4.checks.catalogue import option
from dsv4.reports.report import table
from dsv4.speed.rows import printed_rows

TP_SIZES = (1, 2, 4, 8)
PAIRS = (("flashmla_sparse", "buckets_64_128"), ("triton_sparse", "buckets_64_128"), ("triton_sparse", "none"))


def padding_rows(job, tp_sizes=TP_SIZES, pairs=PAIRS, layer_types=None, echo=None, step=SERVING_STEP) -> list[list]:
    """One row per (tp_size, layer type, pair): refused combinations are rows saying why (check()), a
    failing one says what failed; the first pair that runs at a (tp_size, layer type) is the others'
    reference. `echo(row)` is called with each row as it is measured. `step`: (requests, tokens each,
    context)."""
    import traceback

    from dsv4.checks.compat import check
    from dsv4.values.device import local_platform

    rows = []
    heads = job.spec.num_attention_heads
    for tp in tp_sizes:
        for layer in job.spec.one_layer_per_type():
            kind = job.spec.layer_type(layer)
            if layer_types is not None and kind not in layer_types:
                continue
            ref = None
            for kernel, padding in pairs:
                chosen = replace(job.combo.strategies, mqa_kernel=option("mqa_kernel", kernel),
                                 head_padding=option("head_padding", padding))
                combo = replace(job.combo, strategies=chosen, dtype="bfloat16", tp_size=tp, world_size=None)
                head = [tp, heads // tp, combo.head_padding.padded_heads(heads // tp), kind, kernel, padding]
                problems = check(combo, job.device, here=local_platform())
                if problems:
                    rows.append(head + [f"refused: {problems[0].reason}"[:90], None, None])
                else:
                    try:
                        row, parts = decode_row(job, Backend(label=f"{kernel} + {padding}", combo=combo), layer,
                                                *step)
                        ref = ref or row[5]
                        rows.append(head + [row[5], parts.get(combo.mqa_kernel.name), row[5] / ref])
                    except Exception as e:          # one failing row is a row, not the end of the table
                        traceback.print_exc()
                        rows.append(head + [f"error: {type(e).__name__}: {str(e)[:80]}", None, None])
                        torch.cuda.empty_cache()
                if echo is not None:
                    echo(" | ".join(map(str, rows[-1])))
    return rows


HEADERS = ["tp_size", "heads/rank", "padded to", "layer", "mqa_kernel", "head_padding", "rank's step µs",
           "MQA kernel µs", "step / first row's"]


def bench_padding(job, *, record=None, **kw) -> str:
    """The table of `padding_rows(job, **kw)`; `record` (dsv4/speed/rows.py) takes its rows."""
    rows = padding_rows(job, **kw)
    if record is not None:
        n, tokens, context = kw.get("step", SERVING_STEP)
        record(printed_rows("bench/padding", HEADERS, rows, keys=6, unit=None,
                            given={"step": f"{n}x{tokens}@{context}"}))
    return table(HEADERS, rows, left=(3, 4, 5))
