"""Sparse MQA with attention sink in Triton, reading the paged cache in place (mqa_kernel=triton_sparse):
the portable two-pass kernel, and the call that runs it or, where `plan_kernel` (sparse_plan.py) sends steps
on sm90 with fp8_ds_mla pages, the one-pass Hopper kernels (sparse_mqa_hopper.py, sparse_mqa_hopper_few.py),
which read and decode each row once.

Two passes, so that no program holds more than a [heads, rows] or a [heads, dims] tile (in plain Triton a one-pass
flash kernel owns a [heads, 512] float32 accumulator plus a decoded [rows, 512] tile: 255 registers,
spills, one program per SM):

1. `_scores_kernel`, one program per (block of BN index columns of a token's SWA or compressed list,
   token, head block): gathers the rows, Q·Kᵀ over 8 slices of 64 dims (each slice decoded to bf16 on
   its own, tensor-core dots), then the block's softmax in the log2 domain against the block's own
   maximum: p = 2^(s - m_blk) to a bf16 workspace, (m_blk, l_blk) to a float32 one. p <= 1 is rounded to
   bf16 as FlashMLA rounds P before P·V.
2. `_pv_kernel`, one program per (block of output dims, token, head block): merges the blocks'
   statistics into the token's maximum M and sum L, sink in the denominator, then walks the blocks:
   acc += (p · V[:, dims]) · 2^(m_blk - M), decoding only its own dims of each row (V = K).

The rows are read twice (keys, then values); p is written once and read once per block of dims, from
L2 (the programs of one token are launched next to each other). Prefill-sized steps go through the
workspace WORKSPACE_BYTES at a time.

Addressing: a row's 8 scale bytes are one int64 load per row, shifted per 64 dims (byte loads per
slice, widened through shared memory, stall the scores pass); the page size is a constexpr, so
slot -> (page, offset) is a shift for power-of-two pages instead of an integer division; P·V programs
whose dims hold no RoPE part (3 of 4) skip the bf16 loads. What was measured, and the designs not kept:
docs/notes/2026-11-29-two-pass-kernel.md.

Row decoding (docs/numerics.md §3.2): on GPUs that convert OCP e4m3 in hardware (NVIDIA sm89+) the bytes go
through that conversion; everywhere else (FNUZ bytes, A100, AMD) it is integer arithmetic, which needs
no fp8 hardware: an e4m3 byte's 7 magnitude bits shifted left by 7, with its sign moved to bit 15, are
an fp16 whose value is the e4m3 value times 2^-8 (OCP, bias 7) or 2^-7 (FNUZ, bias 8), subnormals
included; that factor goes into the row's power-of-two scale 2^(E-127). Either way the value is a
4-bit mantissa times a power of two, so its bf16 rounding is exact.

Under TRITON_INTERPRET=1 (CPU tests) the dots take the same bf16-rounded operands widened to float32:
the interpreter's bf16 `tl.dot` returns garbage (Triton 3.6-3.9 with NumPy 2), its float32 one is exact.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import triton
import triton.language as tl

from dsv4.formats.row_format import RowCode
from dsv4.kernels.launch import CompileCase, as_dense, as_f32, as_i32, dependent_start, launch
from dsv4.kernels.mqa.sparse_plan import (FIXED_LAUNCH, FIXED_SPLITS, FIXED_WORKSPACE_BYTES, READS, HopperLaunch,
                                          TwoPassLaunch, fixed_inline, hopper_group, hopper_splits, plan_kernel,
                                          plan_launch)
from dsv4.kernels.mqa.split_combine import finish
from dsv4.kernels.target import E4M3_SM, Target, gpu_launches_dependents, target_of
from dsv4.values.sizes import cdiv

if TYPE_CHECKING:
    from dsv4.values.seam import SparseKV

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)      # the same, inside kernels
# the row codes (RowFormat.code) the kernels branch on: bf16 rows, fp8_ds_mla records with OCP e4m3 NoPE bytes
# (the other they read: FNUZ bytes)
PLAIN, OCP = tl.constexpr(RowCode.PLAIN.value), tl.constexpr(RowCode.FP8_DS_MLA.value)
WORKSPACE_BYTES = 1 << 28      # the bf16 p workspace of one launch; longer steps run in token chunks
ML_BLOCKS = 32                 # list blocks whose maxima and sums the P·V pass combines at a time


@triton.jit
def _rows(slots, ok, BS: tl.constexpr, page_stride, LAYOUT: tl.constexpr, D: tl.constexpr):
    """Per row at `slots` [BN]: its offset (elements of a bf16 pool, bytes of an fp8_ds_mla record) and the
    byte offset of its 8 scale bytes (fp8_ds_mla; 0 for bf16 rows), which `_gather` loads as one int64."""
    slot = tl.where(ok, slots, 0)
    if LAYOUT == PLAIN:
        return slot.to(tl.int64) * D, tl.zeros_like(slot).to(tl.int64)
    page = (slot // BS).to(tl.int64)          # BS is a constexpr: a shift for power-of-two pages
    t = slot % BS
    return page * page_stride + t * (D + 64), page * page_stride + BS * (D + 64) + t * 8


@triton.jit
def _nope(u8, base, words, ok, d0, D: tl.constexpr, W: tl.constexpr, LAYOUT: tl.constexpr, NATIVE: tl.constexpr):
    """NoPE dims [d0, d0 + W) of fp8_ds_mla rows as float32 [BN, W] (0 past the NoPE dims and where not
    `ok`); each 64 dims take their scale byte from the row's `words`. NATIVE: OCP e4m3 bytes through the
    hardware conversion (sm89+); otherwise the integer decoding above."""
    d = d0 + tl.arange(0, W)
    byte = tl.load(u8 + base[:, None] + d[None, :], mask=(d < D - 64)[None, :] & ok[:, None], other=0)
    if NATIVE and LAYOUT == OCP:
        fix: tl.constexpr = 0
        value = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        fix: tl.constexpr = 8 if LAYOUT == OCP else 7
        b16 = byte.to(tl.uint16)
        value = (((b16 & 0x7F) << 7) | ((b16 & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    e = ((words >> (8 * (d0 // 64))) & 0xFF).to(tl.int32)
    scale = tl.broadcast_to((((e + fix) << 23).to(tl.float32, bitcast=True))[:, None], [e.shape[0], W])
    for g in tl.static_range(1, W // 64):
        e = ((words >> (8 * (d0 // 64 + g))) & 0xFF).to(tl.int32)
        scale = tl.where((d >= d0 + 64 * g)[None, :], (((e + fix) << 23).to(tl.float32, bitcast=True))[:, None],
                         scale)
    return value * scale


@triton.jit
def _slice(u8, bf, base, words, ok, d0, LAYOUT: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
           NATIVE: tl.constexpr):
    """Dims [d0, d0 + W) of the rows at `base` (from `_rows`) as bf16 [BN, W], zeros where not `ok`; d0
    and W multiples of 64."""
    d = d0 + tl.arange(0, W)
    if LAYOUT == PLAIN:
        rows = tl.load(bf + base[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    else:
        NOPE: tl.constexpr = D - 64
        rope = tl.load(bf + ((base + NOPE) // 2)[:, None] + (d - NOPE)[None, :],
                       mask=(d >= NOPE)[None, :] & ok[:, None], other=0.0)
        rows = tl.where((d < NOPE)[None, :], _nope(u8, base, words, ok, d0, D, W, LAYOUT, NATIVE),
                        rope.to(tl.float32)).to(tl.bfloat16)
    return rows


@triton.jit
def _gather(idx_ptr, cols, n, num_slots, w64, BS: tl.constexpr, page_stride, LAYOUT: tl.constexpr,
            D: tl.constexpr):
    """The slots at list columns `cols`, which of them are valid rows, their offsets and scale words."""
    slots = tl.load(idx_ptr + cols, mask=cols < n, other=-1)
    ok = (cols < n) & (slots >= 0) & (slots < num_slots)
    base, scl = _rows(slots, ok, BS, page_stride, LAYOUT, D)
    if LAYOUT == PLAIN:
        words = scl                                 # bf16 rows have no scales (zeros)
    else:
        words = tl.load(w64 + scl // 8, mask=ok, other=0)
    return ok, base, words


@triton.jit
def _score_block(q_ptr, p_ptr, ml_ptr, t, blk, heads, hmask, H, NC, NB, idx_ptr, lo, n, num_slots, u8, bf, w64,
                 BS: tl.constexpr, page_stride, qk_scale, LAYOUT: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                 DOT: tl.constexpr, NATIVE: tl.constexpr):
    """Q·Kᵀ for BN columns of a token's list, then the block's p and (max, sum) per head."""
    ok, base, words = _gather(idx_ptr, lo + tl.arange(0, BN), n, num_slots, w64, BS, page_stride, LAYOUT, D)
    qrow = (t.to(tl.int64) * H + heads) * D
    s = tl.zeros([heads.shape[0], BN], tl.float32)
    for j in tl.static_range(D // 64):
        dj = j * 64 + tl.arange(0, 64)
        qj = tl.load(q_ptr + qrow[:, None] + dj[None, :], mask=hmask[:, None], other=0.0).to(DOT)
        kj = _slice(u8, bf, base, words, ok, j * 64, LAYOUT, D, 64, NATIVE).to(DOT)
        s += tl.dot(qj, tl.trans(kj))
    s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
    m = tl.max(s, 1)
    p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
    prow = (t.to(tl.int64) * H + heads) * NC + blk * BN
    tl.store(p_ptr + prow[:, None] + tl.arange(0, BN)[None, :], p.to(tl.bfloat16), mask=hmask[:, None])
    mrow = ((t.to(tl.int64) * NB + blk) * H + heads) * 2
    tl.store(ml_ptr + mrow, m, mask=hmask)
    tl.store(ml_ptr + mrow + 1, tl.sum(p, 1), mask=hmask)


@triton.jit(do_not_specialize=["NB"])     # step sizes: one variant for all
def _scores_kernel(q_ptr, p_ptr, ml_ptr,
                   s_u8, s_bf, s_w64, s_idx, s_len, s_w, s_stride, s_slots,
                   e_u8, e_bf, e_w64, e_idx, e_len, e_w, e_stride, e_slots,
                   H, NC, NB, NBS, qk_scale,
                   S_LAYOUT: tl.constexpr, E_LAYOUT: tl.constexpr, S_BS: tl.constexpr, E_BS: tl.constexpr,
                   HAS_EXTRA: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr,
                   NATIVE: tl.constexpr, PDL: tl.constexpr = False):
    dependent_start(PDL)
    blk = tl.program_id(0)
    t = tl.program_id(1)
    heads = tl.program_id(2) * BH + tl.arange(0, BH)
    hmask = heads < H
    if blk < NBS:                                   # a block of the SWA list
        n = tl.minimum(tl.load(s_len + t), s_w)
        if blk * BN < n:
            _score_block(q_ptr, p_ptr, ml_ptr, t, blk, heads, hmask, H, NC, NB, s_idx + t.to(tl.int64) * s_w,
                         blk * BN, n, s_slots, s_u8, s_bf, s_w64, S_BS, s_stride, qk_scale, S_LAYOUT, BN, D, DOT,
                         NATIVE)
    elif HAS_EXTRA:                                 # a block of the compressed-cache list
        n = tl.minimum(tl.load(e_len + t), e_w)
        if (blk - NBS) * BN < n:
            _score_block(q_ptr, p_ptr, ml_ptr, t, blk, heads, hmask, H, NC, NB, e_idx + t.to(tl.int64) * e_w,
                         (blk - NBS) * BN, n, e_slots, e_u8, e_bf, e_w64, E_BS, e_stride, qk_scale, E_LAYOUT, BN,
                         D, DOT, NATIVE)


@triton.jit
def _pv_blocks(acc, p_ptr, ml_ptr, t, b0, nb, M_use, heads, hmask, H, NC, NB, idx_ptr, n, num_slots, u8, bf, w64,
               BS: tl.constexpr, page_stride, d0, LAYOUT: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
               DB: tl.constexpr, DOT: tl.constexpr, NATIVE: tl.constexpr, ROPE: tl.constexpr):
    """acc += Σ over the list's first nb blocks (workspace blocks b0..) of p · V[:, d0:d0+DB] · 2^(m_blk − M).
    ROPE: whether dims [d0, d0 + DB) reach the bf16 RoPE part (otherwise only e4m3 bytes are read)."""
    prow = (t.to(tl.int64) * H + heads) * NC
    for i in range(0, nb):
        ok, base, words = _gather(idx_ptr, i * BN + tl.arange(0, BN), n, num_slots, w64, BS, page_stride, LAYOUT, D)
        p = tl.load(p_ptr + prow[:, None] + ((b0 + i) * BN + tl.arange(0, BN))[None, :], mask=hmask[:, None],
                    other=0.0).to(DOT)
        if ROPE or LAYOUT == PLAIN:
            v = _slice(u8, bf, base, words, ok, d0, LAYOUT, D, DB, NATIVE).to(DOT)
        else:
            v = _nope(u8, base, words, ok, d0, D, DB, LAYOUT, NATIVE).to(tl.bfloat16).to(DOT)
        m = tl.load(ml_ptr + ((t.to(tl.int64) * NB + b0 + i) * H + heads) * 2, mask=hmask, other=float("-inf"))
        acc += tl.dot(p, v) * tl.exp2(m - M_use)[:, None]
    return acc


@triton.jit
def _pv_lists(p_ptr, ml_ptr, t, M_use, heads, hmask, H, NC, NB, NBS, d0, nb_s, nb_e, n_s, n_e,
              s_u8, s_bf, s_w64, s_idx, s_w, s_stride, s_slots, e_u8, e_bf, e_w64, e_idx, e_w, e_stride, e_slots,
              S_LAYOUT: tl.constexpr, E_LAYOUT: tl.constexpr, S_BS: tl.constexpr, E_BS: tl.constexpr,
              HAS_EXTRA: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DB: tl.constexpr,
              DOT: tl.constexpr, NATIVE: tl.constexpr, ROPE: tl.constexpr):
    """The token's SWA blocks, then its compressed-cache blocks, into one [BH, DB] accumulator."""
    acc = tl.zeros([BH, DB], tl.float32)
    acc = _pv_blocks(acc, p_ptr, ml_ptr, t, 0, nb_s, M_use, heads, hmask, H, NC, NB, s_idx + t.to(tl.int64) * s_w,
                     n_s, s_slots, s_u8, s_bf, s_w64, S_BS, s_stride, d0, S_LAYOUT, BN, D, DB, DOT, NATIVE, ROPE)
    if HAS_EXTRA:
        acc = _pv_blocks(acc, p_ptr, ml_ptr, t, NBS, nb_e, M_use, heads, hmask, H, NC, NB,
                         e_idx + t.to(tl.int64) * e_w, n_e, e_slots, e_u8, e_bf, e_w64, E_BS, e_stride, d0,
                         E_LAYOUT, BN, D, DB, DOT, NATIVE, ROPE)
    return acc


