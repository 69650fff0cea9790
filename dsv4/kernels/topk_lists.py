"""The indexer's top-k as the MQA kernel's lists, in one launch after `torch.topk`: per token, the local
entry indices (-1 where the score is -inf: not visible), their global slots through the request's block
table, and how many are valid (they come first: topk sorts best first). dsv4.components.indexer
(`Indexer.lists`, torch) is the specification.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _topk_lists_kernel(val_ptr, idx_ptr, k, pages_ptr, pages_stride, n_pages, req_ptr, local_ptr, slots_ptr,
                       lens_ptr, K, BS, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    have = cols < k
    v = tl.load(val_ptr + t.to(tl.int64) * k + cols, mask=have, other=float("-inf"))
    i = tl.load(idx_ptr + t.to(tl.int64) * k + cols, mask=have, other=0).to(tl.int32)
    ok = have & (v > float("-inf"))
    r = tl.load(req_ptr + t).to(tl.int64)
    logical = i // BS
    page = tl.load(pages_ptr + r * pages_stride + logical, mask=ok & (logical < n_pages), other=-1)
    ok_slot = ok & (page >= 0)
    out = cols < K
    tl.store(local_ptr + t.to(tl.int64) * K + cols, tl.where(ok, i, -1), mask=out)
    tl.store(slots_ptr + t.to(tl.int64) * K + cols, tl.where(ok_slot, page * BS + i % BS, -1), mask=out)
    tl.store(lens_ptr + t, tl.sum(ok.to(tl.int32), axis=0))


def topk_lists_kernel(values, indices, pages, token_request, *, topk: int, block_size: int):
    """values/indices [T, k] from torch.topk (k <= topk), pages [B, P] int32, token_request [T] ->
    (local [T, topk] int32, slots [T, topk] int32, lens [T] int32). Sync-free."""
    import torch

    T, k = values.shape
    dev = values.device
    local = torch.empty(T, topk, dtype=torch.int32, device=dev)
    slots = torch.empty(T, topk, dtype=torch.int32, device=dev)
    lens = torch.empty(T, dtype=torch.int32, device=dev)
    if T:
        _topk_lists_kernel[(T,)](values.contiguous(), indices.contiguous(), k, pages, pages.stride(0), pages.shape[1],
                                 token_request, local, slots, lens, topk, block_size,
                                 BLOCK=triton.next_power_of_2(max(topk, 1)), num_warps=4)
    return local, slots, lens
