"""indexer=exact: the queries and keys as the layer computes them (RoPE'd float32, keys stored in the
activation dtype): the indexer scores what the model's weights give, with no simulated quantization.
The published code also rounds the head weights and the scores to bf16; here both stay float32."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dsv4.formats.indexer_numerics import IndexerNumerics, QueryFormat
from dsv4.strategies.indexer.common import check_top_k, triton_scores
from dsv4.strategies.indexer.top_k.triton import TritonTopK
from dsv4.strategies.protocols import Needs, TopKStrategy


@dataclass(frozen=True, slots=True, kw_only=True)
class ExactIndexer:
    name: str = "exact"
    top_k: TopKStrategy = field(default_factory=TritonTopK)     # how its scores become lists on a GPU
    error_budget: ClassVar[float] = 0.0
    numerics: ClassVar[IndexerNumerics] = IndexerNumerics.EXACT
    query_format: ClassVar[QueryFormat] = QueryFormat.ROWS

    def __post_init__(self) -> None:
        check_top_k(self)

    def needs(self, device) -> Needs:
        return Needs(batch_invariant=True)       # the torch path's fixed order; our kernels' fixed launches

    def prepare(self, *, head_dim: int, device, batch_invariant: bool = False):
        from dsv4.kernels.target import device_target

        return device_target(device, fixed_order=batch_invariant)

    def key_layout(self, *, dtype: str, head_dim: int) -> None:
        """None: plain rows in the activation dtype (the pool's PlainRowLayout): float32 activations keep exact
        keys; bf16 ones store bf16 keys, as the published inference code does (its indexer cache is a bf16
        tensor scored by a bf16 product)."""
        return None

    def plan(self, *, token_request, counts, pages, block_size: int) -> None:
        return None

    def scores(self, q, w, keys, pages, token_request, counts, *, width: int, w_scale: float, plan=None,
               prepared=None):
        return triton_scores(q, w, keys, pages, token_request, counts, width=width, w_scale=w_scale,
                             prepared=prepared)
