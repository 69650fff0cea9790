"""The layer's own operations (its front, the q_lora norm, the compressors' step, the indexer's scores and
top-k), each in one implementation chosen once, when the layer is built (`layer_ops`): their torch code
(`TorchOps`, on the CPU; the specification the kernels are tested against, which stays in front.py,
compressor.py and indexer.py) or our Triton kernels (`TritonOps`, on a GPU, holding the device's Target).
The layer hands the value to its pieces; no call asks a tensor where it lives to pick one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from dsv4.components import front
from dsv4.components.compressor import compress_all, launch_compress
from dsv4.kernels.target import Target, check_on_gpu
from dsv4.values.layer_types import INDEXED

if TYPE_CHECKING:
    from dsv4.components.indexer import Indexer
    from dsv4.values.seam import PagedCache, RopeRows


class LayerOps(Protocol):
    """What the layer's pieces run, as the torch code or our kernels, and the facts of that choice."""
    on_gpu: bool            # its tensors are on a GPU: side streams exist, products take GPU_ROW_TILE rows
    front_queries: bool     # front_rows makes the indexer's queries too (e4m3 ones with their head weights)

    # RMSNorm of the q_lora rows in `dtype` (front.norm_rows); with `fp8` as an fp8 linear reads them
    def norm_rows(self, x, weight, *, eps: float, dtype, fp8: bool = False) -> Any: ...
    # RoPE on each head's last 64 dims, in `dtype` (front.rotate_rows)
    def rotate_rows(self, x, rot: RopeRows, dtype=None) -> Any: ...
    # the query rows and the KV rows stored into `cache` -> (q rows, the indexer's queries or None) (front.front_rows)
    def front_rows(self, q, kv, weight, rot: RopeRows, slots, faults, cache: PagedCache, *, padded_heads: int,
                   eps: float, dtype, iq=None, iq_dtype=None, iq_fp4: bool = False, iq_weights=None,
                   iq_w_scale: float = 1.0) -> tuple[Any, Any]: ...
    # compressors of one ratio over a step, their entries stored into their caches (compressor.compress_all)
    def compress(self, parts, plan, rot: RopeRows, faults) -> None: ...
    # the indexer strategy's per-step plan, made once per step and layer type (None: nothing to plan)
    def index_plan(self, indexer: Indexer, plan) -> Any: ...
    # the indexer's scores (Indexer.scores), given the step's `index_plan`
    def index_scores(self, indexer: Indexer, q, w, keys: PagedCache, plan, index_plan=None) -> Any: ...
    # the indexer's selection as the MQA kernel reads it (Indexer.lists)
    def index_lists(self, indexer: Indexer, scores, plan) -> Any: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchOps:
    """The torch code of front.py, compressor.py and indexer.py: the CPU path and the specification."""
    on_gpu: ClassVar[bool] = False
    front_queries: ClassVar[bool] = False        # Indexer.queries makes them

    norm_rows = staticmethod(front.norm_rows)
    rotate_rows = staticmethod(front.rotate_rows)
    front_rows = staticmethod(front.front_rows)
    compress = staticmethod(compress_all)

    def index_plan(self, indexer: Indexer, plan) -> None:
        return None

    def index_scores(self, indexer: Indexer, q, w, keys: PagedCache, plan, index_plan=None):
        return indexer.scores(q, w, keys, plan)

    def index_lists(self, indexer: Indexer, scores, plan):
        return indexer.lists(scores, plan)


