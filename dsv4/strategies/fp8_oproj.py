"""fp8 OProjStrategy options: `deepgemm_fp8` (DeepGEMM fp8_einsum), `torch_fp8` (torch scaled-mm) and
`triton_fp8` (our Triton grouped product, dsv4/kernels/fp8_grouped_gemm.py).

Both follow vLLM's DSV4 o_proj (docs/numerics.md §4.2): inverse RoPE on the attention output fused with
fp8 quantization at one power-of-two scale per 128 contiguous dims of each (token, group) vector
(our Triton kernel, dsv4/kernels/inv_rope_fp8.py);
`wo_a` quantized once at build time in 128×128 blocks (power-of-two scales) — or, loaded from a
checkpoint, its stored e4m3 bytes and UE8M0 block scales used as they are; the grouped product
z[t,g] = W_oa[g] · o[t,g] in fp8 with float accumulation; then `wo_b` in bf16.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dsv4.sizes import round_up
from dsv4.strategies.fp8_layouts import E4M3_MAX
from dsv4.strategies.protocols import Needs, OProjWeights
from dsv4.strategies.triton_sparse import TRITON_ARCHS

BLOCK = 128
SM90 = (1, 128, 128)          # DeepGEMM's sm90 recipe: fp32 scales per 1x128 activation and 128x128 weight block
# the NVIDIA architectures Triton supports that have e4m3 tensor cores (sm89 and newer)
FP8_TRITON_ARCHS = frozenset(a for a in TRITON_ARCHS if a.startswith("sm") and int(a[2:]) >= 89)


def pow2_scale(amax, floor: float):
    import torch

    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(floor) / E4M3_MAX)))


def inverse_rope_fp8_quant(o, rot, groups: int):
    """o [T, H, D] -> (x [T, G, hpg·D] e4m3, scales [T, G, hpg·D/128] float32 powers of two).

    The torch-op reference of the fused kernel (dsv4/kernels/inv_rope_fp8.py): o rotated back by -p·f
    on its last 64 dims in float32, then one scale per 128 dims."""
    import torch

    T = o.shape[0]
    x = rot.rotate(o, inverse=True)                   # float32; o itself is not modified
    blocks = x.view(T, groups, -1, BLOCK)
    scale = pow2_scale(blocks.abs().amax(-1, keepdim=True), 1e-10)   # vLLM clamps amax at 1e-10 here
    q = (blocks / scale).to(torch.float8_e4m3fn)      # |blocks / scale| <= 448 by the choice of scale
    return q.view(T, groups, -1), scale.squeeze(-1)


def fused_inverse_rope_fp8_quant(o, rot, groups: int, *, mn_major_scales: bool = False):
    """The same bytes as `inverse_rope_fp8_quant`, from our fused Triton kernel (one read of o, one
    write of the fp8 bytes), the scales token-major or (`mn_major_scales`) in DeepGEMM's sm90 layout
    (dsv4/kernels/inv_rope_fp8.py); on a CPU tensor, the torch-op version."""
    if not o.is_cuda:
        return inverse_rope_fp8_quant(o, rot, groups)
    import torch

    from dsv4.kernels.inv_rope_fp8 import inv_rope_fp8_quant

    return inv_rope_fp8_quant(o if o.dtype == torch.bfloat16 else o.bfloat16(), rot.cos, rot.sin, groups,
                              mn_major_scales=mn_major_scales)


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


def _grouped_weights(weights: OProjWeights, device):
    import torch

    g = weights.groups
    if weights.wo_a_fp8 is not None:          # a checkpoint's bytes: no dequantize-requantize round trip
        return stored_weight_blocks(weights, device), weights.wo_b.to(device=device.torch_device,
                                                                      dtype=torch.bfloat16)
    wa = weights.wo_a.to(device=device.torch_device, dtype=torch.float32)
    wa = wa.view(g, wa.shape[0] // g, wa.shape[1])
    if wa.shape[1] % BLOCK or wa.shape[2] % BLOCK:
        raise ValueError(f"fp8 o_proj needs wo_a group dims divisible by {BLOCK}, got {tuple(wa.shape[1:])}")
    return quantize_weight_blocks(wa), weights.wo_b.to(device=device.torch_device, dtype=torch.bfloat16)


def _block_scaled_weights(weights: OProjWeights, device) -> dict:
    """wo_a's e4m3 bytes [G, N, K] and 128x128 block scales as separate tensors, wo_b in bf16."""
    (wq, ws), wo_b = _grouped_weights(weights, device)
    return {"w": wq, "ws": ws, "wo_b": wo_b, "groups": weights.groups}


