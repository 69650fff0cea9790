"""The front of the layer (docs/numerics.md §2.2 steps 2-4): normalised, rotated query and KV rows.

Each function is written once in torch (the CPU path, and the reference the kernels are tested
against) and, given `kernels` (the device's Target, which the layer resolves once when it is built), runs
our fused Triton kernel instead (dsv4/kernels/front/layer_front.py): one launch instead of a dozen small ones,
which is what makes the step cost what its GEMMs cost; `front_rows` makes the query rows (and the
indexer's) and stores the KV rows in one launch. `kernels` None: the torch code, on CPU tensors.

Rounding follows the layer's activation dtype `dtype` exactly as the unfused math does: RMSNorm in
float32, rounded to `dtype`, RoPE in float32 (then rounded to `dtype` for queries; KV rows stay float32
for the cache layout to round as it stores them).
"""
from __future__ import annotations

from dsv4.components.norms import rms_norm
from dsv4.kernels.target import Target, check_kernels
from dsv4.values.seam import RopeRows


def q_rows(q, rot: RopeRows, *, padded_heads: int, eps: float, dtype, kernels: Target | None = None):
    """q [T, H, D] -> [T, padded_heads, D] in `dtype`: per head the published q·rsqrt(mean(q²) + eps) computed
    in `dtype` (as the published code computes it on its bf16 tensor: each step rounded), RoPE on the last
    64 dims in float32, rounded; heads past H zero (the padded buffer the MQA kernel reads, written once)."""
    check_kernels(kernels, q, "q_rows")
    if kernels is not None:
        from dsv4.kernels.front.layer_front import q_rows_kernel
        return q_rows_kernel(q, rot.cos, rot.sin, padded_heads=padded_heads, eps=eps, dtype=dtype)
    import torch

    T, H, D = q.shape
    qd = q.to(dtype)
    a = qd.square().mean(-1, keepdim=True) + eps                      # in `dtype`, each step rounded
    # the nearest `dtype` value of its rsqrt, as CUDA's gives it (torch's CPU bf16 rsqrt is not always the
    # nearest: 11 of 30 heads here once)
    y = rot.rotate(qd * torch.rsqrt(a.float()).to(dtype)).to(dtype)
    if padded_heads == H:
        return y
    return torch.cat((y, y.new_zeros(T, padded_heads - H, D)), 1)


def kv_rows(kv, weight, rot: RopeRows, slots, faults, *, eps: float, dtype, kernels: Target | None = None):
    """kv [T, D] (in `dtype`, or float32: then rounded to `dtype` first, as a projection in `dtype` would
    give it), slots [T] int32 (the plan's SWA write slots, -1: none) -> (rows [T, D] float32: RMSNorm
    with `weight`, rounded to `dtype`, RoPE; store [T] int32: `slots`, -1 where the row is refused,
    `stored_badly`). Sets faults[0] where a token with a slot has its row refused and clears the other
    rows of faults ([F, T] bool, the layer's fault flags, which its later steps set)."""
    check_kernels(kernels, kv, "kv_rows")
    if kernels is not None:
        from dsv4.kernels.front.layer_front import kv_rows_kernel
        return kv_rows_kernel(kv, weight, rot.cos, rot.sin, slots, faults, eps=eps, dtype=dtype)
    import torch

    rows = rot.rotate(rms_norm(kv.to(dtype), weight, eps).to(dtype))
    bad = stored_badly(rows)
    faults.zero_()
    faults[0] = bad & (slots >= 0)
    return rows, torch.where(bad, -1, slots)


def front_rows(q, kv, weight, rot: RopeRows, slots, faults, cache, *, padded_heads: int, eps: float, dtype,
               iq=None, iq_dtype=None, iq_fp4: bool = False, iq_weights=None, iq_w_scale: float = 1.0,
               kernels: Target | None = None):
    """The front of the layer: `q_rows` of q and `kv_rows` of kv, stored into `cache` (a PagedCache) at their
    slots; -> (q rows, the indexer's queries or None). Given `kernels`, one kernel does both and, given the
    indexer's queries iq, makes them too (RoPE, then with `iq_fp4` the published FP4 numerics, into
    `iq_dtype`; for e4m3, with their head weights `iq_weights` folded, as `front_kernel` says); it stores
    the KV rows itself where the cache's layout has a kernel store, otherwise they go through the layout's
    `write`. In torch the indexer's queries are left to `Indexer.queries`."""
    check_kernels(kernels, q, "front_rows")
    if kernels is not None:
        from dsv4.kernels.front.layer_front import front_kernel
        q_out, rows, iq_out = front_kernel(q, kv, weight, rot.cos, rot.sin, slots, faults, padded_heads=padded_heads,
                                           eps=eps, dtype=dtype, into=cache.store, iq=iq, iq_dtype=iq_dtype,
                                           iq_fp4=iq_fp4, iq_weights=iq_weights, iq_w_scale=iq_w_scale)
    else:
        q_out, iq_out = q_rows(q, rot, padded_heads=padded_heads, eps=eps, dtype=dtype), None
        rows = kv_rows(kv, weight, rot, slots, faults, eps=eps, dtype=dtype)
    if rows is not None:
        cache.write(rows[1], rows[0])
    return q_out, iq_out


def stored_badly(rows):
    """[N] bool: rows not finite once rounded to bf16 -- a float32 row past bf16's range (|x| >= 3.3961e38)
    would be stored as inf, or in fp8_ds_mla as an exponent byte of 255 that poisons its 64-dim block."""
    import torch

    return ~torch.isfinite(rows.bfloat16()).all(-1)


def norm_rows(x, weight, *, eps: float, dtype, fp8: bool = False, kernels: Target | None = None):
    """RMSNorm of x [T, N] (in `dtype`, or float32: rounded to `dtype` first) with `weight`, in float32,
    rounded to `dtype` (the q_lora rows); with `fp8`, those rows as an fp8 linear reads them (Fp8Rows:
    act_quant of the `dtype` rows, written by the norm's own kernel given `kernels`)."""
    from dsv4.formats.fp8_blocks import Fp8Rows, act_quant

    check_kernels(kernels, x, "norm_rows")
    if kernels is not None:
        from dsv4.kernels.front.layer_front import norm_rows_kernel
        out = norm_rows_kernel(x, weight, eps=eps, dtype=dtype, fp8=fp8)
        return Fp8Rows(values=out[0], scales=out[1], dtype=dtype) if fp8 else out
    rows = rms_norm(x.to(dtype), weight, eps).to(dtype)
    return Fp8Rows(*act_quant(rows), dtype=dtype) if fp8 else rows


def rotate_rows(x, rot: RopeRows, dtype=None, *, kernels: Target | None = None):
    """x [T, H, D] -> RoPE on each head's last 64 dims, in float32, returned in `dtype` (float32 if None;
    the indexer's queries, rounded to its keys' dtype)."""
    check_kernels(kernels, x, "rotate_rows")
    if kernels is not None:
        from dsv4.kernels.front.layer_front import rotate_rows_kernel
        return rotate_rows_kernel(x, rot.cos, rot.sin, dtype=dtype)
    y = rot.rotate(x)
    return y if dtype is None else y.to(dtype)
