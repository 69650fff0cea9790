"""RMSNorm as DSV4 uses it: computed in float32, optional weight (the per-head q norm has none)."""
from __future__ import annotations


def rms_norm(x, weight=None, eps: float = 1e-6):
    import torch

    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()
