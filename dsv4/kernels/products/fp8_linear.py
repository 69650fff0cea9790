"""The published fp8 linear in Triton (linear=triton_fp8): y = x·Wᵀ with e4m3 operands, one power-of-two
scale per 1×128 activation block and per 128×128 weight block, float32 sums -- what
`dsv4.formats.fp8_blocks.fp8_linear_reference` states in torch ops.

One program per (BN output columns, BM rows, part of K). It walks its K blocks of 128: a tensor-core e4m3
dot of the activation tile with the weight tile, scaled by the rows' and the block's scales, added in
float32; the loop is software-pipelined by Triton. Up to FEW_ROWS rows the dot is formed transposed (the
weight tile as the MMA's M, `swap`), so that Hopper's warpgroup MMA reads the weight from shared memory
rather than the rows being padded to its M of 64. The activation comes as e4m3 with its scales (made by
the kernel that produced it, e.g. the q_lora norm, or by `act_quant_fp8`), or in its own dtype: then up to
FEW_ROWS rows each program quantizes its tile as `act_quant` does (amax clamped at 1e-4, the scale
2^ceil(log2(amax · fp32(1/448))) from the float32 bits, x / scale clamped to ±448 and rounded to e4m3), so
a decode step's projection is one launch; above that `act_quant_fp8` quantizes the rows once first, since
every column program would redo it.

`plan` picks the launch from the step's rows: up to SMALL_M rows the weight's bytes are the cost, so K's
blocks are split over several programs per output tile until the GPU is full; each writes its float32
partial sums and the tile's last program to arrive adds them in split order (the same sums whichever
arrives last) and stores the tile. More rows take 64x256 tiles over the whole of K (64x128 on GPUs with
~100 KB of shared memory a program), split over K too where that many tiles would leave SMs idle.

On GPUs that launch kernels as programmatic dependents (Target.pdl) a program waits for the previous kernel
before it reads anything, and lets the next kernel launch once its sums are made, before it stores them (asking
L2 for its weight lines before the wait made the products slower: docs/notes/2026-12-07-few-request-levers.md).

Under TRITON_INTERPRET=1 (the CPU tests) the e4m3 rounding is written out in float32 arithmetic (the
interpreter's own conversion does not round to nearest), the dots take the e4m3 values widened to float32
(the products the tensor cores form exactly) and the result is stored as float32 and rounded by torch: the
interpreter's float32 -> bf16 conversion truncates.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsv4.kernels import FEW_ROWS
from dsv4.kernels.launch import CompileCase, as_dense, as_f32, dependent_start, launch
from dsv4.kernels.target import Target, gpu_launches_dependents, target_of
from dsv4.values.sizes import cdiv

BLOCK = 128


@triton.jit
def _e4m3_values(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, a tie to the even one, as float32: the
    conversion written with float32 adds (round to nearest even) at the e4m3 spacing of v's binade, 2^(E-3)
    for |v| in [2^E, 2^(E+1)), 2^-9 below 2^-6. For Triton's interpreter, whose e4m3 conversion does not
    round to nearest (it gives 16 for 31.625 and 18 for 17)."""
    bits = tl.abs(v).to(tl.int32, bitcast=True)
    E = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = ((E + 20 + 127) << 23).to(tl.float32, bitcast=True) * 1.5
    r = (tl.abs(v) + magic) - magic
    return tl.where(v < 0, -r, r)


@triton.jit
def quantize_rows(a, EMULATE: tl.constexpr):
    """a [BM, 128] float32 -> (e4m3 values [BM, 128], float32 power-of-two scales [BM]): act_quant. With
    EMULATE the values come back as float32 (exactly e4m3 values), else as e4m3."""
    amax = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-4)
    bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)      # biased exponent of the ceiling
    scale = (e << 23).to(tl.float32, bitcast=True)
    v = tl.clamp(a / scale[:, None], -448.0, 448.0)
    if EMULATE:
        q = _e4m3_values(v)
    else:
        q = v.to(tl.float8e4nv)
    return q, scale


