"""The published FP4 numerics of the indexer (docs/numerics.md §2.5; DeepSeek's `inference/kernel.py`,
`fp4_act_quant`): the orthonormal Hadamard rotation, e2m1 values over one power-of-two scale per block of
32, and their packed records (e2m1 nibbles, UE8M0 scale bytes), in torch: the indexer options' CPU path
and the specification of dsv4/kernels/indexer/hadamard_fp4.py."""
from __future__ import annotations


FP4_MAX = 6.0


FP4_BLOCK = 32          # values per power-of-two scale (the published fp4_block_size)


def rotate(x):
    """x [..., n] (n a power of two) -> its orthonormal Hadamard rotation (x·H)·n^-1/2 in bf16, H Sylvester's
    (natural order): x rounded to bf16, log2(n) butterfly stages of float32 sums and differences, one scale
    and one rounding -- the published rotate_activation (fast_hadamard_transform). No matrix product, so no
    TF32 setting can change it."""
    import torch

    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two width, not {n}")
    lead = x.shape[:-1]
    y = x.to(torch.bfloat16).float().reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), 2).view(-1, n)
        h *= 2
    return (y * n ** -0.5).to(torch.bfloat16).view(*lead, n)


def pow2_ceil(t):
    """2^ceil(log2 t) for normal float32 t > 0, exactly (from the exponent, as the published kernel's
    bit arithmetic; float32 log2 can round a value just above a power of two down to it)."""
    import torch

    m, e = torch.frexp(t)
    return torch.ldexp(torch.ones_like(t), torch.where(m == 0.5, e - 1, e))


def e2m1(v):
    """v (float32, |v| <= 6) rounded to the nearest e2m1 value, ties to even (steps 0.5 below 2, 1 below 4,
    2 up to 6); the sign kept (so small negatives become -0)."""
    import torch

    a = v.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)      # torch.round: half to even


def _fp4_blocks(x, block: int):
    """x [..., N] -> (e2m1 values [..., N/block, block] float32, scales [..., N/block, 1] float32 powers of
    two), as the published fp4_act_quant computes them."""
    import torch

    if x.shape[-1] % block:
        raise ValueError(f"FP4 blocks of {block} do not divide a width of {x.shape[-1]}")
    xf = x.to(torch.bfloat16).float().unflatten(-1, (-1, block))
    # a Python scalar multiplies a float32 tensor as float32: amax·fp32(1/6), as the kernel's (and no
    # host-to-device copy, so a CUDA graph can capture it)
    s = pow2_ceil(xf.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0 ** -126) * (1 / FP4_MAX))
    return e2m1((xf / s).clamp(-FP4_MAX, FP4_MAX)), s


def fp4_qdq(x, block: int = FP4_BLOCK):
    """x [..., N] (N a multiple of `block`) -> FP4 quantized and dequantized, in bf16 (the published
    fp4_act_quant(x, block, inplace=True)): per block the scale 2^ceil(log2(max(amax, 6·2^-126)·fp32(1/6))),
    values x/scale clamped to ±6 and rounded to e2m1, times the scale (exact in bf16)."""
    import torch

    v, s = _fp4_blocks(x, block)
    return (v * s).flatten(-2).to(torch.bfloat16)


def fp4_encode(x, block: int = FP4_BLOCK):
    """The same quantization as codes: x [..., N] -> (e2m1 codes [..., N] uint8 -- sign in bit 3, the
    magnitude's index in 0, 0.5, 1, 1.5, 2, 3, 4, 6 in bits 0-2, the sign kept on zeros as the published
    conversion keeps it --, UE8M0 scales [..., N/block] uint8: the exponent byte e of 2^(e-127))."""
    import torch

    v, s = _fp4_blocks(x, block)
    a = v.abs()
    index = torch.where(a < 2, 2 * a, torch.where(a < 6, a + 2, 7.0)).to(torch.uint8)
    codes = index | (torch.signbit(v).to(torch.uint8) << 3)
    exps = (torch.frexp(s)[1] + 126).to(torch.uint8).squeeze(-1)          # s = 0.5·2^e' -> e = e' - 1 + 127
    return codes.flatten(-2), exps


def fp4_decode(codes, exps, block: int = FP4_BLOCK):
    """(codes [..., N], scales [..., N/block]) uint8 as `fp4_encode` gives them -> [..., N] float32."""
    import torch

    c = codes.to(torch.int32)
    index = (c & 7).float()
    mag = torch.where(index < 4, 0.5 * index, torch.where(index < 7, index - 2, 6.0))
    value = torch.where((c & 8) != 0, -mag, mag)
    scale = torch.ldexp(torch.ones_like(exps, dtype=torch.float32), exps.to(torch.int32) - 127)
    return (value.unflatten(-1, (-1, block)) * scale[..., None]).flatten(-2)


def fp4_sim(x):
    """The published numerics of the indexer's queries and keys: x [..., Di] rotated, then FP4-simulated,
    as float32 (bf16 values)."""
    return fp4_qdq(rotate(x)).float()
