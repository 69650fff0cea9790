"""The e4m3 queries of indexer=deepgemm_fp8 and triton_fp8 in one launch (key_layouts.fp8_queries is the torch
specification): each head of q [T, Hi, Di] divided by its power-of-two scale 2^ceil(log2(max(amax, 1e-4) /
448)) and rounded to e4m3 (as torch converts), and the head weights times w_scale and that scale."""
from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.front.cache_write import fp8_heads
from dsv4.kernels.launch import CompileCase, as_dense, dependent_start, launch, rows_dense
from dsv4.kernels.target import gpu_launches_dependents, target_of
from dsv4.values.sizes import next_pow2


@triton.jit
def _fp8_queries_kernel(q_ptr, w_ptr, w_stride, w_scale, q8_ptr, wq_ptr, H, D, HP: tl.constexpr, DP: tl.constexpr,
                        PDL: tl.constexpr = False):
    dependent_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)
    d = tl.arange(0, DP)
    m = (h < H)[:, None] & (d < D)[None, :]
    at = (t * H + h)[:, None] * D + d[None, :]
    x = tl.load(q_ptr + at, mask=m, other=0.0).to(tl.float32)
    q8, wq = fp8_heads(x, tl.load(w_ptr + t * w_stride + h, mask=h < H, other=0.0), w_scale)
    tl.store(q8_ptr + at, q8, mask=m)
    tl.store(wq_ptr + t * H + h, wq, mask=h < H)


def fp8_queries_kernel(q, w, w_scale: float):
    """q [T, Hi, Di] (float32 or bf16), w [T, Hi] float32 (rows may be strided) -> (q8 [T, 1, Hi, Di]
    float8_e4m3fn, wq [T, Hi] float32), as `fp8_queries`; a programmatic dependent where the GPU launches them
    (Target.pdl)."""
    import torch

    T, H, D = q.shape
    q8 = torch.empty(T, 1, H, D, dtype=torch.uint8, device=q.device)
    wq = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T:
        w = rows_dense(w if w.dtype == torch.float32 else w.float())
        pdl = target_of(q.device).pdl
        launch(_fp8_queries_kernel, (T,), as_dense(q), w, w.stride(0), w_scale, q8, wq, H, D, HP=next_pow2(H),
               DP=next_pow2(D), PDL=pdl, launch_pdl=pdl)
    return q8.view(torch.float8_e4m3fn), wq


def compile_cases(gpu) -> list[CompileCase]:
    """The fp8 indexers' queries (64 heads of 128 dims) from bf16 and float32 ones, programmatic dependents
    where `gpu` launches them so."""
    return [CompileCase(kernel=_fp8_queries_kernel, constexprs=dict(HP=64, DP=128, PDL=gpu_launches_dependents(gpu)),
                        pointers={"q_ptr": name, "w_ptr": "*fp32", "q8_ptr": "*u8", "wq_ptr": "*fp32"},
                        floats=frozenset({"w_scale"}), divisible=frozenset({"H", "D"}))
            for name in ("*bf16", "*fp32")]
