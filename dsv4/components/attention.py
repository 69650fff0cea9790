"""DSV4Attention: the one concrete attention module, for one tensor-parallel rank.

It is assembled from injected pieces (keyword-only) and contains no platform branches: the sparse MQA
kernel, the output projection, the head padding, the cache layout and how the dense projections multiply
(`linear`) are strategies; the compressor and indexer are components. It holds the math only: where rows
go and which rows a token reads come from the step plan (dsv4/components/plan.py), and what it stores
lives in its LayerCaches. Forward follows docs/numerics.md §2.2 and, on a GPU, runs without a host sync,
so a decode step can be captured in a CUDA graph.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch

from dsv4.components.compressor import CompressPart, Compressor
from dsv4.components.indexer import Indexer
from dsv4.components.kv_pool import LayerCaches
from dsv4.components.layer_ops import LayerOps, layer_ops
from dsv4.components.plan import StepPlan
from dsv4.components.rope import Rope
from dsv4.values.fixed_order import GPU_ROW_TILE, ROW_TILE, asked, in_row_tiles, refuse_unable
from dsv4.formats.fp8_blocks import LinearNumerics
from dsv4.formats.indexer_numerics import IndexerNumerics, QueryFormat
from dsv4.kernels.target import device_target
from dsv4.values.layer_types import by_ratio
from dsv4.values.seam import SparseKV
from dsv4.values.spec import ModelSpec
from dsv4.strategies.linear.common import f32_product, with_tail
from dsv4.strategies.protocols import (CacheLayout, HeadPaddingPolicy, LinearStrategy, LinearWeight, MQAKernelStrategy,
                                       OProjStrategy, OProjWeights)

# rows of LayerStepResult.faults: which stored row of a token was not finite. The compressors write their
# rows whole (FAULT_COMPRESSED last, then FAULT_INDEXER) and the front clears the rows before theirs, so the
# two sides write apart and may run at once
FAULT_SWA, FAULT_INDEXER, FAULT_COMPRESSED = 0, 1, 2
FAULT_ROWS = 3


@dataclass(slots=True)
class LayerStepResult:
    out: Any                    # [T, hidden]: this rank's partial sum of the layer output
    topk: Any | None            # [T, index_topk] int32 local compressed indices (ratio-4 layers)
    faults: Any                 # [3, T] bool: a non-finite SWA row / closed entry / indexer key, not stored


class DSV4Attention(torch.nn.Module):
    def __init__(self, *, spec: ModelSpec, layer: int, heads: int, weights: dict, o_weights: OProjWeights,
                 mqa_kernel: MQAKernelStrategy, o_proj: OProjStrategy, head_padding: HeadPaddingPolicy,
                 cache_layout: CacheLayout, linear: LinearStrategy, compressor: Compressor | None = None,
                 indexer: Indexer | None = None, fp8: dict | None = None, dtype: str, device,
                 overlap: bool = True, batch_invariant: bool = False) -> None:
        """`weights`: this rank's float values under our names; `fp8`: those the checkpoint stores as e4m3
        blocks (formats.fp8_blocks.Fp8Blocks), as stored, which fp8 `linear` and `o_proj` options use;
        `overlap`: on a GPU, the compressors run on a side stream beside the query path; `batch_invariant`:
        a request's results independent of the rest of its steps (its options prepared for it)."""
        super().__init__()
        from dsv4.values.dtypes import torch_dtype

        ratio, padded, kind = _layer_kind(spec, layer, heads, head_padding, compressor, indexer)
        self.spec, self.layer, self.ratio, self.heads, self.padded_heads = spec, layer, ratio, heads, padded
        self.layer_type = kind.name
        self.rope = Rope.for_layer(spec, ratio)
        self.mqa_kernel, self.o_proj, self.head_padding = mqa_kernel, o_proj, head_padding
        self.cache_layout, self.linear = cache_layout, linear
        self.compressor, self.indexer = compressor, indexer
        self.dtype, self.eps = torch_dtype(dtype), spec.rms_norm_eps
        dev = device.torch_device
        # which implementation the layer's own pieces (front, norms, compressors, indexer) run, chosen here once:
        # our Triton kernels (given the device's Target, its facts for kernels that plan by them), or (on the
        # CPU) their torch code
        self.ops: LayerOps = layer_ops(device_target(device, fixed_order=batch_invariant))
        # the compressors' branch runs on the device's side stream beside the query path (`_Branch`)
        gpu = self.ops.on_gpu
        self.side_stream = side_stream(str(torch.device(dev))) if overlap and gpu and kind.compressed else None
        self.tail_product = f32_product(gpu=gpu)       # the compressors' float32 rows (`_tail`)
        self.batch_invariant = batch_invariant
        if batch_invariant:         # check() reports this with a fix; the module only refuses
            refuse_unable((mqa_kernel, o_proj, cache_layout, linear), device)
        self.mqa_prepared = mqa_kernel.prepare(device=device, **asked(self.batch_invariant))
        self.o_proj_prepared = o_proj.prepare(o_weights, device=device, dtype=dtype, **asked(self.batch_invariant))
        self._prepare_products(weights, fp8 or {}, device, dtype)
        for name in ("q_norm.weight", "kv_norm.weight"):
            self.register_buffer(name.split(".")[0], weights[name].to(device=dev, dtype=torch.float32))
        sink = torch.full((padded,), float("-inf"), device=dev)    # padded heads: no effect
        sink[:heads] = weights["attn_sink"].to(dev)
        self.register_buffer("attn_sink", sink)
        self._front_facts()

    def _prepare_products(self, weights: dict, fp8: dict, device, dtype: str) -> None:
        """The dense products, each prepared by `linear` once: x -> [qr | kv] through `linear`, and in
        compressed layers [compressor a | s | indexer compressor a | s | indexer head weights], which the
        checkpoint stores in bf16: accumulated in float32 (the compressors pool in float32; the front kernels
        round qr and kv to the activation dtype as a product in that dtype would). With float linears all of
        it is one product (`x_proj`, its weight the buffer `w_in`); with fp8 ones the float rows are a product
        of their own (`w_tail`), or -- in steps of at most `joint_rows` rows, where the option can -- the same
        launch as x's fp8 product (`x_joint`: the same tensors). Then qr -> the query heads and, in ratio-4
        layers, the indexer's query heads (both the published code's linears of the same normalised qr), and
        z -> the output (`wo_b`)."""
        compressor, indexer = self.compressor, self.indexer

        def weight(name: str, values) -> LinearWeight:
            return LinearWeight(values=values, fp8=fp8.get(name))

        parts = [weight("wq_a.weight", weights["wq_a.weight"]), weight("wkv.weight", weights["wkv.weight"])]
        tail = ([compressor.weights()] if compressor is not None else []) \
            + ([indexer.compressor.weights(), indexer.weights_proj] if indexer is not None else [])
        self.fused_tail = self.linear.numerics is LinearNumerics.FLOAT
        if self.fused_tail:
            parts += [LinearWeight(values=t) for t in tail]
        elif tail:
            self.register_buffer("w_tail", torch.cat([t.to(device.torch_device, self.dtype) for t in tail]))
        self.in_sizes = tuple(p.values.shape[0] for p in parts) + (() if self.fused_tail else
                                                                   tuple(t.shape[0] for t in tail))
        self.x_proj = self._prepare("w_in", LinearWeight.cat(parts), device, dtype)
        # a step of few rows: x's fp8 and float products in one launch, where the option can (float_tail_rows),
        # the sums its rows get not fixed by the step (batch_invariant keeps them apart) and the tail is bf16
        self.joint_rows = self.linear.float_tail_rows if tail and not self.fused_tail and not self.batch_invariant \
            and self.dtype == torch.bfloat16 else 0
        self.x_joint = with_tail(self.x_proj, self.w_tail) if self.joint_rows else None
        q_parts = [weight("wq_b.weight", weights["wq_b.weight"])] + (
            [weight("indexer.wq_b.weight", indexer.wq_b)] if indexer is not None else [])
        self.q_proj = self._prepare("wq_b", LinearWeight.cat(q_parts), device, dtype)
        self.q_sizes = tuple(p.values.shape[0] for p in q_parts)      # the row blocks of wq_b, in that order
        self.out_proj = self._prepare("wo_b", weight("wo_b.weight", weights["wo_b.weight"]), device, dtype)

    def _front_facts(self) -> None:
        """What the front makes of the indexer's queries, fixed by the layer's pieces (read once, not per call):
        the front kernel applies every IndexerNumerics; a kernel that scores e4m3 queries gets them from the
        front, their scales folded into the head weights. And the fault rows the front clears: those before
        the compressors' (which write theirs whole)."""
        idx = self.indexer
        self.fp8_iq = idx is not None and idx.strategy.query_format is QueryFormat.E4M3 and self.ops.front_queries
        self.iq_fp4 = idx is not None and idx.strategy.numerics is IndexerNumerics.FP4
        self.iq_w_scale = idx.weight_scale if self.fp8_iq else 1.0
        self.front_faults = FAULT_ROWS - (0 if self.compressor is None else 1 if idx is None else 2)

    def _prepare(self, name: str, weight: LinearWeight, device, dtype: str):
        """`linear`'s prepared product; its tensors are also this module's buffers (`name`, `name_scale`...),
        so that `buffers()` -- the memory report's weights -- holds them."""
        import dataclasses

        prepared = self.linear.prepare(weight, device=device, dtype=dtype, **asked(self.batch_invariant))
        for f in dataclasses.fields(prepared):
            value = getattr(prepared, f.name)
            if isinstance(value, torch.Tensor):
                self.register_buffer(name if f.name == "weight" else f"{name}_{f.name}", value, persistent=False)
        return prepared

    def _tail(self, x):
        """The compressors' rows (and the indexer's head weights) from the float tail weights, float32; under
        batch_invariant in tiles of a fixed row count, since a product's kernel follows its rows (on a GPU
        GPU_ROW_TILE: one call up to a decode step of that many requests)."""
        if self.batch_invariant:
            return in_row_tiles(lambda rows: self.tail_product(rows, self.w_tail), x,
                                GPU_ROW_TILE if self.ops.on_gpu else ROW_TILE)
        return self.tail_product(x, self.w_tail)

    def forward(self, x, plan: StepPlan, caches: LayerCaches) -> LayerStepResult:
        """One step's rows x [T, hidden] through the layer, phase by phase: the input products, the
        compressors' branch (on the side stream beside the query path, on a GPU), the front, the indexer's
        selection, the sparse attention and the output projection."""
        if caches.swa.layout != self.cache_layout or caches.ratio != self.ratio:
            raise ValueError(f"layer {self.layer}: caches of a ratio-{caches.ratio} layer in cache_layout="
                             f"{caches.swa.layout.name}, built for ratio {self.ratio} and {self.cache_layout.name}")
        xa = x if x.dtype == self.dtype else x.to(self.dtype)
        rot = plan.rope_rows(self.rope)
        faults = torch.empty(FAULT_ROWS, x.shape[0], dtype=torch.bool, device=x.device)
        if self.compressor is None:      # the sliding window alone: one product, no branch, no selection
            qr_raw, kv_raw = self.linear(xa, self.x_proj).split_with_sizes(self.in_sizes, 1)
            q, _ = self._front(qr_raw, kv_raw, None, rot, plan, caches, faults, None)
            kv = SparseKV(swa=caches.swa, swa_indices=plan.swa.indices, swa_lens=plan.swa.lens,
                          layer_type=self.layer_type, runs=plan.runs)
            return LayerStepResult(out=self._output(self._attention(q, kv, plan), rot), topk=None, faults=faults)
        branch = _Branch(self.side_stream)
        entry_rot = plan.rope_rows(self.rope, shift=self.ratio)
        qr_raw, kv_raw, scores = self._project(xa, branch)
        self._compress(scores, entry_rot, plan, caches, faults, branch)
        q, iq = self._front(qr_raw, kv_raw, scores, rot, plan, caches, faults, branch)
        if self.indexer is not None:
            topk, lists, lens = self._select(iq, scores[2], plan, caches, branch)
        else:
            topk, ents = None, plan.entries[self.ratio]
            lists, lens = ents.visible, ents.counts
        branch.join()                # the compressed entries are stored
        kv = SparseKV(swa=caches.swa, swa_indices=plan.swa.indices, swa_lens=plan.swa.lens,
                      layer_type=self.layer_type, runs=plan.runs, extra=caches.compressed, extra_indices=lists,
                      extra_lens=lens, extra_nested=self.indexer is None)
        return LayerStepResult(out=self._output(self._attention(q, kv, plan), rot), topk=topk, faults=faults)

    def one_launch_product(self, rows: int):
        """The prepared product that gives a compressed layer's x products (qr, kv and the compressors' float32
        rows) in one launch for a step of `rows` rows: `x_proj` with float linears, `x_joint` up to
        `joint_rows` rows; None where they are two products."""
        if self.fused_tail:
            return self.x_proj
        return self.x_joint if self.x_joint is not None and rows <= self.joint_rows else None

    def _project(self, xa, branch: _Branch):
        """A compressed layer's input products: -> qr, kv and the float32 rows of the compressors (and the
        indexer's head weights); with fp8 linears those rows in the same launch up to `joint_rows` rows, else
        on the side stream, beside the query path's."""
        joint = self.one_launch_product(xa.shape[0])
        if joint is not None:
            qr_raw, kv_raw, *scores = self.linear(xa, joint, out_dtype=torch.float32).split_with_sizes(
                self.in_sizes, 1)
            return qr_raw, kv_raw, scores
        with branch.side():          # the compressors' bf16 rows, beside the fp8 products of the query path
            scores = self._tail(xa).split_with_sizes(self.in_sizes[2:], 1)
            branch.mark()
        qr_raw, kv_raw = self.linear(xa, self.x_proj).split_with_sizes(self.in_sizes[:2], 1)
        return qr_raw, kv_raw, scores

    def _compress(self, scores, entry_rot, plan: StepPlan, caches: LayerCaches, faults, branch: _Branch) -> None:
        """The compressors' branch: they pool and store their entries (and the indexer's keys) on the side
        stream while the query path runs."""
        idx = self.indexer
        with branch.side():
            parts = [CompressPart(self.compressor, scores[0], caches.state, FAULT_COMPRESSED, caches.compressed)]
            if idx is not None:
                parts.append(idx.key_part(scores[1], caches.indexer_state, FAULT_INDEXER, caches.indexer_keys))
            self.ops.compress(parts, plan, entry_rot, faults)

    def _front(self, qr_raw, kv_raw, scores, rot, plan: StepPlan, caches: LayerCaches, faults, branch):
        """The query path's front: qr normed, its product with wq_b (and the indexer's), the query rows made
        and the KV rows stored (`front_rows`); -> (q, the indexer's queries: the front kernel's, else
        `Indexer.queries`'; None in a layer without an indexer). `branch`: None in a window-only layer."""
        T, idx, lin, ops = qr_raw.shape[0], self.indexer, self.linear, self.ops
        qr = ops.norm_rows(qr_raw, self.q_norm, eps=self.eps, dtype=self.dtype, fp8=lin.fp8_input)
        q_raw = lin(qr, self.q_proj)
        iq_raw = iq_dtype = None
        if idx is not None:
            # in the activation dtype, as the published code's projection returns it (then RoPE, FP4)
            q_raw, iq_raw = q_raw.split_with_sizes(self.q_sizes, 1)
            iq_raw = iq_raw.view(T, idx.n_heads, idx.head_dim)
            iq_dtype = idx.score_dtype(caches.indexer_keys)
        fp8_iq = self.fp8_iq
        if fp8_iq:
            branch.wait_mark()
        q, iq = ops.front_rows(q_raw.view(T, self.heads, self.spec.head_dim), kv_raw, self.kv_norm, rot,
                               plan.swa.write_slots, faults[:self.front_faults], caches.swa,
                               padded_heads=self.padded_heads, eps=self.eps, dtype=self.dtype, iq=iq_raw,
                               iq_dtype=torch.float8_e4m3fn if fp8_iq else iq_dtype, iq_fp4=self.iq_fp4,
                               iq_weights=scores[2] if fp8_iq else None, iq_w_scale=self.iq_w_scale)
        if iq is None and idx is not None:
            iq = idx.queries(iq_raw.flatten(1), rot, iq_dtype, rotate=ops.rotate_rows)
        return q, iq

    def _select(self, iq, head_weights, plan: StepPlan, caches: LayerCaches, branch: _Branch):
        """The indexer's selection, once its keys are stored: scores over them, then each token's top-k;
        -> (topk, lists, lens). With e4m3 queries `iq` is the front's (queries, head weights)."""
        idx, ops = self.indexer, self.ops
        branch.join()                # the indexer's keys are stored
        if self.fp8_iq:
            iq, head_weights = iq
        index_scores = ops.index_scores(idx, iq, head_weights, caches.indexer_keys, plan,
                                        plan.type_plan(self.layer_type).indexer)
        return ops.index_lists(idx, index_scores, plan)

    def _attention(self, q, kv: SparseKV, plan: StepPlan):
        """The sparse MQA over the rows `kv` names, with the sink; -> its output (the log-sum-exp unused)."""
        out, _lse = self.mqa_kernel(q, kv, sink=self.attn_sink, scale=self.spec.softmax_scale,
                                    prepared=self.mqa_prepared, plan=plan.type_plan(self.layer_type).kernel)
        return out

    def _output(self, out, rot):
        """The output projection: the real heads through `o_proj` (its inverse RoPE and wo_a), then wo_b."""
        z = self.o_proj(out if self.padded_heads == self.heads else out[:, :self.heads], rot,
                        prepared=self.o_proj_prepared)
        return self.linear(z if z.dtype == self.dtype else z.to(self.dtype), self.out_proj)