def fp8_needs(*, archs, modules=()) -> Needs:
    """128×128 weight blocks: each group's wo_a rows (o_lora_rank) and columns (heads/group · 512) in whole
    blocks; the prologue is our Triton kernel."""
    return Needs(platforms=frozenset({"cuda"}), archs=frozenset(archs), dtypes=frozenset({"bfloat16"}),
                 modules=(("triton", "triton"),) + tuple(modules), model_multiples=(("o_lora_rank", BLOCK),))


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

    def prepare(self, weights: OProjWeights, *, device, dtype: str) -> Any:
        (wq, ws), wo_b = _grouped_weights(weights, device)
        recipe = self.recipe(device)
        if recipe == (1, 1, 128):              # one scale per output row and 128-wide K block
            ws = ws.repeat_interleave(BLOCK, dim=1).contiguous()
        return {"w": (wq, ws), "wo_b": wo_b, "groups": weights.groups, "recipe": recipe}

    def __call__(self, o, rot, *, prepared):
        import deep_gemm
        import torch

        # on sm90 the activation scales are written where DeepGEMM reads them (no copy inside the call)
        x, xs = fused_inverse_rope_fp8_quant(o, rot, prepared["groups"], mn_major_scales=prepared["recipe"] == SM90)
        wq, _ = prepared["w"]
        z = torch.empty(o.shape[0], prepared["groups"], wq.shape[1], dtype=torch.bfloat16, device=o.device)
        if o.shape[0]:
            deep_gemm.fp8_einsum("bhr,hdr->bhd", (x, xs), prepared["w"], z, recipe=prepared["recipe"])
        return z.flatten(1) @ prepared["wo_b"].T


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
        return _block_scaled_weights(weights, device)

    def __call__(self, o, rot, *, prepared):
        import torch

        x, xs = fused_inverse_rope_fp8_quant(o, rot, prepared["groups"])
        w, ws = prepared["w"], prepared["ws"]
        outs = [blockwise_scaled_mm(x[:, g].contiguous(), xs[:, g], w[g], ws[g]) for g in range(prepared["groups"])]
        return torch.stack(outs, 1).flatten(1) @ prepared["wo_b"].T


M_ALIGN = 8       # cuBLASLt's block-scaled fp8 matmul on the H200 ran every M that is a multiple of 8
                  # (8..256) and refused M = 1 and 33 (bench/probe_scaled_mm.py)


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


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonFp8OProj:
    """The same fp8 projection with our Triton grouped product (dsv4/kernels/fp8_grouped_gemm.py), for
    NVIDIA GPUs with fp8 tensor cores (sm89+) and no DeepGEMM. Launch defaults from the H200 sweep
    (docs/benchmarks.md)."""
    name: str = "triton_fp8"
    error_budget: ClassVar[float] = 5e-2     # vs the oracle: e4m3 activations and weights
    block_m: int = 64         # tokens per program
    num_warps: int = 4
    num_stages: int = 4       # software-pipelining depth of the K loop

    def __post_init__(self) -> None:
        for key, allowed in (("block_m", (64, 128)), ("num_warps", (4, 8)), ("num_stages", (1, 2, 3, 4))):
            if getattr(self, key) not in allowed:
                raise ValueError(f"o_proj=triton_fp8: {key}={getattr(self, key)} is not one of {allowed}")

    def needs(self, device) -> Needs:
        return fp8_needs(archs=FP8_TRITON_ARCHS)

    def prepare(self, weights: OProjWeights, *, device, dtype: str) -> Any:
        return _block_scaled_weights(weights, device)

    def __call__(self, o, rot, *, prepared):
        from dsv4.kernels.fp8_grouped_gemm import grouped_fp8_gemm

        x, xs = fused_inverse_rope_fp8_quant(o, rot, prepared["groups"])
        z = grouped_fp8_gemm(x, xs, prepared["w"], prepared["ws"], block_m=self.block_m, num_warps=self.num_warps,
                             num_stages=self.num_stages)
        return z.flatten(1) @ prepared["wo_b"].T
