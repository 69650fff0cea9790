"""The indexer's top-k as the MQA kernel's lists, in one launch from the scores: per token, the local
entry indices of its top min(K, visible) scores (visible: j < counts[t]), their global slots through the
request's block table (-1 for an entry without a page), -1 padded to K, and how many are valid.
dsv4.components.indexer (`Indexer.lists`, torch.topk) is the specification; here the valid entries come
in index order, not best first, and among entries tied at the K-th score the lowest indices are taken.

One program per token. Each score is mapped to a uint32 whose order is the float's, and the K-th largest
key is found by a radix select from the top, stopping as soon as the keys sharing the digits found so far
are exactly the ones still needed. A pass costs what its lanes do, whatever the row's width (on the H200
it is bound by its reduction and barrier, not by reading keys), so a row is searched over few keys held
in registers, two bits a pass, with a pass's four bin counts summed as one int64:

- a row of at most CAP visible entries is loaded once and searched whole, in the fewest lanes (CAP/4,
  CAP/2 or CAP) that hold it;
- a wider row is sampled (SAMPLE evenly spread entries): the sample's key of rank about 2K·SAMPLE/n is a
  threshold that about 2K of the row's keys reach. One pass writes the indices of the keys at or above
  it to scratch, in index order: the row is cut into one contiguous range per warp, so no step of the
  pass crosses warps. When there are K to CAP of them, they hold the top K and its ties, and are searched
  instead of the row. Otherwise (a row whose sample misleads, or one full of ties) the whole row is
  searched, streamed BLOCK columns at a time, RADIX bits a pass by histogram: the same result, slower.

The lists are written by a running prefix sum over the searched keys: every key above the K-th's found
prefix and the first ties at it. Rows of at most K visible entries take every entry. The measurements,
and the designs measured and left out: docs/notes/2026-12-01-indexer-top-k.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.launch import CompileCase, as_i32, dependent_start, launch, rows_dense
from dsv4.kernels.target import gpu_launches_dependents, target_of
from dsv4.values.sizes import cdiv, next_pow2

# H200, 128 rows (64 requests x 2 tokens) of 2,048, 16,384 and 32,768 columns, K = 512 (bench/tune_indexer.py)
BLOCK, RADIX, NUM_WARPS, SAMPLE, WARP_COLS = 2048, 4, 16, 2048, 128
# rows of at most NARROW columns take NARROW_WARPS, faster there than 16; wider rows keep 16
# (docs/notes/2026-12-01-indexer-top-k.md)
NARROW, NARROW_WARPS = 16384, 8
MIN_CAP = 4096          # rows up to this many entries are searched whole; a wider row's candidates fit here


@triton.jit
def _keys(scores_ptr, row, cols, live):
    """uint32 keys of scores[row, cols] in the floats' order (0 where not live: below every live key)."""
    x = tl.load(scores_ptr + row + cols, mask=live, other=0.0)
    b = x.to(tl.int32, bitcast=True)
    u = (b ^ ((b >> 31) | -2147483648)).to(tl.uint32, bitcast=True)     # negative: ~b; else b | sign
    return tl.where(live, u, 0)


@triton.jit
def _prefix_mask(bits):
    """The uint32 mask of the top `bits` bits (0 <= bits <= 32)."""
    one = tl.full([], 1, tl.int64)
    return ((one << 32) - (one << (32 - bits).to(tl.int64))).to(tl.uint32)


