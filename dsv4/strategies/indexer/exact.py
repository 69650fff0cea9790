"""indexer=exact: the queries and keys as the layer computes them (RoPE'd float32, keys stored in the
activation dtype): the indexer scores what the model's weights give, with no simulated quantization.
The published code also rounds the head weights and the scores to bf16; here both stay float32."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.strategies.indexer.common import no_plan, triton_prepare, plain_keys, triton_scores
from dsv4.strategies.indexer.top_k import DEFAULT_TOP_K, check_top_k
from dsv4.strategies.protocols import Needs


@dataclass(frozen=True, slots=True, kw_only=True)
class ExactIndexer:
    name: str = "exact"
    top_k: str = DEFAULT_TOP_K                # how the scores become lists on a GPU (top_k.TOP_K)
    __post_init__ = check_top_k
    error_budget: ClassVar[float] = 0.0
    transforms: ClassVar[bool] = False        # queries and keys are scored as the layer computes them
    fp4: ClassVar[bool] = False               # the transforms are the published FP4 ones (dsv4/kernels/fp4.py)
    oracle_numerics: ClassVar[str] = "exact"  # what the oracle recomputes the indexer with (oracle.py)
    fp8_queries: ClassVar[bool] = False       # its GPU kernel scores e4m3 queries, scales in the head weights

    scores, prepare, plan, key_layout = staticmethod(triton_scores), triton_prepare, no_plan, plain_keys

    def needs(self, device) -> Needs:
        return Needs()

    def queries(self, q, prepared=None):
        return q

    def keys(self, rows, prepared=None):
        return rows
