"""A minimal paged engine: requests, steps, and the atomicity rule for bad input.

A step is a batch of tokens from several requests (each request's tokens contiguous, continuing at
its current length: chunked prefill, decode, or several tokens per request for multi-token
prediction). Every layer is run as this process's rank modules (all `tp_size` of them when ranks are
simulated in one process, one under torch.distributed); their partial outputs are summed, then
`all_reduce` (wo_b's all-reduce across processes; none when simulated) sums them over processes.

A step is validated whole before anything is written. A refused step raises InvalidRequest naming
every bad request and changes nothing. Then, per rank: the pool reserves the step's pages, one step
plan is made from the block tables (one host-to-device copy) and shared by every layer, each layer runs
without a host sync, and once the step's last layer is queued one read of the layers' fault flags
(non-finite rows that were refused, not stored) decides: commit, or roll back (pages returned, no
length changed; the rows the step wrote were at its own new slots, which nothing else reads).

With `graphs` (dsv4/components/graphs.py), a step of at most the largest capture size replays CUDA
graphs captured at the next capture size (the plan and each layer), padded with inert rows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Hashable, Mapping, Protocol, Sequence

import numpy as np
import torch

from dsv4.components.attention import FAULT_COMPRESSED, FAULT_INDEXER, FAULT_SWA
from dsv4.components.kv_pool import KVPool
from dsv4.components.plan import PageTable, StepPlan, TypePlan
from dsv4.values.errors import InvalidRequest
from dsv4.values.sizes import cdiv, round_up
from dsv4.values.spec import ModelSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """The tokens of one request in a step: batch rows [offset, offset+count), positions from start."""
    rid: Hashable
    start: int
    offset: int
    count: int

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.count)


@dataclass(slots=True)
class StepOutput:
    outputs: dict[int, Any] = field(default_factory=dict)     # layer -> [T, hidden] float32
    topk: dict[int, Any] = field(default_factory=dict)        # ratio-4 layer -> [T, K] int32 local
    seconds: dict[int, float] = field(default_factory=dict)   # layer -> its time in the step (with a timer)
    reduce_seconds: dict[int, float] = field(default_factory=dict)   # layer -> of which the all-reduce
    graph_size: int | None = None                             # the capture size replayed, None: eager


class LayerTimer(Protocol):
    """What `Engine.step` calls around each layer (and its all-reduce) when `run`/`bench` install one."""

    def start(self, key: tuple[str, int]) -> None: ...
    def stop(self, key: tuple[str, int]) -> None: ...
    def seconds(self) -> dict[tuple[str, int], float]: ...     # read after the step (may synchronize)


class WallTimer:
    """Host wall time per key: for the CPU, where every op finishes before the next starts."""

    def __init__(self) -> None:
        self._t0: dict = {}
        self._s: dict = {}

    def start(self, key) -> None:
        self._t0[key] = time.perf_counter()

    def stop(self, key) -> None:
        self._s[key] = self._s.get(key, 0.0) + time.perf_counter() - self._t0.pop(key)

    def seconds(self) -> dict:
        out, self._s = self._s, {}
        return out


class CudaTimer:
    """CUDA events per key, read once after the step: GPU time between them, no sync inside the step."""

    def __init__(self) -> None:
        self._ev: dict = {}

    def start(self, key) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self._ev[key] = [e, None]

    def stop(self, key) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self._ev[key][1] = e

    def seconds(self) -> dict:
        torch.cuda.synchronize()
        out = {k: a.elapsed_time(b) / 1e3 for k, (a, b) in self._ev.items()}
        self._ev = {}
        return out


def timer_for(device: str) -> LayerTimer:
    return CudaTimer() if device != "cpu" else WallTimer()


# Shapes an eager step's plan keeps from step to step, so that a new length compiles no new kernel variant
# (Triton specializes integer arguments divisible by 16 or equal to 1, and pointers on 16-byte alignment):
TABLE_PAGES = 16      # block tables are this many pages wide, or a multiple (-1 padded)
ALIGN = 4             # int32 elements: each packed plan input starts 16-byte aligned
FAULT_WHAT = {FAULT_SWA: "swa row", FAULT_COMPRESSED: "compressed row", FAULT_INDEXER: "indexer key"}


class Engine:
    def __init__(self, *, spec: ModelSpec, layers: dict[int, list], pools: list[KVPool], device: str,
                 all_reduce: Callable[[Any], Any] | None = None, graphs=None) -> None:
        self.spec, self.layers, self.pools, self.device = spec, layers, pools, device
        self.all_reduce = all_reduce
        self.lengths: dict[Hashable, int] = {}
        self.graphs = graphs            # a graphs.StepGraphs, or None (eager only)
        self._kernel_plans: dict[tuple[int, str], Any] = {}     # (rank, layer type) -> the last step's

    def warm_up(self, sizes: Sequence[int] = ()) -> None:
        """Make ready what decode steps run before the first of them. With graphs, every capture size is
        captured now (its kernels compiled or loaded from Triton's cache on the way) instead of at the first
        step of that size; without, on a GPU, each step size in `sizes` (token counts) runs once eagerly on
        an empty step (every row padding: nothing is read or written). Later steps of other lengths compile
        nothing: the kernels do not specialize on what changes from step to step (token counts; tables
        TABLE_PAGES wide, plan inputs aligned). A larger step (prefill) compiles what its size picks the
        first time it is picked."""
        if self.graphs is not None:
            self.graphs.capture(self)
            return
        if torch.device(self.device).type != "cuda":
            return
        for size in sizes:
            for r, pool in enumerate(self.pools):
                plan = self.build_plan(pool, self.plan_inputs(pool, (), requests=size), num_tokens=size)
                plan = plan.with_type_plans(self.type_plans(plan, r, fresh=True))
                for layer, ranks in self.layers.items():
                    x = torch.zeros(size, self.spec.hidden_size, dtype=ranks[r].dtype, device=self.device)
                    ranks[r](x, plan, pool.layers[layer])
        torch.cuda.synchronize()

    def add_request(self, rid: Hashable) -> None:
        if rid in self.lengths:
            raise InvalidRequest(f"request {rid!r} already exists")
        self.lengths[rid] = 0
        for pool in self.pools:
            pool.add(rid)

    def release(self, rid: Hashable) -> None:
        self._known(rid)
        del self.lengths[rid]
        for pool in self.pools:
            pool.release(rid)

    def _known(self, rid: Hashable) -> None:
        if rid not in self.lengths:
            raise InvalidRequest(f"unknown request {rid!r}; known: {sorted(map(repr, self.lengths))}")

    # ---- validation --------------------------------------------------------------------------
    def validate(self, hidden, positions, request_ids: Sequence[Hashable]) -> tuple[Segment, ...]:
        """Every problem of the step, or its segments. Reads the inputs on the host (the only syncs of a step
        besides the final fault check)."""
        hid = self.spec.hidden_size
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != hid \
                or not hidden.is_floating_point():
            raise InvalidRequest(f"hidden_states must be a float tensor [T, {hid}], got "
                                 f"{getattr(hidden, 'dtype', type(hidden).__name__)} {list(getattr(hidden, 'shape', []))}")
        T = hidden.shape[0]
        if T == 0:
            raise InvalidRequest("empty step: no tokens")
        positions = torch.as_tensor(positions)
        if positions.shape != (T,) or positions.is_floating_point():
            raise InvalidRequest(f"positions must be an integer tensor [{T}], got {positions.dtype} {list(positions.shape)}")
        if len(request_ids) != T:
            raise InvalidRequest(f"request_ids has {len(request_ids)} entries for {T} tokens")
        segs: list[Segment] = []
        errors: list[str] = []
        pos_list = positions.tolist()
        finite = torch.isfinite(hidden).all(-1).tolist()
        i = 0
        while i < T:
            rid, j = request_ids[i], i
            while j < T and request_ids[j] == rid:
                j += 1
            if any(s.rid == rid for s in segs):
                errors.append(f"request {rid!r}: its tokens must be contiguous in the batch")
            elif rid not in self.lengths:
                errors.append(f"unknown request {rid!r} (known: {', '.join(map(repr, self.lengths)) or 'none'})")
            else:
                start = self.lengths[rid]
                if pos_list[i:j] != list(range(start, start + j - i)):
                    errors.append(f"request {rid!r}: positions must continue at {start} "
                                  f"({start}..{start + j - i - 1}), got {pos_list[i]}..{pos_list[j - 1]}")
                elif start + (j - i) > self.spec.max_position_embeddings:
                    errors.append(f"request {rid!r}: position {start + j - i - 1} is beyond the model's range "
                                  f"(max_position_embeddings={self.spec.max_position_embeddings})")
                if not all(finite[i:j]):
                    errors.append(f"request {rid!r}: hidden_states contain NaN or Inf")
                segs.append(Segment(rid=rid, start=start, offset=i, count=j - i))
            i = j
        if errors:
            raise InvalidRequest("step refused, nothing was written:\n  " + "\n  ".join(errors))
        return tuple(segs)

    # ---- the step ----------------------------------------------------------------------------
    def step(self, hidden, positions, request_ids: Sequence[Hashable], *, timer: LayerTimer | None = None,
             on_layer: Callable[[int], None] | None = None, eager: bool = False) -> StepOutput:
        """One step. `timer` times each layer; `on_layer(layer)` is called as each layer is queued
        (progress); `eager` skips the CUDA graphs."""
        segs = self.validate(hidden, positions, request_ids)
        spans = {s.rid: (s.start, s.start + s.count) for s in segs}
        reserved = []
        try:
            for pool in self.pools:
                reserved.append((pool, pool.reserve(spans)))
            T = hidden.shape[0]
            size = None if eager or self.graphs is None else self.graphs.size_for(T, segs)
            if size is None:
                result, faults = self._forward(hidden.to(self.device), segs, timer, on_layer)
            else:
                result, faults = self.graphs.replay(self, size, hidden, segs, timer, on_layer)
                result.graph_size = size
            self._raise_on_faults(faults, segs, T)
        except BaseException:
            for pool, res in reserved:
                pool.rollback(res)
            raise
        new = {s.rid: s.start + s.count for s in segs}
        for pool in self.pools:
            pool.commit(new)
        self.lengths.update(new)
        if timer is not None:
            secs = timer.seconds()
            result.seconds = {l: v for (kind, l), v in secs.items() if kind == "layer"}
            result.reduce_seconds = {l: v for (kind, l), v in secs.items() if kind == "reduce"}
        return result

    def plan_inputs(self, pool: KVPool, segs: Sequence[Segment], *, requests: int | None = None,
                    widths: dict[str, int] | None = None) -> dict[str, Any]:
        """The host side of a plan: query_start, seq_lens and every group's block tables as int32 numpy
        arrays, padded to `requests` rows and `widths` pages (the capture shapes of a graph; without them the
        widest table's pages, rounded up to a multiple of TABLE_PAGES)."""
        B = len(segs) if requests is None else requests
        qs = np.zeros(B + 1, dtype=np.int32)
        lens = np.zeros(B, dtype=np.int32)
        counts = np.array([s.count for s in segs], dtype=np.int32)
        qs[1:len(segs) + 1] = np.cumsum(counts)
        qs[len(segs) + 1:] = qs[len(segs)]
        lens[:len(segs)] = [s.start + s.count for s in segs]
        out = {"query_start": qs, "seq_lens": lens}
        for name, g in pool.groups.items():
            rows = [g.tables[s.rid] for s in segs]
            w = round_up(max([len(r) for r in rows] + [1]), TABLE_PAGES) if widths is None else widths[name]
            tab = np.full((B, w), -1, dtype=np.int32)
            for i, r in enumerate(rows):
                tab[i, :len(r)] = r[:w]
            out[name] = tab
        return out

    def build_plan(self, pool: KVPool, host: dict[str, Any], *, num_tokens: int) -> StepPlan:
        """Copy the host arrays in one transfer and derive the plan on the device."""
        buf = torch.from_numpy(pack_inputs(host)).to(self.device, non_blocking=True)
        return plan_from_parts(pool, unpack_inputs(buf, host), num_tokens=num_tokens, window=self.spec.sliding_window)

    def type_plans(self, plan: StepPlan, rank: int, *, fresh: bool = False) -> Mapping[str, TypePlan]:
        """Each layer type's strategy plans for the step of `plan` on local rank `rank`, made once and shared
        by that type's layers (`plan.with_type_plans`): its MQA kernel's, handed the previous step's (buffers
        it keeps) unless `fresh` (a graph capture); at ratio 4 its indexer's (device tensors from the step
        plan's, no sync: a graph's plan captures it)."""
        made: dict[str, TypePlan] = {}
        for ranks in self.layers.values():
            m = ranks[rank]
            if m.layer_type in made:
                continue
            key = (rank, m.layer_type)
            previous = None if fresh else self._kernel_plans.get(key)
            kernel = self._kernel_plans[key] = m.mqa_kernel.plan(tokens=plan.num_tokens, layer_type=m.layer_type,
                                                                 previous=previous)
            indexer = None if m.indexer is None else m.ops.index_plan(m.indexer, plan)
            made[m.layer_type] = TypePlan(kernel=kernel, indexer=indexer)
        return MappingProxyType(made)

    def _forward(self, x, segs, timer, on_layer):
        plans = []
        for r, pool in enumerate(self.pools):
            plan = self.build_plan(pool, self.plan_inputs(pool, segs), num_tokens=x.shape[0])
            plans.append(plan.with_type_plans(self.type_plans(plan, r)))
        return self.run_layers(lambda layer, r: self.run_layer(layer, r, x, plans[r]), timer, on_layer)

    # ---- what CUDA-graph capture and replay use (graphs.GraphedEngine) ---------------------------
    def local_ranks(self) -> range:
        return range(len(self.pools))

    def zero_input(self, tokens: int):
        """An all-zero step input [tokens, hidden] in the layers' dtype, on the device."""
        some = next(iter(self.layers.values()))[0]
        return torch.zeros(tokens, self.spec.hidden_size, dtype=some.dtype, device=self.device)

    def modules(self, rank: int) -> dict[int, Any]:
        """Each layer's module of local rank `rank`, in the order a step runs them."""
        return {layer: ranks[rank] for layer, ranks in self.layers.items()}

    def padded_inputs(self, rank: int, segs: Sequence[Segment], *, requests: int, context: int) -> dict[str, Any]:
        """`plan_inputs` of local rank `rank` padded to a captured step's shapes: `requests` rows, and the pages
        of each group a request of `context` positions needs, rounded up as an eager step's are."""
        pool = self.pools[rank]
        widths = {name: round_up(max(1, cdiv(g.rule.rows(context), g.block_size)), TABLE_PAGES)
                  for name, g in pool.groups.items()}
        return self.plan_inputs(pool, segs, requests=requests, widths=widths)

    def plan_from(self, rank: int, buf, host: dict[str, Any], *, num_tokens: int) -> StepPlan:
        """Local rank `rank`'s step plan derived from `buf`, a device copy of `pack_inputs(host)`."""
        return plan_from_parts(self.pools[rank], unpack_inputs(buf, host), num_tokens=num_tokens,
                               window=self.spec.sliding_window)

    def run_layer(self, layer: int, rank: int, x, plan: StepPlan):
        """`layer`'s module of local rank `rank` on the step's rows x with its caches: a LayerStepResult."""
        return self.layers[layer][rank](x, plan, self.pools[rank].layers[layer])

    def run_layers(self, run: Callable[[int, int], Any], timer, on_layer):
        """Every layer on every local rank (`run(layer, rank)` -> LayerStepResult), ranks summed, then the
        all-reduce; returns (StepOutput, the layers' fault flags)."""
        result, faults = StepOutput(), []
        for layer, ranks in self.layers.items():
            if on_layer is not None:
                on_layer(layer)
            if timer is not None:
                timer.start(("layer", layer))
            total = None
            for r in range(len(ranks)):
                res = run(layer, r)
                total = res.out.float() if total is None else total + res.out.float()
                faults.append((layer, res.faults))
                if res.topk is not None:
                    result.topk[layer] = res.topk
            if self.all_reduce is not None:
                if timer is not None:
                    timer.start(("reduce", layer))
                total = self.all_reduce(total)
                if timer is not None:
                    timer.stop(("reduce", layer))
            if timer is not None:
                timer.stop(("layer", layer))
            result.outputs[layer] = total
        return result, faults

    def _raise_on_faults(self, faults, segs, T: int) -> None:
        """One host read of every layer's fault flags; a non-finite row names its layer, request and position."""
        if not faults:
            return
        flags = torch.stack([f[:, :T] for _, f in faults])              # [layers·ranks, 3, T]
        if not bool(flags.any()):
            return
        n, kind, t = (int(v) for v in flags.nonzero()[0])
        layer = faults[n][0]
        seg = next(s for s in segs if s.offset <= t < s.offset + s.count)
        pos = seg.start + t - seg.offset
        ratio = self.spec.compress_ratio(layer)
        where = (f"layer {layer}, request {seg.rid!r}, position {pos}" if kind == FAULT_SWA else
                 f"layer {layer}, request {seg.rid!r}, {'indexer' if kind == FAULT_INDEXER else 'compressed'} entry "
                 f"{(pos + 1) // ratio - 1} closed at position {pos}")
        raise InvalidRequest(f"non-finite {FAULT_WHAT[kind]} ({where}): refused before packing it into the "
                             f"cache; nothing of this step was kept")


def pack_inputs(host: dict[str, Any]):
    """`Engine.plan_inputs`' arrays as one int32 array: what one host-to-device copy moves. Each array starts
    at a multiple of ALIGN elements, so that the views kernels read are 16-byte aligned whatever the step's
    size (Triton specializes a kernel on its pointers' alignment)."""
    out = np.zeros(sum(round_up(a.size, ALIGN) for a in host.values()), dtype=np.int32)
    off = 0
    for a in host.values():
        out[off:off + a.size] = a.ravel()
        off += round_up(a.size, ALIGN)
    return out


def unpack_inputs(buf, host: dict[str, Any]) -> dict[str, Any]:
    """Views of `buf` (a copy of `pack_inputs(host)`) shaped and named as `host`."""
    parts, off = {}, 0
    for name, a in host.items():
        parts[name] = buf[off:off + a.size].view(a.shape)
        off += round_up(a.size, ALIGN)
    return parts


def plan_from_parts(pool: KVPool, parts: dict[str, Any], *, num_tokens: int, window: int) -> StepPlan:
    """A StepPlan from device tensors named as `Engine.plan_inputs` names them."""
    def table(name: str) -> PageTable:
        return PageTable(block_size=pool.groups[name].block_size, pages=parts[name])

    ratios = pool.ratios()
    return StepPlan.build(query_start=parts["query_start"], seq_lens=parts["seq_lens"], swa=table("swa"),
                          state={r: table(f"state{r}") for r in ratios},
                          entries={r: table(f"entries{r}") for r in ratios}, window=window, num_tokens=num_tokens)
