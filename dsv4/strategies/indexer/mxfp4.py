"""indexer=mxfp4: the published FP4 numerics (`fp4_sim`), the keys stored as packed FP4 records.

The records (68 B for a 128-dim key, against 256 B of bf16 keys; `Mxfp4KeyLayout`,
dsv4/strategies/indexer/key_layouts.py) hold exactly the FP4-simulated keys `fp4_sim` stores as bf16 rows,
so the two options score and select the same entries; our Triton kernel scores them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.strategies.indexer.common import fp4_keys, fp4_needs, fp4_queries, no_plan, triton_prepare, triton_scores
from dsv4.strategies.indexer.key_layouts import Mxfp4KeyLayout
from dsv4.strategies.indexer.top_k import DEFAULT_TOP_K, check_top_k


@dataclass(frozen=True, slots=True, kw_only=True)
class Mxfp4Indexer:
    """fp4_sim's queries and keys; keys stored as Mxfp4KeyLayout records."""
    name: str = "mxfp4"
    top_k: str = DEFAULT_TOP_K                # how the scores become lists on a GPU (top_k.TOP_K)
    __post_init__ = check_top_k
    error_budget: ClassVar[float] = 0.0       # the oracle applies the same numerics
    transforms: ClassVar[bool] = True
    fp4: ClassVar[bool] = True
    oracle_numerics: ClassVar[str] = "fp4"
    fp8_queries: ClassVar[bool] = False

    scores, prepare, plan = staticmethod(triton_scores), triton_prepare, no_plan
    queries, keys, needs = fp4_queries, fp4_keys, fp4_needs

    def key_layout(self, *, dtype: str, head_dim: int):
        return Mxfp4KeyLayout(head_dim=head_dim)
