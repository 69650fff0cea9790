"""How the benches time: warm-up, then CUDA-graph replays of several calls timed with CUDA events, median of
repeats (graph replay removes Python launch overhead, which otherwise dominates small kernels), beside
the card's measured ceilings."""
from __future__ import annotations

import statistics

import torch

CEILINGS = {"sm90": {"tflops": 777.0, "gbps": 4260.0}}   # the H200: bf16 GEMM, d2d copy (docs/benchmarks.md)


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


COPY_BYTES = 1 << 30      # a device copy this large is bound by DRAM on every card here (L2 at most ~60 MB)


def copy_gbps() -> float:
    """This GPU's device-to-device copy bandwidth, GB/s (bytes read + written), measured: the bandwidth a
    step's weights are read at, at best."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us(lambda: dst.copy_(src), calls=2, repeats=5)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / us / 1e3


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
