"""Builders: stitch one rank's layer and its KV pool from the spec, weights and strategies.

The strategies arrive instantiated (one Hydra group each); this is the only place that knows how the
pieces fit, so the module's constructor stays a list of injected parts (torchtune's component builders).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4.components.attention import DSV4Attention
from dsv4.components.compressor import Compressor
from dsv4.components.indexer import Indexer
from dsv4.components.kv_pool import BlockAllocator, LayerKV, PagedCache
from dsv4.components.rope import Rope
from dsv4.components.weights import shard
from dsv4.device import DeviceInfo
from dsv4.dtypes import torch_dtype
from dsv4.spec import ModelSpec
from dsv4.strategies.cache_layout import PlainRowLayout
from dsv4.strategies.protocols import (CacheLayout, HeadPaddingPolicy, MQAKernelStrategy, OProjStrategy,
                                       OProjWeights)

# Indexer keys are kept exact (float32 rows) whatever the main cache layout: the reference indexer
# scores in float32 (DSV4_SPEC §3.4 describes the fp8/fp4 records a quantized indexer would use).
INDEXER_LAYOUT = PlainRowLayout(name="float32", dtype="float32")


@dataclass(frozen=True, slots=True, kw_only=True)
class Strategies:
    mqa_kernel: MQAKernelStrategy
    o_proj: OProjStrategy
    head_padding: HeadPaddingPolicy
    cache_layout: CacheLayout


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolConfig:
    swa_block_size: int = 64
    compressed_block_tokens: int = 256     # positions per compressed page: 64 entries at R=4, 2 at R=128
                                           # (at least one entry per page)
    swa_blocks: int = 64
    compressed_blocks: int = 64

    @classmethod
    def from_config(cls, cfg: Any) -> "PoolConfig":
        return cls(**{k: int(v) for k, v in dict(cfg).items()})

    def compressed_block_size(self, ratio: int) -> int:
        """Entries per compressed page: the page's positions / ratio, at least one."""
        return max(1, self.compressed_block_tokens // ratio)


def build_layer(*, spec: ModelSpec, layer: int, weights: dict, rank: int, tp_size: int,
                strategies: Strategies, device: DeviceInfo, dtype: str, wo_a_fp8: Any = None) -> DSV4Attention:
    """`wo_a_fp8`: a checkpoint's stored fp8 wo_a (`checkpoint.StoredFp8`), for fp8 o_proj strategies."""
    ratio = spec.compress_ratio(layer)
    w = shard(weights, spec, rank, tp_size)
    heads = spec.num_attention_heads // tp_size
    padded = strategies.head_padding.padded_heads(heads)
    if padded is None:        # check() reports this with a fix; the builder only refuses
        raise ValueError(f"head_padding={strategies.head_padding.name} cannot hold {heads} heads")
    dev = device.torch_device
    rope = Rope.for_layer(spec, ratio)

    def compressor(prefix: str, dim: int, r: int) -> Compressor:
        return Compressor(wkv=w[f"{prefix}wkv.weight"].to(dev), wgate=w[f"{prefix}wgate.weight"].to(dev),
                          ape=w[f"{prefix}ape"].to(dev), norm=w[f"{prefix}norm.weight"].to(dev), ratio=r,
                          head_dim=dim, rope=rope, eps=spec.rms_norm_eps)

    comp = compressor("compressor.", spec.head_dim, ratio) if ratio > 1 else None
    idx = None
    if ratio == 4:
        idx = Indexer(wq_b=w["indexer.wq_b.weight"].to(dev), weights_proj=w["indexer.weights_proj.weight"].to(dev),
                      compressor=compressor("indexer.compressor.", spec.index_head_dim, 4),
                      n_heads=spec.index_n_heads, head_dim=spec.index_head_dim, topk=spec.index_topk, rope=rope)
    fp8_a = fp8_s = None
    if wo_a_fp8 is not None:
        from dsv4.components.checkpoint import shard_wo_a_fp8
        fp8_a, fp8_s = shard_wo_a_fp8(wo_a_fp8, spec, rank, tp_size)
    o_weights = OProjWeights(wo_a=w["wo_a.weight"], wo_b=w["wo_b.weight"], groups=spec.o_groups // tp_size,
                             wo_a_fp8=fp8_a, wo_a_scale=fp8_s)
    return DSV4Attention(spec=spec, layer=layer, ratio=ratio, heads=heads, padded_heads=padded, weights=w, rope=rope,
                         compressor=comp, indexer=idx, mqa_kernel=strategies.mqa_kernel,
                         mqa_prepared=strategies.mqa_kernel.prepare(device=device),
                         o_proj=strategies.o_proj,
                         o_proj_prepared=strategies.o_proj.prepare(o_weights, device=device, dtype=dtype),
                         dtype=torch_dtype(dtype), device=dev)


def build_layer_kv(*, spec: ModelSpec, layer: int, layout: CacheLayout, pool: PoolConfig,
                   device: DeviceInfo) -> LayerKV:
    ratio = spec.compress_ratio(layer)
    dev = device.torch_device

    def cache(name: str, lay: CacheLayout, blocks: int, block_size: int, dim: int) -> PagedCache:
        return PagedCache(name=name, layout=lay, block_size=block_size, head_dim=dim,
                          data=lay.allocate(num_blocks=blocks, block_size=block_size, head_dim=dim, device=dev),
                          allocator=BlockAllocator(blocks))

    swa = cache("swa", layout, pool.swa_blocks, pool.swa_block_size, spec.head_dim)
    comp = idx = None
    if ratio > 1:
        comp = cache("compressed", layout, pool.compressed_blocks, pool.compressed_block_size(ratio), spec.head_dim)
    if ratio == 4:
        idx = cache("indexer", INDEXER_LAYOUT, pool.compressed_blocks, pool.compressed_block_size(4),
                    spec.index_head_dim)
    return LayerKV(ratio=ratio, window=spec.sliding_window, swa=swa, compressed=comp, indexer=idx)
