"""linear=deepgemm_triton_fp8: the published fp8 linear through our Triton product for steps of few rows
and DeepGEMM's `fp8_gemm_nt` for the rest (sm90/sm100). At a few rows a projection is bound by its
weight's bytes, which our split-K product spreads over every SM and reads in one launch (its activation
quantized inside it); from tens of rows DeepGEMM's tiles are faster (docs/benchmarks.md). The choice is
made per call from the rows, on the host, so each captured step size keeps one kernel; both kernels read
the same stored blocks and give the published numerics."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.formats.fp8_blocks import LinearNumerics
from dsv4.kernels import FEW_ROWS
from dsv4.values.settings import at_least
from dsv4.strategies.linear.common import (Fp8Linear, deepgemm_needs, deepgemm_product, triton_blocks,
                                           triton_product)
from dsv4.strategies.protocols import LinearWeight, Needs


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepGemmTritonFp8Linear:
    """`triton_fp8` up to `triton_rows` rows, `deepgemm_fp8` above."""
    name: str = "deepgemm_triton_fp8"
    triton_rows: int = at_least(0, 16)     # 0: DeepGEMM at every step
    error_budget: ClassVar[float] = 3e-2        # vs the oracle with fp8 numerics: bf16 rounding moves e4m3 edges
    numerics: ClassVar[LinearNumerics] = LinearNumerics.FP8
    fp8_input: ClassVar[bool] = True

    @property
    def float_tail_rows(self) -> int:
        """x's products in one launch, where our product runs (kernels/products/joint_linear.py)."""
        return min(self.triton_rows, FEW_ROWS)

    def needs(self, device) -> Needs:
        return deepgemm_needs()

    def prepare(self, weight: LinearWeight, *, device, dtype: str) -> Fp8Linear:
        """The blocks as `triton_fp8` prepares them (with its counters and target); DeepGEMM reads the same
        weight and scales."""
        return triton_blocks(weight, device)

    def __call__(self, x, prepared: Fp8Linear, *, out_dtype=None):
        if x.shape[0] <= self.triton_rows:
            return triton_product(x, prepared, out_dtype)
        return deepgemm_product(x, prepared, out_dtype)