TORCH_OPS = TorchOps()


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonOps:
    """Our Triton kernels (dsv4/kernels/front/, the indexer strategy's scoring kernel and top-k) on a GPU's
    tensors: the front in one launch that also makes the indexer's queries and stores the KV rows where the
    cache's layout has a kernel store, the compressors' step in one launch. `target`: the device's facts, as the layer resolved them.
    A CPU tensor is refused (`check_on_gpu`)."""
    target: Target
    on_gpu: ClassVar[bool] = True
    front_queries: ClassVar[bool] = True

    def norm_rows(self, x, weight, *, eps: float, dtype, fp8: bool = False):
        """front.norm_rows in the norm's own kernel, which writes the fp8 rows itself with `fp8`."""
        from dsv4.formats.fp8_blocks import Fp8Rows
        from dsv4.kernels.front.layer_front import norm_rows_kernel

        check_on_gpu(x, "norm_rows")
        out = norm_rows_kernel(x, weight, eps=eps, dtype=dtype, fp8=fp8, pdl=self.target.pdl)
        return Fp8Rows(values=out[0], scales=out[1], dtype=dtype) if fp8 else out

    def rotate_rows(self, x, rot: RopeRows, dtype=None):
        from dsv4.kernels.front.layer_front import rotate_rows_kernel

        check_on_gpu(x, "rotate_rows")
        return rotate_rows_kernel(x, rot.cos, rot.sin, dtype=dtype, pdl=self.target.pdl)

    def front_rows(self, q, kv, weight, rot: RopeRows, slots, faults, cache: PagedCache, *, padded_heads: int,
                   eps: float, dtype, iq=None, iq_dtype=None, iq_fp4: bool = False, iq_weights=None,
                   iq_w_scale: float = 1.0):
        """front.front_rows in one kernel that, given the indexer's queries iq, makes them too (RoPE, then with
        `iq_fp4` the published FP4 numerics, into `iq_dtype`; for e4m3, with their head weights `iq_weights`
        folded, as `front_kernel` says); it stores the KV rows itself where the cache's layout has a kernel
        store, otherwise they go through the cache's writer."""
        from dsv4.kernels.front.layer_front import front_kernel

        check_on_gpu(q, "front_rows")
        q_out, rows, iq_out = front_kernel(q, kv, weight, rot.cos, rot.sin, slots, faults, padded_heads=padded_heads,
                                           eps=eps, dtype=dtype, into=cache.store, iq=iq, iq_dtype=iq_dtype,
                                           iq_fp4=iq_fp4, iq_weights=iq_weights, iq_w_scale=iq_w_scale,
                                           pdl=self.target.pdl)
        if rows is not None:
            cache.write(rows[1], rows[0])
        return q_out, iq_out

    def compress(self, parts, plan, rot: RopeRows, faults) -> None:
        """compressor.compress_all in one launch where the kernel can store every part's entries
        (`kernel_stores`); otherwise a launch per part, storing its entries where it can and its numerics are
        the rows themselves, else handing them back for its numerics and its cache's writer."""
        for p in parts:
            check_on_gpu(p.scores, "compress")
        if all(p.kernel_stores for p in parts):
            launch_compress(tuple((p.compressor, p.scores, p.state, p.fault_row, p.cache.store, p.fp4) for p in parts),
                            plan, rot, faults)
            return
        for p in parts:
            into = p.cache.store if not p.fp4 else None
            out = launch_compress(((p.compressor, p.scores, p.state, p.fault_row, into, False),), plan, rot, faults)[0]
            if into is None:
                rows, store = out
                p.cache.write(store, p.stored(rows))

    def index_plan(self, indexer: Indexer, plan):
        """The indexer strategy's per-step plan (IndexerStrategy.plan) from the step plan's."""
        check_on_gpu(plan.positions, "index_plan")
        ents = plan.entries[INDEXED.ratio]
        return indexer.strategy.plan(token_request=plan.token_request, counts=ents.counts, pages=ents.table.pages,
                                     block_size=ents.table.block_size)

    def index_scores(self, indexer: Indexer, q, w, keys: PagedCache, plan, index_plan=None):
        """The strategy's scoring kernel, given the step's `index_plan`; its rows maybe wider than the entries'
        width. For a strategy whose `query_format` is E4M3, q and w may be what its kernel takes (e4m3 queries,
        their scales folded into w: `front_rows` makes them)."""
        check_on_gpu(q, "index_scores")
        ents = plan.entries[INDEXED.ratio]
        return indexer.strategy.scores(q, w, keys, ents.table.pages, plan.token_request, ents.counts,
                                       width=ents.width, w_scale=indexer.weight_scale, plan=index_plan,
                                       prepared=indexer.prepared)

    def index_lists(self, indexer: Indexer, scores, plan):
        """The strategy's `top_k` (dsv4/strategies/indexer/top_k/: our radix select, valid entries in index order,
        or FlashInfer's), as Indexer.lists gives them."""
        check_on_gpu(scores, "index_lists")
        ents = plan.entries[INDEXED.ratio]
        return indexer.strategy.top_k(scores, ents.counts, ents.table.pages, plan.token_request,
                                      topk=indexer.topk, block_size=ents.table.block_size)


def layer_ops(target: Target | None) -> LayerOps:
    """The layer's ops for a device, chosen once: our kernels given its Target (a GPU's, `device_target`), the
    torch code for None (the CPU)."""
    return TORCH_OPS if target is None else TritonOps(target=target)
