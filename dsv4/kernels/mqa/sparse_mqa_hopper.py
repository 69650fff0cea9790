"""Sparse MQA with sink in one pass on Hopper (sm90), in Gluon: mqa_kernel=triton_sparse variant=hopper,
which auto picks on fp8_ds_mla pages with bf16 queries (the portable two-pass kernel, sparse_mqa.py, reads
every row twice and writes P to memory in between).

One program per (token, 64 heads) (a call with at most 32 heads runs sparse_mqa_hopper_few.py's programs
of 8, 16 or 32 instead; sparse_plan.hopper_heads): 12 warps in three warp-specialized partitions that
hand blocks of 64 list rows to each other through shared memory and mbarriers (FlashMLA's sm90 sparse
decode structure):
- producer (4 warps): gathers a block's rows (7 x 64 e4m3 bytes, 64 bf16 RoPE dims, the 8 scale bytes as
  one int64) and decodes them, e4m3 x 2^(e-127) -> bf16, into one of two K buffers [64, 512], with the
  block's column bias (0, or -inf for an invalid row); in programs of 6 blocks or more, from pools larger
  than L2, it first asks L2 for the next block's rows (prefetch.global.L2, which holds no register), so
  that their loads, issued only once this block is decoded, find them there;
- WG0 (4 warps, the default partition): S = Q·Kᵀ (warpgroup MMA, Q and K in shared memory), the online
  softmax in the log2 domain, P rounded to bf16 (as FlashMLA rounds it) and α into shared memory for
  WG1, then O[:, :256] = O·α + P·V, V being the same K buffer; at the end the sink, lse and 1/denominator;
- WG1 (4 warps): O[:, 256:] = O·α + P·V.
Each row is read from memory once and decoded once. A step with fewer such programs than SMs (decode of
a few requests) cuts each (token, 64 heads) into S programs over equal runs of its list blocks
(sparse_plan.hopper_splits): each writes its unnormalized output and (max, sum) per head in float32,
and split_combine.py merges them, sink and lse included (docs/notes/2026-12-02-hopper-splits.md). Under
batch_invariant a large step takes the runs in turn in one program (`inline`): the runs but the last to the
workspace, the last one's O to shared memory (Q's, and the K buffer its last block did not use), merged
there in split_combine's order of operations, so that a token's bits do not depend on which way it ran.
Shared memory: Q 64 KB + 2 x 64 KB of K + 2 x 8 KB of P. Registers (the SM's 64K over 384 threads): WG0
192 (its half of O is 128 of them), WG1 160, producer 152; the producer loads four chunks before waiting
for a free buffer and the rest while decoding (all seven at once spill). A single 8-warp instruction
stream holds the [64, 512] accumulator beside a decoded tile and spills, and two consumer warp groups of
one register budget get their setmaxnreg ignored by ptxas: hence FlashMLA's split. The designs measured on
the way: docs/notes/2026-11-29-two-pass-kernel.md.

Gluon exposes what this needs and plain Triton does not: explicit shared-memory buffers, warp
specialization with per-partition register budgets, mbarriers, and asynchronous warpgroup MMAs reading
the K buffer both as Kᵀ and as V. Only NVIDIA sm90 runs warpgroup MMAs; sparse_plan.plan_kernel decides
when it runs. The Gluon API used is Triton 3.6's (the H200's) and compiles with 3.9 (CI's compile check).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dsv4.kernels.mqa import sparse_mqa_hopper_few as few
from dsv4.kernels.mqa.hopper_gluon import (BN, LOG2E_C, block_slots, cta_barrier, fence_async_shared, finish_heads,
                                       load_q, mbarrier, nblocks, smem_view, warpgroup_mma, warpgroup_mma_wait)
from dsv4.kernels.launch import CompileCase, launch
from dsv4.kernels.target import target_of
from dsv4.kernels.mqa.sparse_plan import hopper_heads
from dsv4.kernels.mqa.split_combine import combine_splits
from dsv4.values.sizes import cdiv

BH = gl.constexpr(64)      # heads per program: one warpgroup MMA's M
# 12 warps x 168 registers = the SM's 64K: WG1 160, the producer 152, WG0 the rest (192)
MAXNREG, WG1_REGS, PRODUCER_REGS = 168, 160, 152
# programs of at least this many blocks ask L2 for the next block's rows, from pools larger than L2: a
# shorter program cannot hide the extra requests, and rows L2 already holds gain nothing from them
# (docs/notes/2026-12-03-l2-prefetch.md)
PREFETCH_MIN_BLOCKS = gl.constexpr(6)


@gluon.jit
def _rows(idx_row, c0, n, num_slots, w64, page_stride, bs, D: gl.constexpr, blk: gl.constexpr):
    """List columns [c0, c0 + BN): which are valid rows, each row's byte offset and its 8 scale bytes
    (one int64). Invalid rows point at slot 0 and read as zeros."""
    r = c0 + gl.arange(0, BN, layout=gl.SliceLayout(1, blk))
    slots = gl.load(idx_row + r, mask=r < n, other=-1)
    ok = (r < n) & (slots >= 0) & (slots < num_slots)
    slot = gl.where(ok, slots, 0)
    page = (slot // bs).to(gl.int64)
    t = slot % bs
    words = gl.load(w64 + (page * page_stride + bs * (D + 64) + t * 8) // 8, mask=ok, other=0)
    return ok, page * page_stride + t * (D + 64), words


@gluon.jit
def _prefetch_rows(slots, w64, page_stride, num_slots, bs, D: gl.constexpr, pl: gl.constexpr):
    """Ask L2 for the rows at `slots` and their scale words (prefetch.global.L2: nothing waits, no register
    holds them): the five 128-byte lines a 576-byte row touches (it starts at 0 or 64 mod 128), then the
    line of its scale word. Invalid entries ask for slot 0's."""
    ok = (slots >= 0) & (slots < num_slots)
    slot = gl.where(ok, slots, 0)
    page = (slot // bs).to(gl.int64)
    r = slot % bs
    u8 = w64.to(gl.pointer_type(gl.int8), bitcast=True)
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, pl))
    off = gl.where((c < 5)[None, :], (page * page_stride + r * (D + 64))[:, None] + (gl.minimum(c, 4) * 128)[None, :],
                   (page * page_stride + bs * (D + 64) + r * 8)[:, None] + (c * 0)[None, :])
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [u8 + off], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _chunk(u8, base, ok, c: gl.constexpr, blk: gl.constexpr):
    """e4m3 bytes of dims 64c..64c+63 of the rows at `base` (zeros where not ok)."""
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, blk))
    return gl.load(u8 + base[:, None] + (64 * c + cols)[None, :], mask=ok[:, None], other=0)


