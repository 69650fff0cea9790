"""o_proj=torch_fp8: the fp8 projection (fp8_common.py) with one block-scaled `torch._scaled_mm` per
group (cuBLASLt; rows padded to its multiple)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.strategies.linear.common import blockwise_scaled_mm
from dsv4.strategies.o_proj.fp8_common import Fp8WoA, block_scaled_weights, fp8_needs
from dsv4.strategies.protocols import Needs, OProjWeights


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchFp8OProj:
    """torch's own fp8 scaled matrix multiply with the same block scales, for machines with fp8
    tensor cores but without DeepGEMM: one `torch._scaled_mm` per output group, 1×128 activation
    and 128×128 weight scales (cuBLASLt block scaling)."""
    name: str = "torch_fp8"
    error_budget: ClassVar[float] = 5e-2     # vs the oracle: e4m3 activations and weights

    def needs(self, device) -> Needs:
        return fp8_needs(archs={"sm90", "sm100"})

    def prepare(self, weights: OProjWeights, *, device, dtype: str) -> Fp8WoA:
        return block_scaled_weights(weights, device)

    def __call__(self, o, rot, *, prepared: Fp8WoA):
        import torch

        x, xs = prepared.prologue(o, rot, prepared.groups)
        w, ws = prepared.weight, prepared.scale
        outs = [blockwise_scaled_mm(x[:, g].contiguous(), xs[:, g], w[g], ws[g]) for g in range(prepared.groups)]
        return torch.stack(outs, 1).flatten(1)
