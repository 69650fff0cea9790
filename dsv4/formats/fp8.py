"""e4m3 facts and the per-tensor rounding that a cache layout, a kernel adapter and the indexer's records
share (docs/numerics.md §3)."""
from __future__ import annotations

E4M3_MAX = 448.0          # OCP e4m3's largest finite value
E4M3_MIN_SUBNORMAL = 2.0 ** -9   # OCP e4m3's smallest step: half of it and less is stored as 0
FNUZ_NAN = 0x80           # e4m3fnuz's one NaN byte (and OCP e4m3's negative zero)


def e4m3_dtype():
    import torch

    return torch.float8_e4m3fn


def e4m3_over(x, scale: float):
    """e4m3(x / scale), clamped to e4m3's range: a per-tensor fp8 row or query (float8_e4m3fn)."""
    import torch

    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def per_tensor_query(fmt, q):
    """q as a kernel reading rows of the per-tensor format `fmt` takes it in fp8: e4m3(q / q_scale)."""
    return e4m3_over(q, fmt.q_scale)


def per_tensor_scales(fmt, softmax_scale: float) -> tuple[float, float]:
    """(bmm1_scale, bmm2_scale) for fp8 queries over rows of the per-tensor format `fmt`:
    logits = bmm1 · q8·k8, out = bmm2 · P·v8."""
    return softmax_scale * fmt.q_scale * fmt.kv_scale, fmt.kv_scale
