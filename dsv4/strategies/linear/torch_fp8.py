"""linear=torch_fp8: the published fp8 linear through torch's block-scaled `torch._scaled_mm` (cuBLASLt
1×128 / 128×128 scaling; sm90/sm100, with a torch that supports it -- the call fails with torch's reason
where it does not); the activation rows quantized by our Triton kernel."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.formats.fp8_blocks import Fp8Rows, LinearNumerics
from dsv4.strategies.linear.common import Fp8Linear, blockwise_scaled_mm, fp8_blocks, fp8_needs
from dsv4.strategies.protocols import LinearWeight, Needs


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchFp8Linear:
    """One `torch._scaled_mm` per projection with the checkpoint's block scales (no DeepGEMM needed)."""
    name: str = "torch_fp8"
    error_budget: ClassVar[float] = 3e-2        # vs the oracle with fp8 numerics: bf16 rounding moves e4m3 edges
    numerics: ClassVar[LinearNumerics] = LinearNumerics.FP8
    fp8_input: ClassVar[bool] = True
    float_tail_rows: ClassVar[int] = 0

    def needs(self, device) -> Needs:
        return fp8_needs(platforms={"cuda"}, archs={"sm90", "sm100"}, modules=(("triton", "triton"),),
                         dtypes={"bfloat16"})

    def prepare(self, weight: LinearWeight, *, device, dtype: str) -> Fp8Linear:
        return fp8_blocks(weight, device)

    def __call__(self, x, prepared: Fp8Linear, *, out_dtype=None):
        import torch

        from dsv4.kernels.products.fp8_linear import act_quant_fp8

        if x.shape[0] == 0:
            return torch.zeros(0, prepared.weight.shape[0], dtype=out_dtype or torch.bfloat16,
                               device=prepared.weight.device)
        xq, xs = (x.values, x.scales) if isinstance(x, Fp8Rows) else act_quant_fp8(x)
        y = blockwise_scaled_mm(xq, xs, prepared.weight, prepared.scale)
        return y if out_dtype in (None, torch.bfloat16) else y.to(out_dtype)
