"""The indexer's top-k as the MQA kernel's lists, in one launch from the scores: per token, the local
entry indices of its top min(K, visible) scores (visible: j < counts[t]), their global slots through the
request's block table (-1 for an entry without a page), -1 padded to K, and how many are valid.
dsv4.components.indexer (`Indexer.lists`, torch.topk) is the specification; here the valid entries come
in index order, not best first, and among entries tied at the K-th score the lowest indices are taken.

One program per token, a radix select over the row (serving engines' top-k kernels do the same): each
score is mapped to a uint32 whose order is the float's, and the K-th largest key is found RADIX bits at a
time, from the top, by a histogram of the keys that share the digits found so far. The search stops as
soon as the keys sharing the found digits are exactly the ones still needed (all of them are taken), so a
row of distinct scores rarely takes all 32 / RADIX passes (each reads the row, BLOCK columns at a time,
from L1/L2 after the first). A last pass takes every key above the found prefix and the first ties at it,
and writes the lists by a running prefix sum. Rows of at most K visible entries skip the search. (Holding
a row of up to 32k columns in registers for the whole search measured no faster on the H200, and slower
at 16k columns: the passes are bound by the histograms, not by reading the row.)
"""
from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.launch import as_i32, launch, next_pow2, rows_dense

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
def _prefix_mask(bits):
    """The uint32 mask of the top `bits` bits (0 <= bits <= 32)."""
    one = tl.full([], 1, tl.int64)
    return ((one << 32) - (one << (32 - bits).to(tl.int64))).to(tl.uint32)


@triton.jit
def _next_digit(hist, thr, need, p: tl.constexpr, RADIX: tl.constexpr):
    """From the histogram of digit p of the keys sharing `thr`'s top RADIX·p bits: `thr` with digit p of
    the K-th largest key, the keys still needed among those sharing it, and whether that is all of them."""
    NB: tl.constexpr = 1 << RADIX
    bins = tl.arange(0, 2 * NB)
    hist = tl.where(bins < NB, hist, 0)
    above = tl.sum(hist, 0) - tl.cumsum(hist, 0)                # keys of the prefix above each digit
    d = tl.max(tl.where(above + hist >= need, bins, -1), 0)      # the largest digit reaching `need`
    need -= tl.sum(tl.where(bins == d, above, 0), 0)
    whole = (tl.sum(tl.where(bins == d, hist, 0), 0) == need).to(tl.int32)
    return thr | (d.to(tl.uint32) << (32 - RADIX * (p + 1))), need, whole


@triton.jit
def _digit_hist(u, live, thr, p: tl.constexpr, RADIX: tl.constexpr):
    """The histogram (2·2^RADIX bins, the upper half unused) of digit p of the live keys sharing thr's
    top RADIX·p bits."""
    NB: tl.constexpr = 1 << RADIX
    if p == 0:
        match = live
    else:
        match = live & ((u >> (32 - RADIX * p)) == (thr >> (32 - RADIX * p)))
    digit = ((u >> (32 - RADIX * (p + 1))) & (NB - 1)).to(tl.int32)
    return tl.histogram(tl.where(match, digit, NB), 2 * NB)


@triton.jit
def _write_lists(u, cols, live, thr, mask, need, taken, ties, out, out_slots, pages_ptr, r, pages_stride, n_pages, BS):
    """Take the keys of `cols` above thr's prefix and the first `need - ties` equal to it; write their
    indices and slots after the `taken` already written. -> (taken, ties) after these columns."""
    uh = u & mask
    eq = (live & (uh == thr)).to(tl.int32)
    sel = live & ((uh > thr) | ((eq > 0) & (ties + tl.cumsum(eq, 0) <= need)))     # n <= K: mask 0, all
    pos = taken + tl.cumsum(sel.to(tl.int32), 0) - 1
    logical = cols // BS
    page = tl.load(pages_ptr + r * pages_stride + logical, mask=sel & (logical < n_pages), other=-1)
    tl.store(out + pos, cols, mask=sel)
    tl.store(out_slots + pos, tl.where(page >= 0, page * BS + cols % BS, -1), mask=sel)
    return taken + tl.sum(sel.to(tl.int32), 0), ties + tl.sum(eq, 0)


@triton.jit
def _pad_lists(out, out_slots, lens_ptr, t, taken, K, KP: tl.constexpr):
    cols = tl.arange(0, KP)
    pad = (cols >= taken) & (cols < K)
    tl.store(out + cols, tl.full([KP], -1, tl.int32), mask=pad)
    tl.store(out_slots + cols, tl.full([KP], -1, tl.int32), mask=pad)
    tl.store(lens_ptr + t, taken)


@triton.jit
def _topk_lists_kernel(scores_ptr, row_stride, width, cnt_ptr, pages_ptr, pages_stride, n_pages, req_ptr, local_ptr,
                       slots_ptr, lens_ptr, K, BS, BLOCK: tl.constexpr, RADIX: tl.constexpr, KP: tl.constexpr):
    t = tl.program_id(0)
    row = t.to(tl.int64) * row_stride
    n = tl.minimum(tl.load(cnt_ptr + t), width)
    r = tl.load(req_ptr + t).to(tl.int64)
    # the K-th largest key's top `bits` bits `thr`, and how many keys sharing them are taken (`need`)
    thr = tl.zeros([], tl.uint32)
    need = K
    bits = tl.zeros([], tl.int32)
    if n > K:
        whole = tl.zeros([], tl.int32)
        for p in tl.static_range(32 // RADIX):
            if whole == 0:
                hist = tl.zeros([2 << RADIX], tl.int32)
                for c0 in range(0, n, BLOCK):
                    cols = c0 + tl.arange(0, BLOCK)
                    hist += _digit_hist(_keys(scores_ptr, row, cols, n), cols < n, thr, p, RADIX)
                thr, need, whole = _next_digit(hist, thr, need, p, RADIX)
                bits = RADIX * (p + 1)
    mask = _prefix_mask(bits)
    out = local_ptr + t.to(tl.int64) * K
    out_slots = slots_ptr + t.to(tl.int64) * K
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for c0 in range(0, n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        taken, ties = _write_lists(_keys(scores_ptr, row, cols, n), cols, cols < n, thr, mask, need, taken, ties,
                                   out, out_slots, pages_ptr, r, pages_stride, n_pages, BS)
    _pad_lists(out, out_slots, lens_ptr, t, taken, K, KP)


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
               RADIX=radix, KP=next_pow2(max(topk, 16)), num_warps=num_warps or NUM_WARPS)
    return local, slots, lens
