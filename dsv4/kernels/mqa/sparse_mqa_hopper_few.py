"""Sparse MQA with sink in one pass on Hopper (sm90) for a few heads per program (8, 16 or 32: a
tensor-parallel rank's share of DSV4's 64 or 128 heads), in Gluon; sparse_mqa_hopper.py takes more.

The 64-head kernel's products have the heads as the MMA's M, which is at least 64: at 8 heads it does the
work of 64, and its 4 decoding warps, squeezed to 152 registers beside two 64-head accumulators, wait on
one block's loads at a time. Here the products are transposed, so that the heads are the MMA's N (8 to 32)
and nothing is padded to 64:
    Sᵀ [64 rows, NH] = K [64, 512] · Qᵀ,    Oᵀ [512, NH] += Vᵀ [512, 64] · Pᵀ,
both operands from shared memory (K read as Kᵀ for the second), one warp group doing both, Oᵀ being
at most 128 of its registers. That leaves the registers to the 8 decoding warps, which software-pipeline
the gather: while block j is decoded into shared memory, block j + 1's rows (7 x 64 e4m3 bytes, the
bf16 RoPE dims, the scale word) are in flight, and block j + 2's list entries. Four e4m3 bytes at a time
are decoded by one inline PTX block (`_e4m3_to_bf16`), not byte by byte.
The numerics are the 64-head kernel's: e4m3 x 2^(e-127) -> bf16 rows, float32 scores, the online softmax
in the log2 domain, P rounded to bf16, the sink in the denominator; splits merge in split_combine.py.

What bounds it is the latency of the gather, not arithmetic or DRAM bandwidth: the loads in flight finish
later while the decoding stores rows into the K buffers or the MMAs read them, and each decoding thread
holds one block's loads at a time. The measurements, and the designs measured and not kept (rows staged by
cp.async, evict-first loads, Sᵀ from the decoding warps' registers, raw rows in shared memory, two MMA warp
groups at 32 heads, L2 prefetch, no K in shared memory, persistent programs):
docs/notes/2026-12-03-few-heads-designs.md.

G > 1: program p takes group p of the step's runs (QueryRuns.groups: up to G consecutive tokens of one
request, a decode step's MTP tokens), its columns the G x NH heads of its tokens, and reads the union of
their lists once: their SWA windows share all but a row per token, a ratio-128 layer's lists are nested
prefixes, a ratio-4 layer's top-k lists are read in turn. Each column's scores are masked to its own
token's part of the union. Groups come first in the grid, so that no SM waits behind programs with
nothing to do (docs/notes/2026-12-03-mtp-token-groups.md).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dsv4.kernels.launch import CompileCase
from dsv4.kernels.mqa.hopper_gluon import (BN, block_slots, cta_barrier, fence_async_shared, finish_heads, list_len,
                                       load_q, mbarrier, nblocks, warpgroup_mma, warpgroup_mma_wait)

# 12 warps x 168 registers = the SM's 64K: the 8 decoding warps 152, the MMA warp group the rest
MAXNREG, PRODUCER_REGS = 168, 152
PRODUCER_WARPS = gl.constexpr(8)
# K buffers: two (a third, where shared memory holds it beside 8 or 16 heads' Q, measured no faster:
# docs/notes/2026-12-03-few-heads-designs.md)
BUFFERS = 2
MAX_COLUMNS = 32     # heads x tokens of a program: Oᵀ [512, 32] float32 is 128 registers of its warp group


@gluon.jit
def _lists(t, n, sp, S, s_len, e_len, s_w, e_w, G: gl.constexpr, NESTED: gl.constexpr):
    """The lists the program reads: G == 1, token t's (hopper_gluon.nblocks); else the union of its group's
    (tokens t..t+n-1 of one run, QueryRuns.groups), each row once. The group's SWA lists are windows of
    consecutive positions: their union is the first token's first d entries, then the last token's list.
    Its compressed lists are NESTED prefixes of the last token's list, or else each token's list in turn.
    Returns the SWA union's d and length, the compressed union's length, the SWA blocks and the blocks
    [j0, j1) of split sp of S."""
    if G == 1:
        n_s, n_e, nb_s, j0, j1 = nblocks(t, sp, S, s_len, e_len, s_w, e_w)
        return 0, n_s, n_e, nb_s, j0, j1
    last = t + gl.maximum(n - 1, 0)
    la = list_len(s_len + t, s_w)
    lb = list_len(s_len + last, s_w)
    le = list_len(e_len + last, e_w)
    n_s = gl.where(n > 0, n - 1 + la, 0)
    if NESTED:
        n_e = gl.where(n > 0, le, 0)
    else:
        n_e = gl.where(n > 0, (n - 1) * e_w + le, 0)
    nb_s = gl.cdiv(n_s, BN)
    nblk = nb_s + gl.cdiv(n_e, BN)
    per = gl.cdiv(nblk, S)
    j0 = gl.minimum(sp * per, nblk)
    return n - 1 - (lb - la), n_s, n_e, nb_s, j0, gl.minimum(j0 + per, nblk)


@gluon.jit
def _slots(j, j1, t, n, s_d, n_s, n_e, nb_s, s_idx, s_w, e_idx, e_w, G: gl.constexpr, NESTED: gl.constexpr,
           rl: gl.constexpr):
    """List entries of block j of the program's lists (`_lists`); -1 past them and for j >= j1."""
    if G == 1:
        return block_slots(j, j1, t, nb_s, n_s, n_e, s_idx, s_w, e_idx, e_w, rl)
    r = gl.arange(0, BN, layout=rl)
    if j < nb_s:
        c = j * BN + r
        first = c < s_d
        row = gl.where(first, t, t + n - 1)
        col = gl.where(first, c, c - s_d)
        slots = gl.load(s_idx + row.to(gl.int64) * s_w + col, mask=(c < n_s) & (j < j1), other=-1)
    else:
        c = (j - nb_s) * BN + r
        if NESTED:
            row = t + n - 1 + 0 * c
            col = c
        else:
            row = t + c // gl.maximum(e_w, 1)
            col = c % gl.maximum(e_w, 1)
        slots = gl.load(e_idx + row.to(gl.int64) * e_w + col, mask=(c < n_e) & (j < j1), other=-1)
    return slots


