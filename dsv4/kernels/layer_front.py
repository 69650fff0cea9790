"""The front of the layer in one launch each (dsv4.components.front is the torch specification):

- `q_rows_kernel`: per (token, head) RMSNorm without weight, rounded to the activation dtype, RoPE on the
  last 64 dims, rounded again, written into the head-padded buffer the MQA kernel reads (padded heads 0);
- `kv_rows_kernel`: RMSNorm with a weight, rounded to the activation dtype, RoPE, float32 rows, and a flag
  for rows that are not all finite (the layer refuses to store them);
- `norm_rows_kernel`: RMSNorm with a weight over rows of any width (the q_lora rows), in the activation dtype;
- `rotate_rows_kernel`: RoPE alone on every head of float32 rows (the indexer's queries).

Rows are read as (even, odd) pairs, so RoPE rotates pairs in registers; the norm is float32 with an IEEE
square root and division (`sqrt_rn`, `div_rn`: Triton's default rsqrt and `/` are approximate on NVIDIA),
so float32 results are within an ulp or two of torch's and bf16 ones nearly always equal.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

# float32 bit patterns from here up (|x| >= 3.3961e38, inf, NaN) are not finite once rounded to bf16: the rows
# dsv4.components.front.stored_badly refuses to store
BF16_INF_FROM: tl.constexpr = tl.constexpr(0x7F7F8000)

ROPE_DIM = 64                       # RoPE dims: the last 64 of a row (dsv4.components.rope)
ROPE = tl.constexpr(ROPE_DIM)
# The interpreter converts between float32 and bf16 wrongly (rounding half-up without carrying into the
# exponent, subnormals; Triton 3.6-3.9), so there both directions are integer arithmetic; compiled kernels
# use the hardware's conversions (ties to even, as torch rounds).
SOFT_ROUND = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def widen(x, SOFT: tl.constexpr):
    """x (bf16 or float32) as float32, exactly. SOFT: bf16 by shifting its bits."""
    if SOFT and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def round_to(x, dt: tl.constexpr, SOFT: tl.constexpr):
    """float32 x rounded to `dt` (ties to even, as torch rounds). SOFT: bf16 by integer arithmetic."""
    if SOFT and dt == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)                                  # NaN: torch's quiet NaN
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dt)


@triton.jit
def _rms_scale(ev, od, eps, D: tl.constexpr):
    """1 / sqrt(mean(x²) + eps) over the last axis of the pairs (ev, od) [..., D/2], IEEE-rounded."""
    ms = (tl.sum(ev * ev, axis=-1) + tl.sum(od * od, axis=-1)) / D        # D a power of two: exact
    return tl.div_rn(tl.full(ms.shape, 1.0, tl.float32), tl.sqrt_rn(ms + eps))


@triton.jit
def _rotate(ev, od, cos_row, sin_row, D: tl.constexpr):
    """(ev, od) [..., D/2] float32 with RoPE applied to the last 32 pairs; cos_row/sin_row point at the
    token's 32 cos/sin values."""
    j = tl.arange(0, D // 2)
    first = D // 2 - ROPE // 2
    rope = j >= first
    k = tl.where(rope, j - first, 0)
    c = tl.load(cos_row + k)
    s = tl.load(sin_row + k)
    e2 = tl.where(rope, ev * c - od * s, ev)
    o2 = tl.where(rope, od * c + ev * s, od)
    return e2, o2


@triton.jit
def _q_rows_kernel(q_ptr, cos_ptr, sin_ptr, out_ptr, H, PH, eps, D: tl.constexpr, BH: tl.constexpr,
                   SOFT: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    dims = tl.arange(0, D)
    src = (t.to(tl.int64) * H + h)[:, None] * D + dims[None, :]
    x = widen(tl.load(q_ptr + src, mask=(h < H)[:, None], other=0.0), SOFT)      # padded heads: 0 -> 0
    ev, od = tl.split(tl.reshape(x, [BH, D // 2, 2]))
    r = _rms_scale(ev, od, eps, D)[:, None]
    dt = out_ptr.dtype.element_ty
    ev = widen(round_to(ev * r, dt, SOFT), SOFT)
    od = widen(round_to(od * r, dt, SOFT), SOFT)
    ev, od = _rotate(ev, od, cos_ptr + t * (ROPE // 2), sin_ptr + t * (ROPE // 2), D)
    y = tl.reshape(tl.join(ev, od), [BH, D])
    dst = (t.to(tl.int64) * PH + h)[:, None] * D + dims[None, :]
    tl.store(out_ptr + dst, round_to(y, dt, SOFT), mask=(h < PH)[:, None])


@triton.jit
def _kv_rows_kernel(kv_ptr, kv_stride, w_ptr, cos_ptr, sin_ptr, out_ptr, bad_ptr, eps, D: tl.constexpr,
                    DTYPE: tl.constexpr, SOFT: tl.constexpr):
    t = tl.program_id(0)
    dims = tl.arange(0, D)
    x = widen(tl.load(kv_ptr + t.to(tl.int64) * kv_stride + dims), SOFT)
    ev, od = tl.split(tl.reshape(x, [D // 2, 2]))
    w_ev, w_od = tl.split(tl.reshape(tl.load(w_ptr + dims), [D // 2, 2]))
    r = _rms_scale(ev, od, eps, D)
    ev = widen(round_to(ev * r * w_ev, DTYPE, SOFT), SOFT)           # (x·r)·w, as rms_norm multiplies
    od = widen(round_to(od * r * w_od, DTYPE, SOFT), SOFT)
    ev, od = _rotate(ev, od, cos_ptr + t * (ROPE // 2), sin_ptr + t * (ROPE // 2), D)
    y = tl.reshape(tl.join(ev, od), [D])
    tl.store(out_ptr + t.to(tl.int64) * D + dims, y)
    finite = (y.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) < BF16_INF_FROM     # finite once rounded to bf16
    tl.store(bad_ptr + t, tl.min(finite.to(tl.int32), 0) == 0)


@triton.jit
def _norm_rows_kernel(x_ptr, x_stride, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr, SOFT: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = widen(tl.load(x_ptr + t.to(tl.int64) * x_stride + cols, mask=m, other=0.0), SOFT)
    ms = tl.sum(x * x, axis=0) / N
    r = 1.0 / tl.sqrt_rn(ms + eps)
    y = x * r * tl.load(w_ptr + cols, mask=m, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * N + cols, round_to(y, out_ptr.dtype.element_ty, SOFT), mask=m)


@triton.jit
def _rotate_rows_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, D: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    dims = tl.arange(0, D)
    at = (t.to(tl.int64) * H + h)[:, None] * D + dims[None, :]
    x = tl.load(x_ptr + at, mask=(h < H)[:, None], other=0.0)
    ev, od = tl.split(tl.reshape(x, [BH, D // 2, 2]))
    ev, od = _rotate(ev, od, cos_ptr + t * (ROPE // 2), sin_ptr + t * (ROPE // 2), D)
    tl.store(out_ptr + at, tl.reshape(tl.join(ev, od), [BH, D]), mask=(h < H)[:, None])


_TL = {"torch.float32": tl.float32, "torch.bfloat16": tl.bfloat16, "torch.float16": tl.float16}


def _check_dim(D: int) -> None:
    if D < ROPE_DIM or D & (D - 1):
        raise ValueError(f"layer_front kernels take rows of a power-of-two width >= {ROPE_DIM}, not {D}")


def q_rows_kernel(q, cos, sin, *, padded_heads: int, eps: float, dtype, heads_per_program: int = 4,
                  num_warps: int = 4):
    """q [T, H, D] (bf16 or float32), cos/sin [T, 32] float32 -> [T, padded_heads, D] in `dtype`: per-head
    RMSNorm (float32, rounded to `dtype`), RoPE on the last 64 dims (float32, rounded to `dtype`), heads
    H..padded_heads-1 zero. Sync-free; one program per (token, `heads_per_program` heads)."""
    import torch

    T, H, D = q.shape
    _check_dim(D)
    if padded_heads < H:
        raise ValueError(f"q_rows_kernel: padded_heads={padded_heads} < {H} heads")
    out = torch.empty(T, padded_heads, D, dtype=dtype, device=q.device)
    if T and padded_heads:
        bh = min(heads_per_program, triton.next_power_of_2(padded_heads))
        _q_rows_kernel[(T, triton.cdiv(padded_heads, bh))](q.contiguous(), cos.float().contiguous(),
                                                           sin.float().contiguous(), out, H, padded_heads, eps,
                                                           D=D, BH=bh, SOFT=SOFT_ROUND,
                                                           num_warps=num_warps)
    return out


def kv_rows_kernel(kv, weight, cos, sin, *, eps: float, dtype, num_warps: int = 4):
    """kv [T, D] (rows may be strided: a column slice of the input projection), weight [D] float32,
    cos/sin [T, 32] float32 -> (rows [T, D] float32: RMSNorm with `weight` rounded to `dtype`, then RoPE;
    bad [T] bool: the row is not all finite). Sync-free; one program per token."""
    import torch

    T, D = kv.shape
    _check_dim(D)
    rows = torch.empty(T, D, dtype=torch.float32, device=kv.device)
    bad = torch.empty(T, dtype=torch.bool, device=kv.device)
    if T:
        if kv.stride(1) != 1:
            kv = kv.contiguous()
        _kv_rows_kernel[(T,)](kv, kv.stride(0), weight.float().contiguous(), cos.float().contiguous(),
                              sin.float().contiguous(), rows, bad, eps, D=D, DTYPE=_TL[str(dtype)],
                              SOFT=SOFT_ROUND, num_warps=num_warps)
    return rows, bad


def norm_rows_kernel(x, weight, *, eps: float, dtype, num_warps: int = 4):
    """x [T, N] (rows may be strided), weight [N] float32 -> [T, N] in `dtype`: x·rsqrt(mean(x²)+eps)·w in
    float32, as components.norms.rms_norm. Sync-free; one program per row."""
    import torch

    T, N = x.shape
    out = torch.empty(T, N, dtype=dtype, device=x.device)
    if T:
        if x.stride(1) != 1:
            x = x.contiguous()
        _norm_rows_kernel[(T,)](x, x.stride(0), weight.float().contiguous(), out, N, eps,
                                BLOCK=triton.next_power_of_2(N), SOFT=SOFT_ROUND, num_warps=num_warps)
    return out


def rotate_rows_kernel(x, cos, sin, *, heads_per_program: int = 8, num_warps: int = 4):
    """x [T, H, D] float32, cos/sin [T, 32] -> [T, H, D] float32 with RoPE on each head's last 64 dims."""
    import torch

    T, H, D = x.shape
    _check_dim(D)
    out = torch.empty_like(x, dtype=torch.float32)
    if T:
        bh = min(heads_per_program, triton.next_power_of_2(H))
        _rotate_rows_kernel[(T, triton.cdiv(H, bh))](x.float().contiguous(), cos.float().contiguous(),
                                                     sin.float().contiguous(), out, H, D=D, BH=bh, num_warps=num_warps)
    return out
