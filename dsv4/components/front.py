"""The front of the layer (docs/numerics.md §2.2 steps 2-4): normalised, rotated query and KV rows.

Each function here is the torch code: the CPU path, and the reference the kernels are tested against. On a
GPU the layer's Triton ops (dsv4/components/layer_ops.py, chosen once when the layer is built) run our fused
kernels instead (dsv4/kernels/front/layer_front.py): one launch instead of a dozen small ones, which is what
makes the step cost what its GEMMs cost; there one launch makes the query rows (and the indexer's) and
stores the KV rows.

Rounding follows the layer's activation dtype `dtype` exactly as the unfused math does: RMSNorm in
float32, rounded to `dtype`, RoPE in float32 (then rounded to `dtype` for queries; KV rows stay float32
for the cache layout to round as it stores them).
"""
from __future__ import annotations

from dsv4.components.norms import rms_norm
from dsv4.values.seam import RopeRows


def q_rows(q, rot: RopeRows, *, padded_heads: int, eps: float, dtype):
    """q [T, H, D] -> [T, padded_heads, D] in `dtype`: per head the published q·rsqrt(mean(q²) + eps) computed
    in `dtype` (as the published code computes it on its bf16 tensor: each step rounded), RoPE on the last
    64 dims in float32, rounded; heads past H zero (the padded buffer the MQA kernel reads, written once)."""
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


def kv_rows(kv, weight, rot: RopeRows, slots, faults, *, eps: float, dtype):
    """kv [T, D] (in `dtype`, or float32: then rounded to `dtype` first, as a projection in `dtype` would
    give it), slots [T] int32 (the plan's SWA write slots, -1: none) -> (rows [T, D] float32: RMSNorm
    with `weight`, rounded to `dtype`, RoPE; store [T] int32: `slots`, -1 where the row is refused,
    `stored_badly`). Sets faults[0] where a token with a slot has its row refused and clears the other
    rows of faults ([F, T] bool, the layer's fault flags, which its later steps set)."""
    import torch

    rows = rot.rotate(rms_norm(kv.to(dtype), weight, eps).to(dtype))
    bad = stored_badly(rows)
    faults.zero_()
    faults[0] = bad & (slots >= 0)
    return rows, torch.where(bad, -1, slots)


def front_rows(q, kv, weight, rot: RopeRows, slots, faults, cache, *, padded_heads: int, eps: float, dtype,
               iq=None, iq_dtype=None, iq_fp4: bool = False, iq_weights=None, iq_w_scale: float = 1.0):
    """The front of the layer: `q_rows` of q and `kv_rows` of kv, stored into `cache` (a PagedCache) at their
    slots through the cache's writer; -> (q rows, None). The indexer's queries (iq and the arguments after
    it, which the Triton ops' one launch takes) are left to `Indexer.queries` here (`LayerOps.front_queries`)."""
    q_out = q_rows(q, rot, padded_heads=padded_heads, eps=eps, dtype=dtype)
    rows, store = kv_rows(kv, weight, rot, slots, faults, eps=eps, dtype=dtype)
    cache.write(store, rows)
    return q_out, None


def stored_badly(rows):
    """[N] bool: rows not finite once rounded to bf16 -- a float32 row past bf16's range (|x| >= 3.3961e38)
    would be stored as inf, or in fp8_ds_mla as an exponent byte of 255 that poisons its 64-dim block."""
    import torch

    return ~torch.isfinite(rows.bfloat16()).all(-1)


def norm_rows(x, weight, *, eps: float, dtype, fp8: bool = False):
    """RMSNorm of x [T, N] (in `dtype`, or float32: rounded to `dtype` first) with `weight`, in float32,
    rounded to `dtype` (the q_lora rows); with `fp8`, those rows as an fp8 linear reads them (Fp8Rows:
    act_quant of the `dtype` rows)."""
    from dsv4.formats.fp8_blocks import Fp8Rows, act_quant

    rows = rms_norm(x.to(dtype), weight, eps).to(dtype)
    return Fp8Rows(*act_quant(rows), dtype=dtype) if fp8 else rows


def rotate_rows(x, rot: RopeRows, dtype=None):
    """x [T, H, D] -> RoPE on each head's last 64 dims, in float32, returned in `dtype` (float32 if None;
    the indexer's queries, rounded to its keys' dtype)."""
    y = rot.rotate(x)
    return y if dtype is None else y.to(dtype)
