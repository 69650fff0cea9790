"""x's products of a few-row step in one launch (dsv4/kernels/products/joint_linear.py): the fp8 part against our
fp8 product (the published fp8 linear) and the float part against the float32 product of the bf16 values.
Interpreted on the CPU (TRITON_INTERPRET=1, small shapes), compiled on an NVIDIA GPU with fp8 tensor cores
(marked gpu), where DSV4-Flash's and DSV4-Pro's shapes run too."""
from __future__ import annotations

import pytest
import torch

from tests.triton_mode import BIG, DEVICE, INTERPRET, MARK
from tests.test_fp8_linear_kernel import activations, weights

from dsv4.kernels.products.fp8_linear import fp8_linear
from dsv4.kernels.products.joint_linear import BN, joint_counters, joint_linear, joint_plan
from dsv4.kernels.target import Target, target_of
from dsv4.oracle import rel_err

if not INTERPRET and (torch.version.hip or torch.cuda.get_device_capability() < (8, 9)):
    pytestmark = pytest.mark.skip(reason="needs NVIDIA fp8 tensor cores (sm89+)")
else:
    pytestmark = MARK

# (N, N_tail, K): tails that are not whole tiles; on a GPU DSV4-Flash's ratio-4 and ratio-128 layers and DSV4-Pro's
SHAPES = [(256, 200, 512), (128, 64, 1024)] + ([(1536, 2624, 4096), (1536, 1024, 4096), (2048, 2624, 7168)]
                                               if BIG else [])


@pytest.mark.parametrize("N,NT,K", SHAPES)
@pytest.mark.parametrize("M", [1, 3, 16])
def test_one_launch_gives_both_products(M, N, NT, K):
    """At the planned split and others: the fp8 columns are our fp8 product's sums at the same split (the same
    bits, interpreted), the float columns the float32 product of the bf16 values; the counters zero after."""
    g = torch.Generator().manual_seed(M + N + NT)
    x = activations(M, K, g, torch.bfloat16)
    w, ws = weights(N, K, g)
    tail = (torch.randn(NT, K, generator=g) * K ** -0.5).to(torch.bfloat16).to(DEVICE)
    count = joint_counters(N, NT, x.device)
    want_tail = x.float() @ tail.float().T
    kb = K // 128
    planned = joint_plan(N, NT, K, target_of(x.device)).split
    for split, tail_split in ((None, None), (1, 1), (2, kb // 4), (kb // 4, 2)):
        y = joint_linear(x, w, ws, tail, count=count, split=split, tail_split=tail_split)
        want = fp8_linear(x, w, ws, out_dtype=torch.float32, block_m=16, block_n=BN, swap=True,
                          quantize_first=False, split=split or planned)
        assert y.shape == (M, N + NT) and y.dtype == torch.float32
        if INTERPRET:
            assert torch.equal(y[:, :N], want)
        assert rel_err(y[:, :N], want) < (1e-6 if INTERPRET else 1e-5), (split, tail_split)
        assert rel_err(y[:, N:], want_tail) < 1e-5, (split, tail_split)
        assert int(count.abs().sum()) == 0


def test_plan_fills_the_processors():
    """DSV4-Flash's and DSV4-Pro's x products beside their float weights: both weights' K in the same parts, the
    fewest that give 1.2 programs per SM (132 of them)."""
    sm90 = Target(arch="sm90", native_e4m3=True, processors=132)
    for N, NT, K in ((1536, 2624, 4096), (1536, 1024, 4096), (2048, 2624, 7168), (2048, 1024, 7168)):
        p = joint_plan(N, NT, K, sm90)
        tiles = N // BN + -(-NT // BN)
        fewer = [s for s in range(1, p.split) if K // 128 % s == 0]
        assert p.tail_split == p.split == 4 and p.num_stages == 3, (N, NT, K, p)
        assert 5 * tiles * p.split >= 6 * 132 > 5 * max((tiles * s for s in fewer), default=0), (N, NT, K, p)


def test_bad_inputs_are_refused_before_launch():
    g = torch.Generator().manual_seed(3)
    x = activations(4, 256, g, torch.bfloat16)
    w, ws = weights(128, 256, g)
    tail = torch.randn(64, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    count = joint_counters(128, 64, x.device)
    with pytest.raises(ValueError, match="at most 16"):
        joint_linear(activations(17, 256, g, torch.bfloat16), w, ws, tail, count=count)
    with pytest.raises(ValueError, match="in bf16"):
        joint_linear(x.float(), w, ws, tail, count=count)
    with pytest.raises(ValueError, match="in bf16"):
        joint_linear(x, w, ws, tail.float(), count=count)
    with pytest.raises(ValueError, match="counters"):
        joint_linear(x, w, ws, tail, count=count[:1])
    with pytest.raises(ValueError, match="expected e4m3 w"):
        joint_linear(x, w.float(), ws, tail, count=count)
    with pytest.raises(ValueError, match="do not both divide"):
        joint_linear(x, w, ws, tail, count=count, split=3)
    assert joint_linear(x[:0], w, ws, tail, count=count).shape == (0, 192)
