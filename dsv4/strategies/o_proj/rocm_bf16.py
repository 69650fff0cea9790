"""o_proj=rocm_bf16: inverse RoPE, the grouped `wo_a` product through aiter's batched bf16 GEMM
(`aiter.ops.triton.batched_gemm_bf16.batched_gemm_bf16(XQ, WQ, ...)`: Y[i] = X[i] @ W[i]^T, tuned configs
for MI300X and MI350X). Package amd-aiter, ROCm only; not run on AMD hardware:
its marshalling is tested on the CPU (tests/test_aiter_marshalling.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dsv4.strategies.protocols import Needs, OProjWeights

if TYPE_CHECKING:
    from torch import Tensor


AITER_ARCHS = frozenset({"gfx942", "gfx950"})      # the GPUs amd-aiter builds for (mqa_kernel=aiter_sparse's too)


# ---- o_proj=rocm_bf16 -------------------------------------------------------------------------------
def grouped_input(o, rot, groups: int):
    """Inverse RoPE on o [T, H, 512] (float32 math), bf16, per output group: -> [G, T, hpg·512] bf16
    contiguous, batch = group (the XQ of batched_gemm_bf16)."""
    import torch

    x = rot.rotate(o, inverse=True).to(torch.bfloat16)
    return x.reshape(x.shape[0], groups, -1).transpose(0, 1).contiguous()


@dataclass(frozen=True, slots=True)
class Bf16WoA:
    """A layer's `wo_a` on its device in bf16, per output group and contiguous [G, o_lora, hpg·D]: the batched
    GEMM's WQ, made once at build."""
    wo_a: Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class RocmBf16OProj:
    """Inverse RoPE and the grouped `wo_a` product through aiter's batched bf16 GEMM."""
    name: str = "rocm_bf16"
    error_budget: ClassVar[float] = 1e-2     # vs the oracle: bf16 products

    def needs(self, device) -> Needs:
        return Needs(platforms=frozenset({"rocm"}), archs=AITER_ARCHS, dtypes=frozenset({"bfloat16"}),
                     modules=(("aiter", "amd-aiter"),))

    def prepare(self, weights: OProjWeights, *, device, dtype: str) -> Bf16WoA:
        import torch

        g = weights.groups
        wa = weights.wo_a.to(device=device.torch_device, dtype=torch.bfloat16)
        return Bf16WoA(wa.view(g, wa.shape[0] // g, wa.shape[1]).contiguous())       # WQ [G, o_lora, hpg·D]

    def __call__(self, o, rot, *, prepared: Bf16WoA):
        import importlib

        import torch

        wa = prepared.wo_a
        if o.shape[0] == 0:
            return o.new_zeros(0, wa.shape[0] * wa.shape[1], dtype=torch.bfloat16)
        bgemm = importlib.import_module("aiter.ops.triton.batched_gemm_bf16").batched_gemm_bf16
        z = bgemm(grouped_input(o, rot, wa.shape[0]), wa, dtype=torch.bfloat16)   # [G, T, o_lora]
        return z.transpose(0, 1).reshape(o.shape[0], -1)
