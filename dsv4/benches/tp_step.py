"""`mode=bench` under torchrun: the layer step as tp_size processes beside the same step in one process."""
from __future__ import annotations

import statistics

import torch

from dsv4.report import table

STEP_REQUESTS, STEP_TOKENS = 64, 2                          # the layer-step benches' decode batch


def _decode_step_times(eng, spec, layers) -> dict[int, tuple[float, float]]:
    """Per layer, the median µs of a decode step (STEP_REQUESTS requests x STEP_TOKENS tokens, after a
    600-token prefill; CUDA graphs where the engine has them) and of the all-reduce within it."""
    from dsv4.components.engine import CudaTimer

    g = torch.Generator().manual_seed(1)
    nreq, n, prompt = STEP_REQUESTS, STEP_TOKENS, 600
    for r in range(nreq):
        eng.add_request(r)
    for start in range(0, prompt, 300):
        x = torch.randn(nreq * 300, spec.hidden_size, generator=g)
        pos = torch.arange(start, start + 300).repeat(nreq)
        eng.step(x, pos, [r for r in range(nreq) for _ in range(300)])
    times: dict[int, list] = {l: [] for l in layers}
    for step in range(8):
        x = torch.randn(nreq * n, spec.hidden_size, generator=g)
        p0 = prompt + n * step
        out = eng.step(x, torch.arange(p0, p0 + n).repeat(nreq), [r for r in range(nreq) for _ in range(n)],
                       timer=CudaTimer())
        for l in layers:
            times[l].append((out.seconds[l] * 1e6, out.reduce_seconds.get(l, 0.0) * 1e6))
    for r in range(nreq):
        eng.release(r)
    return {l: (statistics.median(t for t, _ in v[2:]), statistics.median(a for _, a in v[2:])) for l, v in times.items()}


def _step_setup(job):
    """(one layer of each type, their random weights, the pools) for the TP layer-step bench."""
    from dsv4.components.kv_pool import PoolConfig
    from dsv4.components.weights import random_layer_weights

    layers = job.spec.one_layer_per_type()
    return layers, {l: random_layer_weights(job.spec, l, 0) for l in layers}, \
        PoolConfig(swa_blocks=1024, compressed_blocks=512, max_requests=STEP_REQUESTS)


def bench_tp_step(job, ranks) -> str | None:
    """Under torchrun: the job's combination as tp_size processes (all-reduce over the group) beside the
    same combination in one process at tp_size=1 (rank 0 alone, after the others have finished). Rank 0
    returns the table."""
    from dataclasses import replace

    from dsv4.runner import build_engine

    layers, weights, pool = _step_setup(job)
    tp = _decode_step_times(build_engine(job, weights, pool, ranks=ranks), job.spec, layers)
    torch.cuda.empty_cache()
    one = None
    if ranks.is_main:
        single = replace(job, combo=replace(job.combo, tp_size=1, world_size=None))
        one = _decode_step_times(build_engine(single, weights, pool), job.spec, layers)
    if not ranks.is_main:
        return None
    rows = [[job.spec.layer_type(l), f"{one[l][0]:.0f}", f"{tp[l][0]:.0f}", f"{tp[l][1]:.0f}",
             f"{tp[l][1] / tp[l][0]:.1%}", f"{one[l][0] / tp[l][0]:.2f}"] for l in layers]
    return table(["layer", "tp_size=1 µs/step", f"tp_size={ranks.world_size} µs/step", "of which all-reduce µs",
                  "all-reduce share", "speed-up"], rows)
