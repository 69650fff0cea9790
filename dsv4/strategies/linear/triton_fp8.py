"""linear=triton_fp8: the published fp8 linear through our Triton product (dsv4/kernels/products/fp8_linear.py,
NVIDIA sm89+): the activation rows are quantized inside the product's own kernel, so a projection is
one launch."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from dsv4.formats.fp8_blocks import LinearNumerics
from dsv4.kernels import FEW_ROWS, FP8_TRITON_ARCHS
from dsv4.strategies.linear.common import Fp8Linear, fp8_needs, triton_blocks, triton_product
from dsv4.strategies.protocols import LinearWeight, Needs


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonFp8Linear:
    """Our Triton block-scaled e4m3 product, its launch planned from the step's rows and the device (under
    batch_invariant=true from the weight's shape alone)."""
    name: str = "triton_fp8"
    error_budget: ClassVar[float] = 3e-2        # vs the oracle with fp8 numerics: bf16 rounding moves e4m3 edges
    numerics: ClassVar[LinearNumerics] = LinearNumerics.FP8
    fp8_input: ClassVar[bool] = True
    float_tail_rows: ClassVar[int] = FEW_ROWS     # x's products in one launch (kernels/products/joint_linear.py)

    def needs(self, device) -> Needs:
        # batch_invariant=true: one launch for every row count (kernels/products/fp8_linear.py fixed_plan)
        return replace(fp8_needs(platforms={"cuda"}, archs=FP8_TRITON_ARCHS, modules=(("triton", "triton"),)),
                       batch_invariant=True)

    def prepare(self, weight: LinearWeight, *, device, dtype: str, batch_invariant: bool = False) -> Fp8Linear:
        return triton_blocks(weight, device, fixed_order=batch_invariant)

    def __call__(self, x, prepared: Fp8Linear, *, out_dtype=None):
        return triton_product(x, prepared, out_dtype)
