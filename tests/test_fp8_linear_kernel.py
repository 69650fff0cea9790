"""linear=triton_fp8's kernel (dsv4/kernels/products/fp8_linear.py) against the published fp8 numerics stated in
torch (dsv4/formats/fp8_blocks.py): the quantized bytes and scales exactly, the product up to the order of
float32 sums, K split over several programs. Interpreted on the CPU
(TRITON_INTERPRET=1, small shapes), compiled on an NVIDIA GPU with fp8 tensor cores (marked gpu)."""
from __future__ import annotations

import pytest
import torch

from tests.triton_mode import BIG, DEVICE, INTERPRET, MARK

from dsv4.formats.fp8_blocks import act_quant, block_product, quantize_blocks
from dsv4.kernels.products.fp8_linear import act_quant_fp8, fp8_linear, plan
from dsv4.kernels.target import target_of
from dsv4.oracle import rel_err

if not INTERPRET and (torch.version.hip or torch.cuda.get_device_capability() < (8, 9)):
    pytestmark = pytest.mark.skip(reason="needs NVIDIA fp8 tensor cores (sm89+)")
else:
    pytestmark = MARK


def activations(M, K, g, dtype):
    """Rows over a wide range of magnitudes; an all-zero block, a tiny one and one of large values."""
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-12, 10, (M, 1), generator=g).float())
    x[0, :128] = 0
    if M > 1:
        x[1, :128] *= 1e-6
    if M > 2:
        x[2, -128:] = x[2, -128:] * 1e4
    return x.to(dtype).to(DEVICE)


def weights(N, K, g):
    b = quantize_blocks(torch.randn(N, K, generator=g) * K ** -0.5)
    return b.weight.to(DEVICE), b.scale.to(DEVICE)


SHAPES = [(1, 128, 128), (3, 256, 256), (70, 384, 128)] + ([(1, 4096, 8192), (64, 40960, 1024), (1000, 1536, 4096)]
                                                          if BIG else [])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_quant_kernel_is_act_quant(dtype):
    g = torch.Generator().manual_seed(0)
    x = activations(37, 384, g, dtype)
    for mn_major in (False, True):
        q, s = act_quant_fp8(x, mn_major_scales=mn_major)
        want_q, want_s = act_quant(x)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s, want_s) and tuple(s.shape) == (37, 3)
        if mn_major:
            assert s.stride() == (1, 40)        # block-major, M padded to a multiple of 4


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_product_is_the_published_linear(M, N, K, dtype):
    g = torch.Generator().manual_seed(M + N + K)
    x = activations(M, K, g, dtype)
    w, ws = weights(N, K, g)
    xq, xs = act_quant(x)
    want = block_product(xq, xs, w, ws)                   # float32, the published sums in K order
    y32 = fp8_linear(x, w, ws, out_dtype=torch.float32)
    # interpreted: float32 summation order only; on Hopper the tensor cores' fp8 product sums each block's
    # 128 terms with fewer bits than float32, as in DeepGEMM and the published kernel (a block at a time)
    assert rel_err(y32, want) < (1e-6 if INTERPRET else 1e-3)
    y = fp8_linear(x, w, ws)
    assert y.dtype == dtype
    if dtype == torch.bfloat16 and INTERPRET:             # at most one bf16 step from the rounded reference
        assert ((y.float() - want.bfloat16().float()).abs() <= want.abs() * 2 ** -7 + 1e-30).all()
    assert rel_err(y.float(), want) < 4e-3
    pre = fp8_linear(xq, w, ws, xs=xs, out_dtype=torch.float32)       # quantized elsewhere: the same sums
    assert torch.equal(pre, y32)


def test_plan_spreads_few_rows_over_the_processors():
    from dataclasses import replace

    h200 = replace(target_of(torch.device(DEVICE)), processors=132)
    # up to 16 rows: the dots transposed; 64-column tiles unless 128 fill the GPU; the fewest parts of K (at
    # most 32 blocks each) that give a program per SM
    wo_b = plan(1, 4096, 8192, h200)                      # 64 tiles: K in 2 would give 128 programs, in 4 256
    assert (wo_b.block_m, wo_b.block_n, wo_b.split, wo_b.quantize_first, wo_b.swap) == (16, 64, 4, False, True)
    q_b = plan(16, 40960, 1024, h200)                     # 320 128-column tiles fill the GPU
    assert (q_b.block_n, q_b.split) == (128, 1)
    assert plan(1, 1536, 4096, h200).split == 8           # 24 tiles; each part at least 4 of K's 32 blocks
    assert plan(1, 2048, 7168, h200).split == 7           # DSV4-Pro's x: 32 tiles; 56 blocks in 7 parts, 224 programs
    assert plan(1, 7168, 16384, h200).split == 4          # DSV4-Pro's wo_b: 112 tiles; K in 2 leaves 64 blocks a part
    sm90 = replace(h200, arch="sm90")
    # more rows: quantized once by its own launch; K's parts bring the programs nearest to one per SM
    x_proj = [plan(m, 1536, 4096, sm90) for m in (32, 64, 128, 256)]
    assert [(p.block_m, p.block_n, p.split) for p in x_proj] == [(32, 64, 4), (64, 64, 4), (64, 64, 2), (64, 64, 1)]
    assert all(p.quantize_first for p in x_proj)
    assert (plan(64, 4096, 8192, sm90).block_n, plan(64, 4096, 8192, sm90).split) == (128, 4)   # 32 tiles
    q_proj = plan(128, 40960, 1024, sm90)                 # 640 128x64 tiles: no split
    assert (q_proj.block_m, q_proj.block_n, q_proj.split) == (128, 64, 1)
    assert plan(8192, 4096, 8192, h200) == plan(8192, 4096, 8192, h200) and plan(8192, 4096, 8192, h200).split == 1
    assert (plan(512, 32768, 1024, sm90).block_n, plan(512, 32768, 1024, sm90).split) == (256, 1)   # 1024 tiles
    wkv = plan(512, 512, 4096, sm90)                      # 16 wide tiles would leave 116 SMs idle
    assert (wkv.block_m, wkv.block_n, wkv.split, wkv.quantize_first) == (64, 128, 8, True)
    assert plan(512, 384, 4096, sm90).block_n == 128      # 384 columns are not whole 256-column tiles
    assert plan(2048, 512, 4096, sm90).split == 4 and plan(8192, 512, 4096, sm90).split == 1


