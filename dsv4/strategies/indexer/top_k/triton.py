"""indexer.top_k=triton: our one-launch radix select with the page lookup fused in (dsv4/kernels/indexer/topk_lists.py)."""
from __future__ import annotations

from dataclasses import dataclass

from dsv4.strategies.protocols import Needs


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonTopK:
    name: str = "triton"

    def needs(self, device) -> Needs:
        # batch invariant: a token's list is its row's alone, the lower indices first among scores equal to
        # the k-th (the torch path on the CPU: a stable sort)
        return Needs(batch_invariant=True)

    def __call__(self, scores, counts, pages, token_request, *, topk: int, block_size: int):
        """scores [T, >= width] float32 (row t visible below counts[t]) -> (local [T, topk], slots [T, topk],
        lens [T]) int32, as `topk_lists` makes them."""
        from dsv4.kernels.indexer.topk_lists import topk_lists

        return topk_lists(scores, counts, pages, token_request, topk=topk, block_size=block_size)