@triton.jit
def _next_digit(hist, thr, need, p: tl.constexpr, RADIX: tl.constexpr):
    """From the histogram of digit p of the keys sharing `thr`'s top RADIX·p bits: `thr` with digit p of
    the need-th largest key, the keys still needed among those sharing it, and whether that is all of them."""
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
def _select(u, live, need):
    """Radix select over keys held in registers, two bits a pass -> (thr: the top `bits` bits of the
    need-th largest live key, how many keys sharing them are taken, bits): 32 bits, fewer once the keys
    sharing them are all taken. A pass's four bin counts are one int64 sum (16-bit fields: at most 65,535 keys),
    and its digit is found by scalar arithmetic: one reduction a pass, no histogram. The passes are a loop,
    not unrolled: a lone program (a step of few tokens) runs with its code cold in the instruction cache,
    and unrolled passes made the kernel several times larger."""
    thr = tl.zeros([], tl.uint32)
    bits = tl.zeros([], tl.int32)
    whole = tl.zeros([], tl.int32)
    one = tl.full(u.shape, 1, tl.int64)
    while (whole == 0) & (bits < 32):
        sh = (30 - bits).to(tl.uint32)
        match = live & ((u & _prefix_mask(bits)) == thr)       # no shift by 32: that is undefined on a GPU
        h = tl.sum(tl.where(match, one << (((u >> sh) & 3).to(tl.int64) * 16), 0), 0)
        h3 = ((h >> 48) & 0xFFFF).to(tl.int32)
        h2 = ((h >> 32) & 0xFFFF).to(tl.int32)
        h1 = ((h >> 16) & 0xFFFF).to(tl.int32)
        h0 = (h & 0xFFFF).to(tl.int32)
        a2 = h3 + h2
        a1 = a2 + h1
        # the largest digit whose keys, with those above it, reach `need`
        d = tl.where(h3 >= need, 3, tl.where(a2 >= need, 2, tl.where(a1 >= need, 1, 0)))
        need -= tl.where(d == 3, 0, tl.where(d == 2, h3, tl.where(d == 1, a2, a1)))
        whole = (tl.where(d == 3, h3, tl.where(d == 2, h2, tl.where(d == 1, h1, h0))) == need).to(tl.int32)
        thr = thr | (d.to(tl.uint32) << sh)
        bits += 2
    return thr, need, bits


