"""The published indexer numerics inside our kernels (dsv4.formats.fp4 is the torch specification):
the Hadamard rotation of a row (Sylvester order, float32 butterflies, scale n^-1/2, one rounding to bf16)
and FP4 e2m1 simulation with one power-of-two scale per 32 values, bit for bit as `rotate` and `fp4_qdq`
compute them; and the FP4 key record of indexer=mxfp4 (dsv4/strategies/indexer/key_layouts.py).

Every step is exact or one IEEE rounding, in the same order as the torch code: the butterflies pair the
same values stage by stage; the block scale comes from the float bits of amax·fp32(1/6) (the exponent,
plus one unless the mantissa is 0, as `pow2_ceil`); x / scale is exact; the e2m1 rounding (to nearest, ties
to even, steps 0.5, 1 and 2) is floor-and-compare arithmetic on exact values.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.rounding import round_to, widen

FP4_MAX_DIM = 4096            # the widest row `hadamard` rotates (its 12 butterfly stages)


@triton.jit
def hadamard(y, R: tl.constexpr, N: tl.constexpr):
    """y [R, N] float32 (N a power of two up to 4096) -> y·H per row (H Sylvester's, unscaled): log2(N)
    butterfly stages, stage s pairing values 2^s apart within blocks of 2^(s+1), as `rotate`."""
    for s in tl.static_range(12):
        if (1 << s) < N:                                          # h = 2^s: [R, N/2h, 2, h] -> [R, N/2h, h, 2]
            pairs = tl.permute(tl.reshape(y, [R, N // (2 << s), 2, 1 << s]), (0, 1, 3, 2))
            a, b = tl.split(pairs)
            y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [R, N])
    return y


@triton.jit
def fp4_blocks(x, R: tl.constexpr, N: tl.constexpr):
    """x [R, N] float32 (bf16 values) -> (e2m1 values [R, N/32, 32] float32, signed; block scales [R, N/32]
    float32 powers of two), as `_fp4_blocks`."""
    xb = tl.reshape(x, [R, N // 32, 32])
    amax = tl.maximum(tl.max(tl.abs(xb), 2), 6.0 * 2.0 ** -126)
    bits = (amax * 0.16666666666666666).to(tl.int32, bitcast=True)        # amax·fp32(1/6)
    s = ((((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)) << 23).to(tl.float32, bitcast=True)
    # a block holding a NaN or an infinity: torch's amax is NaN or inf, whose pow2_ceil is 1 (frexp's
    # exponent 0); here the maximum drops NaNs, so the block is found by its values
    odd = tl.max(((xb != xb) | (tl.abs(xb) == float("inf"))).to(tl.int32), 2) > 0
    s = tl.where(odd, 1.0, s)
    v = xb / s[:, :, None]
    v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -6.0), 6.0))          # NaN stays NaN, as torch.clamp
    a = tl.abs(v)
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    q = a / step                                                            # exact: step is a power of two
    fl = tl.floor(q)
    up = (q - fl > 0.5) | ((q - fl == 0.5) & ((fl.to(tl.int32) & 1) == 1))
    r = (fl + up.to(tl.float32)) * step
    # the sign bit of v (also of -0.0) set by integer arithmetic: a compiled float negation or select of
    # a zero may give +0.0, where torch's copysign keeps the sign
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True), s


@triton.jit
def fp4_sim(y, R: tl.constexpr, N: tl.constexpr, SOFT: tl.constexpr):
    """Rows y [R, N] float32 -> fp4_qdq(rotate(y)) as float32 (bf16 values): y rounded to bf16, rotated,
    scaled by N^-1/2 and rounded to bf16, then FP4-quantized and dequantized."""
    x = widen(round_to(y, tl.bfloat16, SOFT), SOFT)
    x = widen(round_to(hadamard(x, R, N) * (N ** -0.5), tl.bfloat16, SOFT), SOFT)
    v, s = fp4_blocks(x, R, N)
    return tl.reshape(v * s[:, :, None], [R, N])


@triton.jit
def fp4_record(x, slot, u8_ptr, page_stride, BS: tl.constexpr, N: tl.constexpr):
    """Store row x [N] (FP4-simulated values, as `fp4_sim` gives them) as the mxfp4 record of `slot`: its
    N/2 code bytes (the even dim in the low nibble) at page·page_stride + t·N/2, its N/32 scale bytes
    (2^(e-127)) at page·page_stride + BS·N/2 + t·N/32."""
    v, s = fp4_blocks(tl.reshape(x, [1, N]), 1, N)
    a = tl.abs(v)
    index = tl.where(a < 2.0, 2.0 * a, tl.where(a < 6.0, a + 2.0, 7.0)).to(tl.int32)
    codes = tl.reshape(index | ((v.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 3), [N // 2, 2])
    lo, hi = tl.split(codes)
    page = (slot // BS).to(tl.int64)
    t = slot % BS
    base = page * page_stride
    tl.store(u8_ptr + base + t * (N // 2) + tl.arange(0, N // 2), (lo | (hi << 4)).to(tl.uint8))
    exps = tl.reshape((s.to(tl.int32, bitcast=True) >> 23) & 0xFF, [N // 32])
    tl.store(u8_ptr + base + BS * (N // 2) + t * (N // 32) + tl.arange(0, N // 32), exps.to(tl.uint8))
