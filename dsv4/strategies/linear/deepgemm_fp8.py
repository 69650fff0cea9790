"""linear=deepgemm_fp8: the published fp8 linear through DeepGEMM's block-scaled `fp8_gemm_nt` (package
sgl-deep-gemm, sm90/sm100), the product vLLM and SGLang run DSV4's projections with on these GPUs; the
activation rows quantized by our Triton kernel into the scale layout DeepGEMM reads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.formats.fp8_blocks import LinearNumerics
from dsv4.strategies.linear.common import Fp8Linear, deepgemm_needs, deepgemm_product, fp8_blocks
from dsv4.strategies.protocols import LinearWeight, Needs


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepGemmFp8Linear:
    """`deep_gemm.fp8_gemm_nt((x_e4m3, x_scales), (w_e4m3, w_scales), y)`: float32 scales per 1×128
    activation block and 128×128 weight block (DeepGEMM's sm90 recipe; on sm100 it casts them to UE8M0,
    which loses nothing: they are powers of two)."""
    name: str = "deepgemm_fp8"
    error_budget: ClassVar[float] = 3e-2        # vs the oracle with fp8 numerics: bf16 rounding moves e4m3 edges
    numerics: ClassVar[LinearNumerics] = LinearNumerics.FP8
    fp8_input: ClassVar[bool] = True
    float_tail_rows: ClassVar[int] = 0

    def needs(self, device) -> Needs:
        return deepgemm_needs()

    def prepare(self, weight: LinearWeight, *, device, dtype: str) -> Fp8Linear:
        return fp8_blocks(weight, device)

    def __call__(self, x, prepared: Fp8Linear, *, out_dtype=None):
        return deepgemm_product(x, prepared, out_dtype)
