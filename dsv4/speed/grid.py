"""The layer grid: our step at every point where vLLM and SGLang publish theirs (dsv4/speed/peers.py),
beside their figures. Decode points are CUDA-graph replays of the second layer of its type, one token per
request, each compared with its eager forward bit for bit; prefill points are one request timed eagerly.
Every backend of the job's machine (or those named) runs each point; a row shows the fastest, the
`triton` preset (our own kernels) against it, and the faster engine's published latency against it."""
from __future__ import annotations

import torch

from dsv4.speed.layer import INVARIANT, backends, base_label, prefill_row, replayed_step, row_label
from dsv4.speed.peers import LAYER_TYPES, Point, faster, grid, published
from dsv4.checks.catalogue import backend_presets
from dsv4.values.device import local_platform
from dsv4.reports.report import table

HEADERS = ["layer", "step", "fastest backend", "ours µs", "triton preset µs", "triton / ours", "vLLM µs",
           "SGLang µs", "ours / faster engine", "replay == eager"]
INVARIANT_HEADERS = ["batch-invariant µs", "invariant / ours"]     # batch_invariant=true: the fastest such row


def preset_label(preset: str) -> str:
    """A backend preset's row label in the layer tables ('mqa_kernel + o_proj + linear')."""
    chosen = backend_presets()[preset]
    return row_label(chosen["mqa_kernel"], chosen["o_proj"], chosen["linear"])


def time_point(job, backend, layer: int, p: Point) -> tuple[float, bool | None]:
    """µs of `backend` at point p, and whether replay equals eager (None for a prefill: it runs eagerly)."""
    if p.mode == "prefill":
        return prefill_row(job, backend, layer, tokens=p.tokens)[3] * 1e3, None
    return replayed_step(job, backend, layer, p.requests, 1, p.context)


def grid_row(p: Point, times: dict[str, tuple[float, bool | None]], figures: dict[str, float], *,
             invariant: bool = False) -> list:
    """A point's row: the fastest backend run by default, the triton preset beside it, the engines' figures;
    with `invariant`, also the fastest batch-invariant row and its ratio to the fastest."""
    default = [label for label in times if not label.endswith(INVARIANT)] or list(times)   # all else out of memory
    best = min(default, key=lambda label: times[label][0])
    checked = [same for _, same in times.values() if same is not None]
    ours = times[best][0]
    tri = times.get(preset_label("triton"), (None,))[0]
    _, peer = faster(figures)
    row = [p.layer, p.label(), best, ours, tri, None if tri is None else tri / ours, figures.get("vllm"),
           figures.get("sglang"), ours / peer, all(checked) if checked else None]
    if invariant:
        fixed = min((times[label][0] for label in times if label.endswith(INVARIANT)), default=None)
        row[5:5] = [fixed, None if fixed is None else fixed / ours]          # after the triton preset's µs
    return row


def bench_grid(job, *, labels=None, layer_types=LAYER_TYPES, modes=("decode", "prefill"), echo=None) -> str:
    """The grid of the job's model (DSV4-Flash or DSV4-Pro), `labels` the backends to run (default: all
    that run here), as one table."""
    figures = published()
    spec = job.spec
    if spec.name not in {p.model for p in figures}:
        raise ValueError(f"model={spec.name}: the engines publish DSV4-Flash and DSV4-Pro only "
                         f"(model=dsv4_flash or model=dsv4_pro)")
    if job.device.platform != local_platform():
        raise ValueError(f"the grid times GPU steps: the deployment describes {job.device.describe()} and this "
                         f"machine's platform is {local_platform()}")
    here = backends(job)
    runs = [b for b in here if labels is None or base_label(b.label) in labels]
    if not runs:
        raise ValueError(f"none of the backends {labels} runs here; these do: {[b.label for b in here]}")
    first = {lt: next(l for l in spec.one_layer_per_type() if spec.layer_type(l) == lt) for lt in layer_types}
    headers = HEADERS[:5] + INVARIANT_HEADERS + HEADERS[5:] if job.combo.batch_invariant else HEADERS
    rows = []
    for p in grid(spec.name, layer_types):
        if p.mode not in modes:
            continue
        times = {}
        for b in runs:
            try:
                times[b.label] = time_point(job, b, first[p.layer], p)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
        if not times:
            rows.append([p.layer, p.label(), "out of memory"] + [None] * (len(headers) - 3))
            continue
        rows.append(grid_row(p, times, figures[p], invariant=job.combo.batch_invariant))
        if echo is not None:
            echo(" | ".join(map(str, rows[-1])))
    return (f"{spec.name}: decode (one token per request, replay of the second layer of its type, median µs) and "
            f"prefill (one request, eager, µs) beside the engines' published latency (dsv4/speed/peers.py):\n"
            + table(headers, rows, left=(0, 1, 2)))