@gluon.jit
def _lens(t, n, s_len, e_len, s_w, e_w, NH: gl.constexpr, G: gl.constexpr, cl: gl.constexpr):
    """Per column (head h of token k of the group, at k·NH + h): its token's SWA and compressed list
    lengths, 0 past the group's n tokens (`_visible` makes its columns of the unions from them)."""
    k = gl.arange(0, G * NH, layout=cl) // NH
    ok = k < n
    return list_len(s_len + t + k, s_w, ok), list_len(e_len + t + k, e_w, ok)


@gluon.jit
def _visible(s, j, nb_s, la, lk, ek, e_w, NH: gl.constexpr, NESTED: gl.constexpr, s_l: gl.constexpr):
    """Block j's scores s [rows, columns] where the row is in the column's token's list, -inf elsewhere:
    of the SWA union (`_lists`, la the first token's length), token k's columns k + la - l_k .. k + la;
    of the compressed one, 0 .. l_k (NESTED) or k·e_w .. k·e_w + l_k."""
    k = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_l)) // NH
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, s_l))
    if j < nb_s:
        hi = k + la
        lo = hi - lk
        c = j * BN + r
    else:
        lo = 0 * k if NESTED else k * e_w
        hi = lo + ek
        c = (j - nb_s) * BN + r
    return gl.where((c[:, None] >= lo[None, :]) & (c[:, None] < hi[None, :]), s, float("-inf"))


