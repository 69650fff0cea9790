"""Where a layer's decode step spends its time: the replayed CUDA graph under torch.profiler, kernels by
total time (the table behind the layer-step optimisations in docs/benchmarks.md).

  python bench/profile_layer.py                       # flashmla + deepgemm_fp8, every layer type, 64 x 2, 8k
  python bench/profile_layer.py --backend triton_sparse + triton_fp8 --requests 64 --tokens 2 --context 65536
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from hydra import compose, initialize_config_dir

from dsv4.app import CONFIG_DIR, make_job
from dsv4.bench import replay_us
from dsv4.layer_bench import _engine, backends, decode_step, fill


def profile(job, backend, layer: int, nreq: int, tokens: int, context: int, top: int) -> None:
    eng = _engine(job, backend, (layer,), nreq=nreq, tokens=tokens, context=context, graphs=True)
    rids = list(range(nreq))
    fill(eng, rids, context, seed=1)
    T = nreq * tokens
    segs = decode_step(rids, tokens, context)
    for pool in eng.pools:
        pool.reserve({s.rid: (s.start, s.start + s.count) for s in segs})
    eng.graphs.capture(eng, [T])
    eng.graphs.replay(eng, T, torch.randn(T, job.spec.hidden_size), segs, None, None)
    graph = eng.graphs.captured[T].layer_graphs[(layer, 0)]
    us = replay_us(graph.replay)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    per = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name].append(e.device_time)
    rows = sorted(((sum(v) / 10, len(v) // 10, k) for k, v in per.items()), reverse=True)
    total = sum(r[0] for r in rows)
    print(f"\n{job.spec.layer_type(layer)}  {backend.label}  {nreq} x {tokens}  context {context}: replay {us:.1f} µs, "
          f"kernels {total:.1f} µs in {sum(r[1] for r in rows)} launches (gaps {us - total:.1f} µs)")
    for t, n, name in rows[:top]:
        print(f"  {t:8.1f} µs  x{n:<3d} {name[:110]}")
    del eng
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="flashmla + deepgemm_fp8")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layer", default="all", help="swa | c4a | c128a | all")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("overrides", nargs="*", default=["deployment=h200"])
    a = ap.parse_args()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        job = make_job(compose(config_name="config", overrides=a.overrides))
    chosen = next(b for b in backends(job) if b.label == a.backend)
    for layer in job.spec.one_layer_per_type():
        if a.layer in ("all", job.spec.layer_type(layer)):
            profile(job, chosen, layer, a.requests, a.tokens, a.context, a.top)


if __name__ == "__main__":
    main()
