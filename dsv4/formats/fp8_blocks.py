"""The published fp8 numerics of DeepSeek-V4's dense projections (docs/numerics.md §2.9), in torch ops.

A checkpoint stores `wq_a`, `wkv`, `wq_b`, `wo_a`, `wo_b` and the indexer's `wq_b` as e4m3 with one
UE8M0 (power-of-two) scale per 128×128 block. The published `linear()` quantizes each activation row per
128 values with `act_quant(x, 128, "ue8m0")`: amax clamped at 1e-4, the scale the power of two
2^ceil(log2(amax · fp32(1/448))), the values x / scale clamped to ±448 and rounded to e4m3; then
`fp8_gemm` multiplies the e4m3 operands block by block, scales each 128-wide partial product by its two
scales and accumulates in float32; the result is rounded to the activation dtype.

These functions are the specification every fp8 linear option is tested against (and the `fp8_sim`
option itself); the kernels compute the same bytes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsv4.formats.fp8 import E4M3_MAX

if TYPE_CHECKING:
    from torch import Tensor

BLOCK = 128                  # values per activation scale; rows and columns per weight scale
AMAX_FLOOR = 1e-4            # act_quant's clamp of a block's amax (an all-zero block gets scale 2^-22)


@dataclass(frozen=True, slots=True)
class Fp8Blocks:
    """A weight as the checkpoint stores it: e4m3 values [N, K] and one power-of-two scale per 128×128
    block [N/128, K/128] (float32, or float8_e8m0fnu as published: the same values)."""
    weight: Tensor
    scale: Tensor

    def dequantize(self) -> Tensor:
        return dequantize_blocks(self.weight, self.scale)

    def rows(self, start: int, stop: int) -> "Fp8Blocks":
        """Output rows [start, stop) (whole 128-row blocks): a column-parallel shard."""
        _whole("rows", start, stop)
        return Fp8Blocks(weight=self.weight[start:stop], scale=self.scale[start // BLOCK:stop // BLOCK])

    def cols(self, start: int, stop: int) -> "Fp8Blocks":
        """Input columns [start, stop) (whole 128-column blocks): a row-parallel shard."""
        _whole("columns", start, stop)
        return Fp8Blocks(weight=self.weight[:, start:stop], scale=self.scale[:, start // BLOCK:stop // BLOCK])

    @staticmethod
    def cat(parts: list["Fp8Blocks"]) -> "Fp8Blocks":
        """Output rows stacked (each part's rows whole blocks): one product for several projections."""
        import torch

        where = parts[0].weight.device
        return Fp8Blocks(weight=torch.cat([p.weight.to(where) for p in parts]),
                         scale=torch.cat([p.scale.to(where).float() for p in parts]))

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * self.scale.element_size()


@dataclass(frozen=True, slots=True)
class Fp8Rows:
    """Activation rows as an fp8 linear reads them, made by the kernel that produced the rows (act_quant of
    their `dtype` values): e4m3 [T, K] and float32 power-of-two scales [T, K/128] (any strides: DeepGEMM's
    block-major layout included); `dtype`: the activation dtype (the product's output dtype)."""
    values: Tensor
    scales: Tensor
    dtype: object

    @property
    def shape(self):
        return self.values.shape


def _whole(what: str, start: int, stop: int) -> None:
    if start % BLOCK or stop % BLOCK:
        raise ValueError(f"fp8 weight {what} [{start}, {stop}) cut a {BLOCK}x{BLOCK} scale block")


def pow2_scale(amax, floor: float = AMAX_FLOOR):
    """The published power-of-two scale of blocks whose largest |value| is `amax` (float32):
    2^ceil(log2(max(amax, floor) · fp32(1/448))), taken exactly from the float32 bits as the published
    kernel does (exponent, plus one when any mantissa bit is set)."""
    import torch

    v = (amax.float().clamp_min(floor) * torch.tensor(1 / E4M3_MAX, dtype=torch.float32)).contiguous()
    bits = v.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.exp2(e.float())


def act_quant(x, block: int = BLOCK):
    """x [..., K] -> (e4m3 [..., K], float32 scales [..., K/block]): the published `act_quant` with
    `scale_fmt="ue8m0"`. The values are those of x in its own dtype (bf16 activations: bf16 values)."""
    import torch

    if x.shape[-1] % block:
        raise ValueError(f"act_quant: the last dim ({x.shape[-1]}) is not a multiple of {block}")
    b = x.float().unflatten(-1, (-1, block))
    s = pow2_scale(b.abs().amax(-1, keepdim=True))
    q = (b / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s.squeeze(-1)


def quantize_blocks(w) -> Fp8Blocks:
    """A float weight [N, K] in the checkpoint's format: e4m3 with one power-of-two scale per 128×128
    block (the same rule as the activations': the block's amax fits under 448)."""
    import torch

    N, K = w.shape
    if N % BLOCK or K % BLOCK:
        raise ValueError(f"fp8 weight blocks: shape {tuple(w.shape)} is not whole {BLOCK}x{BLOCK} blocks")
    b = w.float().reshape(N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    s = pow2_scale(b.abs().amax(dim=(1, 3), keepdim=True))
    q = (b / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(N, K)
    return Fp8Blocks(weight=q, scale=s.reshape(N // BLOCK, K // BLOCK))


def dequantize_blocks(q, s):
    """e4m3 [N, K] times its 128×128 block scales [N/128, K/128] -> float32 (exact)."""
    N, K = q.shape
    return (q.float().reshape(N // BLOCK, BLOCK, K // BLOCK, BLOCK)
            * s.float()[:, None, :, None]).reshape(N, K)


def block_product(xq, xs, wq, ws):
    """y [M, N] float32 = Σ_kb (xq[:, kb] · wq[:, kb]ᵀ) · xs[:, kb] · ws[nb, kb]: the published fp8_gemm's
    arithmetic (each 128-wide partial product in float32, scaled, summed in K order)."""
    import torch

    M, K = xq.shape
    N = wq.shape[0]
    xb = xq.float().reshape(M, K // BLOCK, BLOCK)
    wb = wq.float().reshape(N, K // BLOCK, BLOCK)
    sw = ws.float().repeat_interleave(BLOCK, 0)[:N]                       # [N, K/128]
    y = torch.zeros(M, N, dtype=torch.float32, device=xq.device)
    for kb in range(K // BLOCK):
        y += (xb[:, kb] @ wb[:, kb].T) * xs[:, kb, None].float() * sw[None, :, kb]
    return y


def fp8_linear_reference(x, w: Fp8Blocks, out_dtype=None):
    """The published fp8 linear on x [M, K]: act_quant, the block product, rounded to `out_dtype` (x's
    dtype by default)."""
    xq, xs = act_quant(x)
    return block_product(xq, xs, w.weight, w.scale).to(out_dtype or x.dtype)


class LinearNumerics(enum.Enum):
    """How the dense projections multiply, as the oracle recomputes them and a dump records them."""
    FLOAT = "float"          # the weights' values in the activation dtype (float32 in the oracle)
    FP8 = "fp8"              # the published fp8 linear: act_quant, e4m3 block product, float32 sums
