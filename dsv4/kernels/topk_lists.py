"""The indexer's top-k as the MQA kernel's lists, in one launch from the scores: per token, the local
entry indices of its top min(K, visible) scores (visible: j < counts[t]), their global slots through the
request's block table (-1 for an entry without a page), -1 padded to K, and how many are valid.
dsv4.components.indexer (`Indexer.lists`, torch.topk) is the specification; here the valid entries come
in index order, not best first, and among entries tied at the K-th score the lowest indices are taken.

One program per token, a radix select over the row (serving engines' top-k kernels do the same): each
score is mapped to a uint32 whose order is the float's, and the K-th largest key is found RADIX bits at a
time, from the top, by a histogram of the keys that share the digits found so far (32 / RADIX passes over
the row, read from L1/L2 after the first). A last pass takes every key above it and the first ties at
it, and writes the lists by a running prefix sum. Rows of at most K visible entries skip the search.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.launch import as_i32, launch, rows_dense

# H200, 128 rows (64 requests x 2 tokens) of 2,048 and 16,384 columns, K = 512 (bench/tune_indexer.py)
BLOCK, RADIX, NUM_WARPS = 2048, 4, 16


@triton.jit
def _keys(scores_ptr, row, cols, n):
    """uint32 keys of scores[row, cols] in the floats' order (0 past n: below every visible key)."""
    x = tl.load(scores_ptr + row + cols, mask=cols < n, other=0.0)
    b = x.to(tl.int32, bitcast=True)
    u = (b ^ ((b >> 31) | -2147483648)).to(tl.uint32, bitcast=True)     # negative: ~b; else b | sign
    return tl.where(cols < n, u, 0)


@triton.jit
def _topk_lists_kernel(scores_ptr, row_stride, width, cnt_ptr, pages_ptr, pages_stride, n_pages, req_ptr, local_ptr, slots_ptr,
                       lens_ptr, K, BS, BLOCK: tl.constexpr, RADIX: tl.constexpr):
    t = tl.program_id(0)
    row = t.to(tl.int64) * row_stride
    n = tl.minimum(tl.load(cnt_ptr + t), width)
    r = tl.load(req_ptr + t).to(tl.int64)
    NB: tl.constexpr = 1 << RADIX
    bins = tl.arange(0, 2 * NB)
    # the K-th largest key `thr`, and how many keys equal to it are taken (`need`)
    thr = tl.zeros([], tl.uint32)
    need = K
    if n > K:
        for p in tl.static_range(32 // RADIX):
            hist = tl.zeros([2 * NB], tl.int32)
            for c0 in range(0, n, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                u = _keys(scores_ptr, row, cols, n)
                if p == 0:
                    match = cols < n
                else:
                    match = (cols < n) & ((u >> (32 - RADIX * p)) == (thr >> (32 - RADIX * p)))
                digit = ((u >> (32 - RADIX * (p + 1))) & (NB - 1)).to(tl.int32)
                hist += tl.histogram(tl.where(match, digit, NB), 2 * NB)
            hist = tl.where(bins < NB, hist, 0)
            above = tl.sum(hist, 0) - tl.cumsum(hist, 0)                # keys of the prefix above each digit
            d = tl.max(tl.where(above + hist >= need, bins, -1), 0)      # the largest digit reaching `need`
            need -= tl.sum(tl.where(bins == d, above, 0), 0)
            thr = thr | (d.to(tl.uint32) << (32 - RADIX * (p + 1)))
    # take keys above thr and the first `need` equal to it; write their indices and slots in order
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    out = local_ptr + t.to(tl.int64) * K
    out_slots = slots_ptr + t.to(tl.int64) * K
    for c0 in range(0, n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        u = _keys(scores_ptr, row, cols, n)
        live = cols < n
        eq = (live & (u == thr)).to(tl.int32)
        sel = live & ((u > thr) | ((eq > 0) & (ties + tl.cumsum(eq, 0) <= need)))     # n <= K: thr 0, all
        pos = taken + tl.cumsum(sel.to(tl.int32), 0) - 1
        logical = cols // BS
        page = tl.load(pages_ptr + r * pages_stride + logical, mask=sel & (logical < n_pages), other=-1)
        tl.store(out + pos, cols, mask=sel)
        tl.store(out_slots + pos, tl.where(page >= 0, page * BS + cols % BS, -1), mask=sel)
        taken += tl.sum(sel.to(tl.int32), 0)
        ties += tl.sum(eq, 0)
    for c0 in range(0, K, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        pad = (cols >= taken) & (cols < K)
        tl.store(out + cols, tl.full([BLOCK], -1, tl.int32), mask=pad)
        tl.store(out_slots + cols, tl.full([BLOCK], -1, tl.int32), mask=pad)
    tl.store(lens_ptr + t, taken)


def topk_lists(scores, counts, pages, token_request, *, topk: int, block_size: int, block: int = 0, radix: int = 0,
               num_warps: int = 0):
    """scores [T, width] float32 (entries j < counts[t] visible, the rest never read; rows may be
    strided, as DeepGEMM pads them), counts [T] int32, pages [B, P] int32,
    token_request [T] -> (local [T, topk] int32, slots [T, topk] int32, lens [T] int32). Sync-free; one
    program per token; launch shapes left at 0 are the module's (RADIX must divide 32)."""
    import torch

    T, width = scores.shape
    dev = scores.device
    local = torch.empty(T, topk, dtype=torch.int32, device=dev)
    slots = torch.empty(T, topk, dtype=torch.int32, device=dev)
    lens = torch.empty(T, dtype=torch.int32, device=dev)
    radix = radix or RADIX
    if 32 % radix:
        raise ValueError(f"topk_lists: radix {radix} must divide 32")
    if T:
        pages = as_i32(pages)
        scores = rows_dense(scores)
        launch(_topk_lists_kernel, (T,), scores, scores.stride(0), width, as_i32(counts), pages, pages.stride(0),
               pages.shape[1], token_request, local, slots, lens, topk, block_size, BLOCK=block or BLOCK,
               RADIX=radix, num_warps=num_warps or NUM_WARPS)
    return local, slots, lens
