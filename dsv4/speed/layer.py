"""`mode=bench`'s whole-layer table: one layer's decode step as a serving engine runs it, beside what its
parts cost alone and what the card's bandwidth allows.

Per layer type and backend, an engine holds that one layer; its requests are filled to the context
directly (pages reserved through the pool, random rows written through the layouts, random compressor
state), so a 64k-token context needs no 64k prefill. The decode step is captured as the engine
captures it (dsv4/components/graphs.py) and timed by replaying the layer's graph (median of repeats).
Beside it, in the same process:
- eager: the same layer forward on the same step plan without the graph (launch overhead included), and
  the host's time to issue it (equal to the eager time when the host is the bottleneck);
- components: the step's GEMMs, its MQA kernel, its o_proj and (ratio 4) the indexer's scores and
  top-k, each timed alone in a CUDA graph on the step's own inputs -- the step minus these is what the
  layer's glue (norms, RoPE, compressors, cache writes, index lists) and the gaps between kernels cost;
- floor: the bytes the step must move (its weights as stored, the KV rows and indexer keys it reads)
  at the card's measured copy bandwidth.
Replay and eager outputs are compared bit for bit. A prefill of one 8192-token request is timed eagerly, on the
second layer of its type too.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

import torch

from dsv4.speed.timing import CEILINGS, eager_us, graph_time_us, replay_us
from dsv4.checks.catalogue import backend_presets, defaults, option
from dsv4.components.engine import CudaTimer, Segment
from dsv4.values.layer_types import by_ratio
from dsv4.reports.report import table
from dsv4.speed.rows import printed_rows
from dsv4.app.runner import tensor_bytes
from dsv4.values.sizes import cdiv

DECODE_CASES = [(64, 2, 8192), (64, 2, 65536), (1, 1, 8192), (16, 1, 8192), (64, 1, 8192), (128, 1, 8192)]
PREFILL_TOKENS = 8192
ERROR = "error: "            # how a row that failed begins its first measured cell (the tables' callers count them)
EAGER_ROUNDS = 5
DECODE_HEADERS = ["layer", "backend", "indexer", "requests", "tokens/req", "context", "replay µs", "+ first of type",
                  "eager µs", "eager/replay", "eager host µs", "plan µs", "components µs", "replay/components",
                  "floor µs", "floor/replay", "replay == eager"]
PARTS_HEADERS = ["layer", "backend", "indexer", "component", "µs"]
PREFILL_HEADERS = ["layer", "backend", "indexer", "tokens", "ms", "tokens/s"]


# ---- filling a context directly ------------------------------------------------------------------
def fill(engine, rids, context: int, seed: int) -> None:
    """Requests `rids` at length `context`: their pages reserved and committed as a prefill would leave
    them, every row a later step reads written with random values through the layouts."""
    g = torch.Generator(device=engine.device).manual_seed(seed)
    dev = engine.device
    for rid in rids:
        engine.add_request(rid)
        for pool in engine.pools:
            pool.reserve({rid: (0, context)})
            pool.commit({rid: context})
        engine.lengths[rid] = context
    for pool in engine.pools:
        for caches in pool.layers.values():
            def rows_of(group, count, first=0):
                """Global slots of rows first..count-1 of every request, through its table."""
                out = []
                for rid in rids:
                    t = torch.tensor(group.tables[rid], dtype=torch.int64, device=dev)
                    i = torch.arange(first, count, device=dev)
                    out.append((t[i // group.block_size] * group.block_size + i % group.block_size).int())
                return torch.cat(out)

            def write(cache, slots, dim, scale=1.0):
                for s in slots.split(1 << 16):
                    cache.write(s, torch.randn(s.shape[0], dim, generator=g, device=dev) * scale)

            swa = pool.swa
            write(caches.swa, rows_of(swa, context, swa.rule.first_kept(context)), caches.swa.head_dim)
            if caches.compressed is not None:
                ents = pool.entries(caches.ratio)
                slots = rows_of(ents, context // caches.ratio)
                write(caches.compressed, slots, caches.compressed.head_dim)
                if caches.indexer_keys is not None:
                    write(caches.indexer_keys, slots, caches.indexer_keys.head_dim)
                st = pool.state(caches.ratio)
                kept = rows_of(st, context, st.rule.first_kept(context)).long()
                for s in (caches.state, caches.indexer_state):
                    if s is not None:
                        s.data[kept] = torch.randn(kept.shape[0], s.data.shape[1], generator=g, device=dev)


def decode_step(rids, tokens: int, context: int) -> tuple[Segment, ...]:
    return tuple(Segment(rid=r, start=context, offset=i * tokens, count=tokens) for i, r in enumerate(rids))


# ---- the step's parts alone ---------------------------------------------------------------------
class _Record:
    """Calls through to `inner`, keeping the arguments of the last call."""

    def __init__(self, inner) -> None:
        self.inner, self.args, self.kwargs = inner, None, None

    def __call__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _RecordScores:
    """The layer's ops with `index_scores` recorded (the indexer's scores as the layer calls them)."""

    def __init__(self, ops, scores: _Record):
        self.ops, self.index_scores = ops, scores

    def __getattr__(self, name):
        return getattr(self.ops, name)


def component_us(layer, x, plan, caches) -> dict[str, float]:
    """The step's GEMMs, MQA kernel, o_proj and (ratio 4) indexer scores and top-k, each timed alone in a
    CUDA graph on the inputs the layer gives them."""
    ops = layer.ops
    mqa, oproj, scores = _Record(layer.mqa_kernel), _Record(layer.o_proj), _Record(ops.index_scores)
    idx = layer.indexer
    layer.mqa_kernel, layer.o_proj, layer.ops = mqa, oproj, _RecordScores(ops, scores)
    try:
        layer(x, plan, caches)
    finally:
        layer.mqa_kernel, layer.o_proj, layer.ops = mqa.inner, oproj.inner, ops
    T = x.shape[0]
    lin = layer.linear
    # the q_lora rows as the layer hands them to wq_b (quantized by the norm's kernel for an fp8 linear)
    qr = ops.norm_rows(torch.randn(T, layer.spec.q_lora_rank, device=x.device), layer.q_norm, eps=layer.eps,
                       dtype=layer.dtype, fp8=lin.fp8_input)
    name = lin.name
    if layer.compressor is None:
        out = {f"x @ [wq_a|wkv] ({name})": graph_time_us(lambda: lin(x, layer.x_proj))}
    elif (joint := layer.one_launch_product(T)) is not None:
        out = {f"x @ [wq_a|wkv|compressors|head weights] (f32 out, {name})":
               graph_time_us(lambda: lin(x, joint, out_dtype=torch.float32))}
    else:
        out = {f"x @ [wq_a|wkv] ({name})": graph_time_us(lambda: lin(x, layer.x_proj)),
               "x @ [compressors|head weights] (f32 out)": graph_time_us(lambda: layer.tail_product(x, layer.w_tail))}
    out[f"qr @ wq_b ({name})" if idx is None else f"qr @ [wq_b|indexer wq_b] ({name})"] = \
        graph_time_us(lambda: lin(qr, layer.q_proj))
    if idx is not None:
        a, k = scores.args, scores.kwargs
        out["indexer scores"] = graph_time_us(lambda: ops.index_scores(*a, **k))
        s = ops.index_scores(*a, **k)
        out["top-k lists"] = graph_time_us(lambda: ops.index_lists(idx, s, plan))
    q, kv = mqa.args
    # the kernel's per-step state (FlashMLA's scheduler metadata) made once, outside the timed calls, as
    # every layer of a type but the first finds it
    kw = dict(mqa.kwargs, plan=layer.mqa_kernel.plan(tokens=T, layer_type=layer.layer_type))
    layer.mqa_kernel(q, kv, **kw)
    out[f"{layer.mqa_kernel.name}"] = graph_time_us(lambda: layer.mqa_kernel(q, kv, **kw))
    o, rot = oproj.args
    out[f"o_proj={layer.o_proj.name}"] = graph_time_us(lambda: layer.o_proj(o, rot, **oproj.kwargs))
    z = layer.o_proj(o, rot, **oproj.kwargs).to(layer.dtype)
    out[f"z @ wo_b ({name})"] = graph_time_us(lambda: lin(z, layer.out_proj))
    return out


def weight_bytes(layer) -> int:
    """The layer's weights as stored on its device (its buffers and o_proj's prepared blocks)."""
    return tensor_bytes(list(layer.buffers())) + tensor_bytes(layer.o_proj_prepared)


def floor_bytes(layer, caches, nreq: int, context: int) -> int:
    """What one decode step must move at least: the layer's weights as stored, each request's KV rows
    (window + compressed entries it attends to) and, at ratio 4, its visible indexer keys."""
    weights = weight_bytes(layer)
    row = caches.swa.layout.bytes_per_token(layer.spec.head_dim)
    kind = by_ratio(layer.ratio)
    entries = context // layer.ratio if kind.compressed else 0
    attended = min(entries, layer.spec.index_topk) if kind.indexed else entries
    kv = nreq * (min(context, layer.spec.sliding_window) + attended) * row
    keys = caches.indexer_keys
    keys = nreq * entries * keys.head_dim * keys.data.element_size() if keys is not None else 0
    return weights + kv + keys


# ---- the table -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Backend:
    label: str
    combo: Any


# besides each backend preset as it ships, its kernel with these output projections too: the triton preset's
# with the float o_proj its configs/backend/triton.yaml names for GPUs without fp8 products, and with DeepGEMM's
# grouped product (faster than ours at one request on the H100: docs/notes/2026-12-07-joint-x-product.md); and
# every preset whose dense projections are fp8 (`linear`) with them in bf16 too (linear=reference, the preset's
# own o_proj), timed in the same run
O_PROJ_SWAPS = {"triton": ("reference", "deepgemm_fp8")}
# each preset's rows also with these dense projections: float, and the fp8 options its own is made of
LINEAR_SWAPS = {"flashmla": ("deepgemm_fp8", "triton_fp8", "reference"), "flashinfer": ("reference",),
                "triton": ("reference",)}


def row_label(mqa_kernel: str, o_proj: str, linear: str) -> str:
    """A backend's row label in the layer tables."""
    return f"{mqa_kernel} + {o_proj} + {linear}"