@triton.jit
def _select_row(scores_ptr, row, n, need, BLOCK: tl.constexpr, RADIX: tl.constexpr):
    """The radix select over a whole row of n keys (a wide row whose candidates did not hold its top K):
    RADIX bits a pass by histogram, each pass streaming the row BLOCK columns at a time."""
    thr = tl.zeros([], tl.uint32)
    bits = tl.zeros([], tl.int32)
    whole = tl.zeros([], tl.int32)
    for p in tl.static_range(32 // RADIX):
        if whole == 0:
            hist = tl.zeros([2 << RADIX], tl.int32)
            for c0 in range(0, n, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                hist += _digit_hist(_keys(scores_ptr, row, cols, cols < n), cols < n, thr, p, RADIX)
            thr, need, whole = _next_digit(hist, thr, need, p, RADIX)
            bits = RADIX * (p + 1)
    return thr, need, bits


@triton.jit
def _slots(pages_ptr, r, pages_stride, n_pages, cols, sel, BS):
    """Global slots of request r's entries `cols` where `sel`, through its table row: -1 for an entry
    without a page (or not selected)."""
    logical = cols // BS
    page = tl.load(pages_ptr + r * pages_stride + logical, mask=sel & (logical < n_pages), other=-1)
    return tl.where(page >= 0, page * BS + cols % BS, -1)


@triton.jit
def _write_lists(u, cols, live, thr, bits, need, taken, ties, out, out_slots, pages_ptr, r, pages_stride, n_pages,
                 BS):
    """Take the live keys above thr's top `bits` bits and the first `need - ties` sharing them; write their
    indices `cols` and slots after the `taken` already written. -> (taken, ties) after these keys."""
    uh = u & _prefix_mask(bits)
    eq = (live & (uh == thr)).to(tl.int32)
    sel = live & ((uh > thr) | ((eq > 0) & (ties + tl.cumsum(eq, 0) <= need)))     # bits 0: every live key
    pos = taken + tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(out + pos, cols, mask=sel)
    tl.store(out_slots + pos, _slots(pages_ptr, r, pages_stride, n_pages, cols, sel, BS), mask=sel)
    return taken + tl.sum(sel.to(tl.int32), 0), ties + tl.sum(eq, 0)


@triton.jit
def _compact(scores_ptr, row, n, lo, cand, ncand, CAP: tl.constexpr, NW: tl.constexpr, CW: tl.constexpr):
    """The row cut into NW contiguous ranges of `span` columns, one per warp: each warp writes the indices
    of its range's keys at or above lo, in order, from cand + w·seg (seg = min(span, CAP): past CAP of
    them the row is searched whole anyway), and their count to ncand[w]; no step crosses warps. -> seg."""
    span = tl.cdiv(tl.cdiv(n, NW), CW) * CW
    seg = tl.minimum(span, CAP)
    w = tl.arange(0, NW)
    c = tl.zeros([NW], tl.int32)
    for j0 in range(0, span, CW):
        cols = (w * span + j0)[:, None] + tl.arange(0, CW)[None, :]
        live = cols < n
        sel = live & (_keys(scores_ptr, row, cols, live) >= lo)
        pos = c[:, None] + tl.cumsum(sel.to(tl.int32), 1) - 1
        tl.store(cand + (w * seg)[:, None] + pos, cols, mask=sel & (pos < seg))
        c += tl.sum(sel.to(tl.int32), 1)
    tl.store(ncand + w, c)
    return seg


@triton.jit
def _search(scores_ptr, row, c, gather, cand, ncand, seg, K, out, out_slots, pages_ptr, r, pages_stride, n_pages, BS,
            L: tl.constexpr, NW: tl.constexpr):
    """The top K of c keys held in registers (L lanes): the row's first c columns, or (gather) its
    candidates, warp range after warp range; the lists written. -> how many were taken."""
    lanes = tl.arange(0, L)
    live = lanes < c
    cols = lanes
    if gather:
        src = tl.zeros([L], tl.int32) - 1
        acc = tl.zeros([], tl.int32)
        for w in tl.static_range(NW):
            cw = tl.load(ncand + w)
            src = tl.where((lanes >= acc) & (lanes < acc + cw), w * seg + lanes - acc, src)
            acc += cw
        cols = tl.load(cand + src, mask=src >= 0, other=0)
    u = _keys(scores_ptr, row, cols, live)
    zero = tl.zeros([], tl.int32)
    thr, need, bits = tl.zeros([], tl.uint32), K, zero
    if c > K:
        thr, need, bits = _select(u, live, K)
    taken, _ = _write_lists(u, cols, live, thr, bits, need, zero, zero, out, out_slots, pages_ptr, r, pages_stride,
                            n_pages, BS)
    return taken


@triton.jit
def _topk_lists_kernel(scores_ptr, row_stride, width, cnt_ptr, pages_ptr, pages_stride, n_pages, req_ptr, local_ptr,
                       slots_ptr, lens_ptr, cand_ptr, cand_stride, ncand_ptr, K, BS, BLOCK: tl.constexpr,
                       RADIX: tl.constexpr, KP: tl.constexpr, CAP: tl.constexpr, SAMPLE: tl.constexpr,
                       NW: tl.constexpr, CW: tl.constexpr, PDL: tl.constexpr = False):
    dependent_start(PDL)
    t = tl.program_id(0)
    row = t.to(tl.int64) * row_stride
    n = tl.minimum(tl.load(cnt_ptr + t), width)
    r = tl.load(req_ptr + t).to(tl.int64)
    out = local_ptr + t.to(tl.int64) * K
    out_slots = slots_ptr + t.to(tl.int64) * K
    cand = cand_ptr + t.to(tl.int64) * cand_stride
    ncand = ncand_ptr + t * NW
    gather = n > CAP                                # searched over its candidates
    c = n
    seg = tl.zeros([], tl.int32)
    if gather:
        # about 2K of the row's keys are at or above the sample's key of rank m
        picks = ((tl.arange(0, SAMPLE).to(tl.int64) * n) // SAMPLE).to(tl.int32)
        m = tl.minimum(tl.maximum((2 * K * SAMPLE) // n, 1), SAMPLE)
        lo, _, _ = _select(_keys(scores_ptr, row, picks, picks < n), picks < n, m)
        seg = _compact(scores_ptr, row, n, lo, cand, ncand, CAP, NW, CW)
        tl.debug_barrier()                          # the candidates and their counts seen by every thread
        c = tl.zeros([], tl.int32)
        for w in tl.static_range(NW):
            c += tl.load(ncand + w)
    if ((c >= K) & (c <= CAP)) | (n <= CAP):        # the top K and their ties are among these c keys
        if c <= CAP // 4:                           # a pass costs what its lanes do: the fewest that hold c
            taken = _search(scores_ptr, row, c, gather, cand, ncand, seg, K, out, out_slots, pages_ptr, r,
                            pages_stride, n_pages, BS, CAP // 4, NW)
        elif c <= CAP // 2:
            taken = _search(scores_ptr, row, c, gather, cand, ncand, seg, K, out, out_slots, pages_ptr, r,
                            pages_stride, n_pages, BS, CAP // 2, NW)
        else:
            taken = _search(scores_ptr, row, c, gather, cand, ncand, seg, K, out, out_slots, pages_ptr, r,
                            pages_stride, n_pages, BS, CAP, NW)
    else:                                           # a misleading sample, or a row full of ties: the whole row
        thr, need, bits = _select_row(scores_ptr, row, n, K, BLOCK, RADIX)
        taken = tl.zeros([], tl.int32)
        ties = tl.zeros([], tl.int32)
        for c0 in range(0, n, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            live = cols < n
            taken, ties = _write_lists(_keys(scores_ptr, row, cols, live), cols, live, thr, bits, need, taken, ties,
                                       out, out_slots, pages_ptr, r, pages_stride, n_pages, BS)
    cols = tl.arange(0, KP)
    pad = (cols >= taken) & (cols < K)
    tl.store(out + cols, tl.full([KP], -1, tl.int32), mask=pad)
    tl.store(out_slots + cols, tl.full([KP], -1, tl.int32), mask=pad)
    tl.store(lens_ptr + t, taken)


@triton.jit
def _slot_lists_kernel(local_ptr, pages_ptr, pages_stride, n_pages, req_ptr, slots_ptr, lens_ptr, K, BS,
                       KP: tl.constexpr, PDL: tl.constexpr = False):
    dependent_start(PDL)
    t = tl.program_id(0)
    cols = tl.arange(0, KP)
    local = tl.load(local_ptr + t.to(tl.int64) * K + cols, mask=cols < K, other=-1)
    valid = local >= 0
    r = tl.load(req_ptr + t).to(tl.int64)
    tl.store(slots_ptr + t.to(tl.int64) * K + cols, _slots(pages_ptr, r, pages_stride, n_pages, local, valid, BS),
             mask=cols < K)
    tl.store(lens_ptr + t, tl.sum(valid.to(tl.int32), 0))


def slot_lists(local, pages, token_request, *, block_size: int):
    """The rest of `topk_lists`' outputs from a selection made elsewhere: local [T, K] int32 (valid entries
    first, -1 padded), pages [B, P] int32, token_request [T] -> (slots [T, K] int32 through each token's
    table, -1 for padding or an entry without a page; lens [T] int32, the valid entries). One program per
    token, a programmatic dependent as `topk_lists`."""
    import torch

    T, K = local.shape
    buf = torch.empty(T * (K + 1), dtype=torch.int32, device=local.device)
    slots, lens = buf.split_with_sizes((T * K, T))
    slots = slots.view(T, K)
    if T:
        pages = as_i32(pages)
        pdl = target_of(local.device).pdl
        launch(_slot_lists_kernel, (T,), as_i32(local), pages, pages.stride(0), pages.shape[1], token_request, slots,
               lens, K, block_size, KP=next_pow2(max(K, 16)), PDL=pdl, launch_pdl=pdl)
    return slots, lens


def topk_lists(scores, counts, pages, token_request, *, topk: int, block_size: int, block: int = 0, radix: int = 0,
               num_warps: int = 0, cap: int = 0, sample: int = 0, warp_cols: int = 0):
    """scores [T, width] float32 (entries j < counts[t] visible, the rest never read; rows may be
    strided, as DeepGEMM pads them), counts [T] int32, pages [B, P] int32,
    token_request [T] -> (local [T, topk] int32, slots [T, topk] int32, lens [T] int32). Sync-free; one
    program per token, a programmatic dependent where the GPU launches them (Target.pdl); launch shapes left
    at 0 are the module's (`radix`, dividing 32, is the whole-row search's; `cap` at least 2·topk; cap and
    sample at most 65,535; cap, sample, block and warp_cols powers of two)."""
    import torch

    T, width = scores.shape
    dev = scores.device
    radix, sample = radix or RADIX, sample or SAMPLE
    nw = num_warps or (NARROW_WARPS if width <= NARROW else NUM_WARPS)
    block, cw = block or BLOCK, warp_cols or WARP_COLS
    cap = cap or max(MIN_CAP, next_pow2(4 * topk))
    if 32 % radix:
        raise ValueError(f"topk_lists: radix {radix} must divide 32")
    if not 2 * topk <= cap < 1 << 16 or sample >= 1 << 16 or any(v & (v - 1) for v in (cap, sample, block, cw)):
        raise ValueError(f"topk_lists: cap {cap} (2·topk to 65,535), sample {sample} (at most 65,535), block "
                         f"{block} and warp_cols {cw} must be powers of two")
    # one allocation: the candidates of rows wider than cap and their counts per warp (where some row may
    # need them), then the lists
    stride = nw * min(cdiv(cdiv(width, nw), cw) * cw, cap) if width > cap else 0
    c0 = T * (stride + (nw if stride else 0))
    buf = torch.empty(c0 + T * (2 * topk + 1), dtype=torch.int32, device=dev)
    cand, ncand, local, slots, lens = buf.split_with_sizes((T * stride, c0 - T * stride, T * topk, T * topk, T))
    local, slots = local.view(T, topk), slots.view(T, topk)
    if T:
        pages = as_i32(pages)
        scores = rows_dense(scores)
        pdl = target_of(dev).pdl
        launch(_topk_lists_kernel, (T,), scores, scores.stride(0), width, as_i32(counts), pages, pages.stride(0),
               pages.shape[1], token_request, local, slots, lens, cand if stride else buf, stride,
               ncand if stride else buf, topk, block_size, BLOCK=block, RADIX=radix, KP=next_pow2(max(topk, 16)),
               CAP=cap, SAMPLE=sample, NW=nw, CW=cw, PDL=pdl, launch_pdl=pdl, num_warps=nw)
    return local, slots, lens


def compile_cases(gpu) -> list[CompileCase]:
    """The top-k lists at both warp counts (K = 512), and the page lookup of a selection made elsewhere; as
    programmatic dependents on NVIDIA GPUs that launch them so."""
    pdl = gpu_launches_dependents(gpu)
    lists = {"local_ptr": "*i32", "pages_ptr": "*i32", "req_ptr": "*i64", "slots_ptr": "*i32", "lens_ptr": "*i32"}
    cases = [CompileCase(kernel=_topk_lists_kernel, constexprs=dict(BLOCK=BLOCK, RADIX=RADIX, KP=512, CAP=MIN_CAP,
                                                                    SAMPLE=SAMPLE, NW=nw, CW=WARP_COLS, PDL=pdl),
                         pointers={**lists, "scores_ptr": "*fp32", "cnt_ptr": "*i32", "cand_ptr": "*i32",
                                   "ncand_ptr": "*i32"},
                         divisible=frozenset({"width", "pages_stride", "cand_stride"}), num_warps=nw)
             for nw in (NARROW_WARPS, NUM_WARPS)]
    return cases + [CompileCase(kernel=_slot_lists_kernel, constexprs=dict(KP=512, PDL=pdl), pointers=lists,
                                divisible=frozenset({"pages_stride", "K"}))]
