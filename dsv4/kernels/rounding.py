"""How our kernels round floats, bit for bit as torch does, compiled and under the interpreter."""
from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.launch import interpreted

# float32 bit patterns from here up (|x| >= 3.3961e38, inf, NaN) are not finite once rounded to bf16: the rows
# dsv4.components.front.stored_badly refuses to store
BF16_INF_FROM: tl.constexpr = tl.constexpr(0x7F7F8000)

# The interpreter converts between float32 and bf16 wrongly (rounding half-up without carrying into the
# exponent, subnormals; Triton 3.6-3.9), so there both directions are integer arithmetic; compiled kernels
# use the hardware's conversions (ties to even, as torch rounds).
SOFT_ROUND = interpreted()

# a torch dtype's Triton type, by str(dtype) (no torch import here)
TL_DTYPES = {"torch.float32": tl.float32, "torch.bfloat16": tl.bfloat16, "torch.float16": tl.float16}


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
