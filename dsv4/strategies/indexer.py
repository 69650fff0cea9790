"""IndexerStrategy options: the numerics of the lightning indexer's queries and keys.

- `exact`: the queries and keys as the layer computes them (RoPE'd float32, keys stored in the
  activation dtype): the indexer scores what the model's weights give, with no simulated quantization.
- `fp4_sim`: the numerics of DeepSeek's published inference code for V4 (`inference/model.py`,
  `Indexer.forward` and `Compressor.forward` with `rotate=True`; `inference/kernel.py`,
  `fp4_act_quant`), which the indexer was trained with (QAT): after RoPE, each 128-dim query head and
  each compressed key is taken in bf16, rotated by the orthonormal Hadamard transform (Sylvester order,
  scale dim^-1/2, float32 butterflies, one rounding to bf16), then quantized and dequantized to FP4 --
  e2m1 values (grid ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, round to nearest, ties to even) with one power-of-two
  scale per block of 32, 2^ceil(log2(amax / 6)) with amax clamped at 6·2^-126 --, in bf16. The keys are
  stored as these values. The rotation is orthogonal, so q·k changes only by the quantization.

- `mxfp4` (dsv4/strategies/mxfp4.py): `fp4_sim`'s numerics, the keys stored as packed FP4 records.
- `triton_fp8`, `deepgemm_fp8` (dsv4/strategies/fp8_keys.py): `fp4_sim`'s numerics, the keys stored as fp8
  records, scored by our kernel or by DeepGEMM.

The published code also rounds the head weights and the scores to bf16; here both stay float32 (the
scores' products and sums are our scoring kernel's for every option but `deepgemm_fp8`, which sums in
DeepGEMM's order and precision). Each option says how its keys are stored (`key_layout`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dsv4.strategies.protocols import Needs
from dsv4.strategies.top_k import DEFAULT_TOP_K, check_top_k

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


def triton_scores(q, w, keys, pages, token_request, counts, *, width: int, w_scale: float, plan=None):
    """The step's scores by our Triton kernel (dsv4/kernels/indexer_logits.py): rows of the keys' dtype,
    FP4 or fp8 records (no per-step plan)."""
    from dsv4.kernels.indexer_logits import indexer_logits

    return indexer_logits(q, w, keys, pages, token_request, counts, width=width, w_scale=w_scale)


def no_prepare(self, *, head_dim: int, device) -> Any:
    """An option's `prepare` when its transforms need nothing made on the device."""
    return None


def no_plan(self, *, token_request, counts, pages, block_size: int) -> None:
    """An option's `plan` when its scoring needs nothing made per step."""
    return None


def fp4_queries(self, q, prepared=None):
    """The FP4 options' `queries`: RoPE'd queries [..., Di] -> rotated, FP4-simulated, float32 (bf16 values)."""
    return fp4_sim(q)


def fp4_keys(self, rows, prepared=None):
    """The FP4 options' `keys`: closed keys [N, Di] after norm and RoPE -> rotated, FP4-simulated, float32
    (bf16 values)."""
    return fp4_sim(rows)


# what the rotation and the blocks need of the model, and the fix where it has other shapes
FP4_NEEDS = {"model_multiples": (("index_head_dim", FP4_BLOCK),), "model_powers_of_two": ("index_head_dim",),
             "fix": "indexer=exact"}


def fp4_needs(self, device) -> Needs:
    """The FP4 options' `needs` where their scoring is ours: the rotation's and the blocks' alone."""
    return Needs(**FP4_NEEDS)


def plain_keys(dtype: str):
    """Keys as plain rows in the activation dtype: float32 activations keep exact keys; bf16 ones store
    bf16 keys, as the published inference code does (its indexer cache is a bf16 tensor scored by a
    bf16 product)."""
    from dsv4.strategies.cache_layout import PlainRowLayout

    return PlainRowLayout(name=dtype, dtype=dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExactIndexer:
    name: str = "exact"
    top_k: str = DEFAULT_TOP_K                # how the scores become lists on a GPU (top_k.TOP_K)
    __post_init__ = check_top_k
    error_budget: ClassVar[float] = 0.0
    transforms: ClassVar[bool] = False        # queries and keys are scored as the layer computes them
    fp4: ClassVar[bool] = False               # the transforms are the published FP4 ones (dsv4/kernels/fp4.py)
    oracle_numerics: ClassVar[str] = "exact"  # what the oracle recomputes the indexer with (oracle.py)
    fp8_queries: ClassVar[bool] = False       # its GPU kernel scores e4m3 queries, scales in the head weights

    scores, prepare, plan = staticmethod(triton_scores), no_prepare, no_plan

    def needs(self, device) -> Needs:
        return Needs()

    def key_layout(self, *, dtype: str, head_dim: int):
        return plain_keys(dtype)

    def queries(self, q, prepared=None):
        return q

    def keys(self, rows, prepared=None):
        return rows


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp4SimIndexer:
    name: str = "fp4_sim"
    top_k: str = DEFAULT_TOP_K                # how the scores become lists on a GPU (top_k.TOP_K)
    __post_init__ = check_top_k
    error_budget: ClassVar[float] = 0.0       # the oracle applies the same numerics
    transforms: ClassVar[bool] = True
    fp4: ClassVar[bool] = True                # which the layer's kernels apply themselves on a GPU
    oracle_numerics: ClassVar[str] = "fp4"
    fp8_queries: ClassVar[bool] = False

    scores, prepare, plan = staticmethod(triton_scores), no_prepare, no_plan
    queries, keys, needs = fp4_queries, fp4_keys, fp4_needs

    def key_layout(self, *, dtype: str, head_dim: int):
        return plain_keys(dtype)

