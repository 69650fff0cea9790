"""A few-row step's products of x in one launch: the fp8 projection (the published fp8 linear, as fp8_linear.py
forms it: [wq_a | wkv]) and a float weight beside it (the compressors' and the indexer's head weights, which the
checkpoint stores in bf16), both read at once. Apart, the float product (cuBLAS, split-K and its reduce) and the
fp8 product each ran below their bytes' bandwidth, one after the other, although both read the same rows: one
launch spreads both weights over every SM.

The result is [M, N + N_tail] float32: the fp8 projection's sums (the layer's front rounds them to the
activation dtype, as the fp8 linear's own result is rounded), then the float weight's. The programs are
(fp8 column tile, part of K) then (float column tile, part of K), 64 columns a tile, the dots transposed (the
weight tile as the MMA's M) and each fp8 program quantizing its rows' blocks itself as `fp8_linear` does up to
FEW_ROWS rows. Both weights' K is split into the same parts, the fewest that give 1.2 programs per SM: on the
H100 that was faster than parts that even out the bytes per program (a float block is twice an fp8 block's
bytes) and than fewer or more programs (`joint_plan`). Parts are added by the tile's last program to arrive,
in split order (`fp8_linear.store_tile`).

Under TRITON_INTERPRET=1 (the CPU tests) the float dots take float32 operands (the interpreter has no bf16
dot); on a GPU they are bf16 tensor-core dots with float32 sums, as cuBLAS forms the float product.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsv4.kernels import FEW_ROWS
from dsv4.kernels.launch import CompileCase, as_dense, as_f32, launch
from dsv4.kernels.products.fp8_linear import BLOCK, part_sums, split_for, store_tile
from dsv4.kernels.target import Target, gpu_launches_dependents, target_of
from dsv4.values.sizes import cdiv

BN = 64          # columns a tile, of either weight


@triton.jit
def _float_sums(x_ptr, t_ptr, rows, cols, live, colive, K, kb0, kb1, BM: tl.constexpr, BN: tl.constexpr,
                DOT: tl.constexpr, STAGES: tl.constexpr):
    """The tile's float32 sums over K blocks kb0..kb1-1 of 128 of x's rows times the float weight's columns
    `cols`, from zero: transposed dots (the weight tile as the MMA's M), the sums transposed back."""
    k = tl.arange(0, 128)
    x_row = rows.to(tl.int64) * K
    t_row = cols.to(tl.int64) * K
    acc = tl.zeros([BN, BM], tl.float32)
    for kb in tl.range(kb0, kb1, num_stages=STAGES):
        a = tl.load(x_ptr + x_row[:, None] + kb * 128 + k[None, :], mask=live[:, None], other=0.0)
        b = tl.load(t_ptr + t_row[:, None] + kb * 128 + k[None, :], mask=colive[:, None], other=0.0)
        acc += tl.dot(b.to(DOT), tl.trans(a.to(DOT)))
    return tl.trans(acc)


@triton.jit(do_not_specialize=["M"])      # step sizes: one compiled variant for all
def _joint_linear_kernel(x_ptr, w_ptr, ws_ptr, t_ptr, y_ptr, part_ptr, count_ptr, M, N, NT, K, BM: tl.constexpr,
                         BN: tl.constexpr, SPLIT: tl.constexpr, TSPLIT: tl.constexpr, DOT: tl.constexpr,
                         TDOT: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    fp8_programs = (N // BN) * SPLIT
    rows = tl.arange(0, BM)
    live = rows < M
    width = N + NT
    if PDL:         # a programmatic dependent: wait for the kernel before it (whose rows it reads)
        gdc_wait()
    if pid < fp8_programs:
        tile = pid // SPLIT
        split = pid % SPLIT
        per = K // 128 // SPLIT
        cols = tile * BN + tl.arange(0, BN)
        acc = part_sums(x_ptr, x_ptr, 0, 0, w_ptr, ws_ptr, rows, cols, live, K, K, split * per, split * per + per,
                        BM, BN, True, DOT, STAGES, True)
        if PDL:
            gdc_launch_dependents()
        store_tile(acc, y_ptr, part_ptr, count_ptr, tile, split, rows.to(tl.int64)[:, None] * width + cols[None, :],
                   live[:, None], M * width, SPLIT)
    else:
        tile = (pid - fp8_programs) // TSPLIT
        split = (pid - fp8_programs) % TSPLIT
        per = K // 128 // TSPLIT
        cols = tile * BN + tl.arange(0, BN)
        colive = cols < NT
        acc = _float_sums(x_ptr, t_ptr, rows, cols, live, colive, K, split * per, split * per + per, BM, BN, TDOT,
                          STAGES)
        if PDL:
            gdc_launch_dependents()
        store_tile(acc, y_ptr, part_ptr, count_ptr, N // BN + tile, split,
                   rows.to(tl.int64)[:, None] * width + N + cols[None, :], live[:, None] & colive[None, :],
                   M * width, TSPLIT)


@dataclass(frozen=True, slots=True)
class JointLaunch:
    split: int           # the fp8 weight's K blocks over this many programs per tile
    tail_split: int      # the float weight's
    num_stages: int


@functools.lru_cache(maxsize=256)
def joint_plan(N: int, NT: int, K: int, target: Target) -> JointLaunch:
    """Both weights' K in the fewest parts that give 1.2 programs per SM (or the most there are), three stages.
    Measured on the H100, one / 16 rows, µs: DSV4-Flash's ratio-4 x product with its float weights 12.4 / 13.0
    (K in 4 parts both), against 15.5 / 15.9 with a float tile's K in twice an fp8 tile's parts (2 and 4: the same
    bytes a program, four stages) and 15.9 / 16.6 for the two products apart (cuBLAS's and ours); its ratio-128
    layer 9.1 / 9.2 against 12.7 / 13.3 and 12.4 / 12.7; DSV4-Pro's ratio-4 22.5 / 25.1 against 26.4 / 27.5 and
    28.6 / 29.5. Four stages were no faster (docs/notes/2026-12-07-joint-x-product.md)."""
    split = split_for(N // BN + cdiv(NT, BN), K // BLOCK, cdiv(6 * target.processors, 5))
    return JointLaunch(split=split, tail_split=split, num_stages=3)


def joint_counters(N: int, NT: int, device):
    """The per-tile arrival counters of `joint_linear` for these widths, zeroed once (each call leaves them
    zeroed)."""
    import torch

    return torch.zeros(N // BN + cdiv(NT, BN), dtype=torch.int32, device=device)


def joint_linear(x, w, ws, tail, *, count, target: Target | None = None, split: int | None = None,
                 tail_split: int | None = None, num_stages: int | None = None):
    """x [M, K] bf16 (M <= FEW_ROWS) times w [N, K] e4m3 with block scales ws [N/128, K/128] (the published fp8
    linear) and times tail [NT, K] bf16 (float32 sums) -> [M, N + NT] float32, in one launch. `count`:
    `joint_counters(N, NT)`; the launch parameters override `joint_plan`."""
    import torch

    M, K = x.shape
    N, NT = w.shape[0], tail.shape[0]
    if x.dtype != torch.bfloat16 or tail.dtype != torch.bfloat16:      # the float dots are bf16 tensor-core dots
        raise ValueError(f"joint linear: x and the float weight in bf16, got {x.dtype} and {tail.dtype}")
    if w.dtype != torch.float8_e4m3fn or K % BLOCK or N % BLOCK or tuple(w.shape) != (N, K) \
            or tuple(ws.shape) != (N // BLOCK, K // BLOCK) or tail.shape[1] != K:
        raise ValueError(f"joint linear: x {tuple(x.shape)}, w {tuple(w.shape)} {w.dtype}, ws {tuple(ws.shape)}, "
                         f"tail {tuple(tail.shape)}: expected e4m3 w, K and N multiples of {BLOCK}, one scale a block")
    if M > FEW_ROWS:
        raise ValueError(f"joint linear: {M} rows; it is a few-row launch, of at most {FEW_ROWS}")
    if count.numel() < N // BN + cdiv(NT, BN):
        raise ValueError(f"joint linear: {count.numel()} counters for {N // BN + cdiv(NT, BN)} tiles")
    tgt = target or target_of(x.device)
    y = torch.empty(M, N + NT, dtype=torch.float32, device=x.device)
    if M == 0:
        return y
    p = joint_plan(N, NT, K, tgt)
    sp, tsp = split or p.split, tail_split or p.tail_split
    if (K // BLOCK) % sp or (K // BLOCK) % tsp:
        raise ValueError(f"joint linear: split={sp}, tail_split={tsp} do not both divide K's {K // BLOCK} blocks")
    part = torch.empty(max(sp, tsp), M, N + NT, dtype=torch.float32, device=x.device) if max(sp, tsp) > 1 else y
    grid = ((N // BN) * sp + cdiv(NT, BN) * tsp,)
    launch(_joint_linear_kernel, grid, as_dense(x), as_dense(w), as_f32(ws), as_dense(tail), y, part,
           count, M, N, NT, K, BM=FEW_ROWS, BN=BN, SPLIT=sp, TSPLIT=tsp,
           DOT=tl.float32 if tgt.interpret else tl.float8e4nv, TDOT=tl.float32 if tgt.interpret else tl.bfloat16,
           STAGES=num_stages or p.num_stages, PDL=tgt.pdl, launch_pdl=tgt.pdl, num_warps=4)
    return y


def compile_cases(gpu) -> list[CompileCase]:
    """The joint launch for DSV4-Flash's and DSV4-Pro's x products with their ratio-4 layers' float weights."""
    tgt = Target(arch=f"sm{gpu.arch}", native_e4m3=True, processors=132)
    pdl = gpu_launches_dependents(gpu)
    cases = []
    for N, NT, K in ((1536, 2624, 4096), (1536, 1024, 4096), (2048, 2624, 7168)):
        p = joint_plan(N, NT, K, tgt)
        cases.append(CompileCase(kernel=_joint_linear_kernel,
                                 constexprs=dict(BM=FEW_ROWS, BN=BN, SPLIT=p.split, TSPLIT=p.tail_split,
                                                 DOT=tl.float8e4nv, TDOT=tl.bfloat16, STAGES=p.num_stages, PDL=pdl),
                                 pointers={"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "t_ptr": "*bf16",
                                           "y_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32"},
                                 divisible=frozenset({"N", "K"})))
    return cases
