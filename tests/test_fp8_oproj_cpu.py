"""The fp8 o_proj strategies' numerics and rules that do not need a GPU (their kernels run in test_gpu_nvidia)."""
from __future__ import annotations

import math

import pytest
import torch

from dsv4.checks.catalogue import strategies
from dsv4.checks.compat import Combination, check
from dsv4.components.rope import Rope
from dsv4.values.device import DeviceInfo
from dsv4.oracle import _rope
from dsv4.strategies import (BucketHeadPadding, DeepGemmFp8OProj, Fp8DsMlaLayout, ReferenceMQA, TorchFp8OProj,
                             TritonFp8OProj)
from dsv4.strategies.o_proj.fp8_common import inverse_rope_fp8_quant, quantize_weight_blocks
from tests.conftest import published_rope_freqs, tiny_spec

SM90 = DeviceInfo(platform="cuda", arch="sm90", name="H200")
SM100 = DeviceInfo(platform="cuda", arch="sm100", name="B200")


def test_inverse_rope_fp8_quant_matches_the_spec():
    g = torch.Generator().manual_seed(0)
    T, H, G = 6, 16, 2
    o = (torch.randn(T, H, 512, generator=g) * torch.logspace(-3, 2, H)[None, :, None]).bfloat16()
    pos = torch.tensor([0, 1, 63, 4096, 65535, 1_000_000])
    x, s = inverse_rope_fp8_quant(o, Rope.for_layer(tiny_spec(), 4).at(pos), G)
    assert x.dtype == torch.float8_e4m3fn and x.shape == (T, G, H // G * 512) and s.shape == (T, G, H // G * 4)
    # independent: inverse GPT-J rotation from the oracle's own RoPE, per-128 power-of-two scales
    want = _rope(o.float(), pos[:, None], published_rope_freqs(4), inverse=True)
    blocks = want.reshape(T, G, -1, 128)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1).clamp_min(1e-10) / 448)))
    assert torch.equal(s, scale)
    assert bool((torch.log2(s) == torch.round(torch.log2(s))).all())
    deq = x.float().unflatten(-1, (-1, 128)) * s[..., None]
    step = blocks.abs() / 8 + scale[..., None] * 2.0 ** -9            # half an e4m3 ulp, normal or subnormal
    assert bool(((deq - blocks).abs() <= step).all())
    assert torch.equal(x, (blocks / scale[..., None]).to(torch.float8_e4m3fn).flatten(-2))


def test_weight_blocks_are_128x128_with_power_of_two_scales():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 256, 384, generator=g) * torch.rand(2, 256, 1, generator=g)
    q, s = quantize_weight_blocks(w)
    assert q.shape == w.shape and s.shape == (2, 2, 3)
    for gi, i, j in [(0, 0, 0), (1, 1, 2), (0, 1, 1)]:
        blk = w[gi, 128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
        assert float(s[gi, i, j]) == 2.0 ** math.ceil(math.log2(float(blk.abs().max()) / 448))
        assert torch.equal(q[gi, 128 * i:128 * (i + 1), 128 * j:128 * (j + 1)], (blk / s[gi, i, j]).to(torch.float8_e4m3fn))


def test_deepgemm_recipe_comes_from_the_device():
    assert DeepGemmFp8OProj.recipe(SM90) == (1, 128, 128)
    assert DeepGemmFp8OProj.recipe(SM100) == (1, 1, 128)


def combo(spec, o_proj, dtype="bfloat16"):
    return Combination(spec=spec, strategies=strategies(mqa_kernel=ReferenceMQA(), o_proj=o_proj, head_padding=
        BucketHeadPadding(name="buckets_64_128", buckets=(64, 128)), cache_layout=Fp8DsMlaLayout()), dtype=dtype)


@pytest.mark.parametrize("strategy", [DeepGemmFp8OProj(), TorchFp8OProj(), TritonFp8OProj()], ids=lambda s: s.name)
def test_fp8_oproj_rules(strategy):
    from omegaconf import OmegaConf

    from dsv4.values.spec import ModelSpec
    from tests.conftest import CONFIGS

    flash = ModelSpec.from_config(OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "dsv4_flash.yaml")))
    assert check(combo(flash, strategy), SM90) == []
    probs = check(combo(tiny_spec(), strategy), SM90)            # o_lora_rank 64: not whole 128-blocks
    assert [p.group for p in probs] == ["o_proj"]
    assert "model.o_lora_rank to be a multiple of 128; model=dsv4_tiny has 64" in probs[0].reason
    assert probs[0].fix == "o_proj=reference"
    cpu = check(combo(flash, strategy), DeviceInfo(platform="cpu"))
    assert any(p.group == "o_proj" and "runs on cuda" in p.reason for p in cpu)
    bf = check(combo(flash, strategy, dtype="float32"), SM90)
    assert [(p.group, p.fix) for p in bf] == [("dtype", "dtype=bfloat16")]


@pytest.mark.parametrize("overrides,group,fix", [
    (["cache_layout=bf16"], "cache_layout", "cache_layout=fp8_ds_mla"),
    (["head_padding=none", "model=dsv4_pro", "tp_size=8"], "head_padding", "head_padding=buckets_64_128"),
])
def test_flashmla_preset_swaps_are_refused_with_a_fix_on_any_machine(compose_cfg, overrides, group, fix):
    """`backend=flashmla` with a single strategy swapped that FlashMLA cannot take: refused before anything
    is allocated, for the H200 checked from this CPU machine."""
    from dsv4.app.job import make_job

    job = make_job(compose_cfg(["deployment=h200", "backend=flashmla"] + overrides))
    probs = check(job.combo, job.device, here="cpu")
    assert [(p.group, p.fix) for p in probs] == [(group, fix)], [p.line() for p in probs]
    if group == "head_padding":
        assert "needs padded heads in [64, 128]; got 16 (16 heads per rank)" in probs[0].reason


def test_flashmla_needs_a_gpu_and_its_package(compose_cfg):
    from dsv4.app.job import make_job

    job = make_job(compose_cfg(["backend=flashmla"]))              # deployment=cpu
    probs = check(job.combo, job.device, here="cpu")
    lines = [p.line() for p in probs]
    assert any("mqa_kernel=flashmla_sparse: runs on cuda, this device is cpu" in x for x in lines), lines
    assert any("dtype=float32" in x and "fix: dtype=bfloat16" in x for x in lines), lines
    # on a CUDA machine without the wheel: named as a missing package, never an ImportError
    h200 = make_job(compose_cfg(["deployment=h200", "backend=flashmla"]))
    missing = check(h200.combo, h200.device, here="cuda")
    import importlib.util
    for module, dist in (("flash_mla", "sgl-flash-mla"), ("deep_gemm", "sgl-deep-gemm")):
        if importlib.util.find_spec(module) is None:
            assert any(f"Python module '{module}' not found (pip package {dist})" in p.reason for p in missing)
