"""The fp8 o_proj's grouped product in Triton (o_proj=triton_fp8): z[t, g] = W_oa[g] · x[t, g] with e4m3
operands, one float32 scale per 1×128 activation block and per 128×128 weight block, float32
accumulation -- the product DeepGEMM's `fp8_einsum` (recipe (1, 128, 128)) and `torch_fp8` compute.

One program per (BM tokens, 128 output rows, group); it walks K in blocks of 128: a tensor-core e4m3 dot
per block, scaled by the block's activation scales (per row) and its weight scale (one per program and
block, since the program's 128 output rows are one weight block). The loop is software-pipelined by
Triton (num_stages).

A decode step of up to FEW_TOKENS tokens reads each group's weight about once, so its bytes are the cost:
there (when the caller keeps the tiles' arrival `counters`, i.e. not under batch_invariant) one program per
(128 output rows, part of K, group) forms the dots transposed, the weight tile as the MMA's M and the tokens
as its N, as fp8_linear's few-row launch does (`part_sums`), with K split into the parts that bring the
programs nearest to one per SM; the tile's last program adds the parts in split order (`store_tile`).
Under TRITON_INTERPRET=1 (CPU tests) the dots take the e4m3 values widened to
float32, the same products the tensor cores form exactly, and the result is stored as float32 and
rounded to bf16 by torch: the interpreter's float32 -> bf16 conversion truncates.
"""
from __future__ import annotations

import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsv4.kernels.launch import CompileCase, as_dense, as_f32, dependent_start, launch
from dsv4.kernels.products.fp8_linear import nearest_split, part_sums, store_tile
from dsv4.kernels.target import Target, gpu_launches_dependents, target_of
from dsv4.values.sizes import cdiv

BLOCK = 128
FEW_TOKENS = 16      # up to this many tokens: the few-token launch (where the caller keeps counters)
FEW_STAGES = 3