def _layer_kind(spec: ModelSpec, layer: int, heads: int, head_padding: HeadPaddingPolicy,
                compressor: Compressor | None, indexer: Indexer | None):
    """The layer's compress ratio, padded head count and LayerType, refusing pieces that do not fit them
    (check() reports these with a fix; the module only refuses)."""
    ratio = spec.compress_ratio(layer)
    padded = head_padding.padded_heads(heads)
    if padded is None or padded < heads:
        raise ValueError(f"head_padding={head_padding.name} cannot hold {heads} heads")
    kind = by_ratio(ratio)
    if (compressor is None) == kind.compressed or (indexer is None) == kind.indexed:
        raise ValueError(f"ratio {ratio} ({kind.name}): a compressor {'is' if kind.compressed else 'is not'} "
                         f"expected, an indexer {'is' if kind.indexed else 'is not'}")
    return ratio, padded, kind


@functools.cache
def side_stream(device: str):
    """The side stream of a GPU, shared by all its layers: the caching allocator keeps the blocks freed on
    a stream for that stream, so a stream per layer would hold a step's branch buffers once per layer."""
    return torch.cuda.Stream(device)


class _Branch:
    """Work forked onto a side CUDA stream and joined back, inside one forward (and so inside a captured
    graph, where it becomes a parallel branch); with no stream (a CPU, or overlap off) every call is a
    no-op and the work runs in program order. Each fork waits for the main stream's work so far, so a
    tensor the side stream frees is reused there only after the main stream's reads of it were issued
    before the next fork."""
    __slots__ = ("stream", "main", "event", "open")

    def __init__(self, stream) -> None:
        self.stream, self.main, self.event, self.open = stream, None, None, False

    def side(self):
        if self.stream is None:
            return contextlib.nullcontext()
        if not self.open:
            self.main = torch.cuda.current_stream(self.stream.device)
            self.stream.wait_stream(self.main)
            self.open = True
        return torch.cuda.stream(self.stream)

    def mark(self) -> None:
        """Remember the side stream's work so far (for `wait_mark`)."""
        if self.stream is not None:
            self.event = torch.cuda.Event()
            self.event.record(self.stream)

    def wait_mark(self) -> None:
        if self.event is not None:
            self.main.wait_event(self.event)

    def join(self) -> None:
        if self.open:
            self.main.wait_stream(self.stream)
            self.open = False