@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("split", [1, 2])
def test_transposed_and_row_tile_dots_give_the_published_sums(M, split):
    """Few rows: the dots with the weight tile as the MMA's M (`swap`, as planned) and with the 16 rows as
    it, from the same quantized rows, both the published block sums."""
    g = torch.Generator().manual_seed(M + 10 * split)
    x = activations(M, 512, g, torch.bfloat16)
    w, ws = weights(256, 512, g)
    want = block_product(*act_quant(x), w, ws)
    for swap in (True, False):
        y = fp8_linear(x, w, ws, out_dtype=torch.float32, swap=swap, split=split)
        assert rel_err(y, want) < (1e-6 if INTERPRET else 1e-3), swap


@pytest.mark.parametrize("M", [1, 20, 64, 200])
def test_split_products_add_their_parts_and_leave_the_counters_zeroed(M):
    """K's blocks over several programs per tile: the tile's last program adds the parts; the counters are
    zero again after each call, so the next call (a graph replay) starts afresh."""
    from dsv4.kernels.products.fp8_linear import counters

    g = torch.Generator().manual_seed(M)
    x = activations(M, 1024, g, torch.bfloat16)
    w, ws = weights(256, 1024, g)
    count = counters(256, x.device)
    whole = fp8_linear(x, w, ws, out_dtype=torch.float32, split=1)
    for sp in (2, 4, 8):
        for _ in range(2):
            y = fp8_linear(x, w, ws, out_dtype=torch.float32, split=sp, count=count)
            assert rel_err(y, whole) < (1e-6 if INTERPRET else 1e-3)
            assert int(count.abs().sum()) == 0
    with pytest.raises(ValueError, match="does not divide"):
        fp8_linear(x, w, ws, split=3)


def test_bad_inputs_are_refused_before_launch():
    g = torch.Generator().manual_seed(6)
    x = activations(4, 256, g, torch.bfloat16)
    w, ws = weights(128, 256, g)
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_linear(x[:, :200], w[:, :200], ws)
    with pytest.raises(ValueError, match="must be float8_e4m3fn"):
        fp8_linear(x, w.float(), ws)
    with pytest.raises(ValueError, match="comes with its scales"):
        fp8_linear(act_quant(x)[0], w, ws)
    with pytest.raises(ValueError, match="one scale per block"):
        fp8_linear(x, w, ws[:, :1])
    assert fp8_linear(x[:0], w, ws).shape == (0, 128)


@pytest.mark.skipif(not BIG, reason="the GPU options: a GPU")
@pytest.mark.parametrize("option", ["triton_fp8", "deepgemm_fp8", "torch_fp8"])
@pytest.mark.parametrize("M", [1, 64, 1000])
def test_gpu_options_are_the_published_linear(option, M):
    """Each fp8 option that runs on this GPU against fp8_sim on the same bytes, on DSV4-Flash's products:
    the same values but for float32 summation order and the bf16 rounding of the result."""
    import importlib.util

    from dsv4.checks.catalogue import option as shipped
    from dsv4.strategies import LinearWeight
    from tests.conftest import gpu_device

    dev = gpu_device()
    lin = shipped("linear", option)
    needs = lin.needs(dev)
    if any(importlib.util.find_spec(m) is None for m, _ in needs.modules) or dev.arch not in needs.archs:
        pytest.skip(f"linear={option} does not run on this GPU")
    sim = shipped("linear", "fp8_sim")
    g = torch.Generator().manual_seed(M)
    for N, K in ((1536, 4096), (40960, 1024), (4096, 8192)):
        b = quantize_blocks(torch.randn(N, K, generator=g) * K ** -0.5)
        weight = LinearWeight(values=b.dequantize(), fp8=b)
        x = activations(M, K, g, torch.bfloat16)
        want = sim(x, sim.prepare(weight, device=dev, dtype="bfloat16")).float()
        y = lin(x, lin.prepare(weight, device=dev, dtype="bfloat16"))
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        assert rel_err(y.float(), want) < 4e-3, (option, N, K)