@gluon.jit
def _put(kb, c: gl.constexpr, byte, words):
    """e4m3 chunk c (dims 64c..64c+63) of the block times its rows' 2^(e-127), as bf16 into K tile kb."""
    e = ((words >> (8 * c)) & 0xFF).to(gl.int32)
    scale = (e << 23).to(gl.float32, bitcast=True)
    v = byte.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]
    kb.slice(64 * c, 64, dim=1).store(v.to(gl.bfloat16))


@gluon.jit
def _producer(a, s_pf, e_pf, D: gl.constexpr, INLINE: gl.constexpr):
    """Worker, 4 warps: per block, gather the rows and decode them into K buffer j % 2 with the block's
    column bias (0, or -inf for an invalid row), then signal `full`. The first four 64-dim chunks are
    loaded before waiting for a free buffer; the rest are loaded while earlier ones are decoded (all
    seven in registers at once spill). INLINE: all the token's blocks, run after run."""
    (q_smem, k_smem, p_smem, bias_smem, alpha_smem, inv_smem, full, empty, p_ready, p_free, fin, t, h0, H,
     out_ptr, s_u8, s_bf, s_w64, s_idx, s_len, s_w, s_stride, s_slots, s_bs, e_u8, e_bf, e_w64, e_idx, e_len, e_w,
     e_stride, e_slots, e_bs, sp, S, T, acc_ptr) = a
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    if INLINE:
        n_s, n_e, nb_s, j0, j1 = nblocks(t, 0, 1, s_len, e_len, s_w, e_w)
    else:
        n_s, n_e, nb_s, j0, j1 = nblocks(t, sp, S, s_len, e_len, s_w, e_w)
    pl: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])       # [rows, 8 lines]
    # programs of PREFETCH_MIN_BLOCKS blocks or more ask L2 for block j + 1's rows while block j is decoded
    pf = (j1 - j0 >= PREFETCH_MIN_BLOCKS) & ((s_pf != 0) | (e_pf != 0))
    sl_next = block_slots(j0 + 1, gl.where(pf, j1, j0), t, nb_s, n_s, n_e, s_idx, s_w, e_idx, e_w,
                          gl.SliceLayout(1, pl))
    for i in range(j1 - j0):
        j = j0 + i
        if j >= nb_s:                       # a block of the compressed list
            u8, bf = e_u8, e_bf
            ok, base, words = _rows(e_idx + t.to(gl.int64) * e_w, (j - nb_s) * BN, n_e, e_slots, e_w64, e_stride,
                                    e_bs, D, blk)
        else:
            u8, bf = s_u8, s_bf
            ok, base, words = _rows(s_idx + t.to(gl.int64) * s_w, j * BN, n_s, s_slots, s_w64, s_stride, s_bs, D,
                                    blk)
        c0 = _chunk(u8, base, ok, 0, blk)
        c1 = _chunk(u8, base, ok, 1, blk)
        c2 = _chunk(u8, base, ok, 2, blk)
        c3 = _chunk(u8, base, ok, 3, blk)
        if pf:
            if j + 1 < nb_s:
                if s_pf != 0:
                    _prefetch_rows(sl_next, s_w64, s_stride, s_slots, s_bs, D, pl)
            elif e_pf != 0:
                _prefetch_rows(sl_next, e_w64, e_stride, e_slots, e_bs, D, pl)
            sl_next = block_slots(j + 2, j1, t, nb_s, n_s, n_e, s_idx, s_w, e_idx, e_w, gl.SliceLayout(1, pl))
        b = i % 2
        mbarrier.wait(empty.index(b), ((i // 2) & 1) ^ 1)     # both consumers are done with this buffer
        kb = k_smem.index(b)
        _put(kb, 0, c0, words)
        c4 = _chunk(u8, base, ok, 4, blk)
        _put(kb, 1, c1, words)
        c5 = _chunk(u8, base, ok, 5, blk)
        _put(kb, 2, c2, words)
        c6 = _chunk(u8, base, ok, 6, blk)
        _put(kb, 3, c3, words)
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, blk))
        rope = gl.load(bf + ((base + D - 64) // 2)[:, None] + cols[None, :], mask=ok[:, None], other=0.0)
        _put(kb, 4, c4, words)
        _put(kb, 5, c5, words)
        _put(kb, 6, c6, words)
        kb.slice(D - 64, 64, dim=1).store(rope)               # the RoPE dims as stored (bf16)
        bias_smem.index(b).store(gl.where(ok, 0.0, float("-inf")))
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(full.index(b), count=1)


@gluon.jit
def _wg1_blocks(a, i0, n, D: gl.constexpr):
    """WG1 over n blocks, the first the program's i0-th: O = O·α + P·V[:, 256:] from zero."""
    (q_smem, k_smem, p_smem, bias_smem, alpha_smem, inv_smem, full, empty, p_ready, p_free, fin, t, h0, H,
     out_ptr, s_u8, s_bf, s_w64, s_idx, s_len, s_w, s_stride, s_slots, s_bs, e_u8, e_bf, e_w64, e_idx, e_len, e_w,
     e_stride, e_slots, e_bs, sp, S, T, acc_ptr) = a
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    o = gl.zeros([BH, D // 2], gl.float32, o_l)
    for i in range(i0, i0 + n):
        b = i % 2
        mbarrier.wait(p_ready.index(b), (i // 2) & 1)
        o = o * alpha_smem.index(b).load(gl.SliceLayout(1, o_l))[:, None]
        o = warpgroup_mma(p_smem.index(b), k_smem.index(b).slice(D // 2, D // 2, dim=1), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        cta_barrier()
        mbarrier.arrive(empty.index(b), count=1)
        mbarrier.arrive(p_free.index(b), count=1)
    return o


@gluon.jit
def _second_half(a, sink_ptr, lse_ptr, ml_ptr, D: gl.constexpr, SPLIT: gl.constexpr, INLINE: gl.constexpr):
    """Worker, 4 warps: output dims 256..511. Per block: wait for WG0's P (shared memory) and α, then
    O = O·α + P·V[:, 256:]; at the end, WG0's 1/denominator. INLINE: each run's O to the workspace, the
    last one's to shared memory, then (once WG0 has stored the runs' (max, sum)) these dims merged."""
    (q_smem, k_smem, p_smem, bias_smem, alpha_smem, inv_smem, full, empty, p_ready, p_free, fin, t, h0, H,
     out_ptr, s_u8, s_bf, s_w64, s_idx, s_len, s_w, s_stride, s_slots, s_bs, e_u8, e_bf, e_w64, e_idx, e_len, e_w,
     e_stride, e_slots, e_bs, sp, S, T, acc_ptr) = a
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    if INLINE:
        one = gl.full([BH], 1.0, gl.float32, gl.SliceLayout(1, o_l))
        # the last run's O waits in the K buffer its last block did not use (the producer is done, WG0 on
        # the other one)
        n_s, n_e, nb_s, j0, nblk = nblocks(t, 0, 1, s_len, e_len, s_w, e_w)
        park = smem_view(k_smem.index(nblk % 2), gl.float32, [BH, D // 2], PARK)
        for r in range(S):
            n_s, n_e, nb_s, j0, j1 = nblocks(t, r, S, s_len, e_len, s_w, e_w)
            o = _wg1_blocks(a, j0, j1 - j0, D)
            if r < S - 1:
                _store_out(o, one, out_ptr, acc_ptr, t, h0, H, r, T, D // 2, D, o_l, True)
            else:
                park.store(o)
        cta_barrier()
        mbarrier.wait(fin, 0)                 # WG0 has stored every run's (max, sum)
        _merge_runs(acc_ptr, ml_ptr, park, sink_ptr, out_ptr, lse_ptr, t, h0, H, T, S, D // 2, D, False)
    else:
        n_s, n_e, nb_s, j0, j1 = nblocks(t, sp, S, s_len, e_len, s_w, e_w)
        o = _wg1_blocks(a, 0, j1 - j0, D)
        mbarrier.wait(fin, 0)
        _store_out(o, inv_smem.load(gl.SliceLayout(1, o_l)), out_ptr, acc_ptr, t, h0, H, sp, T, D // 2, D, o_l,
                   SPLIT)


MERGE_DIMS = gl.constexpr(32)     # output dims per step of the in-program merge
PARK = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))   # a run's O [64, 256] float32 in shared memory


@gluon.jit
def _merge_runs(acc_ptr, ml_ptr, park, sink_ptr, out_ptr, lse_ptr, t, h0, H, T, S, d0, D: gl.constexpr,
                LSE: gl.constexpr):
    """Token t's heads h0.., dims d0..d0+255, from its S runs (the first S - 1 in the workspace, the last in
    shared memory, `park`): split_combine's merge in its order of operations (the same bits as the split
    launch and _combine_kernel), lse where LSE."""
    ml_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    hl: gl.constexpr = gl.SliceLayout(1, ml_l)
    heads = h0 + gl.arange(0, BH, layout=hl)
    hmask = heads < H
    M = gl.full([BH], float("-inf"), gl.float32, hl)
    for s in range(0, S):
        part = (s * T + t).to(gl.int64) * H + heads
        M = gl.maximum(M, gl.load(ml_ptr + part * 2, mask=hmask, other=float("-inf")))
    M_use = gl.where(M == float("-inf"), 0.0, M)
    L = gl.zeros([BH], gl.float32, hl)
    for s in range(0, S):
        part = (s * T + t).to(gl.int64) * H + heads
        w = gl.exp2(gl.load(ml_ptr + part * 2, mask=hmask, other=float("-inf")) - M_use)
        L += gl.load(ml_ptr + part * 2 + 1, mask=hmask, other=0.0) * w
    has = L > 0
    m_fin = gl.where(has, M, 0.0)
    sink_l2 = gl.load(sink_ptr + heads, mask=hmask, other=0.0) * LOG2E_C
    denom = gl.where(has, L + gl.exp2(sink_l2 - m_fin), 1.0)
    row = t.to(gl.int64) * H + heads
    for c in gl.static_range(D // 2 // MERGE_DIMS):
        dims = d0 + c * MERGE_DIMS + gl.arange(0, MERGE_DIMS, layout=gl.SliceLayout(0, ml_l))
        acc = gl.zeros([BH, MERGE_DIMS], gl.float32, ml_l)
        for s in range(0, S - 1):
            part = (s * T + t).to(gl.int64) * H + heads
            w = gl.exp2(gl.load(ml_ptr + part * 2, mask=hmask, other=float("-inf")) - M_use)
            acc += gl.load(acc_ptr + part[:, None] * D + dims[None, :], mask=hmask[:, None], other=0.0) * w[:, None]
        part = ((S - 1) * T + t).to(gl.int64) * H + heads
        w = gl.exp2(gl.load(ml_ptr + part * 2, mask=hmask, other=float("-inf")) - M_use)
        acc += park.slice(c * MERGE_DIMS, MERGE_DIMS, dim=1).load(ml_l) * w[:, None]
        out = gl.where(has[:, None], acc / denom[:, None], 0.0)
        gl.store(out_ptr + row[:, None] * D + dims[None, :], out.to(gl.bfloat16), mask=hmask[:, None])
    if LSE:
        gl.store(lse_ptr + row, gl.where(has, (m_fin + gl.log2(gl.where(has, L, 1.0))) * 0.6931471805599453,
                                         float("inf")), mask=hmask)


@gluon.jit
def _store_out(o, inv, out_ptr, acc_ptr, t, h0, H, sp, T, d0, D: gl.constexpr, o_l: gl.constexpr,
               SPLIT: gl.constexpr):
    """Rows h0.. of token t's output, dims d0..d0+255: o x inv (1/denominator, 0 for an empty head); or,
    SPLIT, o as it is (float32) into split sp's partial output."""
    ho = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, o_l))
    do = d0 + gl.arange(0, D // 2, layout=gl.SliceLayout(0, o_l))
    if SPLIT:
        gl.store(acc_ptr + (((sp * T + t).to(gl.int64) * H + ho) * D)[:, None] + do[None, :], o,
                 mask=(ho < H)[:, None])
    else:
        gl.store(out_ptr + ((t.to(gl.int64) * H + ho) * D)[:, None] + do[None, :], (o * inv[:, None]).to(gl.bfloat16),
                 mask=(ho < H)[:, None])


@gluon.jit
def _wg0_blocks(a, qk_scale, i0, n, D: gl.constexpr):
    """WG0 over n blocks, the first the program's i0-th, from zero: S = Q·Kᵀ, the online softmax, P and α to
    WG1 through shared memory, O = O·α + P·V[:, :256]; returns (max, sum, O)."""
    (q_smem, k_smem, p_smem, bias_smem, alpha_smem, inv_smem, full, empty, p_ready, p_free, fin, t, h0, H,
     out_ptr, s_u8, s_bf, s_w64, s_idx, s_len, s_w, s_stride, s_slots, s_bs, e_u8, e_bf, e_w64, e_idx, e_len, e_w,
     e_stride, e_slots, e_bs, sp, S, T, acc_ptr) = a
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    m_i = gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    l_i = gl.zeros([BH], gl.float32, gl.SliceLayout(1, s_l))
    o = gl.zeros([BH, D // 2], gl.float32, o_l)
    for i in range(i0, i0 + n):
        b = i % 2
        ph = (i // 2) & 1
        mbarrier.wait(full.index(b), ph)
        kb = k_smem.index(b)
        s = warpgroup_mma(q_smem, kb.permute((1, 0)), gl.zeros([BH, BN], gl.float32, s_l), use_acc=False,
                          is_async=True)
        bias = bias_smem.index(b).load(gl.SliceLayout(0, s_l))
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = s * qk_scale + bias[None, :]
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        mbarrier.wait(p_free.index(b), ph ^ 1)                # WG1 is done with the P and α of block j - 2
        p_smem.index(b).store(p.to(gl.bfloat16))
        alpha_smem.index(b).store(alpha)
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(p_ready.index(b), count=1)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        o = warpgroup_mma(p_smem.index(b), kb.slice(0, D // 2, dim=1), o, is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        cta_barrier()
        mbarrier.arrive(empty.index(b), count=1)
    return m_i, l_i, o


@gluon.jit
def _first_half(q_ptr, sink_ptr, lse_ptr, ml_ptr, qk_scale, a, D: gl.constexpr, SPLIT: gl.constexpr,
                INLINE: gl.constexpr):
    """Default partition, 4 warps (WG0): Q into shared memory; its blocks (_wg0_blocks); then sink, lse,
    1/denominator for both halves. INLINE: each run's (max, sum) and O to the workspace (the last run's O
    to Q's shared memory), then these dims of the runs merged."""
    (q_smem, k_smem, p_smem, bias_smem, alpha_smem, inv_smem, full, empty, p_ready, p_free, fin, t, h0, H,
     out_ptr, s_u8, s_bf, s_w64, s_idx, s_len, s_w, s_stride, s_slots, s_bs, e_u8, e_bf, e_w64, e_idx, e_len, e_w,
     e_stride, e_slots, e_bs, sp, S, T, acc_ptr) = a
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    load_q(q_ptr, q_smem, t, 1, h0, H, BH, BH, D, blk)
    hs = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, s_l))
    if INLINE:
        one = gl.full([BH], 1.0, gl.float32, gl.SliceLayout(1, o_l))
        park = smem_view(q_smem, gl.float32, [BH, D // 2], PARK)      # the last run's O, once Q is read
        for r in range(S):
            n_s, n_e, nb_s, j0, j1 = nblocks(t, r, S, s_len, e_len, s_w, e_w)
            m_i, l_i, o = _wg0_blocks(a, qk_scale, j0, j1 - j0, D)
            finish_heads(m_i, l_i, hs, t, hs < H, r, T, H, sink_ptr, lse_ptr, ml_ptr, True)
            if r < S - 1:
                _store_out(o, one, out_ptr, acc_ptr, t, h0, H, r, T, 0, D, o_l, True)
            else:
                park.store(o)
        cta_barrier()
        mbarrier.arrive(fin, count=1)         # the runs' (max, sum) are stored: WG1 may merge
        _merge_runs(acc_ptr, ml_ptr, park, sink_ptr, out_ptr, lse_ptr, t, h0, H, T, S, 0, D, True)
    else:
        n_s, n_e, nb_s, j0, j1 = nblocks(t, sp, S, s_len, e_len, s_w, e_w)
        m_i, l_i, o = _wg0_blocks(a, qk_scale, 0, j1 - j0, D)
        inv = finish_heads(m_i, l_i, hs, t, hs < H, sp, T, H, sink_ptr, lse_ptr, ml_ptr, SPLIT)
        inv_smem.store(inv)
        cta_barrier()
        mbarrier.arrive(fin, count=1)
        _store_out(o, gl.convert_layout(inv, gl.SliceLayout(1, o_l)), out_ptr, acc_ptr, t, h0, H, sp, T, 0, D, o_l,
                   SPLIT)


@gluon.jit(do_not_specialize=["T", "S", "s_pf", "e_pf"])  # one variant for each SPLIT and INLINE
def _hopper_kernel(q_ptr, sink_ptr, out_ptr, lse_ptr,
                   s_u8, s_bf, s_w64, s_idx, s_len, s_w, s_stride, s_slots, s_bs,
                   e_u8, e_bf, e_w64, e_idx, e_len, e_w, e_stride, e_slots, e_bs,
                   acc_ptr, ml_ptr, T, S, H, qk_scale, s_pf, e_pf, D: gl.constexpr, WG1_REGS: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr, SPLIT: gl.constexpr, INLINE: gl.constexpr):
    gl.static_assert(D == 512)
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    t = gl.program_id(0)
    h0 = gl.program_id(1) * BH
    sp = gl.program_id(2)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, D], sh)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, D], sh)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BH, BN], sh)
    bias_smem = gl.allocate_shared_memory(gl.float32, [2, BN], vec)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [2, BH], vec)
    inv_smem = gl.allocate_shared_memory(gl.float32, [BH], vec)
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)            # WG0 and WG1
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)
    mbarrier.init(fin, count=1)
    a = (q_smem, k_smem, p_smem, bias_smem, alpha_smem, inv_smem, full, empty, p_ready, p_free, fin, t, h0, H,
         out_ptr, s_u8, s_bf, s_w64, s_idx, s_len, s_w, s_stride, s_slots, s_bs, e_u8, e_bf, e_w64, e_idx, e_len, e_w,
         e_stride, e_slots, e_bs, sp, S, T, acc_ptr)
    gl.warp_specialize([(_first_half, (q_ptr, sink_ptr, lse_ptr, ml_ptr, qk_scale, a, D, SPLIT, INLINE)),
                        (_second_half, (a, sink_ptr, lse_ptr, ml_ptr, D, SPLIT, INLINE)),
                        (_producer, (a, s_pf, e_pf, D, INLINE))],
                       [4, 4], [WG1_REGS, PRODUCER_REGS])


def prefetched_pools(swa, extra, l2_bytes: int) -> tuple[bool, bool]:
    """Which pools' rows (SWA's, the compressed list's: `pool_args`) the 64-head programs ask L2 for ahead of
    their loads: those larger than L2, whose rows come from DRAM; from a pool that L2 holds a prefetch only
    adds requests."""
    return swa.data.nbytes > l2_bytes, (extra or swa).data.nbytes > l2_bytes


def sparse_mqa_hopper(q, sink, scale_l2: float, swa, swa_idx, swa_len, extra=None,
                      extra_idx=None, extra_len=None, *, splits: int = 1, buffers: int = 0, prefetch=None,
                      groups=None, nested: bool = False, group: int = 1, inline: bool = False):
    """(out [T, H, 512], lse [T, H]) like sparse_mqa's, for fp8_ds_mla (OCP) pools given as `pool_args`.
    sink: the sinks, float32 [H], contiguous; scale_l2: softmax scale x log2(e). Lists int32, contiguous.
    Programs of sparse_plan.hopper_heads(H) heads: 64 here, 8 to 32 in sparse_mqa_hopper_few.py (buffers:
    its K buffers, 0 = its BUFFERS). splits > 1: each (token, head block) is that many programs over
    equal runs of its blocks, merged by split_combine (sparse_plan.hopper_splits says how many fill the
    GPU); `inline` (64-head programs): one program a (token, head block) takes its S runs in turn and merges
    them itself, in split_combine's order (the same bits), where the split programs would not fit on the GPU
    at once (sparse_plan.fixed_inline). prefetch: (SWA, compressed) whether the 64-head programs of
    PREFETCH_MIN_BLOCKS blocks or more ask L2 for the next block's rows of that pool; None:
    `prefetched_pools` on q's device.
    group > 1 (programs of at most 32 heads): program p takes the tokens of group p (`groups` [T, 2] int32,
    QueryRuns.groups(group): its first token and how many) and reads the union of their lists once: their
    SWA lists must be windows of consecutive positions, their compressed lists prefixes of the last one's
    (`nested`, a dense ratio's) or anything (each token's list in turn)."""
    import torch

    T, H, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    split = splits > 1
    acc = ml = lse                                  # unsplit: never written; split: one workspace for both
    if split:                                       # inline: the last run's O stays in shared memory
        n_acc = (splits - int(inline)) * T * H * D
        acc, ml = torch.empty(n_acc + splits * T * H * 2, dtype=torch.float32, device=q.device).split_with_sizes(
            (n_acc, splits * T * H * 2))
    e, e_idx, e_len = (extra, extra_idx, extra_len) if extra is not None else (swa, swa_idx, swa_len)
    e_w = e_idx.shape[1] if extra is not None else 0
    nh = hopper_heads(H)
    if group > 1 and (groups is None or nh * group > few.MAX_COLUMNS):
        raise ValueError(f"sparse_mqa_hopper: group={group} takes the groups of the step's runs and at most "
                         f"{few.MAX_COLUMNS} heads x tokens per program, here {nh} x {group}")
    if inline and (nh != BH or not split):
        raise ValueError(f"sparse_mqa_hopper: inline merges the splits of 64-head programs; here {nh} heads a "
                         f"program, splits={splits}")
    if nh == BH:
        if prefetch is None:
            prefetch = prefetched_pools(swa, e, target_of(q.device).l2_bytes)
        launch(_hopper_kernel, (T, cdiv(H, BH), 1 if inline else splits), q, sink, out, lse,
               *swa.args(), swa_idx, swa_len, swa_idx.shape[1], swa.page_stride, swa.num_slots, swa.block_size,
               *e.args(), e_idx, e_len, e_w, e.page_stride, e.num_slots, e.block_size,
               acc, ml, T, splits, H, scale_l2, int(prefetch[0]), int(prefetch[1]), D=D, WG1_REGS=WG1_REGS,
               PRODUCER_REGS=PRODUCER_REGS, SPLIT=split and not inline, INLINE=inline, num_warps=4, maxnreg=MAXNREG)
    else:
        launch(few._few_heads_kernel, (T, cdiv(H, nh), splits), q, sink, out, lse,
               swa.words, swa_idx, swa_len, swa_idx.shape[1], swa.page_stride, swa.num_slots, swa.block_size,
               e.words, e_idx, e_len, e_w, e.page_stride, e.num_slots, e.block_size,
               acc, ml, swa_len if group == 1 else groups, T, splits, H, scale_l2, NH=nh, D=D,
               NBUF=buffers or few.BUFFERS, PRODUCER_REGS=few.PRODUCER_REGS, SPLIT=split, G=group,
               NESTED=bool(nested), num_warps=4, maxnreg=few.MAXNREG)
    if split and not inline:
        combine_splits(acc, ml, sink, out, lse, splits)
    return out, lse


def compile_cases(gpu) -> list[CompileCase]:
    """The 64-head kernel as sparse_mqa_hopper launches it (sm90 only: `gpu` is not read) on fp8_ds_mla
    pools, SWA pages of 64 rows and compressed pages of 2 (a ratio-128 layer): whole programs, splits merged
    by split_combine, and splits merged inside the program, with its register split."""
    pointers = {"q_ptr": "*bf16", "sink_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "acc_ptr": "*fp32",
                "ml_ptr": "*fp32", **{f"{p}_{v}": t for p in "se" for v, t in (
                    ("u8", "*u8"), ("bf", "*bf16"), ("w64", "*i64"), ("idx", "*i32"), ("len", "*i32"))}}
    ints = frozenset({"s_w", "e_w", "s_stride", "e_stride", "s_slots", "e_slots", "H", "s_bs"})
    return [CompileCase(kernel=_hopper_kernel, constexprs=dict(D=512, WG1_REGS=WG1_REGS, PRODUCER_REGS=PRODUCER_REGS,
                                                               SPLIT=split, INLINE=inline),
                        pointers=pointers, floats=frozenset({"qk_scale"}), divisible=ints,
                        options=dict(maxnreg=MAXNREG))
            for split, inline in ((False, False), (True, False), (False, True))]
