"""Seeded random weights under DeepSeek's checkpoint names (docs/numerics.md §1.2), and TP sharding.

Names are relative to `layers.{l}.attn.`; values are float32 on the CPU. Each layer draws from its
own generator seeded by (seed, layer), so a layer's weights do not depend on which others are built.
The linears the checkpoint stores in fp8 (`FP8_LINEARS`) can be made in that format too
(`in_fp8_blocks`), for the fp8 `linear` options; their blocks are sharded like their float values.
"""
from __future__ import annotations

from dsv4.formats.fp8_blocks import BLOCK, Fp8Blocks, quantize_blocks
from dsv4.values.layer_types import by_ratio
from dsv4.values.spec import ModelSpec

# e4m3 with one power-of-two scale per 128x128 block in DeepSeek-V4's checkpoints (components/checkpoint.py)
FP8_LINEARS = ("wq_a.weight", "wkv.weight", "wq_b.weight", "wo_a.weight", "wo_b.weight", "indexer.wq_b.weight")


def weight_shapes(spec: ModelSpec, ratio: int) -> dict[str, tuple[int, ...]]:
    H, D, hid = spec.num_attention_heads, spec.head_dim, spec.hidden_size
    G, hpg = spec.o_groups, spec.heads_per_group
    shapes: dict[str, tuple[int, ...]] = {
        "wq_a.weight": (spec.q_lora_rank, hid),
        "wkv.weight": (D, hid),
        "q_norm.weight": (spec.q_lora_rank,),
        "wq_b.weight": (H * D, spec.q_lora_rank),
        "kv_norm.weight": (D,),
        "wo_a.weight": (G * spec.o_lora_rank, hpg * D),
        "wo_b.weight": (hid, G * spec.o_lora_rank),
        "attn_sink": (H,),
    }
    kind = by_ratio(ratio)
    if kind.compressed:
        coff = kind.coff
        shapes |= {"compressor.wkv.weight": (coff * D, hid), "compressor.wgate.weight": (coff * D, hid),
                   "compressor.ape": (ratio, coff * D), "compressor.norm.weight": (D,)}
    if kind.indexed:
        Hi, Di = spec.index_n_heads, spec.index_head_dim
        shapes |= {"indexer.wq_b.weight": (Hi * Di, spec.q_lora_rank),
                   "indexer.weights_proj.weight": (Hi, hid),
                   "indexer.compressor.wkv.weight": (2 * Di, hid),
                   "indexer.compressor.wgate.weight": (2 * Di, hid),
                   "indexer.compressor.ape": (4, 2 * Di),
                   "indexer.compressor.norm.weight": (Di,)}
    return shapes


def random_layer_weights(spec: ModelSpec, layer: int, seed: int) -> dict:
    """Linear weights ~ N(0, 1/fan_in); norm weights ~ 1 ± 0.1; sinks and APE ~ N(0, 1), N(0, 0.5²)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    out = {}
    for name, shape in weight_shapes(spec, spec.compress_ratio(layer)).items():
        w = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * w
        elif name.endswith("ape"):
            w = 0.5 * w
        elif name != "attn_sink":
            w = w * shape[1] ** -0.5
        out[name] = w
    return out


def in_fp8_blocks(weights: dict) -> tuple[dict, dict[str, Fp8Blocks]]:
    """Weights in the checkpoint's format: each of FP8_LINEARS whose shape is whole 128x128 blocks
    quantized to e4m3 blocks (`quantize_blocks`), and the float copies replaced by their exact
    dequantization, so that every option and the oracle multiply the same values."""
    out, stored = dict(weights), {}
    for name in FP8_LINEARS:
        w = weights.get(name)
        if w is not None and w.shape[0] % BLOCK == 0 and w.shape[1] % BLOCK == 0:
            stored[name] = quantize_blocks(w)
            out[name] = stored[name].dequantize()
    return out, stored


def shard_fp8(stored: dict[str, Fp8Blocks], spec: ModelSpec, rank: int, tp_size: int) -> dict[str, Fp8Blocks]:
    """Rank `rank`'s view of the fp8 blocks, as `shard` cuts the float values. A weight whose rank slice
    would cut through its blocks is left out (its float values remain; check() refuses an fp8 `linear`
    whose own projections would be cut, `Needs.projection_multiple`)."""
    if tp_size == 1:
        return dict(stored)
    HD = spec.num_attention_heads // tp_size * spec.head_dim
    r = spec.o_groups // tp_size * spec.o_lora_rank
    cuts = {"wq_b.weight": ("rows", HD), "wo_a.weight": ("rows", r), "wo_b.weight": ("cols", r)}
    out = {}
    for name, b in stored.items():
        how, n = cuts.get(name, (None, 0))
        if how is None:
            out[name] = b
        elif n % BLOCK == 0:
            out[name] = getattr(b, how)(rank * n, (rank + 1) * n)
    return out


SHARDED = ("wq_b.weight", "attn_sink", "wo_a.weight", "wo_b.weight")    # cut by `shard`; the rest replicated


def shard(weights: dict, spec: ModelSpec, rank: int, tp_size: int) -> dict:
    """Rank `rank`'s view: wq_b, attn_sink by heads; wo_a by groups (column-parallel); wo_b by its
    input columns (row-parallel: ranks' outputs sum to the layer's). Everything else is replicated."""
    H, D = spec.num_attention_heads // tp_size, spec.head_dim
    G, r = spec.o_groups // tp_size, spec.o_lora_rank
    out = dict(weights)
    out["wq_b.weight"] = weights["wq_b.weight"][rank * H * D:(rank + 1) * H * D]
    out["attn_sink"] = weights["attn_sink"][rank * H:(rank + 1) * H]
    out["wo_a.weight"] = weights["wo_a.weight"][rank * G * r:(rank + 1) * G * r]
    out["wo_b.weight"] = weights["wo_b.weight"][:, rank * G * r:(rank + 1) * G * r]
    return out
