"""indexer=mxfp4: the published FP4 numerics (`fp4_sim`), the keys stored as packed FP4 records.

The records (68 B for a 128-dim key, against 256 B of bf16 keys; `Mxfp4KeyLayout`,
dsv4/strategies/indexer/key_layouts.py) hold exactly the FP4-simulated keys `fp4_sim` stores as bf16 rows,
so the two options score and select the same entries; our Triton kernel scores them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dsv4.formats.indexer_numerics import IndexerNumerics, QueryFormat
from dsv4.strategies.indexer.common import FP4_NEEDS, check_top_k, triton_scores
from dsv4.strategies.indexer.key_layouts import Mxfp4KeyLayout
from dsv4.strategies.indexer.top_k.triton import TritonTopK
from dsv4.strategies.protocols import Needs, TopKStrategy


@dataclass(frozen=True, slots=True, kw_only=True)
class Mxfp4Indexer:
    """fp4_sim's queries and keys; keys stored as Mxfp4KeyLayout records."""
    name: str = "mxfp4"
    top_k: TopKStrategy = field(default_factory=TritonTopK)     # how its scores become lists on a GPU
    error_budget: ClassVar[float] = 0.0       # the oracle applies the same numerics
    numerics: ClassVar[IndexerNumerics] = IndexerNumerics.FP4
    query_format: ClassVar[QueryFormat] = QueryFormat.ROWS

    def __post_init__(self) -> None:
        check_top_k(self)

    def needs(self, device) -> Needs:
        return FP4_NEEDS

    def prepare(self, *, head_dim: int, device, batch_invariant: bool = False):
        from dsv4.kernels.target import device_target

        return device_target(device, fixed_order=batch_invariant)

    def key_layout(self, *, dtype: str, head_dim: int) -> Mxfp4KeyLayout:
        return Mxfp4KeyLayout(head_dim=head_dim)

    def plan(self, *, token_request, counts, pages, block_size: int) -> None:
        return None

    def scores(self, q, w, keys, pages, token_request, counts, *, width: int, w_scale: float, plan=None,
               prepared=None):
        return triton_scores(q, w, keys, pages, token_request, counts, width=width, w_scale=w_scale,
                             prepared=prepared)