@triton.jit(do_not_specialize=["NB"])     # step sizes: one variant for all
def _pv_kernel(p_ptr, ml_ptr, sink_ptr, out_ptr, lse_ptr,
               s_u8, s_bf, s_w64, s_idx, s_len, s_w, s_stride, s_slots,
               e_u8, e_bf, e_w64, e_idx, e_len, e_w, e_stride, e_slots,
               H, NC, NB, NBS,
               S_LAYOUT: tl.constexpr, E_LAYOUT: tl.constexpr, S_BS: tl.constexpr, E_BS: tl.constexpr,
               HAS_EXTRA: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DB: tl.constexpr,
               NBC: tl.constexpr, DOT: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr = False):
    dependent_start(PDL)
    d0 = tl.program_id(0) * DB
    t = tl.program_id(1)
    heads = tl.program_id(2) * BH + tl.arange(0, BH)
    hmask = heads < H
    n_s = tl.maximum(tl.minimum(tl.load(s_len + t), s_w), 0)         # a negative length: no row
    nb_s = tl.cdiv(n_s, BN)
    if HAS_EXTRA:
        n_e = tl.maximum(tl.minimum(tl.load(e_len + t), e_w), 0)
    else:
        n_e = 0
    nb_e = tl.cdiv(n_e, BN)
    # the token's maximum and sum over the blocks the scores pass wrote, NBC of its own blocks at a time (its
    # SWA blocks, then its compressed ones: the same sums whatever the step's list widths)
    M = tl.full([BH], float("-inf"), tl.float32)
    L = tl.zeros([BH], tl.float32)
    for j0 in range(0, nb_s + nb_e, NBC):
        j = j0 + tl.arange(0, NBC)
        written = j < nb_s + nb_e
        b = tl.where(j < nb_s, j, NBS + j - nb_s)          # its workspace block
        mrow = ((t.to(tl.int64) * NB + b)[:, None] * H + heads[None, :]) * 2
        mb = tl.load(ml_ptr + mrow, mask=written[:, None] & hmask[None, :], other=float("-inf"))
        lb = tl.load(ml_ptr + mrow + 1, mask=written[:, None] & hmask[None, :], other=0.0)
        M_new = tl.maximum(M, tl.max(mb, 0))
        M_use = tl.where(M_new == float("-inf"), 0.0, M_new)
        L = L * tl.exp2(M - M_use) + tl.sum(lb * tl.exp2(mb - M_use[None, :]), 0)
        M = M_new
    M_use = tl.where(M == float("-inf"), 0.0, M)
    lists = (p_ptr, ml_ptr, t, M_use, heads, hmask, H, NC, NB, NBS, d0, nb_s, nb_e, n_s, n_e, s_u8, s_bf, s_w64, s_idx,
             s_w, s_stride, s_slots, e_u8, e_bf, e_w64, e_idx, e_w, e_stride, e_slots)
    if d0 + DB <= D - 64:                       # e4m3 dims only (3 of 4 programs at DB=128): no RoPE loads
        acc = _pv_lists(*lists, S_LAYOUT, E_LAYOUT, S_BS, E_BS, HAS_EXTRA, BH, BN, D, DB, DOT, NATIVE, False)
    else:
        acc = _pv_lists(*lists, S_LAYOUT, E_LAYOUT, S_BS, E_BS, HAS_EXTRA, BH, BN, D, DB, DOT, NATIVE, True)
    sink_l2 = tl.load(sink_ptr + heads, mask=hmask, other=0.0) * LOG2E_C
    row = t.to(tl.int64) * H + heads
    finish(acc, M, L, sink_l2, out_ptr + row[:, None] * D + (d0 + tl.arange(0, DB))[None, :],
           lse_ptr + row, hmask, hmask & (heads * 0 + d0 == 0))       # one dims block writes lse


