"""The layer grid: our step at every point where vLLM and SGLang publish theirs (dsv4/speed/peers.py),
beside their figures. Decode points are CUDA-graph replays of the second layer of its type, one token per
request, each compared with its eager forward bit for bit; prefill points are one request timed eagerly.
Every backend of the job's machine (or those named) runs each point; a row shows the fastest, the
`triton` preset (our own kernels) against it, and the faster engine's published latency against it."""
from __future__ import annotations

import torch

from dsv4.speed.layer import INVARIANT, backends, base_label, prefill_row, replayed_step, row_label
from dsv4.speed.peers import LAYER_TYPES, MODELS, Point, card_of, faster, grid, published
from dsv4.speed.rows import measurement
from dsv4.speed.timing import copy_gbps
from dsv4.checks.catalogue import backend_presets
from dsv4.values.device import local_platform
from dsv4.reports.report import table

HEADERS = ["layer", "step", "fastest backend", "ours µs", "triton preset µs", "triton / ours", "vLLM µs",
           "SGLang µs", "ours / faster engine", "replay == eager", "weights / copy"]
INVARIANT_HEADERS = ["batch-invariant µs", "invariant / ours"]     # batch_invariant=true: the fastest such row


def preset_label(preset: str) -> str:
    """A backend preset's row label in the layer tables ('mqa_kernel + o_proj + linear')."""
    chosen = backend_presets()[preset]
    return row_label(chosen["mqa_kernel"], chosen["o_proj"], chosen["linear"])


def time_point(job, backend, layer: int, p: Point) -> tuple[float, bool | None, int | None]:
    """µs of `backend` at point p, whether replay equals eager and the layer's weight bytes (None and None
    for a prefill: it runs eagerly)."""
    if p.mode == "prefill":
        return prefill_row(job, backend, layer, tokens=p.tokens)[3] * 1e3, None, None
    return replayed_step(job, backend, layer, p.requests, 1, p.context)


def grid_row(p: Point, times: dict[str, tuple], figures: dict[str, float], *, invariant: bool = False,
             copy_gbps: float | None = None) -> list:
    """A point's row: the fastest backend run by default, the triton preset beside it, the engines' figures;
    with `invariant`, also the fastest batch-invariant row and its ratio to the fastest. `times`: per
    backend (µs, replay == eager) or (µs, replay == eager, weight bytes); with the card's measured
    `copy_gbps`, the last column is the fastest row's weight bytes over its time as a share of that
    bandwidth (how near a decode step is to reading its weights once at copy speed)."""
    default = [label for label in times if not label.endswith(INVARIANT)] or list(times)   # all else out of memory
    best = min(default, key=lambda label: times[label][0])
    checked = [t[1] for t in times.values() if t[1] is not None]
    ours = times[best][0]
    weights = times[best][2] if len(times[best]) > 2 else None
    share = weights / (copy_gbps * 1e3 * ours) if weights and copy_gbps else None
    tri = times.get(preset_label("triton"), (None,))[0]
    _, peer = faster(figures)
    row = [p.layer, p.label(), best, ours, tri, None if tri is None else tri / ours, figures.get("vllm"),
           figures.get("sglang"), ours / peer, all(checked) if checked else None, share]
    if invariant:
        fixed = min((times[label][0] for label in times if label.endswith(INVARIANT)), default=None)
        row[5:5] = [fixed, None if fixed is None else fixed / ours]          # after the triton preset's µs
    return row