@gluon.jit
def _gather(j, nb_s, slots, s_w64, s_stride, s_slots, s_bs, e_w64, e_stride, e_slots, e_bs, D: gl.constexpr,
            wl: gl.constexpr, rl: gl.constexpr):
    """Issue block j's loads: which rows are valid, their scale words, the 7 chunks of 64 e4m3 bytes and the
    RoPE dims, all as 32-bit words (a tensor of bytes carried across iterations takes a register per
    byte). Zeros where not valid; nothing here waits for them."""
    if j < nb_s:
        w64, stride, num_slots, bs = s_w64, s_stride, s_slots, s_bs
    else:
        w64, stride, num_slots, bs = e_w64, e_stride, e_slots, e_bs
    u32 = w64.to(gl.pointer_type(gl.int32), bitcast=True)            # the same pages, 4 bytes at a time
    ok = (slots >= 0) & (slots < num_slots)
    slot = gl.where(ok, slots, 0)
    page = (slot // bs).to(gl.int64)
    r = slot % bs
    scales = gl.load(w64 + (page * stride + bs * (D + 64) + r * 8) // 8, mask=ok, other=0)
    w1 = (page * stride + r * (D + 64)) // 4           # the row's first word
    w, m = w1[:, None], ok[:, None]
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, wl))
    ropes = gl.arange(0, 32, layout=gl.SliceLayout(0, rl))
    rope = gl.load(u32 + gl.convert_layout(w1, gl.SliceLayout(1, rl))[:, None] + (D - 64) // 4 + ropes[None, :],
                   mask=gl.convert_layout(ok, gl.SliceLayout(1, rl))[:, None], other=0)
    return (ok, scales, gl.load(u32 + w + cols[None, :], mask=m, other=0),
            gl.load(u32 + w + (16 + cols)[None, :], mask=m, other=0),
            gl.load(u32 + w + (32 + cols)[None, :], mask=m, other=0),
            gl.load(u32 + w + (48 + cols)[None, :], mask=m, other=0),
            gl.load(u32 + w + (64 + cols)[None, :], mask=m, other=0),
            gl.load(u32 + w + (80 + cols)[None, :], mask=m, other=0),
            gl.load(u32 + w + (96 + cols)[None, :], mask=m, other=0), rope)


