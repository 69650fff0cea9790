"""Builders: stitch one rank's layer and its KV pool, and an engine of ranks, from the spec, weights and strategies.

The strategies arrive instantiated, an option of each group (dsv4.strategies.Strategies: a job's, or the
caller's own); this is the only place that knows how the pieces fit, so the module's constructor stays a list
of injected parts (torchtune's component builders).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from dsv4.components.attention import DSV4Attention
from dsv4.components.compressor import Compressor
from dsv4.components.engine import Engine
from dsv4.components.graphs import StepGraphs
from dsv4.components.indexer import Indexer
from dsv4.components.kv_pool import CompressorState, KVPool, LayerCaches, PageGroup, PoolConfig, page_groups
from dsv4.values.seam import PagedCache
from dsv4.components.weights import shard, shard_fp8
from dsv4.values.device import DeviceInfo
from dsv4.values.dtypes import torch_dtype
from dsv4.values.fixed_order import refuse_unable
from dsv4.formats.fp8_blocks import BLOCK as FP8_BLOCK
from dsv4.values.graph_config import GraphConfig
from dsv4.values.layer_types import by_ratio
from dsv4.values.spec import ModelSpec
from dsv4.strategies import indexer_keys_layout
from dsv4.strategies.choice import Strategies
from dsv4.strategies.protocols import CacheLayout, IndexerStrategy, OProjWeights


def build_layer(*, spec: ModelSpec, layer: int, weights: dict, rank: int, tp_size: int,
                strategies: Strategies, device: DeviceInfo, dtype: str, fp8: dict | None = None,
                overlap: bool = True, batch_invariant: bool = False) -> DSV4Attention:
    """`weights`: the whole layer's float values; `fp8`: those stored as e4m3 blocks (a checkpoint's, or
    random weights made in that format: `weights.in_fp8_blocks`), which fp8 `linear` and `o_proj` options
    take as they are. Each is cut to rank `rank`'s shard. `overlap`: on a GPU, the compressors run on a
    side stream beside the query path; `batch_invariant`: a request's results independent of its steps'
    other requests (every option able to, `Needs.batch_invariant`)."""
    ratio = spec.compress_ratio(layer)
    w = shard(weights, spec, rank, tp_size)
    blocks = shard_fp8(fp8 or {}, spec, rank, tp_size)
    dev = device.torch_device

    def compressor(prefix: str, dim: int, r: int) -> Compressor:
        return Compressor(wkv=w[f"{prefix}wkv.weight"].to(dev), wgate=w[f"{prefix}wgate.weight"].to(dev),
                          ape=w[f"{prefix}ape"].to(dev), norm=w[f"{prefix}norm.weight"].to(dev), ratio=r,
                          head_dim=dim, eps=spec.rms_norm_eps, dtype=torch_dtype(dtype))

    kind = by_ratio(ratio)
    comp = compressor("compressor.", spec.head_dim, ratio) if kind.compressed else None
    idx = None
    if kind.indexed:
        if batch_invariant:       # before the indexer option is prepared for it (the layer refuses its own)
            refuse_unable((strategies.indexer, strategies.indexer.top_k), device)
        # wq_b stays where the weights are: the layer multiplies it through `linear`, as its own prepared copy
        idx = Indexer(wq_b=w["indexer.wq_b.weight"], weights_proj=w["indexer.weights_proj.weight"].to(dev),
                      compressor=compressor("indexer.compressor.", spec.index_head_dim, ratio),
                      n_heads=spec.index_n_heads, head_dim=spec.index_head_dim, topk=spec.index_topk,
                      strategy=strategies.indexer, device=device, batch_invariant=batch_invariant)
    wo_a = blocks.get("wo_a.weight")
    if spec.o_lora_rank % FP8_BLOCK:            # a group's rows cut its blocks: fp8 o_proj options quantize the values
        wo_a = None
    o_weights = OProjWeights(wo_a=w["wo_a.weight"], groups=spec.o_groups // tp_size,
                             wo_a_fp8=None if wo_a is None else wo_a.weight,
                             wo_a_scale=None if wo_a is None else wo_a.scale)
    return DSV4Attention(spec=spec, layer=layer, heads=spec.num_attention_heads // tp_size, weights=w,
                         o_weights=o_weights, mqa_kernel=strategies.mqa_kernel, o_proj=strategies.o_proj,
                         head_padding=strategies.head_padding, cache_layout=strategies.cache_layout,
                         linear=strategies.linear, compressor=comp, indexer=idx, fp8=blocks, dtype=dtype,
                         device=device, overlap=overlap, batch_invariant=batch_invariant)


def build_pool(*, spec: ModelSpec, layers, layout: CacheLayout, pool: PoolConfig, device: DeviceInfo,
               dtype: str, indexer: IndexerStrategy | None = None) -> KVPool:
    """One rank's pool for `layers`: the page groups their ratios need, and each layer's caches on them.
    The SWA group keeps the sliding window; compressor state its coff·R positions; entries everything.
    The indexer keys are stored as `indexer` says (`key_layout`; None: plain rows), for activations of
    `dtype`."""
    dev = device.torch_device
    groups = page_groups(window=spec.sliding_window, ratios={spec.compress_ratio(l) for l in layers}, pool=pool)

    def cache(name: str, lay: CacheLayout, group: PageGroup, dim: int) -> PagedCache:
        return PagedCache(name=name, layout=lay, block_size=group.block_size, head_dim=dim,
                          data=lay.allocate(num_blocks=group.num_blocks, block_size=group.block_size, head_dim=dim,
                                            device=dev))

    def state(group: PageGroup, width: int) -> CompressorState:
        import torch
        return CompressorState(data=torch.zeros(group.num_slots, 2 * width, dtype=torch.float32, device=dev),
                         block_size=group.block_size, width=width)

    caches = {}
    for l in layers:
        r = spec.compress_ratio(l)
        kind = by_ratio(r)
        kw: dict[str, Any] = {}
        if kind.compressed:
            kw |= dict(compressed=cache("compressed", layout, groups[f"entries{r}"], spec.head_dim),
                       state=state(groups[f"state{r}"], kind.coff * spec.head_dim))
        if kind.indexed:             # the indexer's keys: a compressor of the layer's ratio of its own
            keys = indexer_keys_layout(indexer, dtype=dtype, head_dim=spec.index_head_dim)
            kw |= dict(indexer_keys=cache("indexer", keys, groups[f"entries{r}"], spec.index_head_dim),
                       indexer_state=state(groups[f"state{r}"], kind.coff * spec.index_head_dim))
        caches[l] = LayerCaches(ratio=r, swa=cache("swa", layout, groups["swa"], spec.head_dim), **kw)
    return KVPool(groups=groups, layers=caches, window=spec.sliding_window)


def build_engine(*, spec: ModelSpec, weights: dict[int, dict], strategies: Strategies, pool: PoolConfig,
                 device: DeviceInfo, dtype: str, tp_size: int, graphs: GraphConfig, fp8: dict | None = None,
                 overlap: bool = True, batch_invariant: bool = False, ranks: Sequence[int] | None = None,
                 all_reduce: Callable | None = None) -> Engine:
    """An engine over the layers of `weights` ({layer: its whole weights}): each layer built for each of
    `ranks` (default: all tp_size of them, simulated in this process and summed locally) and one pool per
    rank. `all_reduce`: sums the ranks' partial outputs across processes (distributed ranks, one each);
    `fp8`: per layer the linears stored as fp8 blocks; `graphs`: CUDA-graph decode when enabled."""
    ranks = range(tp_size) if ranks is None else ranks
    layers = {l: [build_layer(spec=spec, layer=l, weights=w, rank=r, tp_size=tp_size, strategies=strategies,
                              device=device, dtype=dtype, fp8=(fp8 or {}).get(l), overlap=overlap,
                              batch_invariant=batch_invariant)
                  for r in ranks] for l, w in weights.items()}
    pools = [build_pool(spec=spec, layers=list(weights), layout=strategies.cache_layout, pool=pool, device=device,
                        dtype=dtype, indexer=strategies.indexer)
             for _ in ranks]
    return Engine(spec=spec, layers=layers, pools=pools, device=device.torch_device, all_reduce=all_reduce,
                  graphs=StepGraphs(graphs) if graphs.enabled else None)