def grid_measurement(model: str, p: Point, row: list, headers: list[str], *, one_backend: bool = False,
                     invariant: bool = False) -> dict:
    """A point's row of the grid as a row of docs/benchmarks.md's grid table of its model and mode
    (dsv4/speed/rows.py): the fastest backend by its preset's name (left out where one backend ran), the
    triton preset where it ran, the engines' figures as the peers'."""
    cells = dict(zip(headers, row))
    case = {"layer": p.layer} | ({"requests @ context": p.label()} if p.mode == "decode" else {"tokens": p.tokens})
    peers = {"vLLM": cells["vLLM µs"], "SGLang": cells["SGLang µs"]}
    name = f"grid/{model}/{p.mode}" + ("/batch_invariant" if invariant else "")
    if row[2] == "out of memory":
        return measurement(name, case=case, ours={"ours": row[2]}, peers=peers)
    presets = {preset_label(preset): preset for preset in backend_presets()}
    ours = {} if one_backend else {"fastest preset": presets.get(cells["fastest backend"], cells["fastest backend"])}
    ours["ours"] = cells["ours µs"]
    if cells["triton preset µs"] is not None:
        ours |= {"triton preset": cells["triton preset µs"], "triton / ours": cells["triton / ours"]}
    if invariant:
        ours |= {"batch-invariant": cells["batch-invariant µs"], "invariant / ours": cells["invariant / ours"]}
    after = {"ours / faster engine": cells["ours / faster engine"]}
    if cells["replay == eager"] is not None:
        after["replay == eager"] = cells["replay == eager"]
    return measurement(name, case=case, ours=ours | after, peers=peers, columns=[*case, *ours, *peers, *after])


def gpu_name() -> str:
    """This machine's first CUDA GPU, by name."""
    return torch.cuda.get_device_name()


def bench_grid(job, *, labels=None, layer_types=LAYER_TYPES, modes=("decode", "prefill"), max_requests=None,
               echo=None, record=None) -> str:
    """The grid of the job's model (DSV4-Flash or DSV4-Pro), `labels` the backends to run (default: all
    that run here), as one table (`max_requests`: its decode points of at most that many requests); `record`
    (dsv4/speed/rows.py) takes each point's row as it is measured."""
    spec = job.spec
    if spec.name not in MODELS:
        raise ValueError(f"model={spec.name}: the engines publish DSV4-Flash and DSV4-Pro only "
                         f"(model=dsv4_flash or model=dsv4_pro)")
    if job.device.platform != local_platform():
        raise ValueError(f"the grid times GPU steps: the deployment describes {job.device.describe()} and this "
                         f"machine's platform is {local_platform()}")
    here = backends(job)
    runs = [b for b in here if labels is None or base_label(b.label) in labels]
    if not runs:
        raise ValueError(f"none of the backends {labels} runs here; these do: {[b.label for b in here]}")
    card = card_of(gpu_name())          # the engines' rows of the card this runs on
    figures = published(card)
    bandwidth = copy_gbps() if "decode" in modes else None
    first = {lt: next(l for l in spec.one_layer_per_type() if spec.layer_type(l) == lt) for lt in layer_types}
    headers = HEADERS[:5] + INVARIANT_HEADERS + HEADERS[5:] if job.combo.batch_invariant else HEADERS
    rows = []
    for p in grid(spec.name, layer_types, max_requests=max_requests):
        if p.mode not in modes:
            continue
        times = {}
        for b in runs:
            try:
                times[b.label] = time_point(job, b, first[p.layer], p)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
        if times:
            rows.append(grid_row(p, times, figures[p], invariant=job.combo.batch_invariant, copy_gbps=bandwidth))
        else:
            rows.append([p.layer, p.label(), "out of memory"] + [None] * (len(headers) - 3))
        if record is not None:
            record([grid_measurement(spec.name, p, rows[-1], headers, one_backend=len(runs) == 1,
                                     invariant=job.combo.batch_invariant)])
        if echo is not None and times:
            echo(" | ".join(map(str, rows[-1])))
    return (f"{spec.name}: decode (one token per request, replay of the second layer of its type, median µs) and "
            f"prefill (one request, eager, µs) beside the engines' published latency on the {card} "
            f"(dsv4/speed/peers.py); weights / copy: the fastest row's weight bytes over its time, as a share "
            f"of this card's copy bandwidth, {bandwidth or 0:.0f} GB/s measured:\n"
            + table(headers, rows, left=(0, 1, 2)))