@gluon.jit
def _e4m3_to_bf16(byte, scale):
    """bf16(e4m3 byte x scale), scale float32 of the same shape: what Triton emits for
    .to(float8e4nv).to(float32) * scale -> bf16 (e4m3x2 -> f16x2 -> f32, one rounding), bit for bit, as one
    PTX block per 4 bytes, which take the 32-bit word they were loaded in: Triton's conversion extracts
    the bytes and packs them again (the decoding warps' loop: 681 -> 569 instructions per block at 8
    heads)."""
    return gl.inline_asm_elementwise(
        """{ .reg .b16 lo, hi; .reg .b32 h0, h1; .reg .f16 x0, x1, x2, x3; .reg .f32 a0, a1, a2, a3;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 h0, lo;
        cvt.rn.f16x2.e4m3x2 h1, hi;
        mov.b32 {x0, x1}, h0;
        mov.b32 {x2, x3}, h1;
        cvt.f32.f16 a0, x0;
        cvt.f32.f16 a1, x1;
        cvt.f32.f16 a2, x2;
        cvt.f32.f16 a3, x3;
        mul.f32 a0, a0, $3;
        mul.f32 a1, a1, $4;
        mul.f32 a2, a2, $5;
        mul.f32 a3, a3, $6;
        cvt.rn.bf16x2.f32 $0, a1, a0;
        cvt.rn.bf16x2.f32 $1, a3, a2; }""",
        "=r,=r,r,r,r,r,r", [byte, scale], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def _put(kb, c: gl.constexpr, w, scales, blk: gl.constexpr):
    """Chunk c (dims 64c..64c+63) of the block, 16 words of 4 e4m3 bytes per row, times its rows'
    2^(e-127), as bf16 into K tile kb."""
    b = gl.join(gl.join(w & 0xFF, (w >> 16) & 0xFF), gl.join((w >> 8) & 0xFF, (w >> 24) & 0xFF))
    b = gl.convert_layout(gl.reshape(b, [BN, 64]), blk)          # byte 4i + k of a row at column 4i + k
    e = ((scales >> (8 * c)) & 0xFF).to(gl.int32)
    scale = gl.convert_layout((e << 23).to(gl.float32, bitcast=True), gl.SliceLayout(1, blk))
    kb.slice(64 * c, 64, dim=1).store(_e4m3_to_bf16(b.to(gl.uint8),
                                                    gl.zeros([BN, 64], gl.float32, blk) + scale[:, None]))


@gluon.jit
def _put_rope(kb, w, D: gl.constexpr, blk: gl.constexpr):
    """The RoPE dims, 32 words of two bf16 per row, into K tile kb's last 64 columns as stored."""
    lo = (w << 16).to(gl.float32, bitcast=True)
    hi = (w & -65536).to(gl.float32, bitcast=True)
    v = gl.convert_layout(gl.reshape(gl.join(lo, hi), [BN, 64]), blk)
    kb.slice(D - 64, 64, dim=1).store(v.to(gl.bfloat16))


@gluon.jit
def _producer(a, D: gl.constexpr, NBUF: gl.constexpr, G: gl.constexpr, NESTED: gl.constexpr):
    """Worker, 8 warps: per block, decode the rows loaded one iteration earlier into K buffer i % NBUF,
    with the block's column bias (0, or -inf for an invalid row), after issuing the next block's loads
    and the list entries of the one after."""
    (q_smem, k_smem, p_smem, bias_smem, full, empty, t, h0, H, out_ptr, s_w64, s_idx, s_len,
     s_w, s_stride, s_slots, s_bs, e_w64, e_idx, e_len, e_w, e_stride, e_slots, e_bs, sp, S, T,
     acc_ptr, n) = a
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])     # [rows, 64 dims]
    wl: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [8, 1], [1, 0])       # [rows, 16 words]
    rl: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0])       # [rows, 32 words]
    il: gl.constexpr = gl.SliceLayout(1, wl)
    pools = (s_w64, s_stride, s_slots, s_bs, e_w64, e_stride, e_slots, e_bs)
    s_d, n_s, n_e, nb_s, j0, j1 = _lists(t, n, sp, S, s_len, e_len, s_w, e_w, G, NESTED)
    lists = (t, n, s_d, n_s, n_e, nb_s, s_idx, s_w, e_idx, e_w)
    sl = _slots(j0, j1, *lists, G, NESTED, il)
    ok, sc, c0, c1, c2, c3, c4, c5, c6, rope = _gather(j0, nb_s, sl, *pools, D, wl, rl)
    sl = _slots(j0 + 1, j1, *lists, G, NESTED, il)
    for i in range(j1 - j0):
        j = j0 + i
        ok_n, sc_n, n0, n1, n2, n3, n4, n5, n6, rope_n = _gather(j + 1, nb_s, sl, *pools, D, wl, rl)
        sl = _slots(j + 2, j1, *lists, G, NESTED, il)
        b = i % NBUF
        mbarrier.wait(empty.index(b), ((i // NBUF) & 1) ^ 1)      # the MMA warp group is done with it
        kb = k_smem.index(b)
        _put(kb, 0, c0, sc, blk)
        _put(kb, 1, c1, sc, blk)
        _put(kb, 2, c2, sc, blk)
        _put(kb, 3, c3, sc, blk)
        _put(kb, 4, c4, sc, blk)
        _put(kb, 5, c5, sc, blk)
        _put(kb, 6, c6, sc, blk)
        _put_rope(kb, rope, D, blk)
        bias_smem.index(b).store(gl.where(ok, 0.0, float("-inf")))
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(full.index(b), count=1)
        ok, sc, c0, c1, c2, c3, c4, c5, c6, rope = ok_n, sc_n, n0, n1, n2, n3, n4, n5, n6, rope_n


@gluon.jit
def _scores(kb, q_smem, NQ: gl.constexpr, s_l: gl.constexpr):
    """Issue Sᵀ = K·Qᵀ of K buffer kb (asynchronous; the caller waits)."""
    return warpgroup_mma(kb, q_smem.permute((1, 0)), gl.zeros([BN, NQ], gl.float32, s_l), use_acc=False,
                         is_async=True)


@gluon.jit
def _consumer(q_ptr, sink_ptr, lse_ptr, ml_ptr, qk_scale, a, NH: gl.constexpr, D: gl.constexpr,
              NBUF: gl.constexpr, SPLIT: gl.constexpr, G: gl.constexpr, NESTED: gl.constexpr):
    """Default partition, 4 warps (one warp group): Q into shared memory; per block Sᵀ = K·Qᵀ, the online
    softmax over the block's rows, Pᵀ to shared memory, Oᵀ = Oᵀ·α + Vᵀ·Pᵀ; then sink, lse, 1/denominator,
    and the output (or, SPLIT, the unnormalized output and (max, sum) per head). Only the max is reduced
    over each block's rows. G > 1: the columns are the heads of the group's tokens, each masked to its
    token's part of the union (`_visible`)."""
    (q_smem, k_smem, p_smem, bias_smem, full, empty, t, h0, H, out_ptr, s_w64, s_idx, s_len,
     s_w, s_stride, s_slots, s_bs, e_w64, e_idx, e_len, e_w, e_stride, e_slots, e_bs, sp, S, T,
     acc_ptr, n) = a
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    NQ: gl.constexpr = G * NH
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
    s_d, n_s, n_e, nb_s, j0, j1 = _lists(t, n, sp, S, s_len, e_len, s_w, e_w, G, NESTED)
    load_q(q_ptr, q_smem, t, n, h0, H, NH, NQ, D, blk)
    if G > 1:
        lk, ek = _lens(t, n, s_len, e_len, s_w, e_w, NH, G, gl.SliceLayout(0, s_l))
        la = list_len(s_len + t, s_w)
    m_i = gl.full([NQ], float("-inf"), gl.float32, gl.SliceLayout(0, s_l))
    # the running sums per row position of a block, summed over the rows once at the end: a sum over a
    # block's rows is a reduction across the warp group's 4 warps (shared memory and two barriers) on
    # this warp group's chain every block (docs/notes/2026-12-03-few-heads-designs.md)
    l_rows = gl.zeros([BN, NQ], gl.float32, s_l)
    o = gl.zeros([D, NQ], gl.float32, s_l)
    # 32 heads, where this warp group's chain is about as long as the gather: block i + 1's Sᵀ is issued
    # before block i's Oᵀ is waited for (past the last block, on a buffer that is not written any more;
    # its result is dropped). Fewer heads: measured no faster (docs/notes/2026-12-03-few-heads-designs.md);
    # 16 heads of two tokens: the early Sᵀ beside the group's lengths spills.
    AHEAD: gl.constexpr = NH == 32
    nb = j1 - j0
    if AHEAD:
        mbarrier.wait(full.index(0), 0, pred=nb > 0)
        s = _scores(k_smem.index(0), q_smem, NQ, s_l)
    for i in range(nb):
        b = i % NBUF
        if not AHEAD:
            mbarrier.wait(full.index(b), (i // NBUF) & 1)
            s = _scores(k_smem.index(b), q_smem, NQ, s_l)
        kb = k_smem.index(b)
        bias = bias_smem.index(b).load(gl.SliceLayout(1, s_l))
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = s * qk_scale + bias[:, None]
        if G > 1:
            s = _visible(s, j0 + i, nb_s, la, lk, ek, e_w, NH, NESTED, s_l)
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        l_rows = l_rows * alpha[None, :] + p
        m_i = m_new
        p_smem.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
        fence_async_shared()
        cta_barrier()
        o = warpgroup_mma(kb.permute((1, 0)), p_smem.permute((1, 0)), o * alpha[None, :], is_async=True)
        if AHEAD:
            b1 = (i + 1) % NBUF
            mbarrier.wait(full.index(b1), ((i + 1) // NBUF) & 1, pred=i + 1 < nb)
            s = _scores(k_smem.index(b1), q_smem, NQ, s_l)
            o = warpgroup_mma_wait(num_outstanding=1, deps=(o,))
        else:
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        cta_barrier()
        mbarrier.arrive(empty.index(b), count=1)
    if AHEAD:
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

    cols = gl.arange(0, NQ, layout=gl.SliceLayout(0, s_l))
    hs = h0 + cols % NH
    inv = finish_heads(m_i, gl.sum(l_rows, 0), hs, t + cols // NH, (cols // NH < n) & (hs < H), sp, T, H,
                       sink_ptr, lse_ptr, ml_ptr, SPLIT)
    o = o * inv[None, :]
    # Oᵀ [dims, columns] stored with each head's dims contiguous
    st: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
    o = gl.convert_layout(o, st)
    cols = gl.arange(0, NQ, layout=gl.SliceLayout(0, st))
    ho = h0 + cols % NH
    to = t + cols // NH
    ok = ((cols // NH < n) & (ho < H))[None, :]
    do = gl.arange(0, D, layout=gl.SliceLayout(1, st))
    if SPLIT:
        gl.store(acc_ptr + (((sp * T + to).to(gl.int64) * H + ho) * D)[None, :] + do[:, None], o, mask=ok)
    else:
        gl.store(out_ptr + ((to.to(gl.int64) * H + ho) * D)[None, :] + do[:, None], o.to(gl.bfloat16), mask=ok)


@gluon.jit(do_not_specialize=["T", "S"])     # step sizes and split counts: one variant for each SPLIT
def _few_heads_kernel(q_ptr, sink_ptr, out_ptr, lse_ptr,
                      s_w64, s_idx, s_len, s_w, s_stride, s_slots, s_bs,
                      e_w64, e_idx, e_len, e_w, e_stride, e_slots, e_bs,
                      acc_ptr, ml_ptr, groups_ptr, T, S, H, qk_scale, NH: gl.constexpr, D: gl.constexpr,
                      NBUF: gl.constexpr, PRODUCER_REGS: gl.constexpr, SPLIT: gl.constexpr,
                      G: gl.constexpr, NESTED: gl.constexpr):
    gl.static_assert(D == 512)
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    t = gl.program_id(0)
    n = 1
    if G > 1:             # program t takes group t: its first token and how many (none past the groups)
        n = gl.load(groups_ptr + 2 * t + 1)
        t = gl.load(groups_ptr + 2 * t)
    h0 = gl.program_id(1) * NH
    sp = gl.program_id(2)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [G * NH, D], sh)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, D], sh)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [G * NH, BN], sh)
    bias_smem = gl.allocate_shared_memory(gl.float32, [NBUF, BN], vec)
    full = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    a = (q_smem, k_smem, p_smem, bias_smem, full, empty, t, h0, H, out_ptr, s_w64, s_idx, s_len,
         s_w, s_stride, s_slots, s_bs, e_w64, e_idx, e_len, e_w, e_stride, e_slots, e_bs, sp, S, T,
         acc_ptr, n)
    gl.warp_specialize([(_consumer, (q_ptr, sink_ptr, lse_ptr, ml_ptr, qk_scale, a, NH, D, NBUF, SPLIT, G, NESTED)),
                        (_producer, (a, D, NBUF, G, NESTED))],
                       [PRODUCER_WARPS], [PRODUCER_REGS])


def compile_cases(gpu) -> list[CompileCase]:
    """The few-heads kernel as sparse_mqa_hopper launches it (sm90 only: `gpu` is not read), whole and split:
    8, 16 and 32 heads one token a program; a run's tokens up to 32 columns, compressed lists of each token in
    turn or nested."""
    pointers = {"q_ptr": "*bf16", "sink_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "acc_ptr": "*fp32",
                "ml_ptr": "*fp32", "groups_ptr": "*i32",
                **{f"{p}_{v}": t for p in "se" for v, t in (("w64", "*i64"), ("idx", "*i32"), ("len", "*i32"))}}
    ints = frozenset({"s_w", "e_w", "s_stride", "e_stride", "s_slots", "e_slots", "H", "s_bs"})
    return [CompileCase(kernel=_few_heads_kernel, constexprs=dict(NH=nh, D=512, NBUF=BUFFERS,
                                                                  PRODUCER_REGS=PRODUCER_REGS, SPLIT=split, G=g,
                                                                  NESTED=nested),
                        pointers=pointers, floats=frozenset({"qk_scale"}), divisible=ints,
                        options=dict(maxnreg=MAXNREG))
            for split in (False, True)
            for nh, g, nested in ((8, 1, False), (16, 1, False), (32, 1, False), (8, 2, False), (8, 2, True),
                                  (16, 2, False), (8, 4, True))]
