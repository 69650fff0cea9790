"""indexer.top_k=flashinfer: FlashInfer's deterministic `top_k_ragged_transform` (package flashinfer-python,
CUDA), then our one-launch page lookup (`slot_lists`): the package docstring says why this form."""
from __future__ import annotations

from dataclasses import dataclass

from dsv4.strategies.protocols import Needs


PREFER_LOWER_INDEX = 1          # FlashInfer's TopKTieBreak for ties at the K-th score


@dataclass(frozen=True, slots=True, kw_only=True)
class FlashInferTopK:
    name: str = "flashinfer"

    def needs(self, device) -> Needs:
        return Needs(platforms=frozenset({"cuda"}), modules=(("flashinfer", "flashinfer-python"),),
                     variance="FlashInfer's top-k has not been shown to choose among equal scores alike in any step")

    def __call__(self, scores, counts, pages, token_request, *, topk: int, block_size: int):
        """As TritonTopK's call (FlashInfer reads contiguous rows: DeepGEMM's padded ones are read whole,
        no copy, each up to its count)."""
        import flashinfer
        import torch

        from dsv4.kernels.launch import as_i32, full_rows
        from dsv4.kernels.indexer.topk_lists import slot_lists

        T = scores.shape[0]
        if not T:
            local = torch.empty(0, topk, dtype=torch.int32, device=scores.device)
        else:
            local = flashinfer.top_k_ragged_transform(full_rows(scores), torch.zeros_like(counts, dtype=torch.int32),
                                                      as_i32(counts), topk, deterministic=True,
                                                      tie_break=PREFER_LOWER_INDEX)
        slots, lens = slot_lists(local, pages, token_request, block_size=block_size)
        return local, slots, lens
