"""Inverse RoPE fused with per-128 fp8 quantization of the attention output (the o_proj prologue).

One program per token and run of up to 16 blocks of 128 dims: it reads the bf16 values once,
de-rotates a head's last 64 (RoPE) dims, takes each block's amax, and writes its e4m3 bytes and one
power-of-two float32 scale per block — the bytes `deepgemm_fp8`/`torch_fp8` consume,
the same as `dsv4.strategies.fp8_oproj.inverse_rope_fp8_quant` computes in torch ops.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _inv_rope_fp8_kernel(o_ptr, cos_ptr, sin_ptr, x_ptr, s_ptr, stride_t, n_blocks,
                         HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, BLOCK: tl.constexpr, BPP: tl.constexpr):
    t = tl.program_id(0)
    rows = tl.program_id(1) * BPP + tl.arange(0, BPP)          # this program's 128-dim blocks
    flat = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # index within the token's H*D values
    base = o_ptr + t * stride_t
    x = tl.load(base + flat).to(tl.float32)
    partner = tl.load(base + (flat ^ 1)).to(tl.float32)        # the other element of its GPT-J pair
    dim = flat % HEAD_DIM
    is_rope = dim >= HEAD_DIM - ROPE
    pair = tl.where(is_rope, (dim - (HEAD_DIM - ROPE)) // 2, 0)
    c = tl.load(cos_ptr + t * (ROPE // 2) + pair)
    s = tl.load(sin_ptr + t * (ROPE // 2) + pair)
    even = (flat % 2) == 0
    # inverse rotation (angle -p·f): even' = ev·c + od·s, odd' = od·c - ev·s
    rot = tl.where(even, x * c + partner * s, x * c - partner * s)
    x = tl.where(is_rope, rot, x)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10)
    # scale = 2^ceil(log2(amax / 448)) from the float's bits (exact, unlike an approximate log2)
    bits = (amax / 448.0).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = (e << 23).to(tl.float32, bitcast=True)
    q = x / scale[:, None]
    tl.store(x_ptr + t * n_blocks * BLOCK + flat, q.to(tl.float8e4nv))
    tl.store(s_ptr + t * n_blocks + rows, scale)


def inv_rope_fp8_quant(o, cos, sin, groups: int):
    """o [T, H, D] bf16, cos/sin [T, 32] float32 -> (x [T, G, H·D/G] e4m3, s [T, G, H·D/G/128] float32)."""
    import torch

    T, H, D = o.shape
    o = o.contiguous()
    n_blocks = H * D // 128
    bpp = next(b for b in (16, 8, 4, 2, 1) if n_blocks % b == 0)   # blocks per program
    x = torch.empty(T, n_blocks * 128, dtype=torch.float8_e4m3fn, device=o.device)
    s = torch.empty(T, n_blocks, dtype=torch.float32, device=o.device)
    if T:
        _inv_rope_fp8_kernel[(T, n_blocks // bpp)](o, cos.contiguous(), sin.contiguous(), x, s, o.stride(0),
                                                   n_blocks, HEAD_DIM=D, ROPE=64, BLOCK=128, BPP=bpp)
    return x.view(T, groups, -1), s.view(T, groups, -1)