INVARIANT = " [batch-invariant]"      # the label's suffix of a row run with batch_invariant=true


def base_label(label: str) -> str:
    """A row's label without INVARIANT: the backend it runs."""
    return label.removesuffix(INVARIANT)


def backends(job) -> list[Backend]:
    """The shipped backend presets (catalogue.backend_presets) whose kernel is not the reference and that
    check() accepts on this machine, each as (label 'mqa_kernel + o_proj + linear', combination) with the
    preset's head padding and cache layout, bf16 activations, one rank; and the O_PROJ_SWAPS and
    LINEAR_SWAPS of them. A job with batch_invariant=true has each also with it, where check() accepts that,
    labelled with INVARIANT, beside the default."""
    from dsv4.checks.compat import check
    from dsv4.values.device import local_platform

    out = []
    for preset, chosen in backend_presets().items():
        if chosen["mqa_kernel"] == defaults()["mqa_kernel"]:        # the reference: what the others are checked by
            continue
        for o in (chosen["o_proj"], *O_PROJ_SWAPS.get(preset, ())):
            swaps = LINEAR_SWAPS.get(preset, ()) if o == chosen["o_proj"] else ()
            for lin in dict.fromkeys((chosen["linear"], *swaps)):
                groups = {g: option(g, n) for g, n in chosen.items() if g != "indexer"} | {
                    "o_proj": option("o_proj", o), "linear": option("linear", lin)}
                c = replace(job.combo, strategies=replace(job.combo.strategies, **groups), dtype="bfloat16",
                            tp_size=1, world_size=None, batch_invariant=False)
                label = row_label(chosen["mqa_kernel"], o, lin)
                if check(c, job.device, here=local_platform()):
                    continue
                out.append(Backend(label=label, combo=c))
                fixed = replace(c, batch_invariant=True)
                if job.combo.batch_invariant and not check(fixed, job.device, here=local_platform()):
                    out.append(Backend(label=label + INVARIANT, combo=fixed))
    return out


