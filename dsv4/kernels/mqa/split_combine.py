"""How a sparse MQA kernel's heads are finished (`finish`: the sink in the denominator, lse), and the merge
of a call's splits: a kernel that cut each token's lists into S runs of blocks wrote, per split, its
unnormalized output acc [S, T, H, D] float32 and (max, sum) per head ml [S, T, H, 2] (the max of the
scores times scale·log2(e), the sum of 2^(s - max)); here M = max over the splits, L = Σ l·2^(m - M),
out = Σ acc·2^(m - M) / (L + 2^(sink·log2(e) - M)) and lse, as an unsplit kernel finishes."""
from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.launch import CompileCase, dependent_start, launch
from dsv4.kernels.target import gpu_launches_dependents, target_of
from dsv4.values.sizes import cdiv

BH, DB = 16, 128     # heads and output dims per merge program


@triton.jit
def finish(acc, m, l, sink_l2, out_ptrs, lse_ptrs, hmask, lse_mask):
    """Sink in the denominator; a head with no valid row gets 0 and lse = +inf."""
    has = l > 0
    m_use = tl.where(has, m, 0.0)
    denom = tl.where(has, l + tl.exp2(sink_l2 - m_use), 1.0)
    out = tl.where(has[:, None], acc / denom[:, None], 0.0)
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=hmask[:, None])
    tl.store(lse_ptrs, tl.where(has, (m_use + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453,
                                float("inf")), mask=lse_mask)


@triton.jit(do_not_specialize=["T", "S"])
def _combine_kernel(acc_ptr, ml_ptr, sink_ptr, out_ptr, lse_ptr, T, H, S, BH: tl.constexpr, DB: tl.constexpr,
                    D: tl.constexpr, PDL: tl.constexpr = False):
    dependent_start(PDL)
    t = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    d0 = tl.program_id(2) * DB
    hmask = heads < H
    dims = d0 + tl.arange(0, DB)
    M = tl.full([BH], float("-inf"), tl.float32)
    for s in range(0, S):
        part = (s * T + t).to(tl.int64) * H + heads
        M = tl.maximum(M, tl.load(ml_ptr + part * 2, mask=hmask, other=float("-inf")))
    M_use = tl.where(M == float("-inf"), 0.0, M)
    acc = tl.zeros([BH, DB], tl.float32)
    L = tl.zeros([BH], tl.float32)
    for s in range(0, S):
        part = (s * T + t).to(tl.int64) * H + heads
        w = tl.exp2(tl.load(ml_ptr + part * 2, mask=hmask, other=float("-inf")) - M_use)
        L += tl.load(ml_ptr + part * 2 + 1, mask=hmask, other=0.0) * w
        acc += tl.load(acc_ptr + part[:, None] * D + dims[None, :], mask=hmask[:, None], other=0.0) * w[:, None]
    row = t.to(tl.int64) * H + heads
    sink_l2 = tl.load(sink_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634      # log2(e)
    finish(acc, M, L, sink_l2, out_ptr + row[:, None] * D + dims[None, :], lse_ptr + row, hmask,
           hmask & (heads * 0 + d0 == 0))                                             # one dims block writes lse


def combine_splits(acc, ml, sink, out, lse, splits: int) -> None:
    """out [T, H, D] (its dtype) and lse [T, H] from the splits' acc and ml (flat, as laid out above).
    One program per (token, BH heads, DB dims): a decode step of one request still spreads over
    D/DB·H/BH programs; a programmatic dependent where the GPU launches them (Target.pdl)."""
    T, H, D = out.shape
    pdl = target_of(out.device).pdl
    launch(_combine_kernel, (T, cdiv(H, BH), cdiv(D, DB)), acc, ml, sink, out, lse, T, H, splits, BH=BH, DB=DB, D=D,
           PDL=pdl, launch_pdl=pdl, num_warps=4, num_stages=1)


def compile_cases(gpu) -> list[CompileCase]:
    """The merge as combine_splits launches it after the Hopper kernels (512 dims, bf16 out), as a programmatic
    dependent on NVIDIA GPUs that launch them so."""
    return [CompileCase(kernel=_combine_kernel, constexprs=dict(BH=BH, DB=DB, D=512, PDL=gpu_launches_dependents(gpu)),
                        divisible=frozenset({"H"}),
                        pointers={"acc_ptr": "*fp32", "ml_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
                                  "lse_ptr": "*fp32"})]