class Pool(NamedTuple):
    """A PagedCache as the sparse MQA kernels read it."""
    code: int            # its row format's RowFormat.code, one of READS'
    block_size: int
    data: Any            # fp8_ds_mla: the uint8 pages; bf16: the rows
    bf16: Any            # fp8_ds_mla: the pages as bf16 (the RoPE dims); bf16: the rows
    words: Any           # fp8_ds_mla: the pages as int64 (the exponent words); bf16: the rows
    page_stride: int     # fp8_ds_mla: bytes per page; bf16: 0
    num_slots: int

    def args(self) -> tuple:
        """The kernels' pool arguments after the layout and block size, and before the index lists."""
        return self.data, self.bf16, self.words


def pool_args(cache) -> Pool:
    """A PagedCache as the kernels read it (its views made once, by its layout's row store, where it has one)."""
    import torch

    row = cache.layout.row_format
    if row not in READS:
        raise ValueError(f"mqa_kernel=triton_sparse reads {', '.join(f.label for f in READS)} rows, not "
                         f"{row.label} (cache {cache.name}); check() refuses this combination")
    code, data, store = row.code, cache.data, cache.store
    if store is not None:                  # the views its row stores write through, made once per cache
        return Pool(code, cache.block_size, *store.args())
    if code == RowCode.PLAIN:
        return Pool(code, cache.block_size, data, data, data, 0, cache.num_slots)
    return Pool(code, cache.block_size, data, data.view(torch.bfloat16), data.view(torch.int64), data.stride(0),
                cache.num_slots)


