"""mqa_kernel=flashmla_sparse: FlashMLA's sparse fp8 decode kernel (package sgl-flash-mla, import flash_mla).

Every query token is one batch row (s_q = 1) of `flash_mla_with_kvcache` reading the fp8_ds_mla pages
directly: the SWA cache through `indices`/`topk_length`, the compressed cache as the "extra" cache
through `extra_indices_in_kvcache`/`extra_topk_length`, with the attention sink (docs/numerics.md §4.2). The
tile-scheduler metadata is the strategy's per-step plan: made empty once per layer type per step
(`plan`), filled by the first call and reused by the other layers of that type in the step (the API
requires identical shapes and lengths, which layers of one type in one step have); so are the index
lists the type's layers share, padded to the kernel's width (the SWA windows; ratio-128 layers' entries).
In a CUDA graph the first layer's captured call recomputes both on every replay. The page views of a
layer's caches are made once, by the layer's `PageViews` (which `prepare` makes). On sm90 the kernels are the
package's legacy ones.

Prefill tokens go through the same decode kernel by default: it reads the fp8 pages in place, while
`flash_mla_sparse_fwd` first needs the referenced rows dequantized into a bf16 workspace
(`prefill_gather_min_tokens` switches to that path for steps of at least that many tokens; the
benchmark decides which is faster on a machine). The gather sizes its workspace on the host, so CUDA graphs may
capture only smaller steps: check() refuses graph.capture_sizes that reach it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from dsv4.formats.fp8_ds_mla import fp8_ds_mla_pages
from dsv4.formats.index_lists import attended, distinct_rows, pad_columns
from dsv4.formats.row_format import FP8_DS_MLA
from dsv4.values.settings import at_least
from dsv4.values.sizes import round_up
from dsv4.strategies.protocols import Needs
from dsv4.values.seam import SparseKV


WIDTH_MULTIPLE = 128          # index widths: multiples of B_TOPK (64 for h64, 128 for h128)


def _pad_width(idx):
    """idx padded with -1 to the width FlashMLA reads (a multiple of WIDTH_MULTIPLE, at least one)."""
    return pad_columns(idx, max(WIDTH_MULTIPLE, round_up(idx.shape[1], WIDTH_MULTIPLE)))


@dataclass(slots=True, eq=False)
class PageViews:
    """A layer's memo of its caches' page views (fp8_ds_mla_pages), each made once per cache buffer and kept
    by the buffer's identity, so that no call of the layer makes them again."""
    views: dict = field(default_factory=dict)       # id(buffer) -> (the buffer, its page view)

    def of(self, cache):
        """fp8_ds_mla_pages(cache), made by the first call that reads its buffer."""
        hit = self.views.get(id(cache.data))
        if hit is None or hit[0] is not cache.data:
            hit = self.views[id(cache.data)] = (cache.data, fp8_ds_mla_pages(cache))
        return hit[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class FlashMLAPrepared:
    """A layer's own state: whether the package's legacy kernels run (sm90), and the memo of its caches' page
    views (made once per buffer, not per call)."""
    use_legacy: bool
    pages: PageViews = field(default_factory=PageViews, compare=False, repr=False)


@dataclass(slots=True)
class FlashMLAPlan:
    """One step's state for one layer type: the tile-scheduler metadata (flash_mla.FlashMLASchedMeta), made
    by the type's first call in the step, and the index lists as the kernel reads them ([T, 1, W] int32,
    W padded to its width) for lists the step's layers share (the SWA windows; at ratio 128 every visible
    entry), each made once: the last list seen in each role and its padded view."""
    sched: Any = field(default=None)
    views: dict = field(default_factory=dict)       # role -> (the step's list, its padded [T, 1, W] view)

    def padded(self, role: str, lists):
        hit = self.views.get(role)
        if hit is None or hit[0] is not lists:
            hit = self.views[role] = (lists, _pad_width(lists).view(lists.shape[0], 1, -1))
        return hit[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class FlashMLASparse:
    name: str = "flashmla_sparse"
    error_budget: ClassVar[float] = 1e-2     # vs the oracle: bf16 probabilities, FlashMLA
    prefill_gather_min_tokens: int = at_least(0, 0)   # 0: never gather; N: steps of >= N tokens gather

    def needs(self, device) -> Needs:
        return Needs(platforms=frozenset({"cuda"}), archs=frozenset({"sm90", "sm100"}),
                     row_formats=frozenset({FP8_DS_MLA}), padded_heads=frozenset({64, 128}),
                     dtypes=frozenset({"bfloat16"}), modules=(("flash_mla", "sgl-flash-mla"),),
                     # the gather path sizes its rows by torch.unique: only steps below its tokens can be captured
                     graphs=self.prefill_gather_min_tokens != 1,
                     graph_tokens=max(self.prefill_gather_min_tokens - 1, 0),
                     variance="FlashMLA's tile scheduler divides a step's work over SM parts by its batch")

    def prepare(self, *, device) -> FlashMLAPrepared:
        return FlashMLAPrepared(use_legacy=device.arch == "sm90")       # sm90 runs the package's legacy kernels

    def plan(self, *, tokens: int, layer_type: str, previous=None) -> FlashMLAPlan:
        import flash_mla

        return FlashMLAPlan(sched=flash_mla.get_mla_metadata()[0])

    def __call__(self, q, kv: SparseKV, *, sink, scale: float, prepared: FlashMLAPrepared | None = None,
                 plan: FlashMLAPlan | None = None):
        if self.prefill_gather_min_tokens and q.shape[0] >= self.prefill_gather_min_tokens:
            return self._gather_prefill(q, kv, sink=sink, scale=scale, prepared=prepared)
        import flash_mla
        import torch

        from dsv4.kernels.launch import as_dense, as_f32

        legacy = prepared is not None and prepared.use_legacy
        T, H, D = q.shape
        if plan is None:                             # this call alone
            plan = FlashMLAPlan(sched=flash_mla.get_mla_metadata()[0])
        pages = prepared.pages if prepared is not None else PageViews()      # this call alone: views of its own
        extra = {}
        if kv.extra is not None:
            extra = dict(extra_k_cache=pages.of(kv.extra),
                         extra_indices_in_kvcache=plan.padded("extra", kv.extra_indices),
                         extra_topk_length=as_dense(kv.extra_lens))
        qb = q if q.dtype == torch.bfloat16 else q.to(torch.bfloat16)
        out, lse = flash_mla.flash_mla_with_kvcache(
            as_dense(qb).view(T, 1, H, D), pages.of(kv.swa), None, None, 512, plan.sched, softmax_scale=scale,
            is_fp8_kvcache=True, indices=plan.padded("swa", kv.swa_indices), attn_sink=as_f32(sink),
            topk_length=as_dense(kv.swa_lens), use_legacy=legacy, **extra)
        out = out.view(T, H, -1)
        return (out if out.dtype == q.dtype else out.to(q.dtype)), lse.view(T, H)

    def _gather_prefill(self, q, kv: SparseKV, *, sink, scale: float, prepared: FlashMLAPrepared | None = None):
        """Dequantize each referenced row once into a bf16 workspace, then flash_mla_sparse_fwd."""
        import flash_mla
        import torch

        # the rows that count, over both pools and valid ones first (so that topk_length counts exactly them)
        ids, counts = attended(kv)
        rows, local = distinct_rows(kv, ids, width=kv.swa.head_dim)
        local = _pad_width(local)
        lens = counts.int()
        out, _, lse = flash_mla.flash_mla_sparse_fwd(
            q.to(torch.bfloat16).contiguous(), rows.unsqueeze(1), local.unsqueeze(1), scale, 512,
            attn_sink=sink.float().contiguous(), topk_length=lens,
            use_legacy=prepared is not None and prepared.use_legacy)
        return out.to(q.dtype), lse
