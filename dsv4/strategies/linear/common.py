"""What the linear options share: their prepared weights (one frozen value per projection), the fp8
options' needs, and the products the options are made of (float, torch, our Triton kernel, DeepGEMM)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4.formats.fp8_blocks import BLOCK, Fp8Blocks, quantize_blocks
from dsv4.values.sizes import round_up
from dsv4.strategies.protocols import LinearWeight, Needs


@dataclass(frozen=True, slots=True)
class FloatLinear:
    """A projection's weight [N, K] in the activation dtype; `row_tile`: rows per product call where the
    product must not depend on the step's size (batch_invariant=true), 0 for one call; `product_f32`: the
    device's float32-result product (`f32_product`), chosen at prepare."""
    weight: Any
    product_f32: Any
    row_tile: int = 0


@dataclass(frozen=True, slots=True)
class Fp8Linear:
    """A projection's weight as the checkpoint stores it, on the device: e4m3 [N, K] and float32
    power-of-two scales [N/128, K/128]; `target`: the device's facts its kernel plans by (None: torch);
    `count`: what its kernel keeps between calls (our Triton product's arrival counters), or None; `tail`: a
    float weight [N_tail, K] multiplied with the same rows in the same launch (`with_tail`), or None."""
    weight: Any
    scale: Any
    target: Any = None
    count: Any = None
    tail: Any = None


def fp8_blocks(weight: LinearWeight, device) -> Fp8Linear:
    """The stored fp8 blocks of `weight` on the device (a checkpoint's, or random weights made in that
    format), or -- for float weights handed in by an engine -- its values quantized once in 128x128 blocks."""
    blocks: Fp8Blocks = weight.fp8 if weight.fp8 is not None else quantize_blocks(weight.values)
    dev = device.torch_device
    return Fp8Linear(weight=blocks.weight.to(dev).contiguous(), scale=blocks.scale.to(dev).float().contiguous())


def triton_blocks(weight: LinearWeight, device, *, fixed_order: bool = False) -> Fp8Linear:
    """The blocks on the device with what our Triton product keeps (dsv4/kernels/products/fp8_linear.py): this
    projection's own arrival counters (its split products' last program adds the partial sums) and the
    device's facts its launch is planned by (`fixed_order`: one launch for every row count)."""
    from dataclasses import replace

    from dsv4.kernels.products.fp8_linear import counters
    from dsv4.kernels.target import device_target

    blocks = fp8_blocks(weight, device)
    count = counters(blocks.weight.shape[0], device.torch_device)
    # on the CPU none: the tests' interpreted kernels plan by the tensors' device
    return replace(blocks, count=count, target=device_target(device, fixed_order=fixed_order))


def with_tail(prepared: Fp8Linear, tail) -> Fp8Linear:
    """Our Triton product's blocks with a float weight [N_tail, K] (the compressors' and the indexer's head
    weights, bf16) multiplied beside them in one launch (dsv4/kernels/products/joint_linear.py), with that
    launch's own counters: `triton_product` then gives [T, N + N_tail] float32, for steps of at most
    `float_tail_rows` rows."""
    from dataclasses import replace

    from dsv4.kernels.products.joint_linear import joint_counters

    return replace(prepared, tail=tail,
                   count=joint_counters(prepared.weight.shape[0], tail.shape[0], prepared.weight.device))


def triton_product(x, prepared: Fp8Linear, out_dtype=None):
    """x (rows in the activation dtype, or Fp8Rows) times the blocks, through our Triton product; with a float
    tail (`with_tail`) x's rows times both weights in one launch, float32."""
    from dsv4.formats.fp8_blocks import Fp8Rows
    from dsv4.kernels.products.fp8_linear import fp8_linear

    if prepared.tail is not None:
        from dsv4.kernels.products.joint_linear import joint_linear

        return joint_linear(x, prepared.weight, prepared.scale, prepared.tail, count=prepared.count,
                            target=prepared.target)
    if isinstance(x, Fp8Rows):
        return fp8_linear(x.values, prepared.weight, prepared.scale, xs=x.scales, out_dtype=out_dtype or x.dtype,
                          target=prepared.target, count=prepared.count)
    return fp8_linear(x, prepared.weight, prepared.scale, out_dtype=out_dtype, target=prepared.target,
                      count=prepared.count)


def deepgemm_product(x, prepared: Fp8Linear, out_dtype=None):
    """The same product through DeepGEMM's `fp8_gemm_nt`, rows in the activation dtype quantized first by
    our kernel into the scale layout DeepGEMM reads (Fp8Rows come in it)."""
    import deep_gemm
    import torch

    from dsv4.formats.fp8_blocks import Fp8Rows
    from dsv4.kernels.products.fp8_linear import act_quant_fp8

    y = torch.empty(x.shape[0], prepared.weight.shape[0], dtype=torch.bfloat16, device=prepared.weight.device)
    if x.shape[0]:
        xq, xs = (x.values, x.scales) if isinstance(x, Fp8Rows) else act_quant_fp8(x, mn_major_scales=True)
        deep_gemm.fp8_gemm_nt((xq, xs), (prepared.weight, prepared.scale), y)
    return y if out_dtype in (None, torch.bfloat16) else y.to(out_dtype)


def fp8_needs(*, platforms=(), archs=(), modules=(), dtypes=()) -> Needs:
    """Every fp8 option: each projection's N and K (per rank) in whole 128x128 blocks."""
    return Needs(platforms=frozenset(platforms), archs=frozenset(archs), modules=tuple(modules),
                 dtypes=frozenset(dtypes), projection_multiple=BLOCK)


def deepgemm_needs() -> Needs:
    """What an option multiplying through DeepGEMM needs (the activation quantized by our Triton kernel)."""
    from dataclasses import replace

    return replace(fp8_needs(platforms={"cuda"}, archs={"sm90", "sm100"},
                             modules=(("triton", "triton"), ("deep_gemm", "sgl-deep-gemm")), dtypes={"bfloat16"}),
                   variance="DeepGEMM's products (and ours, at few rows) choose their tiles by the row count")


def _mm_f32_cpu(x, w):
    import torch

    if x.dtype == torch.float32:
        return x @ (w if w.dtype == torch.float32 else w.float()).T
    w = w if w.dtype == x.dtype else w.to(x.dtype)       # `.to` costs host time even when it returns w
    return x.float() @ w.float().T


def _mm_f32_gpu(x, w):
    import torch

    if x.dtype == torch.float32:
        return x @ (w if w.dtype == torch.float32 else w.float()).T
    w = w if w.dtype == x.dtype else w.to(x.dtype)
    try:
        return torch.mm(x, w.T, out_dtype=torch.float32)
    except (TypeError, RuntimeError):          # a torch without mm's out_dtype: the same product in float32
        return x.float() @ w.float().T


def f32_product(*, gpu: bool):
    """x @ w.T with a float32 result, for one device, chosen once where the device is known (a layer's build, a
    linear's prepare): a float32 product for float32 inputs; for bf16 inputs the bf16 product accumulated and
    returned in float32 (what the published code gets from x.float() @ w.float() with bf16-valued x and w):
    on a GPU by torch.mm itself, on the CPU as the float32 product of the bf16 values."""
    return _mm_f32_gpu if gpu else _mm_f32_cpu


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