def sparse_mqa(q, kv: SparseKV, *, sink, scale: float, variant: str = "auto",
               two_pass: TwoPassLaunch = TwoPassLaunch(), hopper: HopperLaunch = HopperLaunch(),
               native_fp8: bool | None = None, target: Target | None = None):
    """q [T, H, D] -> (out [T, H, D] in q's dtype, lse [T, H] float32, natural log, sink excluded).

    `kv`: the caches (read in place through `pool_args`), each token's index lists [T, W] (int32, -1 padding)
    and lengths [T], and the step's runs. `variant` picks the kernel (plan_kernel): the one-pass Hopper kernels
    (sparse_mqa_hopper.py), launched as `hopper` says, or the portable two-pass one, launched as `two_pass`
    says (settings left at 0 come from `plan_launch`); `two_pass` set for a call the Hopper kernel runs is an
    error. `native_fp8`: decode OCP e4m3 with the hardware conversion; None = where the GPU has it (NVIDIA
    sm89+). `target`: the device's facts as the strategy prepared them (default: `target_of` q's device; with
    `fixed_order`, sparse_plan's FIXED_ launches whatever the step). With `kv.runs` (the SWA lists then
    windows, the extra lists `kv.extra_nested` prefixes or not) the Hopper kernel's programs of 8 heads take a
    run's tokens together and read the rows they share once; the two-pass kernel reads each token's lists
    alone."""
    import torch

    T, H, D = q.shape
    q = as_dense(q)
    tgt = target or target_of(q.device)
    native = tgt.native_e4m3 if native_fp8 is None else native_fp8
    interpret = tgt.interpret
    swa = pool_args(kv.swa)
    extra = pool_args(kv.extra) if kv.extra is not None else None
    kernel = plan_kernel(variant, arch=tgt.arch, layouts=(swa.code, (extra or swa).code), head_dim=D,
                         native=native, dtype=str(q.dtype).removeprefix("torch."))
    if kernel == "hopper" and two_pass != TwoPassLaunch():
        raise ValueError("sparse_mqa: block_n/block_h/block_d/num_warps/num_warps_pv set the two-pass kernel's "
                         f"launch, and variant={variant} runs the one-pass Hopper kernel here; pass "
                         "variant='two_pass'")
    sink = as_f32(sink)
    s_idx, s_len = as_i32(kv.swa_indices), as_i32(kv.swa_lens)
    e_idx, e_len = (as_i32(kv.extra_indices), as_i32(kv.extra_lens)) if extra is not None else (None, None)
    sw = s_idx.shape[1]
    ew = e_idx.shape[1] if extra is not None else 0
    if kernel == "hopper":
        from dsv4.kernels.mqa.sparse_mqa_hopper import prefetched_pools, sparse_mqa_hopper

        prefetch = prefetched_pools(swa, extra, tgt.l2_bytes)
        if tgt.fixed_order:      # every token's blocks in FIXED_SPLITS runs, one token a program (sparse_plan)
            splits = hopper.splits or FIXED_SPLITS
            step = max(1, FIXED_WORKSPACE_BYTES // (splits * H * (D + 2) * 4))
            parts = []
            for t0 in range(0, max(T, 1), step):           # token chunks: the split partials stay bounded
                sl = slice(t0, t0 + step)
                e_lists = (e_idx[sl], e_len[sl]) if extra is not None else (None, None)
                n = min(T, t0 + step) - t0
                inline = hopper.inline if hopper.inline is not None else fixed_inline(n, H, splits, tgt.processors)
                parts.append(sparse_mqa_hopper(q[sl], sink, scale * LOG2E, swa, s_idx[sl], s_len[sl], extra,
                                               *e_lists, splits=splits, prefetch=prefetch, nested=kv.extra_nested,
                                               inline=inline))
            return parts[0] if len(parts) == 1 else tuple(torch.cat(p) for p in zip(*parts))
        runs = kv.runs
        group = 1 if runs is None else (hopper.group or hopper_group(T, H, sw + ew, tgt.processors))
        return sparse_mqa_hopper(q, sink, scale * LOG2E, swa, s_idx, s_len, extra, e_idx, e_len,
                                 splits=hopper.splits or hopper_splits(T, H, sw + ew, tgt.processors, group=group),
                                 prefetch=prefetch, groups=runs.groups(group) if group > 1 else None,
                                 nested=kv.extra_nested, group=group)
    out = torch.empty_like(q)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    plan = FIXED_LAUNCH if tgt.fixed_order else plan_launch(T, H, sw + ew, tgt.processors)
    BN, BH, DB = two_pass.block_n or plan.block_n, two_pass.block_h or plan.block_h, two_pass.block_d or plan.block_d
    nbs, nbe = cdiv(sw, BN), cdiv(ew, BN)
    NB, NC = nbs + nbe, (nbs + nbe) * BN
    e, e_idx, e_len = (extra, e_idx, e_len) if extra is not None else (swa, s_idx, s_len)  # no extra: never read
    common = dict(S_LAYOUT=swa.code, E_LAYOUT=e.code, S_BS=swa.block_size, E_BS=e.block_size,
                  HAS_EXTRA=extra is not None, BN=BN, D=D,
                  NATIVE=native, DOT=tl.float32 if interpret else tl.bfloat16, PDL=tgt.pdl, launch_pdl=tgt.pdl)
    step = max(1, WORKSPACE_BYTES // (H * NC * 2))
    p = torch.empty(min(T, step) * H * NC, dtype=torch.bfloat16, device=q.device)
    ml = torch.empty(min(T, step) * NB * H * 2, dtype=torch.float32, device=q.device)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        pools = (*swa.args(), s_idx[t0:t1], s_len[t0:t1], sw, swa.page_stride, swa.num_slots,
                 *e.args(), e_idx[t0:t1], e_len[t0:t1], ew, e.page_stride, e.num_slots)
        launch(_scores_kernel, (NB, t1 - t0, cdiv(H, BH)), q[t0:t1], p, ml, *pools, H, NC, NB, nbs,
               scale * LOG2E, BH=BH, **common, num_warps=two_pass.num_warps, num_stages=1)
        launch(_pv_kernel, (D // DB, t1 - t0, cdiv(H, BH)), p, ml, sink, out[t0:t1], lse[t0:t1], *pools, H,
               NC, NB, nbs, BH=BH, DB=DB, NBC=ML_BLOCKS, **common,
               num_warps=two_pass.num_warps_pv or plan.num_warps_pv, num_stages=1)
    return out, lse


def compile_cases(gpu, rows=READS) -> list[CompileCase]:
    """Both passes as sparse_mqa launches them for a GPU (`gpu`: Triton's GPUTarget) reading pools of each
    format of `rows` (READS'): the planner's two launches (large steps, decode), SWA pages of 64 rows and
    compressed pages of 3, OCP e4m3 bytes through the hardware conversion where sparse_mqa takes it
    (NVIDIA sm89+)."""
    cases = []
    for row in rows:
        if row not in READS:
            raise ValueError(f"the sparse MQA kernels read {', '.join(f.label for f in READS)} rows, not {row.label}")
        code = row.code
        native = gpu.backend == "cuda" and gpu.arch >= E4M3_SM and code == RowCode.FP8_DS_MLA
        # fp8_ds_mla pages in their three views; bf16 pools pass their rows three times
        views = dict(u8="*u8", bf="*bf16", w64="*i64") if code != RowCode.PLAIN else dict.fromkeys(
            ("u8", "bf", "w64"), "*bf16")
        pools = {f"{p}_{v}": t for p in "se" for v, t in (*views.items(), ("idx", "*i32"), ("len", "*i32"))}
        ints = frozenset({"s_w", "e_w", "s_stride", "e_stride", "s_slots", "e_slots", "H", "NC"})
        for plan in (plan_launch(256, 64, 640, 132), plan_launch(1, 64, 640, 132)):
            const = dict(S_LAYOUT=code, E_LAYOUT=code, S_BS=64, E_BS=3, HAS_EXTRA=True, BH=plan.block_h,
                         BN=plan.block_n, D=512, DOT=tl.bfloat16, NATIVE=native, PDL=gpu_launches_dependents(gpu))
            cases.append(CompileCase(kernel=_scores_kernel, constexprs=const, divisible=ints,
                                     pointers={"q_ptr": "*bf16", "p_ptr": "*bf16", "ml_ptr": "*fp32", **pools},
                                     floats=frozenset({"qk_scale"})))
            cases.append(CompileCase(kernel=_pv_kernel, constexprs=dict(const, DB=plan.block_d, NBC=ML_BLOCKS),
                                     pointers={"p_ptr": "*bf16", "ml_ptr": "*fp32", "sink_ptr": "*fp32",
                                               "out_ptr": "*bf16", "lse_ptr": "*fp32", **pools},
                                     divisible=ints, num_warps=plan.num_warps_pv))
    return cases
