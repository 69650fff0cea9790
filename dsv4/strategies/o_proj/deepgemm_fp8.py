"""o_proj=deepgemm_fp8: the fp8 projection (fp8_common.py) with DeepGEMM's `fp8_einsum` as the grouped
product (package sgl-deep-gemm), its recipe per architecture."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

from dsv4.strategies.o_proj.fp8_common import (BLOCK, SM90, grouped_weights, fp8_needs,
                                               o_proj_prologue)
from dsv4.strategies.protocols import Needs, OProjWeights

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepGemmWoA:
    """A layer's `wo_a` on its device as `fp8_einsum` reads it, made once at build: e4m3 bytes [G, N, K], float32
    scales in the recipe's layout ([G, N/128, K/128], or per output row [G, N, K/128] for (1, 1, 128)), its G
    groups and the recipe of its device's architecture."""
    weight: Tensor
    scale: Tensor
    groups: int
    recipe: tuple[int, int, int]
    prologue: Callable      # o, rot, groups -> (e4m3 bytes, scales where DeepGEMM reads them)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepGemmFp8OProj:
    """DeepGEMM `fp8_einsum("bhr,hdr->bhd")`, with the recipe of the device's architecture:
    (1, 128, 128) on sm90 (fp32 scales per 1×128 activation block and 128×128 weight block);
    (1, 1, 128) on sm100 (weight scales per output row, which DeepGEMM packs as UE8M0)."""
    name: str = "deepgemm_fp8"
    error_budget: ClassVar[float] = 5e-2     # vs the oracle: e4m3 operands (3.8e-2 measured)

    def needs(self, device) -> Needs:
        return fp8_needs(archs={"sm90", "sm100"}, modules=(("deep_gemm", "sgl-deep-gemm"),))

    @staticmethod
    def recipe(device) -> tuple[int, int, int]:
        return SM90 if device.arch == "sm90" else (1, 1, 128)

    def prepare(self, weights: OProjWeights, *, device, dtype: str) -> DeepGemmWoA:
        wq, ws = grouped_weights(weights, device)
        recipe = self.recipe(device)
        if recipe == (1, 1, 128):              # one scale per output row and 128-wide K block
            ws = ws.repeat_interleave(BLOCK, dim=1).contiguous()
        # on sm90 the activation scales are written where DeepGEMM reads them (no copy inside the call)
        return DeepGemmWoA(weight=wq, scale=ws, groups=weights.groups, recipe=recipe,
                           prologue=o_proj_prologue(device, mn_major_scales=recipe == SM90))

    def __call__(self, o, rot, *, prepared: DeepGemmWoA):
        import deep_gemm
        import torch

        x, xs = prepared.prologue(o, rot, prepared.groups)
        z = torch.empty(o.shape[0], prepared.groups, prepared.weight.shape[1], dtype=torch.bfloat16, device=o.device)
        if o.shape[0]:
            deep_gemm.fp8_einsum("bhr,hdr->bhd", (x, xs), (prepared.weight, prepared.scale), z,
                                 recipe=prepared.recipe)
        return z.flatten(1)
