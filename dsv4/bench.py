"""`mode=bench`: GPU timings of the sparse MQA kernels, the output projections and the whole layer step,
every option available on this machine side by side in one process (docs/design.md §3).

Timing: warm-up, then CUDA-graph replays of several calls timed with CUDA events, median of repeats
(graph replay removes Python launch overhead, which otherwise dominates small kernels). Inputs are
fresh random data; the fp8_ds_mla pools are far larger than L2 and the slot lists random over them.
FLOPs and bytes (docs/numerics.md §2.7): per query row 2·H·N·(512+512) FLOPs and N·584 bytes
of KV (N = valid SWA + compressed entries), plus q and out.
"""
from __future__ import annotations

import statistics
from typing import Any

import torch

from dsv4.catalogue import options
from dsv4.components.kv_pool import PagedCache
from dsv4.oracle import rel_err
from dsv4.report import table
from dsv4.strategies import Fp8DsMlaLayout, OProjWeights, SparseKV

CEILINGS = {"sm90": {"tflops": 777.0, "gbps": 4260.0}}   # the H200: bf16 GEMM, d2d copy (docs/benchmarks.md)
STEP_REQUESTS, STEP_TOKENS = 64, 2                          # the layer-step benches' decode batch
POOL_BLOCKS = 4096                                          # 262,144 rows x 584 B = 153 MB per cache
DECODE_CASES = [("h64 128+512", 64, 64, 512, b, sq) for b, sq in ((1, 1), (64, 2), (128, 1), (128, 2))] + [
    ("h128 128+1024", 128, 64, 1024, 128, 2), ("h64 128 SWA only", 64, None, 0, 128, 1)]


def replay_us(fn, *, calls: int = 20, repeats: int = 7) -> float:
    """Median over `repeats` of `calls` calls of fn (a graph's replay, or an eager call), µs per call,
    between CUDA events, after 3 warm-up calls. Python's cyclic garbage collector is paused while timing
    (as `timeit` does): an eager call is host-bound, and a collection its garbage did not trigger would
    land in whichever call it interrupts."""
    return eager_us(fn, calls=calls, repeats=repeats)[0]


def eager_us(fn, *, calls: int = 20, repeats: int = 7) -> tuple[float, float]:
    """`replay_us` of fn, and beside it the host's time to issue the same calls (perf_counter until the
    last is issued, before the closing event): equal when the call is bound by the host, lower when the
    GPU is the bottleneck."""
    import gc
    import time

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times, host = [], []
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host.append((time.perf_counter() - t0) * 1e6 / calls)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / calls)
    finally:
        if collecting:
            gc.enable()
    return statistics.median(times), statistics.median(host)


