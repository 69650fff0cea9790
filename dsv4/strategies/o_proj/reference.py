"""o_proj=reference: the float projection (inverse RoPE, the grouped `wo_a` einsum) in the activation
dtype, on any device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dsv4.strategies.protocols import Needs, OProjWeights

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True, slots=True)
class FloatWoA:
    """A layer's `wo_a` on its device, in the activation dtype, per output group [G, o_lora, hpg·D]: the einsum's
    operand, made once at build; `row_tile`: tokens per einsum where it must not depend on the step's size
    (batch_invariant=true), 0 for one."""
    wo_a: Tensor
    row_tile: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferenceOProj:
    """Inverse RoPE and the per-group einsum with `wo_a`, in the activation dtype."""
    name: str = "reference"
    error_budget: ClassVar[float] = 0.0     # vs the oracle: the float32 projection

    def needs(self, device) -> Needs:
        # batch_invariant=true: products on tiles of a fixed row count (a fixed shape's BLAS call)
        return Needs(batch_invariant=device.platform in ("cpu", "cuda"),
                     variance="not shown on ROCm, whose BLAS libraries may add a product's K splits with atomics")

    def prepare(self, weights: OProjWeights, *, device, dtype: str, batch_invariant: bool = False) -> FloatWoA:
        from dsv4.values.dtypes import torch_dtype
        from dsv4.values.fixed_order import ROW_TILE

        dt = torch_dtype(dtype)
        g = weights.groups
        wa = weights.wo_a.to(device=device.torch_device, dtype=dt)
        return FloatWoA(wa.view(g, wa.shape[0] // g, wa.shape[1]), row_tile=ROW_TILE if batch_invariant else 0)

    def __call__(self, o, rot, *, prepared: FloatWoA):
        import torch

        wa = prepared.wo_a
        o = rot.rotate(o, inverse=True).to(wa.dtype)                  # [T, H, D]
        og = o.reshape(o.shape[0], wa.shape[0], -1)                   # [T, G, hpg*D]
        if prepared.row_tile:
            from dsv4.values.fixed_order import in_row_tiles

            z = in_row_tiles(lambda rows: torch.einsum("tgd,grd->tgr", rows, wa), og, prepared.row_tile)
        else:
            z = torch.einsum("tgd,grd->tgr", og, wa)                  # [T, G, o_lora]
        return z.flatten(1)
