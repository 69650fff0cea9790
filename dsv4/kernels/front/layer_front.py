"""The front of the layer in one launch each (dsv4.components.front is the torch specification):

- `q_rows_kernel`: per (token, head) the published norm without weight, every step in the activation
  dtype, RoPE on the last 64 dims, rounded again, written into the head-padded buffer the MQA kernel reads
  (padded heads 0);
- `kv_rows_kernel`: RMSNorm with a weight, rounded to the activation dtype, RoPE, float32 rows, stored
  into their cache pages by the same program (a RowStore) or returned with the slots to store them at;
  rows that are not all finite are refused (not stored, slot -1) and flagged in the layer's faults;
- `norm_rows_kernel`: RMSNorm with a weight over rows of any width (the q_lora rows), in the activation dtype;
- `rotate_rows_kernel`: RoPE alone on every head of float32 rows (the indexer's queries), stored in a
  given dtype;
- `front_kernel`: the query heads, the indexer's query heads and the KV rows of a step as programs of one
  grid (each part as the kernels above make it; the indexer's queries also as deepgemm_fp8 scores them,
  e4m3 over a power-of-two scale per head that goes into the head's weight).

Inputs may be the float32 output of a wider product (a compressed layer's one product of x): they are
rounded to the activation dtype first, as that product in the activation dtype would give them.

Rows are read as (even, odd) pairs, so RoPE rotates pairs in registers; the norm is float32 with an IEEE
square root and division (`sqrt_rn`, `div_rn`: Triton's default rsqrt and `/` are approximate on NVIDIA),
so float32 results are within an ulp or two of torch's and bf16 ones nearly always equal.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.front.cache_write import NO_CACHE, STORE_POINTERS, fp8_heads, row_outputs, store_row
from dsv4.kernels.indexer.hadamard_fp4 import FP4_MAX_DIM, fp4_sim
from dsv4.kernels.products.fp8_linear import quantize_rows
from dsv4.formats.row_format import RowCode
from dsv4.kernels.launch import CompileCase, as_f32, as_i32, dependent_start, launch, rows_dense
from dsv4.kernels.rounding import BF16_INF_FROM, SOFT_ROUND, TL_DTYPES, round_to, widen
from dsv4.values.sizes import cdiv, next_pow2

ROPE_DIM = 64                       # RoPE dims: the last 64 of a row (dsv4.components.rope)
ROPE = tl.constexpr(ROPE_DIM)


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
def _q_part(t, hb, q_ptr, q_stride, cos_ptr, sin_ptr, out_ptr, H, PH, eps, D: tl.constexpr, BH: tl.constexpr,
            SOFT: tl.constexpr):
    """Heads hb·BH.. of token t's query (rows q_stride apart): the published per-head norm
    q·rsqrt(mean(q²) + eps) with every step in the activation dtype (the squares, their mean, the sum with
    eps, the rsqrt and the product each rounded, as the published code computes it on a tensor of that
    dtype), RoPE, into the head-padded buffer."""
    h = hb * BH + tl.arange(0, BH)
    dims = tl.arange(0, D)
    dt = out_ptr.dtype.element_ty
    src = t.to(tl.int64) * q_stride + h[:, None] * D + dims[None, :]
    x = tl.load(q_ptr + src, mask=(h < H)[:, None], other=0.0)               # padded heads: 0 -> 0
    if x.dtype != dt:                                      # a wider product's output, rounded as the linear's
        x = round_to(x.to(tl.float32), dt, SOFT)
    x = widen(x, SOFT)
    ev, od = tl.split(tl.reshape(x, [BH, D // 2, 2]))
    sq = tl.sum(widen(round_to(ev * ev, dt, SOFT), SOFT), axis=-1) + tl.sum(widen(round_to(od * od, dt, SOFT), SOFT),
                                                                           axis=-1)
    ms = widen(round_to(sq / D, dt, SOFT), SOFT)                     # D a power of two: exact
    a = widen(round_to(ms + eps, dt, SOFT), SOFT)
    r = widen(round_to(tl.div_rn(tl.full(a.shape, 1.0, tl.float32), tl.sqrt_rn(a)), dt, SOFT), SOFT)[:, None]
    ev = widen(round_to(ev * r, dt, SOFT), SOFT)
    od = widen(round_to(od * r, dt, SOFT), SOFT)
    ev, od = _rotate(ev, od, cos_ptr + t * (ROPE // 2), sin_ptr + t * (ROPE // 2), D)
    y = tl.reshape(tl.join(ev, od), [BH, D])
    dst = (t.to(tl.int64) * PH + h)[:, None] * D + dims[None, :]
    tl.store(out_ptr + dst, round_to(y, dt, SOFT), mask=(h < PH)[:, None])


@triton.jit
def _kv_part(t, kv_ptr, kv_stride, w_ptr, cos_ptr, sin_ptr, slot_ptr, out_ptr, store_ptr, faults_ptr, T, eps,
             cache_ptr, cache_bf_ptr, cache_w64_ptr, page_stride, n_slots, D: tl.constexpr, DTYPE: tl.constexpr,
             FAULT_ROWS: tl.constexpr, KIND: tl.constexpr, BS: tl.constexpr, SOFT: tl.constexpr):
    """Token t's KV row: RMSNorm with its weight, RoPE; stored (KIND: its cache's row code) or returned with
    its slot (KIND == NO_CACHE)."""
    dims = tl.arange(0, D)
    x = tl.load(kv_ptr + t.to(tl.int64) * kv_stride + dims)
    if x.dtype != DTYPE:                                             # a wider product's output: round as the
        x = round_to(x.to(tl.float32), DTYPE, SOFT)                  # linear's output in `DTYPE` would be
    x = widen(x, SOFT)
    ev, od = tl.split(tl.reshape(x, [D // 2, 2]))
    w_ev, w_od = tl.split(tl.reshape(tl.load(w_ptr + dims), [D // 2, 2]))
    r = _rms_scale(ev, od, eps, D)
    ev = widen(round_to(ev * r * w_ev, DTYPE, SOFT), SOFT)           # (x·r)·w, as rms_norm multiplies
    od = widen(round_to(od * r * w_od, DTYPE, SOFT), SOFT)
    ev, od = _rotate(ev, od, cos_ptr + t * (ROPE // 2), sin_ptr + t * (ROPE // 2), D)
    y = tl.reshape(tl.join(ev, od), [D])
    finite = (y.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) < BF16_INF_FROM     # finite once rounded to bf16
    bad = tl.min(finite.to(tl.int32), 0) == 0
    slot = tl.load(slot_ptr + t)
    if KIND == NO_CACHE:                                             # the rows and their slots, for the writer
        tl.store(out_ptr + t.to(tl.int64) * D + dims, y)
        tl.store(store_ptr + t, tl.where(bad, -1, slot))
    else:                                                            # stored here (RowStore)
        store_row(y, slot, ~bad, cache_ptr, cache_bf_ptr, cache_w64_ptr, page_stride, n_slots, D, BS, KIND, SOFT)
    tl.store(faults_ptr + t, bad & (slot >= 0))
    for i in tl.static_range(1, FAULT_ROWS):                         # the rows later kernels of the layer set
        tl.store(faults_ptr + i * T + t, False)


@triton.jit
def _rot_part(t, hb, x_ptr, x_stride, cos_ptr, sin_ptr, out_ptr, H, w_ptr, w_stride, w_scale, wq_ptr,
              D: tl.constexpr, BH: tl.constexpr, SOFT: tl.constexpr, FP4: tl.constexpr, FP8: tl.constexpr):
    """Heads hb·BH.. of token t of x [T, H, D] (float32 or bf16; rows x_stride apart): RoPE, then (FP4) the
    indexer's published numerics (dsv4/kernels/indexer/hadamard_fp4.py), stored in out's dtype; with FP8 rounded to bf16 and
    stored as e4m3 bytes over each head's power-of-two scale, which goes into its head weight:
    wq[t, h] = w[t, h] · w_scale · scale (the fp8 indexers' queries: indexer/key_layouts.fp8_queries)."""
    h = hb * BH + tl.arange(0, BH)
    dims = tl.arange(0, D)
    at = (t.to(tl.int64) * H + h)[:, None] * D + dims[None, :]
    src = t.to(tl.int64) * x_stride + h[:, None] * D + dims[None, :]
    x = widen(tl.load(x_ptr + src, mask=(h < H)[:, None], other=0.0), SOFT)
    ev, od = tl.split(tl.reshape(x, [BH, D // 2, 2]))
    ev, od = _rotate(ev, od, cos_ptr + t * (ROPE // 2), sin_ptr + t * (ROPE // 2), D)
    y = tl.reshape(tl.join(ev, od), [BH, D])
    if FP4:
        y = fp4_sim(y, BH, D, SOFT)
    if FP8:
        wv = tl.load(w_ptr + t.to(tl.int64) * w_stride + h, mask=h < H, other=0.0)
        q8, wq = fp8_heads(widen(round_to(y, tl.bfloat16, SOFT), SOFT), wv, w_scale)
        tl.store(out_ptr + at, q8, mask=(h < H)[:, None])
        tl.store(wq_ptr + t.to(tl.int64) * H + h, wq, mask=h < H)
    else:
        tl.store(out_ptr + at, round_to(y, out_ptr.dtype.element_ty, SOFT), mask=(h < H)[:, None])


@triton.jit(do_not_specialize=["NQ", "NI", "T"])     # step sizes: one variant for all
def _front_kernel(q_ptr, q_stride, qo_ptr, H, PH, NQ, iq_ptr, iq_stride, iqo_ptr, HI, NI, iw_ptr, iw_stride,
                  iw_scale, iwq_ptr, kv_ptr, kv_stride, w_ptr, cos_ptr, sin_ptr, slot_ptr, out_ptr, store_ptr,
                  faults_ptr, T, eps, cache_ptr, cache_bf_ptr, cache_w64_ptr, page_stride, n_slots,
                  D: tl.constexpr, BH: tl.constexpr, NQB: tl.constexpr, DI: tl.constexpr, BHI: tl.constexpr,
                  NIB: tl.constexpr, FP4: tl.constexpr, FP8: tl.constexpr, DTYPE: tl.constexpr,
                  FAULT_ROWS: tl.constexpr, KIND: tl.constexpr, BS: tl.constexpr, SOFT: tl.constexpr,
                  PDL: tl.constexpr = False):
    """Programs 0..NQ-1: query heads (NQB programs per token); the next NI: the indexer's query heads
    (NIB per token); the next T: KV rows. With PDL (a programmatic dependent) each waits for the kernel before
    it first, and lets the next one launch."""
    dependent_start(PDL)
    pid = tl.program_id(0)
    if pid < NQ:
        _q_part(pid // NQB, pid % NQB, q_ptr, q_stride, cos_ptr, sin_ptr, qo_ptr, H, PH, eps, D, BH, SOFT)
    elif pid < NQ + NI:
        _rot_part((pid - NQ) // NIB, (pid - NQ) % NIB, iq_ptr, iq_stride, cos_ptr, sin_ptr, iqo_ptr, HI, iw_ptr,
                  iw_stride, iw_scale, iwq_ptr, DI, BHI, SOFT, FP4, FP8)
    else:
        _kv_part(pid - NQ - NI, kv_ptr, kv_stride, w_ptr, cos_ptr, sin_ptr, slot_ptr, out_ptr, store_ptr, faults_ptr,
                 T, eps, cache_ptr, cache_bf_ptr, cache_w64_ptr, page_stride, n_slots, D, DTYPE, FAULT_ROWS, KIND, BS,
                 SOFT)


@triton.jit(do_not_specialize=["s_row", "s_col"])     # DeepGEMM's scale layout: strides follow T
def _norm_rows_kernel(x_ptr, x_stride, w_ptr, out_ptr, q_ptr, s_ptr, s_row, s_col, N, eps, BLOCK: tl.constexpr,
                      SOFT: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr = False):
    dependent_start(PDL)
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(x_ptr + t.to(tl.int64) * x_stride + cols, mask=m, other=0.0)
    dt = out_ptr.dtype.element_ty
    if x.dtype != dt:                                     # a wider product's output, rounded as the linear's
        x = round_to(x.to(tl.float32), dt, SOFT)
    x = widen(x, SOFT)
    ms = tl.sum(x * x, axis=0) / N
    r = 1.0 / tl.sqrt_rn(ms + eps)
    y = round_to(x * r * tl.load(w_ptr + cols, mask=m, other=0.0), dt, SOFT)
    if FP8:         # the row as an fp8 linear reads it: e4m3 and one power-of-two scale per 128 values
        q, scale = quantize_rows(tl.reshape(widen(y, SOFT), [BLOCK // 128, 128]), SOFT)
        blk = tl.arange(0, BLOCK // 128)
        live = blk < N // 128
        tl.store(q_ptr + t.to(tl.int64) * N + tl.reshape(cols, [BLOCK // 128, 128]), q.to(tl.float8e4nv),
                 mask=live[:, None])
        tl.store(s_ptr + t.to(tl.int64) * s_row + blk * s_col, scale, mask=live)
    else:
        tl.store(out_ptr + t.to(tl.int64) * N + cols, y, mask=m)


@triton.jit
def _rotate_rows_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, D: tl.constexpr, BH: tl.constexpr, SOFT: tl.constexpr,
                        PDL: tl.constexpr = False):
    dependent_start(PDL)
    _rot_part(tl.program_id(0), tl.program_id(1), x_ptr, H * D, cos_ptr, sin_ptr, out_ptr, H, x_ptr, 0, 1.0, x_ptr,
              D, BH, SOFT, False, False)


def _check_dim(D: int) -> None:
    if D < ROPE_DIM or D & (D - 1):
        raise ValueError(f"layer_front kernels take rows of a power-of-two width >= {ROPE_DIM}, not {D}")


def front_kernel(q, kv, weight, cos, sin, slots, faults, *, padded_heads: int, eps: float, dtype, into=None,
                 iq=None, iq_dtype=None, iq_fp4: bool = False, iq_weights=None, iq_w_scale: float = 1.0,
                 heads_per_program: int = 4, num_warps: int = 4, pdl: bool = False):
    """The front of the layer in one launch: `q_rows_kernel` on q [T, H, D], `kv_rows_kernel` on kv [T, D] and
    `rotate_rows_kernel` on the indexer's queries iq [T, Hi, Di] (float32 or bf16, stored in `iq_dtype`; with
    `iq_fp4` then rotated and FP4-simulated as the published code does, dsv4/kernels/indexer/hadamard_fp4.py); any may be
    None, the other arguments as theirs -> (q_rows_kernel's result, kv_rows_kernel's, the queries'; None for
    an absent part). Each part's rows are separate programs of one grid. The rows of q and iq may be strided
    (column blocks of one product: the layer's one product of qr gives both).

    With `iq_dtype` float8_e4m3fn the queries come out as `key_layouts.fp8_queries` makes them from the
    bf16-rounded rows and the head weights `iq_weights` [T, Hi] float32 (rows may be strided) with
    `iq_w_scale`: (e4m3 [T, 1, Hi, Di], the folded weights [T, Hi] float32). `pdl`: launched as a programmatic
    dependent (Target.pdl)."""
    import torch

    if q is None and kv is None and iq is None:
        raise ValueError("front_kernel: no query, KV or indexer query rows")
    T, D = (q.shape[0], q.shape[2]) if q is not None else kv.shape if kv is not None else (iq.shape[0], ROPE_DIM)
    _check_dim(D)
    some = next(t for t in (q, kv, iq) if t is not None)
    q_out, nq, nqb, H, bh = None, 0, 1, 0, 1
    if q is not None:
        H = q.shape[1]
        if padded_heads < H:
            raise ValueError(f"q_rows_kernel: padded_heads={padded_heads} < {H} heads")
        q_out = torch.empty(T, padded_heads, D, dtype=dtype, device=q.device)
        bh = min(heads_per_program, next_pow2(max(padded_heads, 1)))
        nqb = cdiv(padded_heads, bh)
        nq = T * nqb if padded_heads else 0
        q = rows_dense(q)
    iq_out, ni, nib, hi, di, bhi = None, 0, 1, 0, ROPE_DIM, 1
    fp8, iw, iwq = iq is not None and iq_dtype == torch.float8_e4m3fn, some, some
    if iq is not None:
        hi, di = iq.shape[1], iq.shape[2]
        _check_dim(di)
        if iq_fp4 and di > FP4_MAX_DIM:
            raise ValueError(f"front_kernel: FP4 numerics on query heads of {di} dims (at most {FP4_MAX_DIM})")
        if iq.shape[0] != T:
            raise ValueError(f"front_kernel: indexer queries {tuple(iq.shape)} for {T} tokens")
        iq = rows_dense(iq)
        if fp8:
            if iq_weights is None or iq_weights.shape != (T, hi) or iq_weights.dtype != torch.float32:
                raise ValueError(f"front_kernel: fp8 indexer queries need their head weights, [{T}, {hi}] float32")
            iw = rows_dense(iq_weights)
            iwq = torch.empty(T, hi, dtype=torch.float32, device=iq.device)
            iq_out = torch.empty(T, 1, hi, di, dtype=torch.uint8, device=iq.device)
        else:
            iq_out = torch.empty(T, hi, di, dtype=iq_dtype or torch.float32, device=iq.device)
        bhi = min(8, next_pow2(max(hi, 1)))
        nib = cdiv(hi, bhi)
        ni = T * nib
    tk, kv_out = 0, None
    if kv is not None:
        if kv.shape != (T, D):
            raise ValueError(f"front_kernel: KV rows {tuple(kv.shape)} for {T} tokens of {D} dims")
        tk = T
        rows, store, (out, st, *cache), kind, bs = row_outputs("kv_rows_kernel", into, faults, 0, T, D, kv.device)
        kv_out = None if into is not None else (rows, store)
        kv = rows_dense(kv)
        kv_args = (kv, kv.stride(0), as_f32(weight), as_f32(cos), as_f32(sin), as_i32(slots), out, st, faults, T,
                   eps, *cache)
        fault_rows = faults.shape[0]
    else:                        # no KV programs: placeholders of the right types for the unused arguments
        kind, bs, fault_rows = 0, 1, 1
        f32, i32 = as_f32(cos), torch.empty(1, dtype=torch.int32, device=some.device)
        flags = torch.empty(1, 1, dtype=torch.bool, device=some.device)
        kv_args = (some, 0, f32, f32, as_f32(sin), i32, f32, i32, flags, 0, eps, f32, f32, f32, 0, 0)
    if nq + ni + tk:
        launch(_front_kernel, (nq + ni + tk,), q if q is not None else some, q.stride(0) if q is not None else 0,
               q_out if q_out is not None else some, H, padded_heads, nq, iq if iq is not None else some,
               iq.stride(0) if iq is not None else 0, iq_out if iq_out is not None else some, hi, ni,
               iw, iw.stride(0) if fp8 else 0, float(iq_w_scale), iwq, *kv_args, D=D, BH=bh, NQB=nqb, DI=di, BHI=bhi,
               NIB=nib, FP4=bool(iq_fp4), FP8=fp8, DTYPE=TL_DTYPES[str(dtype)], FAULT_ROWS=fault_rows, KIND=kind,
               BS=bs, SOFT=SOFT_ROUND, PDL=pdl, launch_pdl=pdl, num_warps=num_warps)
    if fp8:
        iq_out = (iq_out.view(torch.float8_e4m3fn), iwq)
    return q_out, kv_out, iq_out


def q_rows_kernel(q, cos, sin, *, padded_heads: int, eps: float, dtype, heads_per_program: int = 4,
                  num_warps: int = 4):
    """q [T, H, D] (bf16 or float32), cos/sin [T, 32] float32 -> [T, padded_heads, D] in `dtype`: per-head
    RMSNorm (float32, rounded to `dtype`), RoPE on the last 64 dims (float32, rounded to `dtype`), heads
    H..padded_heads-1 zero. Sync-free; one program per (token, `heads_per_program` heads)."""
    return front_kernel(q, None, None, cos, sin, None, None, padded_heads=padded_heads, eps=eps, dtype=dtype,
                        heads_per_program=heads_per_program, num_warps=num_warps)[0]


def kv_rows_kernel(kv, weight, cos, sin, slots, faults, *, eps: float, dtype, into=None, num_warps: int = 4):
    """The SWA rows of a step, stored where the plan puts them.

    kv [T, D] (the input projection's columns, in `dtype` or float32 -- then rounded to `dtype` first, as
    the projection's output in `dtype` would be; rows may be strided), weight [D] float32, cos/sin [T, 32]
    float32, slots [T] int32 (-1: none). Each row: RMSNorm with `weight` rounded to `dtype`, then RoPE, in
    float32; refused where it is not all finite once rounded to bf16. With `into` (a cache's RowStore) the
    rows are stored there and nothing is returned; without, -> (rows [T, D] float32, store [T] int32:
    `slots`, -1 for refused rows) for the cache's writer (`PagedCache.write`). Writes faults[0] (a refused row of a
    token with a slot) and clears faults[1:] ([F, T] bool, for the layer's later kernels). Sync-free; one
    program per token."""
    return front_kernel(None, kv, weight, cos, sin, slots, faults, padded_heads=0, eps=eps, dtype=dtype, into=into,
                        num_warps=num_warps)[1]


def norm_rows_kernel(x, weight, *, eps: float, dtype, fp8: bool = False, num_warps: int = 4, pdl: bool = False):
    """x [T, N] (in `dtype` or float32 -- then rounded to `dtype` first; rows may be strided), weight [N]
    float32 -> [T, N] in `dtype`: x·rsqrt(mean(x²)+eps)·w in float32, as components.norms.rms_norm. With
    `fp8` (N a multiple of 128) the rows as an fp8 linear reads them instead: (e4m3 [T, N], float32 scales
    [T, N/128] in DeepGEMM's block-major layout), `act_quant` of the `dtype` rows. Sync-free; one program
    per row; `pdl`: launched as a programmatic dependent (Target.pdl)."""
    import torch

    from dsv4.kernels.products.fp8_linear import fp8_scales

    T, N = x.shape
    if fp8:
        out = torch.empty(1, dtype=dtype, device=x.device)
        q = torch.empty(T, N, dtype=torch.float8_e4m3fn, device=x.device)
        s = fp8_scales(T, N, x.device, mn_major=True)
    else:
        out = torch.empty(T, N, dtype=dtype, device=x.device)
        q = s = out
    if T:
        x = rows_dense(x)
        launch(_norm_rows_kernel, (T,), x, x.stride(0), as_f32(weight), out, q, s, s.stride(0),
               s.stride(-1), N, eps, BLOCK=next_pow2(N), SOFT=SOFT_ROUND, FP8=fp8, PDL=pdl, launch_pdl=pdl,
               num_warps=num_warps)
    return (q, s) if fp8 else out


def rotate_rows_kernel(x, cos, sin, *, dtype=None, heads_per_program: int = 8, num_warps: int = 4, pdl: bool = False):
    """x [T, H, D] float32, cos/sin [T, 32] -> [T, H, D] with RoPE on each head's last 64 dims, in float32,
    stored in `dtype` (float32 if None); `pdl`: launched as a programmatic dependent (Target.pdl)."""
    import torch

    T, H, D = x.shape
    _check_dim(D)
    out = torch.empty(T, H, D, dtype=dtype or torch.float32, device=x.device)
    if T:
        bh = min(heads_per_program, next_pow2(H))
        launch(_rotate_rows_kernel, (T, cdiv(H, bh)), as_f32(x), as_f32(cos), as_f32(sin), out, H, D=D,
               BH=bh, SOFT=SOFT_ROUND, PDL=pdl, launch_pdl=pdl, num_warps=num_warps)
    return out


def compile_cases(gpu) -> list[CompileCase]:
    """The front, q_lora norm and rotation kernels as their wrappers launch them: bf16 and
    float32 activations, the SWA projection's output in them or in float32, 64 heads of 512 dims and the
    indexer's 8 of 128; rows handed back, or stored as fp8_ds_mla records (OCP, with the fp8 indexers' e4m3
    queries; FNUZ) or plain bf16 rows (with the FP4 numerics on the indexer's queries); the norm's rows as they
    are or as an fp8 linear reads them; as programmatic dependents on NVIDIA GPUs that launch them so."""
    from dsv4.kernels.target import gpu_launches_dependents

    pdl = gpu_launches_dependents(gpu)
    cases = []
    rope = {"cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    for dt, name in ((tl.bfloat16, "*bf16"), (tl.float32, "*fp32")):
        for kv in {name, "*fp32"}:                       # the SWA projection's output, or the float32 one
            for kind, cache in STORE_POINTERS[:4]:
                fp8 = kind == RowCode.FP8_DS_MLA
                cases.append(CompileCase(
                    kernel=_front_kernel, constexprs=dict(D=512, BH=4, NQB=16, DI=128, BHI=8, NIB=8, DTYPE=dt,
                                                          FP4=kind == RowCode.PLAIN or fp8, FP8=fp8, FAULT_ROWS=3,
                                                          KIND=kind, BS=64, SOFT=False, PDL=pdl),
                    pointers={**rope, **cache, "q_ptr": name, "qo_ptr": name, "iq_ptr": name,
                              "iqo_ptr": "*u8" if fp8 else name, "iw_ptr": "*fp32", "iwq_ptr": "*fp32", "kv_ptr": kv,
                              "w_ptr": "*fp32", "slot_ptr": "*i32", "out_ptr": "*fp32", "store_ptr": "*i32",
                              "faults_ptr": "*i1"},
                    floats=frozenset({"eps", "iw_scale"}), divisible=frozenset({"kv_stride", "H", "PH", "HI",
                                                                                "iw_stride"})))
            for fp8 in (False, True):                     # the rows, or as an fp8 linear reads them
                cases.append(CompileCase(
                    kernel=_norm_rows_kernel, constexprs=dict(BLOCK=1024, SOFT=False, FP8=fp8, PDL=pdl),
                    pointers={"x_ptr": kv, "w_ptr": "*fp32", "out_ptr": name, "q_ptr": "*fp8e4nv" if fp8 else name,
                              "s_ptr": "*fp32" if fp8 else name},
                    floats=frozenset({"eps"}), divisible=frozenset({"x_stride", "N", "s_row", "s_col"})))
        cases.append(CompileCase(kernel=_rotate_rows_kernel, constexprs=dict(D=128, BH=8, SOFT=False, PDL=pdl),
                                 pointers={**rope, "x_ptr": "*fp32", "out_ptr": name}, divisible=frozenset({"H"})))
    return cases
