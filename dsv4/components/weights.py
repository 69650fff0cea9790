"""Seeded random weights under DeepSeek's checkpoint names (docs/numerics.md §1.2), and TP sharding.

Names are relative to `layers.{l}.attn.`; values are float32 on the CPU. Each layer draws from its
own generator seeded by (seed, layer), so a layer's weights do not depend on which others are built.
"""
from __future__ import annotations

from dsv4.spec import ModelSpec


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
    if ratio > 1:
        coff = 2 if ratio == 4 else 1
        shapes |= {"compressor.wkv.weight": (coff * D, hid), "compressor.wgate.weight": (coff * D, hid),
                   "compressor.ape": (ratio, coff * D), "compressor.norm.weight": (D,)}
    if ratio == 4:
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