def two_of_type(spec, layer: int) -> list[int]:
    """`layer` and the next layer of its type (the second reuses the first's per-step kernel plan, as all
    but one layer of each type do in a model)."""
    same = [l for l in range(spec.num_hidden_layers) if spec.compress_ratio(l) == spec.compress_ratio(layer)]
    return same[same.index(layer):same.index(layer) + 2]


def engine_for(job, backend: Backend, layers, *, nreq: int, tokens: int, context: int, graphs: bool,
               steps: int = 1, ranks=None):
    """An engine of `layers` (random weights) with room for nreq requests of `context` tokens and `steps`
    steps of `tokens` each after it, its graphs (if any) captured at nreq x tokens; this process's `ranks`
    (default: all of the combination's, simulated)."""
    from dsv4.components.kv_pool import PoolConfig
    from dsv4.components.weights import random_layer_weights
    from dsv4.values.graph_config import GraphConfig
    from dsv4.app.runner import job_engine

    new = tokens * steps
    pool = PoolConfig(swa_block_size=64, compressed_block_tokens=256,
                      swa_blocks=nreq * (cdiv(job.spec.sliding_window + new, 64) + 2) + cdiv(context, 64) + 8,
                      compressed_blocks=nreq * cdiv(context + new, 256) + 8, max_requests=nreq + 1)
    gc = GraphConfig(enabled=graphs, capture_sizes=(nreq * tokens,), max_context=context + new)
    weights = {l: random_layer_weights(job.spec, l, 0) for l in layers}
    return job_engine(replace(job, combo=backend.combo), weights, pool, ranks=ranks, graphs=gc)


