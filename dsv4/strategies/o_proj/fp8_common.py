"""What the fp8 o_proj options (`deepgemm_fp8`, `torch_fp8`, `triton_fp8`) share, following vLLM's DSV4
o_proj (docs/numerics.md §4.2): inverse RoPE on the attention output fused with fp8 quantization at one
power-of-two scale per 128 contiguous dims of each (token, group) vector (our Triton kernel,
dsv4/kernels/products/inv_rope_fp8.py); `wo_a` quantized once at build time in 128×128 blocks (power-of-two
scales) -- or, loaded from a checkpoint, its stored e4m3 bytes and UE8M0 block scales used as they are;
then the grouped product z[t,g] = W_oa[g] · o[t,g] in fp8 with float accumulation, z in bf16 (the input of
the layer's `wo_b`, which its `linear` option multiplies)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from dsv4.formats.fp8 import E4M3_MAX
from dsv4.strategies.protocols import Needs, OProjWeights

if TYPE_CHECKING:
    from torch import Tensor

    from dsv4.kernels.target import Target


BLOCK = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp8WoA:
    """A layer's `wo_a` on its device as the grouped fp8 products read it, made once at build: e4m3 bytes
    [G, N, K], float32 scales per 128x128 block [G, N/128, K/128], its G groups, and (`target`) the device's
    facts our Triton product plans by, resolved once (None: the torch product, or a CPU), and (`count`) its
    few-token launch's arrival counters (None: one launch shape for every step, batch_invariant)."""
    weight: Tensor
    scale: Tensor
    groups: int
    prologue: Callable      # o, rot, groups -> (e4m3 bytes, scales): `o_proj_prologue` of the device
    target: Target | None = None
    count: Tensor | None = None


SM90 = (1, 128, 128)          # DeepGEMM's sm90 recipe: fp32 scales per 1x128 activation and 128x128 weight block


def pow2_scale(amax, floor: float):
    import torch

    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(floor) / E4M3_MAX)))


def inverse_rope_fp8_quant(o, rot, groups: int):
    """o [T, H, D] -> (x [T, G, hpg·D] e4m3, scales [T, G, hpg·D/128] float32 powers of two).

    The torch-op reference of the fused kernel (dsv4/kernels/products/inv_rope_fp8.py): o rotated back by -p·f
    on its last 64 dims in float32, then one scale per 128 dims."""
    import torch

    T = o.shape[0]
    x = rot.rotate(o, inverse=True)                   # float32; o itself is not modified
    blocks = x.view(T, groups, -1, BLOCK)
    scale = pow2_scale(blocks.abs().amax(-1, keepdim=True), 1e-10)   # vLLM clamps amax at 1e-10 here
    q = (blocks / scale).to(torch.float8_e4m3fn)      # |blocks / scale| <= 448 by the choice of scale
    return q.view(T, groups, -1), scale.squeeze(-1)


def o_proj_prologue(device, *, mn_major_scales: bool = False) -> Callable:
    """The prologue of an fp8 o_proj for its device, chosen once at build: our fused kernel on a GPU; on a
    CPU (where the tests run the fp8 options' numerics) the torch ops, the same bytes with token-major
    scales."""
    if device.platform == "cpu":
        return inverse_rope_fp8_quant
    from dsv4.kernels.target import device_target

    return functools.partial(fused_inverse_rope_fp8_quant, mn_major_scales=mn_major_scales,
                             pdl=device_target(device).pdl)


def fused_inverse_rope_fp8_quant(o, rot, groups: int, *, mn_major_scales: bool = False, pdl: bool = False):
    """The same bytes as `inverse_rope_fp8_quant`, from our fused Triton kernel (one read of o, one
    write of the fp8 bytes), the scales token-major or (`mn_major_scales`) in DeepGEMM's sm90 layout
    (dsv4/kernels/products/inv_rope_fp8.py), launched as a programmatic dependent with `pdl` (Target.pdl). The
    fp8 options that call it run on GPUs only (check() refuses them elsewhere); `inverse_rope_fp8_quant` is the
    torch-op version."""
    import torch

    from dsv4.kernels.products.inv_rope_fp8 import inv_rope_fp8_quant

    return inv_rope_fp8_quant(o if o.dtype == torch.bfloat16 else o.bfloat16(), rot.cos, rot.sin, groups,
                              mn_major_scales=mn_major_scales, pdl=pdl)


def quantize_weight_blocks(w):
    """w [G, N, K] -> (e4m3 [G, N, K], scales [G, N/128, K/128] float32 powers of two)."""
    import torch

    G, N, K = w.shape
    blocks = w.float().view(G, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    s = pow2_scale(blocks.abs().amax(dim=(2, 4), keepdim=True), 1e-4)
    q = (blocks / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(G, N, K)
    return q, s.view(G, N // BLOCK, K // BLOCK)


def stored_weight_blocks(weights: OProjWeights, device):
    """A checkpoint's e4m3 `wo_a` and its 128×128 block scales, as stored, viewed per group:
    (e4m3 [G, N, K], scales [G, N/128, K/128] float32 — UE8M0 scales convert exactly)."""
    import torch

    g, w, s = weights.groups, weights.wo_a_fp8, weights.wo_a_scale
    rows, K = w.shape
    n = rows // g
    if (s is None or w.dtype != torch.float8_e4m3fn or rows % g or n % BLOCK or K % BLOCK
            or tuple(s.shape) != (rows // BLOCK, K // BLOCK)):
        raise ValueError(f"wo_a_fp8 {w.dtype} {tuple(w.shape)} with scales {None if s is None else tuple(s.shape)}: "
                         f"expected e4m3 [{g}·N, K] with one scale per 128×128 block, N and K multiples of {BLOCK}")
    dev = device.torch_device
    return w.to(dev).view(g, n, K), s.to(dev).float().view(g, n // BLOCK, K // BLOCK)


def grouped_weights(weights: OProjWeights, device):
    import torch

    g = weights.groups
    if weights.wo_a_fp8 is not None:          # a checkpoint's bytes: no dequantize-requantize round trip
        return stored_weight_blocks(weights, device)
    wa = weights.wo_a.to(device=device.torch_device, dtype=torch.float32)
    wa = wa.view(g, wa.shape[0] // g, wa.shape[1])
    if wa.shape[1] % BLOCK or wa.shape[2] % BLOCK:
        raise ValueError(f"fp8 o_proj needs wo_a group dims divisible by {BLOCK}, got {tuple(wa.shape[1:])}")
    return quantize_weight_blocks(wa)


def block_scaled_weights(weights: OProjWeights, device) -> Fp8WoA:
    """wo_a's e4m3 bytes [G, N, K] and 128x128 block scales as separate tensors."""
    wq, ws = grouped_weights(weights, device)
    return Fp8WoA(weight=wq, scale=ws, groups=weights.groups, prologue=o_proj_prologue(device))


def fp8_needs(*, archs, modules=()) -> Needs:
    """128×128 weight blocks: each group's wo_a rows (o_lora_rank) and columns (heads/group · 512) in whole
    blocks; the prologue is our Triton kernel."""
    return Needs(platforms=frozenset({"cuda"}), archs=frozenset(archs), dtypes=frozenset({"bfloat16"}),
                 modules=(("triton", "triton"),) + tuple(modules), model_multiples=(("o_lora_rank", BLOCK),))