@triton.jit(do_not_specialize=["T"])     # step sizes: one variant for all
def _grouped_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, z_ptr, T, G, N, K, BM: tl.constexpr, DOT: tl.constexpr,
                        STAGES: tl.constexpr, PDL: tl.constexpr = False):
    pid_m = tl.program_id(0)
    nb = tl.program_id(1)                       # this program's 128 output rows: weight block row nb
    g = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    n = nb * 128 + tl.arange(0, 128)
    k = tl.arange(0, 128)
    live = rows < T
    KB = K // 128
    x_row = (rows.to(tl.int64) * G + g) * K
    w_row = (g.to(tl.int64) * N + n) * K
    dependent_start(PDL)
    acc = tl.zeros([BM, 128], tl.float32)
    for kb in tl.range(0, KB, num_stages=STAGES):
        a = tl.load(x_ptr + x_row[:, None] + kb * 128 + k[None, :], mask=live[:, None], other=0.0)
        b = tl.load(w_ptr + w_row[:, None] + kb * 128 + k[None, :])
        sa = tl.load(xs_ptr + (rows.to(tl.int64) * G + g) * KB + kb, mask=live, other=0.0)
        sb = tl.load(ws_ptr + (g * (N // 128) + nb) * KB + kb)
        acc += tl.dot(a.to(DOT), tl.trans(b.to(DOT))) * (sa[:, None] * sb)
    z = z_ptr + (rows.to(tl.int64) * G + g)[:, None] * N + n[None, :]
    tl.store(z, acc.to(z_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit(do_not_specialize=["T"])
def _grouped_few_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, z_ptr, part_ptr, count_ptr, T, G, N, K, BM: tl.constexpr,
                        SPLIT: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    nb = tl.program_id(0)
    split = tl.program_id(1)
    g = tl.program_id(2)
    rows = tl.arange(0, BM)
    cols = nb * 128 + tl.arange(0, 128)
    live = rows < T
    KB = K // 128
    per = KB // SPLIT
    if PDL:
        gdc_wait()
    acc = part_sums(x_ptr + g * K, xs_ptr + g * KB, G * KB, 1, w_ptr + g.to(tl.int64) * N * K,
                    ws_ptr + g * (N // 128) * KB, rows, cols, live, K, G * K, split * per, split * per + per,
                    BM, 128, False, DOT, STAGES, True)
    if PDL:
        gdc_launch_dependents()
    out = (rows.to(tl.int64) * G + g)[:, None] * N + cols[None, :]
    store_tile(acc, z_ptr, part_ptr, count_ptr, g * (N // 128) + nb, split, out, live[:, None], T * G * N, SPLIT)


def counters(G: int, N: int, device):
    """The per-tile arrival counters of the few-token launch, zeroed once (each call leaves them zeroed)."""
    import torch

    return torch.zeros(G * (N // BLOCK), dtype=torch.int32, device=device)


def grouped_fp8_gemm(x, xs, w, ws, *, block_m: int = 64, num_warps: int = 4, num_stages: int = 4,
                     target: Target | None = None, count=None, split: int | None = None):
    """x [T, G, K] e4m3, xs [T, G, K/128] float32; w [G, N, K] e4m3, ws [G, N/128, K/128] float32 ->
    z [T, G, N] bf16. The default launch is the H200 sweep's (bench/tune_triton.py oproj;
    docs/notes/2026-12-04-fp8-products.md); with `count` (`counters`) up to FEW_TOKENS tokens take the
    few-token launch, K in `split` parts (default: nearest to one program per SM).
    `target`: the device's facts as the strategy prepared them (default: `target.target_of` x's device)."""
    import torch

    T, G, K = x.shape
    N = w.shape[1]
    if x.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"grouped fp8 product: x and w must be float8_e4m3fn (OCP e4m3), got {x.dtype} and {w.dtype}")
    if K % BLOCK or N % BLOCK or tuple(w.shape) != (G, N, K) or tuple(ws.shape) != (G, N // BLOCK, K // BLOCK) \
            or tuple(xs.shape) != (T, G, K // BLOCK):
        raise ValueError(f"grouped fp8 product: x {tuple(x.shape)}, xs {tuple(xs.shape)}, w {tuple(w.shape)}, "
                         f"ws {tuple(ws.shape)}: expected K and N multiples of {BLOCK} and one scale per block")
    tgt = target or target_of(x.device)
    interpret = tgt.interpret
    z = torch.empty(T, G, N, dtype=torch.float32 if interpret else torch.bfloat16, device=x.device)
    if T == 0:
        return z.bfloat16()
    dot = tl.float32 if interpret else tl.float8e4nv
    if count is not None and T <= FEW_TOKENS:
        sp = split or nearest_split(G * (N // BLOCK), K // BLOCK, tgt.processors)
        if (K // BLOCK) % sp:
            raise ValueError(f"grouped fp8 product: split={sp} does not divide K's {K // BLOCK} blocks")
        if count.numel() < G * (N // BLOCK):
            raise ValueError(f"grouped fp8 product: {count.numel()} counters for {G * (N // BLOCK)} tiles")
        part = torch.empty(sp, T, G, N, dtype=torch.float32, device=x.device) if sp > 1 else z
        launch(_grouped_few_kernel, (N // BLOCK, sp, G), as_dense(x), as_f32(xs), as_dense(w), as_f32(ws), z, part,
               count, T, G, N, K, BM=FEW_TOKENS, SPLIT=sp, DOT=dot, STAGES=FEW_STAGES, PDL=tgt.pdl,
               launch_pdl=tgt.pdl, num_warps=4)
        return z.bfloat16()
    launch(_grouped_fp8_kernel, (cdiv(T, block_m), N // BLOCK, G), as_dense(x), as_f32(xs), as_dense(w),
           as_f32(ws), z, T, G, N, K, BM=block_m, DOT=dot, STAGES=num_stages,
           PDL=tgt.pdl, launch_pdl=tgt.pdl, num_warps=num_warps)
    return z.bfloat16()


def compile_cases(gpu) -> list[CompileCase]:
    """The grouped e4m3 product at both allowed token blocks (o_proj=triton_fp8's), 4 stages, on an e4m3 GPU,
    a programmatic dependent where it launches so; and the few-token launch, K whole and split."""
    pointers = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "z_ptr": "*bf16"}
    pdl = gpu_launches_dependents(gpu)
    return [CompileCase(kernel=_grouped_fp8_kernel, constexprs=dict(BM=bm, DOT=tl.float8e4nv, STAGES=4, PDL=pdl),
                        pointers=pointers, divisible=frozenset({"N", "K"}), num_warps=warps)
            for bm, warps in ((64, 4), (128, 8))] + [
        CompileCase(kernel=_grouped_few_kernel,
                    constexprs=dict(BM=FEW_TOKENS, SPLIT=sp, DOT=tl.float8e4nv, STAGES=FEW_STAGES, PDL=pdl),
                    pointers=pointers | {"part_ptr": "*fp32", "count_ptr": "*i32"}, divisible=frozenset({"N", "K"}))
        for sp in (1, 2)]