def replayed_step(job, backend: Backend, layer: int, nreq: int, tokens: int, context: int) -> tuple[float, bool, int]:
    """The second layer of `layer`'s type replayed (µs, median), whether that replay's output equals the
    eager forward's bit for bit, and the layer's weight bytes: a decode row without its eager timing and
    components."""
    return decode_row(job, backend, layer, nreq, tokens, context, full=False)


def decode_row(job, backend: Backend, layer: int, nreq: int, tokens: int, context: int, *, full: bool = True):
    """The decode table's row for one step and the step's components timed alone; with full=False only
    (replay µs, replay == eager, the layer's weight bytes)."""
    first, second = two_of_type(job.spec, layer)
    eng = engine_for(job, backend, (first, second), nreq=nreq, tokens=tokens, context=context, graphs=True)
    rids = list(range(nreq))
    fill(eng, rids, context, seed=layer + nreq)
    T = nreq * tokens
    segs = decode_step(rids, tokens, context)
    hidden = torch.randn(T, job.spec.hidden_size, generator=torch.Generator().manual_seed(T))
    for pool in eng.pools:
        pool.reserve({s.rid: (s.start, s.start + s.count) for s in segs})
    eng.graphs.capture(eng, [T])
    res, _ = eng.graphs.replay(eng, T, hidden, segs, None, None)
    cap = eng.graphs.captured[T]
    module, plan, caches = eng.layers[second][0], cap.plans[0], eng.pools[0].layers[second]
    replayed = res.outputs[second].clone()
    step_us = replay_us(cap.layer_graphs[(second, 0)].replay)
    x = cap.x
    eager_plan = plan.with_type_plans(eng.type_plans(plan, 0, fresh=True))   # its own plans, made eagerly
    eng.layers[first][0](x, eager_plan, eng.pools[0].layers[first])
    eager_out = module(x, eager_plan, caches).out[:T].float()
    same = torch.equal(eager_out, replayed)
    if not full:
        weights = weight_bytes(module)
        del eng
        torch.cuda.empty_cache()
        return step_us, same, weights
    first_us = replay_us(cap.layer_graphs[(first, 0)].replay)     # + the type's per-step kernel plan
    plan_us = replay_us(cap.plan_graph.replay)
    # host-bound, so timed EAGER_ROUNDS times (the host's speed drifts more than the GPU's), the medians kept
    timed = [eager_us(lambda: module(x, eager_plan, caches)) for _ in range(EAGER_ROUNDS)]
    eager, host = statistics.median(t for t, _ in timed), statistics.median(h for _, h in timed)
    parts = component_us(module, x, eager_plan, caches)
    comp = sum(parts.values())
    floor = floor_bytes(module, caches, nreq, context) / (CEILINGS["sm90"]["gbps"] * 1e3)
    del eng
    torch.cuda.empty_cache()
    return [job.spec.layer_type(layer), backend.label, nreq, tokens, context, step_us, first_us - step_us, eager,
            eager / step_us, host, plan_us, comp, step_us / comp, floor, floor / step_us, same], parts


def prefill_row(job, backend: Backend, layer: int, tokens: int = PREFILL_TOKENS) -> list:
    """One request of `tokens` tokens through the second layer of `layer`'s type, eagerly (after one warm-up
    request): as in the decode rows, the type's per-step kernel plan is made by the first layer, once a step
    in a model."""
    first, second = two_of_type(job.spec, layer)
    eng = engine_for(job, backend, (first, second), nreq=1, tokens=tokens, context=0, graphs=False)
    hidden = torch.randn(tokens, job.spec.hidden_size, generator=torch.Generator().manual_seed(5)).to(eng.device)
    pos = torch.arange(tokens)
    times = []
    for rid in range(3):
        eng.add_request(rid)
        out = eng.step(hidden, pos, [rid] * tokens, timer=CudaTimer())
        times.append(out.seconds[second])
        eng.release(rid)
    us = statistics.median(times[1:]) * 1e6
    del eng
    torch.cuda.empty_cache()
    return [job.spec.layer_type(layer), backend.label, tokens, us / 1e3, tokens / us * 1e6]


def indexer_label(ix) -> str:
    """An indexer option's name, with its top-k where that is not the default (ours)."""
    return ix.name if ix.top_k.name == defaults()["indexer.top_k"] else f"{ix.name}, top_k={ix.top_k.name}"