@triton.jit
def part_sums(x_ptr, xs_ptr, xs_row, xs_col, w_ptr, ws_ptr, rows, cols, live, K, XK, kb0, kb1, BM: tl.constexpr,
              BN: tl.constexpr, QUANT: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr,
              SWAP: tl.constexpr = False):
    """The tile's float32 sums over K blocks kb0..kb1-1 of 128, from zero (x's rows XK apart): e4m3 dots
    scaled per block. With SWAP the dots are formed transposed, the weight tile as the MMA's M and the rows
    as its N (a warpgroup MMA reading the weight from shared memory, none of its M padded), and the sums
    transposed back."""
    k = tl.arange(0, 128)
    x_row = rows.to(tl.int64) * XK
    w_row = cols.to(tl.int64) * K
    ws_row = (cols // 128) * (K // 128)
    acc = tl.zeros([BN, BM] if SWAP else [BM, BN], tl.float32)
    for kb in tl.range(kb0, kb1, num_stages=STAGES):
        if QUANT:
            a = tl.load(x_ptr + x_row[:, None] + kb * 128 + k[None, :], mask=live[:, None], other=0.0)
            q, sa = quantize_rows(a.to(tl.float32), DOT == tl.float32)
        else:
            q = tl.load(x_ptr + x_row[:, None] + kb * 128 + k[None, :], mask=live[:, None], other=0.0)
            sa = tl.load(xs_ptr + rows.to(tl.int64) * xs_row + kb * xs_col, mask=live, other=0.0)
        b = tl.load(w_ptr + w_row[:, None] + kb * 128 + k[None, :])
        sb = tl.load(ws_ptr + ws_row + kb)
        if SWAP:
            acc += tl.dot(b.to(DOT), tl.trans(q.to(DOT))) * sa[None, :] * sb[:, None]
        else:
            acc += tl.dot(q.to(DOT), tl.trans(b.to(DOT))) * sa[:, None] * sb[None, :]
    return tl.trans(acc) if SWAP else acc


@triton.jit(do_not_specialize=["M", "xs_row", "xs_col"])      # step sizes: one compiled variant for all
def _fp8_linear_kernel(x_ptr, xs_ptr, xs_row, xs_col, w_ptr, ws_ptr, y_ptr, part_ptr, count_ptr, M, N, K,
                       BM: tl.constexpr,
                       BN: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr, DOT: tl.constexpr,
                       STAGES: tl.constexpr, INLINE: tl.constexpr = False, PDL: tl.constexpr = False,
                       SWAP: tl.constexpr = False):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    live = rows < M
    per = K // 128 // SPLIT
    if PDL:         # a programmatic dependent: wait for the kernel before it (whose rows it reads)
        gdc_wait()
    out = rows.to(tl.int64)[:, None] * N + cols[None, :]
    keep = live[:, None]
    if INLINE and SPLIT > 1:
        # all SPLIT parts in this program, each from zero, added in split order: the split launch's sums
        acc = tl.zeros([BM, BN], tl.float32)
        for s in range(SPLIT):
            acc += part_sums(x_ptr, xs_ptr, xs_row, xs_col, w_ptr, ws_ptr, rows, cols, live, K, K, s * per,
                             s * per + per, BM, BN, QUANT, DOT, STAGES, SWAP)
        if PDL:
            gdc_launch_dependents()
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=keep)
    else:
        acc = part_sums(x_ptr, xs_ptr, xs_row, xs_col, w_ptr, ws_ptr, rows, cols, live, K, K, split * per,
                        split * per + per, BM, BN, QUANT, DOT, STAGES, SWAP)
        if PDL:
            gdc_launch_dependents()
        store_tile(acc, y_ptr, part_ptr, count_ptr, pid_m * tl.num_programs(0) + pid_n, split, out, keep, M * N,
                   SPLIT)


