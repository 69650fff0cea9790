"""o_proj=triton_fp8: its grouped e4m3 product against the same fp8 numerics simulated in float32, the
whole projection against the other fp8 options' numerics, and its rules. Interpreted on the CPU
(TRITON_INTERPRET=1, tiny shapes; the dots take the e4m3 values widened to float32), compiled on an
NVIDIA GPU with fp8 tensor cores (tests marked gpu)."""
from __future__ import annotations

import os

import pytest
import torch

from dsv4.values.device import DeviceInfo
from dsv4.oracle import rel_err
from dsv4.strategies import TritonFp8OProj
from tests.conftest import fp8_block_product

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton>=3.7)")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])
    pytestmark = pytest.mark.skipif(VERSION < (3, 7), reason="Triton's interpreter before 3.7 (NumPy 2)")
    DEVICE = "cpu"
else:
    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(torch.version.hip) or torch.cuda.get_device_capability()
                                                      < (8, 9), reason="needs NVIDIA fp8 tensor cores (sm89+)")]
    DEVICE = "cuda"


def e4m3_blocks(rows, K, g, lead=()):
    """Random e4m3 values over their whole range and power-of-two scales per 128 columns."""
    x = (torch.randn(*lead, rows, K, generator=g, device=DEVICE) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.exp2(torch.randint(-12, 4, (*lead, rows, K // 128), generator=g, device=DEVICE).float())
    return x, s


SHAPES = [(1, 2, 128, 256), (5, 1, 256, 128), (70, 2, 128, 384), (3, 2, 256, 256)] + ([(33, 8, 1024, 4096), (300, 8, 1024, 4096)]
                                                                    if not INTERPRET else [])


@pytest.mark.parametrize("T,G,N,K", SHAPES)
@pytest.mark.parametrize("launch", [dict(), dict(block_m=128, num_warps=8, num_stages=3)], ids=["default", "m128"])
def test_grouped_product_matches_the_fp8_simulation(T, G, N, K, launch):
    from dsv4.kernels.products.fp8_grouped_gemm import grouped_fp8_gemm

    g = torch.Generator(device=DEVICE).manual_seed(T * 7 + G)
    x, xs = e4m3_blocks(G, K, g, (T,))
    w, ws = e4m3_blocks(N, K, g, (G,))
    ws = ws[:, ::128]                                   # one scale per 128x128 weight block
    z = grouped_fp8_gemm(x, xs, w, ws, **launch)
    want = fp8_block_product(x, xs, w, ws).bfloat16()
    assert z.shape == (T, G, N) and z.dtype == torch.bfloat16
    # float32 products are exact; only the order of the sums differs (interpreted: 3e-8 measured). Tensor
    # cores accumulate e4m3 products with fewer bits within each 128-wide block: a bf16 rounding
    assert rel_err(z, want) <= (1e-6 if INTERPRET else 4e-3)


@pytest.mark.parametrize("T,G,N,K", [(1, 2, 256, 512), (16, 3, 128, 512)] + ([(1, 8, 1024, 4096), (7, 16, 1024, 4096)]
                                                                       if not INTERPRET else []))
@pytest.mark.parametrize("split", [None, 1, 2, 4])
def test_few_token_launch_adds_its_parts_and_leaves_the_counters_zeroed(T, G, N, K, split):
    """Up to 16 tokens with counters: the dots transposed, K split over programs, the tile's last program
    adding the parts; the same sums as the fp8 simulation, and the counters zero again after each call."""
    from dsv4.kernels.products.fp8_grouped_gemm import counters, grouped_fp8_gemm

    g = torch.Generator(device=DEVICE).manual_seed(T * 11 + G)
    x, xs = e4m3_blocks(G, K, g, (T,))
    w, ws = e4m3_blocks(N, K, g, (G,))
    ws = ws[:, ::128]
    count = counters(G, N, DEVICE)
    want = fp8_block_product(x, xs, w, ws).bfloat16()
    for _ in range(2):                                  # a second call (a graph replay) starts afresh
        z = grouped_fp8_gemm(x, xs, w, ws, count=count, split=split)
        assert rel_err(z, want) <= (1e-6 if INTERPRET else 4e-3)
        assert int(count.abs().sum()) == 0
    with pytest.raises(ValueError, match="does not divide"):
        grouped_fp8_gemm(x, xs, w, ws, count=count, split=3)


def test_bad_shapes_and_launches_are_refused():
    from dsv4.kernels.products.fp8_grouped_gemm import grouped_fp8_gemm

    g = torch.Generator(device=DEVICE).manual_seed(0)
    x, xs = e4m3_blocks(1, 256, g, (3,))
    w, ws = e4m3_blocks(128, 256, g, (1,))
    with pytest.raises(ValueError, match="one scale per block"):
        grouped_fp8_gemm(x, xs, w, ws)                  # ws per row, not per 128x128 block
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        grouped_fp8_gemm(x.float(), xs, w, ws[:, ::128])
    for key, value in (("block_m", 0), ("num_warps", 2), ("num_stages", 0)):
        with pytest.raises(ValueError, match=key):
            TritonFp8OProj(**{key: value})


def test_rules_name_the_architectures():
    from omegaconf import OmegaConf

    from dsv4.checks.compat import check
    from dsv4.values.spec import ModelSpec
    from tests.conftest import CONFIGS
    from tests.test_fp8_oproj_cpu import combo

    flash = ModelSpec.from_config(OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "dsv4_flash.yaml")))
    for arch in ("sm89", "sm90", "sm100", "sm103", "sm120", "sm121"):
        assert check(combo(flash, TritonFp8OProj()), DeviceInfo(platform="cuda", arch=arch, name=arch)) == []
    a100 = check(combo(flash, TritonFp8OProj()), DeviceInfo(platform="cuda", arch="sm80", name="A100"))
    assert [p.group for p in a100] == ["o_proj"] and "sm80" in a100[0].reason