def layer_backends(job, layer: int, labels, indexers) -> list[Backend]:
    """The backends to time `layer` with: those whose labels are in `labels` (None: all); at ratio 4 each
    with every indexer option named in `indexers` (None: the job's) and the job's top-k -- a batch-invariant
    row only with those that can give it --, elsewhere with the job's (it has no indexer)."""
    out = []
    for b in backends(job):
        if labels is not None and base_label(b.label) not in labels:
            continue
        if indexers is None or not by_ratio(job.spec.compress_ratio(layer)).indexed:
            out.append(b)
        else:
            top_k = job.combo.indexer.top_k
            swaps = [replace(option("indexer", name), top_k=top_k) for name in indexers]
            out += [Backend(label=b.label, combo=b.combo.with_choice("indexer", idx)) for idx in swaps
                    if not b.combo.batch_invariant or idx.needs(job.device).batch_invariant]
    return out


def bench_layer_step(job, cases=DECODE_CASES, *, labels=None, indexers=None, layer_types=None, prefill: bool = True,
                     echo=None, record=None) -> str:
    """The decode table over `cases` ((requests, tokens per request, context)), the components of the
    first case, and the prefill; for the backends whose labels are in `labels` (default: all), the ratio-4
    layer with each indexer option in `indexers` (default: the job's), the layer types in `layer_types`
    (default: all). A row that fails says so and the others still run. `echo(line)` is called with each
    row as it is measured; `record` (dsv4/speed/rows.py) takes the tables' rows."""
    import traceback

    rows, parts_rows, pre = [], [], []
    layers = [l for l in job.spec.one_layer_per_type()
              if layer_types is None or job.spec.layer_type(l) in layer_types]
    for layer in layers:
        for backend in layer_backends(job, layer, labels, indexers):
            ix = indexer_label(backend.combo.indexer) if by_ratio(job.spec.compress_ratio(layer)).indexed else "-"
            for nreq, tokens, context in cases:
                try:
                    row, parts = decode_row(job, backend, layer, nreq, tokens, context)
                except Exception as e:                  # one failing case is a row, not the end of the table
                    traceback.print_exc()
                    row, parts = [job.spec.layer_type(layer), backend.label, nreq, tokens, context,
                                  f"{ERROR}{type(e).__name__}: {str(e)[:80]}"] + [None] * 10, {}
                    torch.cuda.empty_cache()
                row.insert(2, ix)
                rows.append(row)
                if echo is not None:
                    echo(" | ".join(map(str, row)))
                if (nreq, tokens, context) == cases[0]:
                    parts_rows += [[row[0], backend.label, ix, name, us] for name, us in parts.items()]
            if prefill:
                try:
                    row = prefill_row(job, backend, layer)
                except Exception as e:
                    traceback.print_exc()
                    row = [job.spec.layer_type(layer), backend.label, PREFILL_TOKENS, None,
                           f"{ERROR}{type(e).__name__}: {str(e)[:80]}"]
                row.insert(2, ix)
                pre.append(row)
                if echo is not None:
                    echo(" | ".join(map(str, row)))
                torch.cuda.empty_cache()
    return layer_tables(cases, rows, parts_rows, pre, record)


def layer_tables(cases, rows: list, parts_rows: list, pre: list, record=None) -> str:
    """The whole-layer tables as printed (decode, the first case's components, prefill), their rows handed
    to `record` (dsv4/speed/rows.py) where one is given."""
    n, tokens, context = cases[0]
    if record is not None:
        record(printed_rows("bench/layer/decode", DECODE_HEADERS, rows, keys=6, unit=None)      # units in the headers
               + printed_rows("bench/layer/components", PARTS_HEADERS, parts_rows, keys=4, unit=None,
                              given={"step": f"{n}x{tokens}@{context}"})
               + printed_rows("bench/layer/prefill", PREFILL_HEADERS, pre, keys=4, unit=None))
    return "\n\n".join([
        "decode step, CUDA-graph replay of the second layer of its type (median µs; the first also makes the "
        "type's per-step kernel plan: + first of type), with what it costs eagerly and its parts alone:\n"
        + table(DECODE_HEADERS, rows, left=(0, 1, 2)),
        f"components of the first case ({n} requests x {tokens} tokens, {context} context), "
        "each alone in a CUDA graph:\n" + table(PARTS_HEADERS, parts_rows, left=(0, 1, 2, 3)),
        f"prefill of one {PREFILL_TOKENS}-token request, eager (median of 2 after a warm-up):\n"
        + table(PREFILL_HEADERS, pre, left=(0, 1, 2)) if pre else ""])
