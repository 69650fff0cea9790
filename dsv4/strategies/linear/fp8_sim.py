"""linear=fp8_sim: the published fp8 linear in torch ops on any device -- the statement of the fp8
options' results on a CPU, in the tests and in the oracle's terms (dsv4/formats/fp8_blocks.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.formats.fp8_blocks import Fp8Rows, LinearNumerics, act_quant, dequantize_blocks
from dsv4.strategies.linear.common import Fp8Linear, fp8_blocks, fp8_needs
from dsv4.strategies.protocols import LinearWeight, Needs


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp8SimLinear:
    """The weights kept as stored (e4m3 and block scales); each call quantizes the activation rows per
    128 values (act_quant) and forms the block product in float32: the e4m3 operands' products are exact
    in float32 and the power-of-two scales exact, so the result is the published one up to the order of
    float32 sums; then rounded to the activation dtype."""
    name: str = "fp8_sim"
    error_budget: ClassVar[float] = 3e-2        # vs the oracle with fp8 numerics: bf16 rounding moves e4m3 edges
    numerics: ClassVar[LinearNumerics] = LinearNumerics.FP8
    fp8_input: ClassVar[bool] = True
    float_tail_rows: ClassVar[int] = 0

    def needs(self, device) -> Needs:
        from dataclasses import replace

        return replace(fp8_needs(), variance="its simulated products are not yet made in rows of a fixed count")

    def prepare(self, weight: LinearWeight, *, device, dtype: str) -> Fp8Linear:
        return fp8_blocks(weight, device)

    def __call__(self, x, prepared: Fp8Linear, *, out_dtype=None):
        xq, xs = (x.values, x.scales) if isinstance(x, Fp8Rows) else act_quant(x)
        xd = (xq.float().unflatten(-1, (-1, 128)) * xs[..., None]).flatten(-2)
        y = xd @ dequantize_blocks(prepared.weight, prepared.scale).T
        return y.to(out_dtype or x.dtype)