def graph_time_us(fn, *, calls: int = 20, repeats: int = 7) -> float:
    """Median over `repeats` CUDA-graph replays of `calls` calls of fn, per call, in µs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    return replay_us(graph.replay, calls=1, repeats=repeats) / calls


def random_pages(name: str, blocks: int, block_size: int, g, layout=None) -> PagedCache:
    """A PagedCache on g's device (fp8_ds_mla unless `layout` says otherwise) with a random row in every
    slot, written in scrambled order."""
    lay, dev = layout or Fp8DsMlaLayout(), g.device
    c = PagedCache(name=name, layout=lay, block_size=block_size, head_dim=512,
                   data=lay.allocate(num_blocks=blocks, block_size=block_size, head_dim=512, device=dev))
    n = blocks * block_size
    c.write(torch.randperm(n, generator=g, device=dev).int(), torch.randn(n, 512, generator=g, device=dev))
    return c


def sparse_case(T: int, H: int, *, extra_block, extra_w: int, seed: int, swa_w: int = 128, swa_blocks: int = 16,
                extra_blocks: int = 64, full: bool = False, q_std: float = 1.0, layout=None, device: str = "cuda"):
    """q [T, H, 512] bf16, a SparseKV over random pages, sinks. Slot lists are random over the pools,
    -1 padded past random lengths (or full, for benchmarks that count every entry)."""
    g = torch.Generator(device=device).manual_seed(seed)
    swa = random_pages("swa", swa_blocks, 64, g, layout)

    def lists(width, slots):
        idx = torch.randint(0, slots, (T, width), generator=g, device=device)
        lens = torch.full((T,), width, device=device) if full else \
            torch.randint(1 if width == swa_w else 0, width + 1, (T,), generator=g, device=device)
        cols = torch.arange(width, device=device)[None]
        return torch.where(cols < lens[:, None], idx, -1).int(), lens.int()

    si, sl = lists(swa_w, swa.num_slots)
    kw: dict[str, Any] = dict(swa=swa, swa_indices=si, swa_lens=sl)
    if extra_w:
        ext = random_pages("compressed", extra_blocks, extra_block, g, layout)
        ei, el = lists(extra_w, ext.num_slots)
        kw |= dict(extra=ext, extra_indices=ei, extra_lens=el)
    q = (torch.randn(T, H, 512, generator=g, device=device) * q_std).bfloat16()   # logits ~ N(0, q_std²)
    return q, SparseKV(**kw), torch.randn(H, generator=g, device=device)


def oproj_case(T: int, G: int, seed: int = 0, hpg: int = 8, o_lora: int = 1024, hidden: int = 4096):
    g = torch.Generator().manual_seed(seed)
    w = OProjWeights(wo_a=torch.randn(G * o_lora, hpg * 512, generator=g) * (hpg * 512) ** -0.5,
                     wo_b=torch.randn(hidden, G * o_lora, generator=g) * (G * o_lora) ** -0.5, groups=G)
    o = torch.randn(T, G * hpg, 512, generator=g).cuda().bfloat16()
    pos = torch.randint(0, 100_000, (T,), generator=g).cuda()
    return w, o, pos


def available_options(job, group: str) -> list:
    """Every option of `group` that check() accepts on this machine with the job's other choices,
    except for the cache layout, which is fp8_ds_mla for every kernel (the one all of them read)."""
    from dataclasses import replace

    from dsv4.compat import check
    from dsv4.device import local_platform

    out = []
    for strat in options(group).values():
        combo = replace(job.combo, **{group: strat}, cache_layout=Fp8DsMlaLayout(), dtype="bfloat16")
        probs = [p for p in check(combo, job.device, here=local_platform()) if p.group in (group, "dtype")]
        if not probs:
            out.append(strat)
    return out


def bench_mqa(job) -> str:
    from dataclasses import replace

    kernels = available_options(job, "mqa_kernel")
    # on sm90, where auto runs the one-pass Hopper kernel, triton_sparse's two-pass kernel beside it
    if job.device.arch == "sm90":
        kernels += [replace(k, variant="two_pass") for k in kernels if getattr(k, "variant", None) == "auto"]
    ceil = CEILINGS.get(job.device.arch, {})
    rows = []
    for label, H, eb, ew, b, sq in DECODE_CASES:
        T = b * sq
        q, kv, sink = sparse_case(T, H, extra_block=eb, extra_w=ew, seed=T + H, swa_blocks=POOL_BLOCKS,
                                  extra_blocks=POOL_BLOCKS, full=True)
        n = 128 + ew
        flops, nbytes = 2 * T * H * n * 1024, T * (n * 584 + 2 * H * 512 * 2)
        ref_out = None
        base = None
        for k in kernels:
            name = k.name if getattr(k, "variant", "auto") == "auto" else f"{k.name} ({k.variant})"
            prep = k.prepare(device=job.device)
            out, _ = k(q, kv, sink=sink, scale=512 ** -0.5, prepared=prep)
            ref_out = out if ref_out is None else ref_out
            us = graph_time_us(lambda: k(q, kv, sink=sink, scale=512 ** -0.5, prepared=prep),
                               calls=20 if k.name != "reference" else 3, repeats=7 if k.name != "reference" else 3)
            base = base or us
            tf, gb = flops / us / 1e6, nbytes / us / 1e3
            rows.append([label, b, sq, name, f"{us:.1f}", f"{tf:.0f}", f"{gb:.0f}",
                         f"{tf / ceil['tflops']:.0%}" if ceil else "-", f"{gb / ceil['gbps']:.0%}" if ceil else "-",
                         f"{us / base:.2f}", f"{rel_err(out, ref_out):.1e}"])
    return table(["case", "b", "s_q", "mqa_kernel", "µs", "TFLOP/s", "GB/s", "of bf16 peak", "of copy BW",
                  "time / first", "rel err vs first"], rows)


def bench_o_proj(job) -> str:
    from dsv4.components.rope import Rope

    strategies = available_options(job, "o_proj")
    rope = Rope.for_layer(job.spec, 4)
    rows = []
    for T in (1, 128, 4096):
        w, o, pos = oproj_case(T, 8)
        rot = rope.at(pos)
        base = ref = None
        for s in strategies:
            prep = s.prepare(w, device=job.device, dtype="bfloat16")
            y = s(o, rot, prepared=prep)
            ref = y if ref is None else ref
            us = graph_time_us(lambda: s(o, rot, prepared=prep))
            base = base or us
            rows.append([T, s.name, f"{us:.1f}", f"{us / base:.2f}", f"{rel_err(y, ref):.1e}"])
    return table(["T", "o_proj", "µs", "time / first", "rel err vs first"], rows)


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


def run_bench(job, ranks=None) -> None:
    from dsv4.errors import ConfigError
    from dsv4.indexer_bench import CONTEXTS, NREQ, TOKENS, bench_indexer
    from dsv4.layer_bench import bench_layer_step

    if job.device.platform != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"mode=bench times GPU kernels: deployment gives {job.device.describe()} and this "
                          f"machine has {'a' if torch.cuda.is_available() else 'no'} CUDA GPU")
    if ranks is not None and ranks.distributed:
        t = bench_tp_step(job, ranks)
        if t is not None:
            print(f"dsv4 bench on {ranks.world_size} x {job.device.describe()}, torch {torch.__version__}; "
                  f"model={job.spec.name}; " + " ".join(f"{k}={v}" for k, v in job.choices.items()))
            print(f"\nwhole layer, decode steps after a 600-token prefill, tp_size={ranks.world_size} "
                  f"(one process per GPU, NCCL all-reduce) beside tp_size=1 (eager, median):\n{t}")
        return
    print(f"dsv4 bench on {job.device.describe()}, torch {torch.__version__}; model={job.spec.name}")
    print("\nsparse MQA decode, fp8_ds_mla pages (153 MB per cache), full index lists:\n" + bench_mqa(job))
    print("\no_proj, G=8 groups of 8 heads, 4096 -> 1024 per group, then wo_b:\n" + bench_o_proj(job))
    print("\nwhole layer, one layer of each type:\n" + bench_layer_step(job))
    indexers = available_options(job, "indexer")
    print(f"\nthe indexer: scores and top-{job.spec.index_topk} of {NREQ} requests x {TOKENS} tokens by each option, "
          "in CUDA graphs:\n" + bench_indexer(job, indexers))
    print("\nthe ratio-4 layer with each indexer option:\n"
          + bench_layer_step(job, [(NREQ, TOKENS, c) for c in CONTEXTS[::2]], indexers=[ix.name for ix in indexers],
                             layer_types=("c4a",), prefill=False))
