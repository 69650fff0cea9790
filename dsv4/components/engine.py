"""A minimal paged engine: requests, steps, and the atomicity rule for bad input.

A step is a batch of tokens from several requests (each request's tokens contiguous, continuing at
its current length: chunked prefill, decode, or several tokens per request for multi-token
prediction). Every layer is run as this process's rank modules (all `tp_size` of them when ranks are
simulated in one process, one under torch.distributed); their partial outputs are summed, then
`all_reduce` (wo_b's all-reduce across processes; none when simulated) sums them over processes.

A step is validated whole before anything is written. A refused step raises InvalidRequest naming
every bad request and changes nothing; a step that fails later is rolled back (its new pages
returned, no length or compressor state committed), so other requests never see its effects.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

from dsv4.components.kv_pool import LayerKV, Segment, StepMeta
from dsv4.errors import InvalidRequest
from dsv4.spec import ModelSpec


@dataclass(slots=True)
class StepOutput:
    outputs: dict[int, Any] = field(default_factory=dict)     # layer -> [T, hidden] float32
    topk: dict[int, Any] = field(default_factory=dict)        # ratio-4 layer -> [T, K] int32 local
    seconds: dict[int, float] = field(default_factory=dict)   # layer -> wall time of its forward
    reduce_seconds: dict[int, float] = field(default_factory=dict)   # layer -> of which the all-reduce


class Engine:
    def __init__(self, *, spec: ModelSpec, layers: dict[int, list], kvs: dict[int, list[LayerKV]],
                 device: str, all_reduce: Callable[[Any], Any] | None = None) -> None:
        self.spec, self.layers, self.kvs, self.device = spec, layers, kvs, device
        self.all_reduce = all_reduce
        self.lengths: dict[Hashable, int] = {}

    def add_request(self, rid: Hashable) -> None:
        if rid in self.lengths:
            raise InvalidRequest(f"request {rid!r} already exists")
        self.lengths[rid] = 0
        for kvs in self.kvs.values():
            for kv in kvs:
                kv.add(rid)

    def release(self, rid: Hashable) -> None:
        self._known(rid)
        del self.lengths[rid]
        for kvs in self.kvs.values():
            for kv in kvs:
                kv.release(rid)

    def _known(self, rid: Hashable) -> None:
        if rid not in self.lengths:
            raise InvalidRequest(f"unknown request {rid!r}; known: {sorted(map(repr, self.lengths))}")

    # ---- validation --------------------------------------------------------------------------
    def _plan(self, hidden, positions, request_ids: Sequence[Hashable]) -> StepMeta:
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
                if not bool(torch.isfinite(hidden[i:j]).all()):
                    errors.append(f"request {rid!r}: hidden_states contain NaN or Inf")
                segs.append(Segment(rid=rid, start=start, offset=i, count=j - i))
            i = j
        if errors:
            raise InvalidRequest("step refused, nothing was written:\n  " + "\n  ".join(errors))
        dev = self.device
        seg_of = torch.repeat_interleave(torch.arange(len(segs)), torch.tensor([s.count for s in segs]))
        return StepMeta(segments=tuple(segs), positions=positions.to(device=dev, dtype=torch.int64),
                        segment_of_token=seg_of.to(dev))

    # ---- the step ----------------------------------------------------------------------------
    def step(self, hidden, positions, request_ids: Sequence[Hashable], *,
             on_layer: Callable[[int], None] | None = None) -> StepOutput:
        """One step; `on_layer(layer)` is called as each layer starts (progress reporting)."""
        meta = self._plan(hidden, positions, request_ids)
        counts = {s.rid: s.count for s in meta.segments}
        reserved: list[tuple[LayerKV, dict]] = []
        try:
            for kvs in self.kvs.values():
                for kv in kvs:
                    reserved.append((kv, kv.reserve(counts)))
            result, states = self._forward(hidden.to(self.device), meta, on_layer)
        except BaseException:
            for kv, taken in reserved:
                kv.rollback(taken)
            raise
        for layer, kvs in self.kvs.items():
            for kv, st in zip(kvs, states[layer]):
                for s in meta.segments:
                    kv.commit(s.rid, s.start + s.count, {name: v for (rid, name), v in st.items() if rid == s.rid})
        for s in meta.segments:
            self.lengths[s.rid] = s.start + s.count
        return result

    def _forward(self, x, meta: StepMeta, on_layer: Callable[[int], None] | None = None):
        result, states = StepOutput(), {}
        for layer, ranks in self.layers.items():
            if on_layer is not None:
                on_layer(layer)
            t0 = time.perf_counter()
            total, states[layer] = None, []
            for module, kv in zip(ranks, self.kvs[layer]):
                r = module(x, meta, kv)
                total = r.out.float() if total is None else total + r.out.float()
                states[layer].append(r.states)
                if r.topk is not None:
                    result.topk[layer] = r.topk
            if self.all_reduce is not None:
                if x.is_cuda:
                    torch.cuda.synchronize()
                t1 = time.perf_counter()
                total = self.all_reduce(total)
            if x.is_cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if self.all_reduce is not None:
                result.reduce_seconds[layer] = now - t1
            result.seconds[layer] = now - t0
            result.outputs[layer] = total
        return result, states
