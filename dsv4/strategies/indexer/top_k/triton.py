"""indexer.top_k=triton: our one-launch radix select with the page lookup fused in (dsv4/kernels/topk_lists.py)."""
from __future__ import annotations

from dataclasses import dataclass

from dsv4.strategies.protocols import Needs


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonTopK:
    name: str = "triton"

    def needs(self, device) -> Needs:
        # on the CPU the indexer selects by a stable sort (the lower index first among equal scores)
        return Needs(batch_invariant=device.platform == "cpu",
                     variance="our radix select's choice among equal scores is not yet fixed")

    def __call__(self, scores, counts, pages, token_request, *, topk: int, block_size: int):
        """scores [T, >= width] float32 (row t visible below counts[t]) -> (local [T, topk], slots [T, topk],
        lens [T]) int32, as `topk_lists` makes them."""
        from dsv4.kernels.topk_lists import topk_lists

        return topk_lists(scores, counts, pages, token_request, topk=topk, block_size=block_size)
