"""CUDA-graph decode: the step plan and every layer captured once per capture size, replayed per step.

A step of T tokens, T at most the largest capture size, is padded to the next size Tc: its host plan
inputs (query_start, seq_lens, block tables, padded to Tc requests and to the pages `max_context`
needs) are copied into the graph's static buffer in one transfer, its hidden states into the static
input, and the graphs replay: first the plan's derivation, then each layer (each rank's module in
turn), in the order eager runs them. Padding rows and requests write and read nothing. Layers of one
type share their MQA kernel's per-step plan inside the captured step (FlashMLA's scheduler metadata is
made by the first of them, in its graph), so the graphs are replayed together, never one alone.

A request longer than `max_context`, or a step larger than the largest size, runs eagerly. Prefill
steps usually do; nothing else differs between the two paths. Of the engine, capture and replay use only
`GraphedEngine`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from dsv4.components.engine import pack_inputs
from dsv4.components.plan import RUN_GROUPS, StepPlan, TypePlan
from dsv4.values.graph_config import GraphConfig
from dsv4.values.layer_types import by_ratio


class GraphedEngine(Protocol):
    """What capture and replay use of an engine (components.engine.Engine), and nothing else of it."""
    device: str

    def local_ranks(self) -> range: ...
    def zero_input(self, tokens: int) -> Any: ...
    def modules(self, rank: int) -> dict[int, Any]: ...      # layer -> the rank's module, in step order
    def padded_inputs(self, rank: int, segs: Sequence, *, requests: int, context: int) -> dict[str, Any]: ...
    def plan_from(self, rank: int, buf, host: dict[str, Any], *, num_tokens: int) -> StepPlan: ...
    def type_plans(self, plan: StepPlan, rank: int, *, fresh: bool = False) -> Mapping[str, TypePlan]: ...
    def run_layer(self, layer: int, rank: int, x, plan: StepPlan) -> Any: ...
    def run_layers(self, run: Callable[[int, int], Any], timer, on_layer) -> tuple[Any, list]: ...


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
    def capture(self, engine: GraphedEngine, sizes: Sequence[int] | None = None) -> None:
        """Capture every size (largest first, so smaller graphs reuse its memory pool)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for size in sorted(sizes or self.config.capture_sizes, reverse=True):
            if size not in self.captured:
                self.captured[size] = self._capture(engine, size)
        torch.cuda.synchronize()

    def _static_plan(self, engine: GraphedEngine, rank: int, size: int, buf, host) -> StepPlan:
        """The captured step's plan from its static buffer, with what its layers derive from it made here (in
        the plan's graph, not a layer's): each layer's RoPE rows, the runs' groups kernels may read, and each
        layer type's strategy plans (fresh: no previous step's)."""
        plan = engine.plan_from(rank, buf, host, num_tokens=size)
        for m in engine.modules(rank).values():
            plan.rope_rows(m.rope)
            if by_ratio(m.ratio).compressed:
                plan.rope_rows(m.rope, shift=m.ratio)
        for group in RUN_GROUPS:
            plan.runs.groups(group)
        return plan.with_type_plans(engine.type_plans(plan, rank, fresh=True))

    def _capture(self, engine: GraphedEngine, size: int) -> _Captured:
        dev, ranks = engine.device, engine.local_ranks()
        host = [engine.padded_inputs(r, (), requests=size, context=self.config.max_context) for r in ranks]
        inputs = []
        for h in host:      # an empty step: no requests with tokens, every row padding
            inputs.append(torch.from_numpy(pack_inputs(h)).to(dev))
        x = engine.zero_input(size)
        layers = list(engine.modules(0))

        # warm up eagerly (compiles kernels, fills JIT caches) on throwaway plans
        for r in ranks:
            plan = self._static_plan(engine, r, size, inputs[r], host[r])
            for layer in layers:
                engine.run_layer(layer, r, x, plan)
        torch.cuda.synchronize()

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        plans = []
        with torch.cuda.stream(stream):
            plan_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(plan_graph, pool=self.pool, stream=stream):
                for r in ranks:
                    plans.append(self._static_plan(engine, r, size, inputs[r], host[r]))
            cap = _Captured(size=size, x=x, inputs=inputs, plans=plans, plan_graph=plan_graph)
            for layer in layers:
                for r in ranks:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool, stream=stream):
                        cap.results[(layer, r)] = engine.run_layer(layer, r, x, plans[r])
                    cap.layer_graphs[(layer, r)] = g
        torch.cuda.current_stream().wait_stream(stream)
        return cap

    # ---- replay ------------------------------------------------------------------------------
    def replay(self, engine: GraphedEngine, size: int, hidden, segs, timer, on_layer):
        if size not in self.captured:
            self.capture(engine, [size])
        cap = self.captured[size]
        T = hidden.shape[0]
        for r in engine.local_ranks():
            h = engine.padded_inputs(r, segs, requests=size, context=self.config.max_context)
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
