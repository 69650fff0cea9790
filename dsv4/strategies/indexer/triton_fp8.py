"""indexer=triton_fp8: `deepgemm_fp8`'s keys and queries (fp8 records, e4m3 queries with their scales
folded into the head weights) scored by our Triton kernel, for GPUs without DeepGEMM: it multiplies the
queries with the records' e4m3 bytes on the tensor cores as they are stored (NVIDIA sm89+; elsewhere both
decoded to their bf16 values) and sums the exact products in float32 -- on the H200 bit for bit what
`fp4_sim`'s bf16 values give."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.strategies.indexer.common import fp4_keys, fp4_needs, fp4_queries, no_plan, triton_prepare
from dsv4.strategies.indexer.key_layouts import Fp8KeyLayout, e4m3_queries
from dsv4.strategies.indexer.top_k import DEFAULT_TOP_K, check_top_k


def triton_fp8_scores(q, w, keys, pages, token_request, counts, *, width: int, w_scale: float, plan=None,
                      prepared=None):
    """The step's scores by our Triton kernel (dsv4/kernels/indexer_logits.py): e4m3 queries, their scales
    in the head weights, against the fp8 records as stored (no per-step plan)."""
    from dsv4.kernels.indexer_logits import indexer_logits

    q8, wq = e4m3_queries(q, w, w_scale)
    return indexer_logits(q8, wq, keys, pages, token_request, counts, width=width, target=prepared)


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonFp8Indexer:
    """fp4_sim's queries and keys; keys stored as Fp8KeyLayout records, scored by our Triton kernel (e4m3
    queries as deepgemm_fp8's)."""
    name: str = "triton_fp8"
    top_k: str = DEFAULT_TOP_K                # how the scores become lists on a GPU (top_k.TOP_K)
    __post_init__ = check_top_k
    # the exact values of fp4_sim's queries and keys, their exact products summed in float32 (the e4m3
    # tensor cores' sums equal the bf16 ones' bit for bit on the H200: tests/test_gpu_layer.py)
    error_budget: ClassVar[float] = 0.0
    transforms: ClassVar[bool] = True
    fp4: ClassVar[bool] = True
    oracle_numerics: ClassVar[str] = "fp4"
    fp8_queries: ClassVar[bool] = True
    scores, prepare, plan = staticmethod(triton_fp8_scores), triton_prepare, no_plan
    queries, keys, needs = fp4_queries, fp4_keys, fp4_needs

    def key_layout(self, *, dtype: str, head_dim: int):
        return Fp8KeyLayout(head_dim=head_dim)
