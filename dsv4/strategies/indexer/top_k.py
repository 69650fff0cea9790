"""How an indexer option's scores become the MQA kernel's lists on a GPU: its `top_k` setting
(`indexer.top_k=...`; the CPU path is torch.topk, dsv4/components/indexer.py, their specification).

- `triton`: our one-launch radix select (dsv4/kernels/topk_lists.py), the page lookup fused in.
- `flashinfer`: FlashInfer's `top_k_ragged_transform` (package flashinfer-python, CUDA; its kernels are
  compiled by FlashInfer's JIT on first use, which needs the CUDA toolkit) for the local indices, then
  our one-launch page lookup (`slot_lists`). Its deterministic mode with ties at the K-th score broken
  towards the lower index: the same set as `triton`'s, the same lists eager and replayed. (Its
  `top_k_page_table_transform` would fuse the lookup but reads a table of one slot per entry, which a
  step would have to build; on the H200 it was also slower than the ragged form.)

Both write valid entries first, so a list's length is its count of them; the order among them is each
kernel's own.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsv4.strategies.protocols import Needs


DEFAULT_TOP_K = "triton"        # the indexer options' top-k unless they say otherwise


PREFER_LOWER_INDEX = 1          # FlashInfer's TopKTieBreak for ties at the K-th score


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonTopK:
    name: str = DEFAULT_TOP_K

    def needs(self, device) -> Needs:
        return Needs()

    def __call__(self, scores, counts, pages, token_request, *, topk: int, block_size: int):
        """scores [T, >= width] float32 (row t visible below counts[t]) -> (local [T, topk], slots [T, topk],
        lens [T]) int32, as `topk_lists` makes them."""
        from dsv4.kernels.topk_lists import topk_lists

        return topk_lists(scores, counts, pages, token_request, topk=topk, block_size=block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class FlashInferTopK:
    name: str = "flashinfer"

    def needs(self, device) -> Needs:
        return Needs(platforms=frozenset({"cuda"}), modules=(("flashinfer", "flashinfer-python"),),
                     fix=f"indexer.top_k={DEFAULT_TOP_K}")

    def __call__(self, scores, counts, pages, token_request, *, topk: int, block_size: int):
        """As TritonTopK's call (FlashInfer reads contiguous rows: DeepGEMM's padded ones are read whole,
        no copy, each up to its count)."""
        import flashinfer
        import torch

        from dsv4.kernels.launch import as_i32, full_rows
        from dsv4.kernels.topk_lists import slot_lists

        T = scores.shape[0]
        if not T:
            local = torch.empty(0, topk, dtype=torch.int32, device=scores.device)
        else:
            local = flashinfer.top_k_ragged_transform(full_rows(scores), torch.zeros_like(counts, dtype=torch.int32),
                                                      as_i32(counts), topk, deterministic=True,
                                                      tie_break=PREFER_LOWER_INDEX)
        slots, lens = slot_lists(local, pages, token_request, block_size=block_size)
        return local, slots, lens


TOP_K = {s.name: s for s in (TritonTopK(), FlashInferTopK())}


def check_top_k(self) -> None:
    """The indexer options' `__post_init__`: their `top_k` names one of TOP_K."""
    if self.top_k not in TOP_K:
        raise ValueError(f"indexer={self.name}: top_k={self.top_k!r} is not one of {tuple(TOP_K)}")
