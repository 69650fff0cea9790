"""The model's attention-relevant configuration (docs/numerics.md §1.1) as a frozen value.

Pure Python: `mode=check` builds it without importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dsv4.values.errors import ConfigError
from dsv4.values.layer_types import RATIOS, by_ratio
from dsv4.values.settings import above, at_least, parse


@dataclass(frozen=True, slots=True, kw_only=True)
class YarnScaling:
    factor: float = above(0)
    original_max_position_embeddings: int = at_least(1)
    beta_fast: float = above(0)
    beta_slow: float = above(0)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    name: str
    hidden_size: int = at_least(1)
    num_hidden_layers: int = at_least(1)
    num_attention_heads: int = at_least(1)
    head_dim: int = at_least(1)
    qk_rope_head_dim: int = at_least(1)
    q_lora_rank: int = at_least(1)
    o_lora_rank: int = at_least(1)
    o_groups: int = at_least(1)
    sliding_window: int = at_least(1)
    compress_ratios: tuple[int, ...] = at_least(0)
    index_topk: int = at_least(1)
    index_n_heads: int = at_least(1)
    index_head_dim: int = at_least(1)
    rope_theta: float = above(0)
    compress_rope_theta: float = above(0)
    rope_scaling: YarnScaling
    max_position_embeddings: int = at_least(1)
    rms_norm_eps: float = above(0)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "ModelSpec":
        spec = parse(cls, cfg, "model")
        spec.validate()
        return spec

    def validate(self) -> None:
        """Structural invariants of the layer itself (not of a strategy combination)."""
        errs = []
        if self.qk_rope_head_dim != 64 or self.head_dim <= 64:
            errs.append(f"qk_rope_head_dim must be 64 and head_dim > 64 (got {self.qk_rope_head_dim}, {self.head_dim})")
        if self.index_head_dim < 64:
            errs.append(f"index_head_dim must be >= 64 (RoPE on its last 64 dims), got {self.index_head_dim}")
        if self.num_attention_heads % self.o_groups:
            errs.append(f"num_attention_heads ({self.num_attention_heads}) must be divisible by o_groups ({self.o_groups})")
        if len(self.compress_ratios) < self.num_hidden_layers:
            errs.append(f"compress_ratios has {len(self.compress_ratios)} entries for {self.num_hidden_layers} layers")
        bad = sorted({r for r in self.compress_ratios if max(1, r) not in RATIOS})
        if bad:
            errs.append(f"compress_ratios may hold only 0 (or 1), {', '.join(map(str, RATIOS[1:]))}, got {bad}")
        if errs:
            raise ConfigError(f"model={self.name}: " + "; ".join(errs))

    # ---- derived -------------------------------------------------------------------------
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    def compress_ratio(self, layer: int) -> int:
        """vLLM: max(1, compress_ratios[layer]); 1 means SWA-only."""
        if not 0 <= layer < self.num_hidden_layers:
            raise ConfigError(f"layer {layer} out of range: model={self.name} has {self.num_hidden_layers} layers")
        return max(1, self.compress_ratios[layer])

    def layer_type(self, layer: int) -> str:
        """The name of the layer's type (dsv4/values/layer_types.py): swa, c4a or c128a."""
        return by_ratio(self.compress_ratio(layer)).name

    def one_layer_per_type(self) -> tuple[int, ...]:
        """The first layer of each type present (SWA-only, ratio 4, ratio 128), in that order."""
        first: dict[int, int] = {}
        for layer in range(self.num_hidden_layers):
            first.setdefault(self.compress_ratio(layer), layer)
        return tuple(first[r] for r in sorted(first))

    def projections(self, tp_size: int = 1) -> dict[str, tuple[int, int]]:
        """The dense projections a `linear` option multiplies, as (N, K) of one tensor-parallel rank's
        weight: `wq_a`, `wkv` (replicated), `wq_b` (its heads), the indexer's `wq_b` (replicated; ratio-4
        layers only) and `wo_b` (its groups' input columns)."""
        D, H, G = self.head_dim, self.num_attention_heads // tp_size, self.o_groups // tp_size
        out = {"wq_a": (self.q_lora_rank, self.hidden_size), "wkv": (D, self.hidden_size),
               "wq_b": (H * D, self.q_lora_rank)}
        if any(by_ratio(max(1, r)).indexed for r in self.compress_ratios[:self.num_hidden_layers]):
            out["indexer.wq_b"] = (self.index_n_heads * self.index_head_dim, self.q_lora_rank)
        out["wo_b"] = (self.hidden_size, G * self.o_lora_rank)
        return out

    def to_dump(self) -> dict[str, Any]:
        """The `model` object of the dump contract's spec.json (docs/design.md §3)."""
        keys = ("hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank",
                "o_lora_rank", "o_groups", "sliding_window", "index_topk", "index_n_heads",
                "index_head_dim", "rope_theta", "compress_rope_theta", "rms_norm_eps")
        out: dict[str, Any] = {k: getattr(self, k) for k in keys}
        rs = self.rope_scaling
        out["rope_scaling"] = {"factor": rs.factor,
                               "original_max_position_embeddings": rs.original_max_position_embeddings,
                               "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow}
        return out
