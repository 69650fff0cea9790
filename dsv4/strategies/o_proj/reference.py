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
    operand, made once at build."""
    wo_a: Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferenceOProj:
    """Inverse RoPE and the per-group einsum with `wo_a`, in the activation dtype."""
    name: str = "reference"
    error_budget: ClassVar[float] = 0.0     # vs the oracle: the float32 projection

    def needs(self, device) -> Needs:
        return Needs()

    def prepare(self, weights: OProjWeights, *, device, dtype: str) -> FloatWoA:
        from dsv4.dtypes import torch_dtype

        dt = torch_dtype(dtype)
        g = weights.groups
        wa = weights.wo_a.to(device=device.torch_device, dtype=dt)
        return FloatWoA(wa.view(g, wa.shape[0] // g, wa.shape[1]))

    def __call__(self, o, rot, *, prepared: FloatWoA):
        import torch

        wa = prepared.wo_a
        o = rot.rotate(o, inverse=True).to(wa.dtype)                  # [T, H, D]
        og = o.reshape(o.shape[0], wa.shape[0], -1)                   # [T, G, hpg*D]
        z = torch.einsum("tgd,grd->tgr", og, wa)                      # [T, G, o_lora]
        return z.flatten(1)
