"""o_proj=torch_fp8: the fp8 projection (fp8_common.py) with one block-scaled `torch._scaled_mm` per
group (cuBLASLt; rows padded to its multiple); `wo_b` in bf16."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dsv4.sizes import round_up
from dsv4.strategies.o_proj.fp8_common import (block_scaled_weights, fp8_needs,
                                               fused_inverse_rope_fp8_quant)
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

    def prepare(self, weights: OProjWeights, *, device, dtype: str) -> Any:
        return block_scaled_weights(weights, device)

    def __call__(self, o, rot, *, prepared):
        import torch

        x, xs = fused_inverse_rope_fp8_quant(o, rot, prepared["groups"])
        w, ws = prepared["w"], prepared["ws"]
        outs = [blockwise_scaled_mm(x[:, g].contiguous(), xs[:, g], w[g], ws[g]) for g in range(prepared["groups"])]
        return torch.stack(outs, 1).flatten(1) @ prepared["wo_b"].T


M_ALIGN = 8       # cuBLASLt's block-scaled fp8 matmul on the H200 ran every M that is a multiple of 8


def blockwise_scaled_mm(a, sa, w, sw):
    """a [M, K] e4m3 with sa [M, K/128]; w [N, K] e4m3 with sw [N/128, K/128] -> a·wᵀ [M, N] bf16.

    cuBLASLt's block scaling (torch._scaled_mm) wants the activation scales M-major (stride (1, M)),
    the weight scales [N/128, K/128] transposed like b = wᵀ, and M a multiple of M_ALIGN: rows are
    zero-padded (scale 1) and the padding cut off."""
    import torch

    M = a.shape[0]
    Mp = round_up(M, M_ALIGN)
    if Mp != M:
        a = torch.cat((a, a.new_zeros(Mp - M, a.shape[1])))
        sa = torch.cat((sa.float(), sa.new_ones(Mp - M, sa.shape[1], dtype=torch.float32)))
    sa_t = sa.float().t().contiguous().t()             # [Mp, K/128], M-major
    out = torch._scaled_mm(a, w.t(), scale_a=sa_t, scale_b=sw.float().t(), out_dtype=torch.bfloat16)
    return out[:M]