@triton.jit
def store_tile(acc, y_ptr, part_ptr, count_ptr, tile, split, out, keep, part_stride, SPLIT: tl.constexpr):
    """A tile's float32 sums `acc` of part `split` of K: stored as they are when K is whole; else to the
    workspace (parts `part_stride` apart), and the tile's last program to finish adds the parts in split order
    (the same order whoever finishes last), stores the tile and resets its counter for the next call."""
    if SPLIT == 1:
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=keep)
    else:
        tl.store(part_ptr + split * part_stride + out, acc, mask=keep)
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT - 1:
            acc = tl.zeros(acc.shape, tl.float32)
            for s in range(SPLIT):
                acc += tl.load(part_ptr + s * part_stride + out, mask=keep, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=keep)
            tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, s_row, s_col, BM: tl.constexpr, EMULATE: tl.constexpr,
                      PDL: tl.constexpr = False):
    dependent_start(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    kb = tl.program_id(1)
    live = rows < M
    offs = rows.to(tl.int64)[:, None] * K + kb * 128 + tl.arange(0, 128)[None, :]
    q, scale = quantize_rows(tl.load(x_ptr + offs, mask=live[:, None], other=0.0).to(tl.float32), EMULATE)
    tl.store(q_ptr + offs, q.to(tl.float8e4nv), mask=live[:, None])      # exact: q holds e4m3 values
    tl.store(s_ptr + rows.to(tl.int64) * s_row + kb * s_col, scale, mask=live)


@dataclass(frozen=True, slots=True)
class LinearLaunch:
    block_m: int
    block_n: int
    split: int           # K's blocks split over this many programs per output tile (1: none)
    num_warps: int
    num_stages: int
    quantize_first: bool  # bf16/float32 x: quantized by its own launch first, not inside every program
    swap: bool = False    # the dots transposed: the weight tile is the MMA's M, the rows its N (`part_sums`)


FEW_PART_BLOCKS = 32         # a few-row program's most K blocks: longer parts leave the weight to too few programs
SMALL_M = 256                # up to this many rows a product reads its weight about once: bandwidth-bound
WIDE_N = 4096                # from this many columns 128-column tiles (fewer, longer programs) win up to SMALL_M rows
BIG_SHARED = frozenset({"sm90", "sm100", "sm103"})    # ~227 KB of shared memory a program: 64x256 tiles, 4 stages


@functools.lru_cache(maxsize=1024)
def plan(M: int, N: int, K: int, target: Target) -> LinearLaunch:
    """The launch for an [M, K] x [N, K]ᵀ product (bench/tune_triton.py linear).

    Up to FEW_ROWS rows: 16-row tiles, each program quantizing its activation tile itself (no launch before it),
    its dots transposed (`swap`: the weight tile as a warpgroup MMA's M, read from shared memory, rather than 16
    activation rows padded to it); 128 columns a tile where that gives a tile per SM, else 64, and K in the
    fewest parts of at most FEW_PART_BLOCKS blocks that give a program per SM (`split_for`), four stages where
    shared memory holds them. That form was the fastest of three plans in the layer replayed on the H100 at
    seven of eight points (DSV4-Flash and DSV4-Pro, 1 and 16 requests), ahead of 128-column tiles with K in the
    parts nearest one program per SM and of 16-row dots (docs/notes/2026-12-07-few-row-products.md). Up to
    SMALL_M rows the weight's bytes are still the cost: 32- or 64-row tiles of 64 columns (128 from WIDE_N), the
    activation quantized by its own launch (a program's share of the quantizing would outweigh it), K split into
    the parts that bring the programs nearest to one per SM (more parts only add partial sums to write and
    read); a product with a tile per SM already takes 128x64 tiles from 128 rows. More rows: 64x256 tiles over
    the whole of K (64x128 on GPUs with ~100 KB of shared memory a program), or -- where those tiles would leave
    SMs idle -- 64x128 tiles with K split to fill them. The choices are the fastest of a sweep on the H200 at
    DSV4-Flash's and DSV4-Pro's products (docs/notes/2026-12-04-fp8-products.md)."""
    big = target.arch in BIG_SHARED
    stages = 4 if big else 3
    if M > SMALL_M:
        wide = big and N % 256 == 0
        if cdiv(M, 64) * (N // (256 if wide else 128)) >= target.processors:
            return LinearLaunch(block_m=64, block_n=256 if wide else 128, split=1, num_warps=8 if wide else 4,
                                num_stages=stages, quantize_first=True)
        tiles = cdiv(M, 64) * (N // 128)
        split = split_for(tiles, K // BLOCK, 2 * target.processors) if tiles <= counter_slots(N) else 1
        return LinearLaunch(block_m=64, block_n=128, split=split, num_warps=4, num_stages=stages,
                            quantize_first=True)
    if M <= FEW_ROWS:
        bn = BLOCK if N // BLOCK >= target.processors else 64
        split = split_for(N // bn, K // BLOCK, target.processors, most_blocks=FEW_PART_BLOCKS)
        return LinearLaunch(block_m=16, block_n=bn, split=split, num_warps=4, num_stages=stages,
                            quantize_first=False, swap=True)
    bm = 32 if M <= 32 else 64
    bn = 128 if N >= WIDE_N and N % 128 == 0 else 64 if N % 64 == 0 else 32
    if M >= 128 and cdiv(M, 128) * (N // 64) >= target.processors and N % 64 == 0:
        return LinearLaunch(block_m=128, block_n=64, split=1, num_warps=4, num_stages=stages, quantize_first=True)
    tiles = cdiv(M, bm) * (N // bn)
    split = nearest_split(tiles, K // BLOCK, target.processors)
    return LinearLaunch(block_m=bm, block_n=bn, split=split, num_warps=4, num_stages=stages, quantize_first=True)


FIXED_M = 64       # rows per tile of fixed_plan's launch, the least of any under Target.fixed_order


@functools.lru_cache(maxsize=1024)
def fixed_plan(N: int, K: int, target: Target) -> LinearLaunch:
    """The launch of an [N, K] weight that fixes a row's sums for every row count (Target.fixed_order,
    batch_invariant=true; `fixed_launch` may widen its tile): FIXED_M-row tiles, the activation quantized
    by its own launch first, 128 columns a tile where that gives one per SM (else 64, or 32 for narrow N) and
    K split into the parts that bring one row tile's programs nearest to one per SM. The tile's rows and K's
    split fix the sums (the H200 gives other bits at 16, 32 and 64 rows a tile); no one choice is the fastest
    at every row count: 16-row tiles are 2x faster at one row and 2-3x slower from 64
    (docs/notes/2026-12-04-batch-invariance.md)."""
    big = target.arch in BIG_SHARED
    bn = 128 if N // 128 >= target.processors else (64 if N % 64 == 0 and N // 64 >= 8 else 32)
    return LinearLaunch(block_m=FIXED_M, block_n=bn, split=nearest_split(N // bn, K // BLOCK, target.processors),
                        num_warps=4, num_stages=4 if big else 3, quantize_first=True)


WGMMA_ARCHS = frozenset({"sm90"})     # 64-row tiles and up are warpgroup MMAs: the same sums in any of them


@functools.lru_cache(maxsize=1024)
def fixed_launch(M: int, N: int, K: int, target: Target) -> LinearLaunch:
    """`fixed_plan`'s K split for M rows, in `plan`'s tile where `plan` takes a warpgroup-MMA tile (64 rows or
    more, on WGMMA_ARCHS) over the whole of K: a row's sums there do not depend on the tile's rows or columns
    (the H200 gives the same bits in 64x64, 64x128, 64x256, 128x64 and 128x128 tiles at a given split), only
    on the split; a tile `plan` would split K for has too few programs at fixed_plan's split."""
    p = fixed_plan(N, K, target)
    q = plan(M, N, K, target)
    if target.arch in WGMMA_ARCHS and q.block_m >= FIXED_M and q.split == 1:
        return _launch_params(p, block_m=q.block_m, block_n=q.block_n, num_warps=q.num_warps,
                              num_stages=q.num_stages)
    return p


def _splits(k_blocks: int):
    """K's possible parts: the divisors of its blocks that leave each part at least 4 blocks."""
    return [s for s in range(1, k_blocks + 1) if k_blocks % s == 0 and k_blocks // s >= 4] or [1]


@functools.lru_cache(maxsize=1024)      # asked per call by the grouped few-token product
def nearest_split(tiles: int, k_blocks: int, want: int) -> int:
    """The part count that brings tiles x parts nearest to `want` programs (by ratio, the fewer on a tie)."""
    import math

    return min(_splits(k_blocks), key=lambda s: (abs(math.log(tiles * s / want)), s))


def split_for(tiles: int, k_blocks: int, want: int, *, most_blocks: int = 0) -> int:
    """The fewest parts of K's blocks (each at least 4 blocks, and at most `most_blocks` where given) that give
    `want` programs, or the most there are."""
    parts = [s for s in _splits(k_blocks) if not most_blocks or k_blocks // s <= most_blocks]
    parts = parts or _splits(k_blocks)[-1:]
    return next((s for s in parts if tiles * s >= want), parts[-1])


def counters(N: int, device):
    """The per-tile arrival counters a split product needs, zeroed once (each call leaves them zeroed): for
    any split launch `plan` makes for N columns."""
    import torch

    return torch.zeros(counter_slots(N), dtype=torch.int32, device=device)


def counter_slots(N: int) -> int:
    """How many per-tile counters a product of N columns keeps: room for the most tiles of any split launch
    `plan` makes (tiles of at least 16x32 up to 32 rows, 64x64 up to SMALL_M, 64x128 up to 2048 rows)."""
    return cdiv(SMALL_M, 32) * cdiv(N, 32)


def _launch_params(p: LinearLaunch, **given) -> LinearLaunch:
    from dataclasses import replace

    return replace(p, **{k: v for k, v in given.items() if v is not None})


def fp8_linear(x, w, ws, *, xs=None, out_dtype=None, target: Target | None = None, count=None,
               block_m: int | None = None, block_n: int | None = None, split: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None, quantize_first: bool | None = None,
               swap: bool | None = None, inline: bool | None = None):
    """x [M, K] (bf16/float32 activations; or e4m3 with its scales `xs` [M, K/128] float32, row- or
    block-major) times w [N, K] e4m3 with block scales ws [N/128, K/128] float32 -> y [M, N] in `out_dtype`
    (default: x's dtype; bf16 for e4m3 x): one launch, or two where the plan quantizes x first. `target`:
    the device's facts (default: x's device's; with `fixed_order`, `fixed_launch`'s, in launches of as many
    rows as its counters hold); `count`: the projection's `counters` (a split product's;
    made for the call when not given -- calls that may run at once on several streams need their own);
    the launch parameters override the plan; `inline`: whether a split launch's programs add its parts
    themselves, in split order (the same sums; None: under fixed_order where its tiles fill the GPU)."""
    import torch

    M, K = x.shape
    N = w.shape[0]
    fp8_x = x.dtype == torch.float8_e4m3fn
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 linear: w must be float8_e4m3fn (OCP e4m3), got {w.dtype}")
    if not fp8_x and x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8 linear: x must be bf16, fp16, float32 or (with xs) e4m3, got {x.dtype}")
    if fp8_x != (xs is not None):
        raise ValueError("fp8 linear: an e4m3 x comes with its scales xs, and only an e4m3 x")
    if K % BLOCK or N % BLOCK or tuple(w.shape) != (N, K) or tuple(ws.shape) != (N // BLOCK, K // BLOCK) \
            or (xs is not None and tuple(xs.shape) != (M, K // BLOCK)):
        raise ValueError(f"fp8 linear: x {tuple(x.shape)}, w {tuple(w.shape)}, ws {tuple(ws.shape)}"
                         f"{'' if xs is None else f', xs {tuple(xs.shape)}'}: expected K and N multiples of "
                         f"{BLOCK} and one scale per block")
    out_dtype = out_dtype or (torch.bfloat16 if fp8_x else x.dtype)
    tgt = target or target_of(x.device)
    y = torch.empty(M, N, dtype=torch.float32 if tgt.interpret else out_dtype, device=x.device)
    if M == 0:
        return y.to(out_dtype)
    if tgt.fixed_order:          # one split of K for every row count
        p = fixed_launch(M, N, K, tgt)
    else:
        p = plan(M, N, K, tgt)                   # a step's plan is computed once, then looked up
    given = dict(block_m=block_m, block_n=block_n, split=split, num_warps=num_warps, num_stages=num_stages,
                 quantize_first=quantize_first, swap=swap)
    if any(v is not None for v in given.values()):
        p = _launch_params(p, **given)
    if (K // BLOCK) % p.split:
        raise ValueError(f"fp8 linear: split={p.split} does not divide K's {K // BLOCK} blocks")
    if p.quantize_first and not fp8_x:
        x, xs = act_quant_fp8(x, target=tgt)
        fp8_x = True
    bm, bn, sp = p.block_m, p.block_n, p.split
    if inline is None:           # a fixed launch whose tiles alone fill the GPU: the parts in each program
        inline = tgt.fixed_order and cdiv(M, bm) * (N // bn) >= tgt.processors
    inline = inline and sp > 1
    rows = M                     # rows per launch: all, unless a split launch has more tiles than counters
    count_buf = y
    if sp > 1 and not inline:
        count_buf = count if count is not None else counters(N, x.device)
        rows = min(M, count_buf.numel() // (N // bn) * bm) if tgt.fixed_order else M
        if rows < 1 or count_buf.numel() < (N // bn) * cdiv(rows, bm):
            raise ValueError(f"fp8 linear: {count_buf.numel()} counters for {(N // bn) * cdiv(M, bm)} tiles")
    if xs is not None and xs.dtype != torch.float32:
        xs = xs.float()
    x, w, ws = as_dense(x), as_dense(w), as_f32(ws)
    xs_strides = (xs.stride(0), xs.stride(1)) if xs is not None else (0, 0)
    part = torch.empty(sp, rows, N, dtype=torch.float32, device=x.device) if sp > 1 and not inline else y
    for r0 in range(0, M, rows):     # each launch's rows start a tile: a row's tile is the same in any of them
        r1 = min(M, r0 + rows)
        xr, yr = (x, y) if rows == M else (x[r0:r1], y[r0:r1])
        xsr = xr if xs is None else xs if rows == M else xs[r0:r1]
        launch(_fp8_linear_kernel, (N // bn, 1 if inline else sp, cdiv(r1 - r0, bm)), xr, xsr, *xs_strides, w, ws,
               yr, part, count_buf, r1 - r0, N, K, BM=bm, BN=bn, SPLIT=sp, QUANT=not fp8_x,
               DOT=tl.float32 if tgt.interpret else tl.float8e4nv, STAGES=p.num_stages, INLINE=inline,
               PDL=tgt.pdl, SWAP=p.swap, launch_pdl=tgt.pdl, num_warps=p.num_warps)
    return y.to(out_dtype)


def fp8_scales(M: int, K: int, device, *, mn_major: bool):
    """Room for the float32 scales [M, K/128] of M rows quantized per 128 values: row-major, or block-major
    with M padded to a multiple of 4 (`mn_major`: the layout DeepGEMM's sm90 kernels read without a copy)."""
    import torch

    if mn_major:
        return torch.empty(K // BLOCK, cdiv(M, 4) * 4, dtype=torch.float32, device=device)[:, :M].t()
    return torch.empty(M, K // BLOCK, dtype=torch.float32, device=device)


def act_quant_fp8(x, *, mn_major_scales: bool = False, target: Target | None = None):
    """x [M, K] bf16/fp16/float32 -> (e4m3 [M, K], float32 scales [M, K/128]): `act_quant`, one launch. With
    `mn_major_scales` the scales are stored block-major with M padded to a multiple of 4 (a view [M, K/128]
    of that storage): the layout DeepGEMM's sm90 kernels read, which they would otherwise copy into."""
    import torch

    M, K = x.shape
    if K % BLOCK:
        raise ValueError(f"act_quant: the last dim ({K}) is not a multiple of {BLOCK}")
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = fp8_scales(M, K, x.device, mn_major=mn_major_scales)
    if M:
        tgt = target or target_of(x.device)
        launch(_act_quant_kernel, (cdiv(M, 32), K // BLOCK), as_dense(x), q, s, M, K, s.stride(0), s.stride(1),
               BM=32, EMULATE=tgt.interpret, PDL=tgt.pdl, launch_pdl=tgt.pdl, num_warps=4)
    return q, s


def compile_cases(gpu) -> list[CompileCase]:
    """linear=triton_fp8 on an e4m3 GPU (`gpu`: Triton's GPUTarget, NVIDIA): the planned launches for
    DSV4-Flash's products at decode and prefill row counts and batch_invariant's fixed ones (split over
    programs or inside them), rows quantized elsewhere (the q_lora norm) or inside the product; and the
    activation quantizer."""
    tgt = Target(arch=f"sm{gpu.arch}", native_e4m3=True, processors=132)
    shapes = ((1536, 4096), (40960, 1024), (4096, 8192))
    launches = {(plan(M, N, K, tgt), False) for M in (1, 64, 8192) for N, K in shapes}
    launches |= {(fixed_launch(M, N, K, tgt), inline) for M in (1, 256) for N, K in shapes for inline in (False, True)}
    fp8 = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "y_ptr": "*bf16",
           "part_ptr": "*fp32", "count_ptr": "*i32"}
    pdl = gpu_launches_dependents(gpu)
    cases = [CompileCase(kernel=_fp8_linear_kernel, constexprs=dict(BM=p.block_m, BN=p.block_n, SPLIT=p.split,
                                                                  QUANT=quant, DOT=tl.float8e4nv,
                                                                  STAGES=p.num_stages, INLINE=inline, PDL=pdl,
                                                                  SWAP=p.swap),
                         pointers=fp8 | ({"x_ptr": "*bf16", "xs_ptr": "*bf16"} if quant else {}),
                         divisible=frozenset({"N", "K", "xs_row", "xs_col"}), num_warps=p.num_warps)
             for p, inline in sorted(launches, key=str) for quant in {False, not p.quantize_first}]
    return cases + [CompileCase(kernel=_act_quant_kernel, constexprs=dict(BM=32, EMULATE=False, PDL=pdl),
                                pointers={"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                                divisible=frozenset({"K", "s_row", "s_col"}))]
