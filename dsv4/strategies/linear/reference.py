"""linear=reference: the projections' float weights in the activation dtype, on any device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.values.fixed_order import ROW_TILE, in_row_tiles
from dsv4.formats.fp8_blocks import LinearNumerics
from dsv4.strategies.linear.common import FloatLinear, f32_product
from dsv4.strategies.protocols import LinearWeight, Needs


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferenceLinear:
    """x·Wᵀ in the activation dtype (torch), or accumulated into float32 where asked."""
    name: str = "reference"
    error_budget: ClassVar[float] = 0.0         # vs the oracle: the float32 projection
    numerics: ClassVar[LinearNumerics] = LinearNumerics.FLOAT
    fp8_input: ClassVar[bool] = False
    float_tail_rows: ClassVar[int] = 0

    def needs(self, device) -> Needs:
        # batch_invariant=true: products on tiles of a fixed row count (a fixed shape's BLAS call)
        return Needs(batch_invariant=device.platform in ("cpu", "cuda"),
                     variance="not shown on ROCm, whose BLAS libraries may add a product's K splits with atomics")

    def prepare(self, weight: LinearWeight, *, device, dtype: str, batch_invariant: bool = False) -> FloatLinear:
        from dsv4.values.dtypes import torch_dtype

        weight = weight.values.to(device=device.torch_device, dtype=torch_dtype(dtype)).contiguous()
        return FloatLinear(weight=weight, product_f32=f32_product(gpu=device.platform != "cpu"),
                           row_tile=ROW_TILE if batch_invariant else 0)

    def __call__(self, x, prepared: FloatLinear, *, out_dtype=None):
        if prepared.row_tile:
            return in_row_tiles(lambda rows: self._product(rows, prepared, out_dtype), x, prepared.row_tile)
        return self._product(x, prepared, out_dtype)

    @staticmethod
    def _product(x, prepared: FloatLinear, out_dtype):
        import torch

        if out_dtype == torch.float32 and x.dtype != torch.float32:
            return prepared.product_f32(x, prepared.weight)
        y = x @ prepared.weight.T
        return y if out_dtype is None else y.to(out_dtype)
