"""Inverse RoPE fused with per-128 fp8 quantization of the attention output (the o_proj prologue).

Each program takes BPP blocks of 128 dims of one token: it reads the bf16 values once, as
(even, odd) pairs, de-rotates the pairs of each head's last 64 (RoPE) dims with the token's 32
cos/sin values (loaded once per program), takes each block's amax, and writes its e4m3 bytes and
one power-of-two float32 scale per block -- the bytes `deepgemm_fp8`/`torch_fp8` consume, the same
as `dsv4.strategies.o_proj.fp8_common.inverse_rope_fp8_quant` computes in torch ops. The scales are stored
token-major, or block-major with the token count padded to a multiple of 4 (`mn_major_scales`): the
layout DeepGEMM's sm90 kernels read, which it would otherwise make with a copy on every call.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.launch import CompileCase, as_dense, dependent_start, launch
from dsv4.values.sizes import cdiv


@triton.jit(do_not_specialize=["s_token", "s_block"])     # DeepGEMM's scale strides follow T
def _inv_rope_fp8_kernel(o_ptr, cos_ptr, sin_ptr, x_ptr, s_ptr, s_token, s_block, n_blocks, groups_per_token,
                         HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, BPP: tl.constexpr, PDL: tl.constexpr = False):
    dependent_start(PDL)
    pid = tl.program_id(0)
    t = pid // groups_per_token
    blocks = (pid % groups_per_token) * BPP + tl.arange(0, BPP)        # this program's 128-dim blocks
    j = tl.arange(0, 64)                                                 # pair index within a block
    flat = t.to(tl.int64) * n_blocks * 128 + blocks[:, None] * 128 + tl.arange(0, 128)[None, :]
    ev, od = tl.split(tl.reshape(tl.load(o_ptr + flat).to(tl.float32), [BPP, 64, 2]))
    # a head's RoPE pairs: the last ROPE/2 pairs of its last block
    first = 64 - ROPE // 2
    k = tl.where(j >= first, j - first, 0)
    c = tl.load(cos_ptr + t * (ROPE // 2) + k)
    s = tl.load(sin_ptr + t * (ROPE // 2) + k)
    last = (blocks % (HEAD_DIM // 128)) == HEAD_DIM // 128 - 1
    rope = last[:, None] & (j >= first)[None, :]
    c = tl.where(rope, c[None, :], 1.0)
    s = tl.where(rope, s[None, :], 0.0)
    # inverse rotation (angle -p·f): even' = ev·c + od·s, odd' = od·c - ev·s
    ev, od = ev * c + od * s, od * c - ev * s
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(ev), axis=1), tl.max(tl.abs(od), axis=1)), 1e-10)
    # scale = 2^ceil(log2(amax / 448)) from the float's bits (exact, unlike an approximate log2)
    bits = (amax / 448.0).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = (e << 23).to(tl.float32, bitcast=True)
    inv = 1.0 / scale                                                   # a power of two: exact
    x = tl.reshape(tl.join(ev * inv[:, None], od * inv[:, None]), [BPP, 128])
    tl.store(x_ptr + flat, x.to(tl.float8e4nv))
    tl.store(s_ptr + t.to(tl.int64) * s_token + blocks * s_block, scale)


def inv_rope_fp8_quant(o, cos, sin, groups: int, *, mn_major_scales: bool = False, blocks_per_program: int = 16,
                       num_warps: int = 4, pdl: bool = False):
    """o [T, H, D] bf16, cos/sin [T, 32] float32 -> (x [T, G, H·D/G] e4m3, s [T, G, H·D/G/128] float32).
    s is contiguous, or with `mn_major_scales` a view of a [blocks, align(T, 4)] buffer (strides (1,
    blocks/G·align(T, 4), align(T, 4))). `pdl`: launched as a programmatic dependent (Target.pdl)."""
    import torch

    T, H, D = o.shape
    o = as_dense(o)
    n_blocks = H * D // 128
    bpp = next(b for b in (blocks_per_program, 16, 8, 4, 2, 1) if n_blocks % b == 0)
    x = torch.empty(T, n_blocks * 128, dtype=torch.float8_e4m3fn, device=o.device)
    kpg = n_blocks // groups
    if mn_major_scales:             # strides set exactly: DeepGEMM compares them even where a size is 1
        ta = cdiv(T, 4) * 4
        s = torch.empty(n_blocks * ta, dtype=torch.float32, device=o.device).as_strided((T, groups, kpg),
                                                                                      (1, kpg * ta, ta))
        s_token, s_block = 1, ta
    else:
        s = torch.empty(T, groups, kpg, dtype=torch.float32, device=o.device)
        s_token, s_block = n_blocks, 1
    if T:
        launch(_inv_rope_fp8_kernel, (T * (n_blocks // bpp),), o, as_dense(cos), as_dense(sin), x, s, s_token,
               s_block, n_blocks, n_blocks // bpp, HEAD_DIM=D, ROPE=64, BPP=bpp, PDL=pdl, launch_pdl=pdl,
               num_warps=num_warps)
    return x.view(T, groups, -1), s


def compile_cases(gpu) -> list[CompileCase]:
    """The fused o_proj prologue as inv_rope_fp8_quant launches it (512-dim heads, 16 blocks a program) on an
    e4m3 GPU, a programmatic dependent where it launches so."""
    from dsv4.kernels.target import gpu_launches_dependents

    return [CompileCase(kernel=_inv_rope_fp8_kernel, constexprs=dict(HEAD_DIM=512, ROPE=64, BPP=16,
                                                                    PDL=gpu_launches_dependents(gpu)),
                        pointers={"o_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "x_ptr": "*fp8e4nv",
                                  "s_ptr": "*fp32"}, divisible=frozenset({"n_blocks", "groups_per_token"}))]
