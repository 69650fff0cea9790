"""indexer=triton_fp8: `deepgemm_fp8`'s keys and queries (fp8 records, e4m3 queries with their scales
folded into the head weights) scored by our Triton kernel, for GPUs without DeepGEMM: it multiplies the
queries with the records' e4m3 bytes on the tensor cores as they are stored (NVIDIA sm89+; elsewhere both
decoded to their bf16 values) and sums the exact products in float32 -- on the H200 bit for bit what
`fp4_sim`'s bf16 values give."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dsv4.formats.indexer_numerics import IndexerNumerics, QueryFormat
from dsv4.strategies.indexer.common import FP4_NEEDS, check_top_k, triton_scores
from dsv4.strategies.indexer.key_layouts import Fp8KeyLayout, e4m3_queries
from dsv4.strategies.indexer.top_k.triton import TritonTopK
from dsv4.strategies.protocols import Needs, TopKStrategy


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonFp8Indexer:
    """fp4_sim's queries and keys; keys stored as Fp8KeyLayout records, scored by our Triton kernel (e4m3
    queries as deepgemm_fp8's)."""
    name: str = "triton_fp8"
    top_k: TopKStrategy = field(default_factory=TritonTopK)     # how its scores become lists on a GPU
    # the exact values of fp4_sim's queries and keys, their exact products summed in float32 (the e4m3
    # tensor cores' sums equal the bf16 ones' bit for bit on the H200: tests/test_gpu_layer.py)
    error_budget: ClassVar[float] = 0.0
    numerics: ClassVar[IndexerNumerics] = IndexerNumerics.FP4
    query_format: ClassVar[QueryFormat] = QueryFormat.E4M3

    def __post_init__(self) -> None:
        check_top_k(self)

    def needs(self, device) -> Needs:
        return FP4_NEEDS

    def prepare(self, *, head_dim: int, device, batch_invariant: bool = False):
        from dsv4.kernels.target import device_target

        return device_target(device, fixed_order=batch_invariant)

    def key_layout(self, *, dtype: str, head_dim: int) -> Fp8KeyLayout:
        return Fp8KeyLayout(head_dim=head_dim)

    def plan(self, *, token_request, counts, pages, block_size: int) -> None:
        return None

    def scores(self, q, w, keys, pages, token_request, counts, *, width: int, w_scale: float, plan=None,
               prepared=None):
        """Our Triton kernel: e4m3 queries, their scales in the head weights (w_scale folded in), against the
        fp8 records as stored."""
        q8, wq = e4m3_queries(q, w, w_scale)
        return triton_scores(q8, wq, keys, pages, token_request, counts, width=width, w_scale=1.0,
                             prepared=prepared)
