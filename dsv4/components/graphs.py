"""CUDA-graph decode: the step plan and every layer captured once per capture size, replayed per step.

A step of T tokens, T at most the largest capture size, is padded to the next size Tc: its host plan
inputs (query_start, seq_lens, block tables, padded to Tc requests and to the pages `max_context`
needs) are copied into the graph's static buffer in one transfer, its hidden states into the static
input, and the graphs replay: first the plan's derivation, then each layer (each rank's module in
turn), in the order eager runs them. Padding rows and requests write and read nothing. Layers of one
type share their MQA kernel's per-step plan inside the captured step (FlashMLA's scheduler metadata is
made by the first of them, in its graph), so the graphs are replayed together, never one alone.

A request longer than `max_context`, or a step larger than the largest size, runs eagerly. Prefill
steps usually do; nothing else differs between the two paths.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dsv4.components.engine import TABLE_PAGES, pack_inputs
from dsv4.components.plan import RUN_GROUPS, StepPlan
from dsv4.values.graph_config import GraphConfig
from dsv4.values.layer_types import by_ratio
from dsv4.values.sizes import cdiv, round_up


@dataclass(slots=True)
class _Captured:
    size: int
    x: Any                                  # [size, hidden] static input
    inputs: list[Any]                       # per rank: the static int32 device buffer
    plans: list[StepPlan]
    plan_graph: Any
    layer_graphs: dict[tuple[int, int], Any] = field(default_factory=dict)
    results: dict[tuple[int, int], Any] = field(default_factory=dict)


class StepGraphs:
    """The captured steps of one engine, one per capture size."""

    def __init__(self, config: GraphConfig) -> None:
        self.config = config
        self.captured: dict[int, _Captured] = {}
        self.pool = None

    def widths(self, engine, rank: int) -> dict[str, int]:
        """Pages of each group a request of max_context positions needs (the captured tables' width), rounded
        up as an eager step's are."""
        out = {}
        for name, g in engine.pools[rank].groups.items():
            out[name] = round_up(max(1, cdiv(g.rule.rows(self.config.max_context), g.block_size)), TABLE_PAGES)
        return out

    def describe(self) -> str:
        return f"CUDA graphs captured at {len(self.captured)} sizes up to {max(self.captured, default=0)} tokens"

    def size_for(self, T: int, segs: Sequence) -> int | None:
        """The capture size a step of T tokens replays at, or None (eager): too many tokens, or a request
        longer than max_context."""
        if T > self.config.capture_sizes[-1]:
            return None
        if max(s.start + s.count for s in segs) > self.config.max_context:
            return None
        return next(s for s in self.config.capture_sizes if s >= T)

    # ---- capture -----------------------------------------------------------------------------
    def capture(self, engine, sizes: Sequence[int] | None = None) -> None:
        """Capture every size (largest first, so smaller graphs reuse its memory pool)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for size in sorted(sizes or self.config.capture_sizes, reverse=True):
            if size not in self.captured:
                self.captured[size] = self._capture(engine, size)
        torch.cuda.synchronize()

    def _static_plan(self, engine, rank: int, size: int, buf) -> StepPlan:
        from dsv4.components.engine import plan_from_parts, unpack_inputs

        host = engine.plan_inputs(engine.pools[rank], (), requests=size, widths=self.widths(engine, rank))
        plan = plan_from_parts(engine.pools[rank], unpack_inputs(buf, host), num_tokens=size,
                               window=engine.spec.sliding_window)
        for ranks in engine.layers.values():          # RoPE rows inside the plan's graph, not a layer's
            m = ranks[rank]
            plan.rope_rows(m.rope)
            if by_ratio(m.ratio).compressed:
                plan.rope_rows(m.rope, shift=m.ratio)
        for group in RUN_GROUPS:                       # and the runs' groups, which kernels may read
            plan.runs.groups(group)
        return plan

    def _capture(self, engine, size: int) -> _Captured:
        dev = engine.device
        nranks = len(engine.pools)
        host = [engine.plan_inputs(engine.pools[r], (), requests=size, widths=self.widths(engine, r))
                for r in range(nranks)]
        inputs = []
        for h in host:      # an empty step: no requests with tokens, every row padding
            inputs.append(torch.from_numpy(pack_inputs(h)).to(dev))
        some = next(iter(engine.layers.values()))[0]
        x = torch.zeros(size, engine.spec.hidden_size, dtype=some.dtype, device=dev)

        # warm up eagerly (compiles kernels, fills JIT caches) on throwaway plans
        for r in range(nranks):
            plan = self._static_plan(engine, r, size, inputs[r])
            engine.kernel_plans(plan, r, fresh=True)
            engine.indexer_plans(plan, r)
            for layer, ranks in engine.layers.items():
                ranks[r](x, plan, engine.pools[r].layers[layer])
        torch.cuda.synchronize()

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        plans = []
        with torch.cuda.stream(stream):
            plan_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(plan_graph, pool=self.pool, stream=stream):
                for r in range(nranks):
                    plans.append(self._static_plan(engine, r, size, inputs[r]))
                    engine.indexer_plans(plans[r], r)
            for r in range(nranks):
                engine.kernel_plans(plans[r], r, fresh=True)
            cap = _Captured(size=size, x=x, inputs=inputs, plans=plans, plan_graph=plan_graph)
            for layer, ranks in engine.layers.items():
                for r in range(nranks):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool, stream=stream):
                        cap.results[(layer, r)] = ranks[r](x, plans[r], engine.pools[r].layers[layer])
                    cap.layer_graphs[(layer, r)] = g
        torch.cuda.current_stream().wait_stream(stream)
        return cap

    # ---- replay ------------------------------------------------------------------------------
    def replay(self, engine, size: int, hidden, segs, timer, on_layer):
        if size not in self.captured:
            self.capture(engine, [size])
        cap = self.captured[size]
        T = hidden.shape[0]
        for r in range(len(engine.pools)):
            h = engine.plan_inputs(engine.pools[r], segs, requests=size, widths=self.widths(engine, r))
            cap.inputs[r].copy_(torch.from_numpy(pack_inputs(h)), non_blocking=True)
        cap.x[:T].copy_(hidden, non_blocking=True)
        cap.plan_graph.replay()

        def run(layer, r):
            cap.layer_graphs[(layer, r)].replay()
            res = cap.results[(layer, r)]
            return type(res)(out=res.out[:T], topk=None if res.topk is None else res.topk[:T].clone(),
                             faults=res.faults)
        result, faults = engine.run_layers(run, timer, on_layer)
        for layer, y in result.outputs.items():
            result.outputs[layer] = y.clone()
        return result, faults
