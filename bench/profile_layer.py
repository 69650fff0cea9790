"""Where a layer's decode step spends its time: the replayed CUDA graph of the second layer of its type (as the
layer grid times it; the first also makes the type's per-step kernel plan) under torch.profiler, kernels by
total time (the tables behind the layer-step optimisations in docs/archive/benchmarks-journal.md); with
--eager, the host's time in the same forward run without the graph (cProfile, functions by their own time).

  python bench/profile_layer.py          # the flashmla preset, every layer type, 64 x 2, 8k
  python bench/profile_layer.py --backend "triton_sparse + triton_fp8 + triton_fp8" --requests 64 --context 65536
  python bench/profile_layer.py --eager --layer c4a   # the eager forward's host time by function
  python bench/profile_layer.py --timeline --requests 1 --tokens 1   # one replay's kernels in order, with gaps
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from hydra import compose, initialize_config_dir

from dsv4.checks.catalogue import config_dir
from dsv4.app.job import make_job
from dsv4.speed.gpu import require_gpu
from dsv4.speed.timing import replay_us
from dsv4.speed.layer import backends, decode_step, engine_for, fill, two_of_type


def traced(fn, calls: int = 10, *, host: bool = False):
    """fn() `calls` times under torch.profiler -> ({kernel: (µs per call, launches per call)}, {CUDA API call:
    (calls per call, host µs per call)}; the second only with `host`)."""
    acts = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if host else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    gpu, api = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu[e.name][0] += e.device_time / calls
            gpu[e.name][1] += 1
        elif host and e.name.startswith("cu"):         # CUDA runtime and driver calls
            api[e.name][0] += 1
            api[e.name][1] += e.cpu_time_total / calls
    return ({k: (t, n // calls) for k, (t, n) in gpu.items()}, {k: (n / calls, t) for k, (n, t) in api.items()})


def timeline(fn, calls: int = 3) -> list[tuple[float, float, float, str]]:
    """The kernels of fn's last of `calls` calls in order of start: (start µs from the first kernel's start,
    duration µs, idle µs since the latest end before it -- the GPU ran none of fn's kernels then, name)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    ks = ks[len(ks) - len(ks) // calls:]
    out, t0, end = [], ks[0][0], ks[0][0]
    for start, stop, name in ks:
        out.append((start - t0, stop - start, max(0.0, start - end), name))
        end = max(end, stop)
    return out


def host_profile(eng, layer: int, T: int, top: int) -> None:
    """The eager forward of `layer` on the captured step's plan, 50 calls under cProfile."""
    import cProfile
    import pstats
    import time

    cap = eng.graphs.captured[T]
    plan = cap.plans[0].with_type_plans(eng.type_plans(cap.plans[0], 0, fresh=True))
    module, caches = eng.layers[layer][0], eng.pools[0].layers[layer]
    for _ in range(5):
        module(cap.x, plan, caches)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        module(cap.x, plan, caches)
    host = (time.perf_counter() - t0) / 50 * 1e6
    torch.cuda.synchronize()
    gpu, api = traced(lambda: module(cap.x, plan, caches), host=True)
    print(f"  eager forward on the GPU: {sum(t for t, _ in gpu.values()):.1f} µs of kernels per call; per call:")
    for name, (t, _n) in sorted(gpu.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {t:8.1f} µs  {name[:110]}")
    print("  CUDA API calls of the eager forward, per call:")
    for name, (n, t) in sorted(api.items(), key=lambda kv: -kv[1][1]):
        print(f"  {t:8.1f} µs  x{n:<5.1f} {name}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        module(cap.x, plan, caches)
    prof.disable()
    torch.cuda.synchronize()
    print(f"  eager forward: {host:.0f} µs of host time per call (no profiler); under cProfile, per call:")
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, name), (_cc, nc, tt, ct, _callers) in rows:
        print(f"  {tt / 50 * 1e6:8.1f} µs own {ct / 50 * 1e6:8.1f} µs cum  x{nc // 50:<3d} {name} "
              f"({file.split('site-packages/')[-1].split('/work/')[-1]}:{line})")


def profile(job, backend, layer: int, nreq: int, tokens: int, context: int, top: int, eager: bool = False,
            show_timeline: bool = False) -> None:
    layers = two_of_type(job.spec, layer)
    eng = engine_for(job, backend, layers, nreq=nreq, tokens=tokens, context=context, graphs=True)
    rids = list(range(nreq))
    fill(eng, rids, context, seed=1)
    T = nreq * tokens
    segs = decode_step(rids, tokens, context)
    for pool in eng.pools:
        pool.reserve({s.rid: (s.start, s.start + s.count) for s in segs})
    eng.graphs.capture(eng, [T])
    eng.graphs.replay(eng, T, torch.randn(T, job.spec.hidden_size), segs, None, None)
    layer = layers[-1]
    graph = eng.graphs.captured[T].layer_graphs[(layer, 0)]
    us = replay_us(graph.replay)
    rows = sorted(((t, n, k) for k, (t, n) in traced(graph.replay)[0].items()), reverse=True)
    total = sum(r[0] for r in rows)
    print(f"\n{job.spec.layer_type(layer)}  {backend.label}  {nreq} x {tokens}  context {context}: replay {us:.1f} µs, "
          f"kernels {total:.1f} µs in {sum(r[1] for r in rows)} launches (gaps {us - total:.1f} µs)")
    for t, n, name in rows[:top]:
        print(f"  {t:8.1f} µs  x{n:<3d} {name[:110]}")
    if show_timeline:
        rows = timeline(graph.replay)
        print(f"  one replay in order: {rows[-1][0] + rows[-1][1]:.1f} µs from first start to last end, "
              f"{sum(r[2] for r in rows):.1f} µs with no kernel running")
        for start, dur, idle, name in rows:
            print(f"  {start:8.1f} +{dur:6.1f} (idle {idle:5.1f})  {name[:100]}")
    if eager:
        host_profile(eng, layer, T, top)
    del eng
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="flashmla_sparse + deepgemm_fp8 + deepgemm_triton_fp8",
                    help="a label 'mqa_kernel + o_proj + linear' of dsv4/speed/layer.py's backends")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layer", default="all", help="swa | c4a | c128a | all")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--eager", action="store_true", help="also the eager forward's host time by function")
    ap.add_argument("--timeline", action="store_true", help="also one replay's kernels in order, with the gaps")
    ap.add_argument("overrides", nargs="*", default=[], help="Hydra overrides (deployment=h200 unless one is given)")
    a = ap.parse_args()
    require_gpu("bench/profile_layer.py")
    if not any(o.startswith("deployment=") for o in a.overrides):
        a.overrides.insert(0, "deployment=h200")
    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir())):
        job = make_job(compose(config_name="config", overrides=a.overrides))
    labels = {b.label: b for b in backends(job)}
    if a.backend not in labels:
        raise SystemExit(f"error: --backend {a.backend!r}: this machine runs {', '.join(labels) or 'none of them'}")
    chosen = labels[a.backend]
    for layer in job.spec.one_layer_per_type():
        if a.layer in ("all", job.spec.layer_type(layer)):
            profile(job, chosen, layer, a.requests, a.tokens, a.context, a.top, a.eager, a.timeline)


if __name__ == "__main__":
    main()
