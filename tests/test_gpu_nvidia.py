"""NVIDIA kernels on a real GPU, against the reference on the same pages. Skipped without sm90/sm100."""
from __future__ import annotations

import pytest
import torch

from dsv4.speed.cases import oproj_case, sparse_case
from dsv4.components.rope import Rope
from dsv4.oracle import rel_err
from dsv4.strategies import (DeepGemmFp8OProj, FlashMLASparse, ReferenceMQA, ReferenceOProj, TorchFp8OProj,
                             TritonFp8OProj)
from dsv4.strategies.o_proj.fp8_common import inverse_rope_fp8_quant, quantize_weight_blocks
from tests.conftest import gpu_device, fp8_block_product, tiny_spec


DEV = gpu_device()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEV is None or DEV.arch not in ("sm90", "sm100"),
                                                  reason="needs an sm90/sm100 CUDA GPU (FlashMLA, DeepGEMM)")]


def assert_flashmla_close(a, b, *, abs_tol, rel_tol, cos_tol, min_pass=1.0):
    """FlashMLA's check_is_allclose (FlashMLA's tests/lib.py): elements within abs_tol or rel_tol
    (here: a share `min_pass` of them), and the cosine difference 1 - 2Σab/Σ(a²+b²) within cos_tol."""
    a, b = a.double(), b.double()
    err = (a - b).abs()
    ok = (err <= abs_tol) | (err <= rel_tol * b.abs())
    share = float(ok.double().mean())
    assert share >= min_pass, f"{int((~ok).sum())} of {ok.numel()} elements off; worst {float(err.max()):.3e}"
    cos_diff = 1 - 2 * float((a * b).sum()) / max(float((a * a + b * b).sum()), 1e-300)
    assert cos_diff <= cos_tol, cos_diff


@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("extra_block,extra_w", [(None, 0), (64, 512), (2, 256)])
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("gather", [0, 1])
def test_flashmla_matches_reference_on_the_same_pages(H, extra_block, extra_w, T, gather):
    q, kv, sink = sparse_case(T, H, extra_block=extra_block, extra_w=extra_w, seed=H + T + extra_w)
    k = FlashMLASparse(prefill_gather_min_tokens=gather)
    out, lse = k(q, kv, sink=sink, scale=512 ** -0.5, prepared=k.prepare(device=DEV))
    ref, ref_lse = ReferenceMQA()(q.float(), kv, sink=sink, scale=512 ** -0.5)
    # FlashMLA's test criterion: bf16 output against the float32 reference rounded to bf16, N(0,1) q and
    # rows. On our inputs 0.01-0.22% of elements miss its abs 1e-3 / rel 2.01/128 by a few bf16 ulps (the
    # kernel rounds P to bf16 before the PV product; worst 1.6e-2 absolute); the cosine criterion holds.
    assert_flashmla_close(out, ref.bfloat16(), abs_tol=1e-3, rel_tol=2.01 / 128, cos_tol=5e-6, min_pass=0.995)
    assert rel_err(out, ref) <= 3e-3              # measured 2.0-2.1e-3 (2.2e-3 on another day)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert_flashmla_close(lse[fin], ref_lse[fin], abs_tol=1e-6, rel_tol=8.01 / 65536, cos_tol=1e-12)


def test_flashmla_sink_infinities_and_empty_queries():
    q, kv, sink = sparse_case(8, 64, extra_block=64, extra_w=128, seed=5)
    k = FlashMLASparse()
    prep = k.prepare(device=DEV)
    sink = sink.clone()
    sink[:4] = float("inf")
    sink[4:8] = float("-inf")
    out, _ = k(q, kv, sink=sink, scale=512 ** -0.5, prepared=prep)
    ref, _ = ReferenceMQA()(q.float(), kv, sink=sink, scale=512 ** -0.5)
    assert bool((out[:, :4] == 0).all())
    assert rel_err(out[:, 4:], ref[:, 4:]) <= 1e-2


def test_flashmla_schedule_is_made_once_per_layer_type_and_step_and_reused():
    """Layers of one type in one step share shapes and lengths: the first call fills the tile-scheduler
    metadata in the step's plan, the second reuses it and gives what a fresh schedule gives."""
    q, kv, sink = sparse_case(16, 64, extra_block=64, extra_w=512, seed=11)
    k = FlashMLASparse()
    prep = k.prepare(device=DEV)
    plan = k.plan(tokens=16, layer_type="c4a")
    first, _ = k(q, kv, sink=sink, scale=512 ** -0.5, prepared=prep, plan=plan)
    sched = plan.sched
    assert sched.have_initialized and sched.tile_scheduler_metadata is not None
    q2 = torch.randn_like(q.float()).bfloat16()              # another layer: new q, same shapes and lengths
    again, _ = k(q2, kv, sink=sink, scale=512 ** -0.5, prepared=prep, plan=plan)
    assert plan.sched is sched
    fresh, _ = k(q2, kv, sink=sink, scale=512 ** -0.5, prepared=prep, plan=k.plan(tokens=16, layer_type="c4a"))
    assert torch.equal(again, fresh)
    assert not torch.equal(first, again)


@pytest.mark.parametrize("strategy", [DeepGemmFp8OProj(), TorchFp8OProj(), TritonFp8OProj()], ids=lambda s: s.name)
@pytest.mark.parametrize("T,G", [(1, 8), (33, 8), (256, 2)])
def test_fp8_oproj_matches_fp8_simulation_and_reference(strategy, T, G):
    spec = tiny_spec()
    rope = Rope.for_layer(spec, 4)
    w, o, pos = oproj_case(T, G)
    y = strategy(o, rope.at(pos), prepared=strategy.prepare(w, device=DEV, dtype="bfloat16"))
    ref = ReferenceOProj()
    y_ref = ref(o.float(), rope.at(pos), prepared=ref.prepare(w, device=DEV, dtype="float32"))
    # z, the input of wo_b (the layer's `linear` product), in exactly the fp8 numerics, simulated in float32
    x, xs = inverse_rope_fp8_quant(o, rope.at(pos), G)
    wq, ws = quantize_weight_blocks(w.wo_a.cuda().view(G, 1024, -1))
    z_sim = fp8_block_product(x, xs, wq, ws).bfloat16().flatten(1).float()
    assert y.shape == y_ref.shape == z_sim.shape == (T, G * 1024)
    assert rel_err(y.float(), z_sim) <= 2e-2
    assert rel_err(y.float(), y_ref.float()) <= 6e-2          # fp8 activations and weights against float


@pytest.mark.parametrize("mn_major", [False, True], ids=["token-major scales", "DeepGEMM sm90 scales"])
@pytest.mark.parametrize("T,H,G", [(1, 64, 8), (37, 16, 2), (4096, 64, 8)])
def test_fused_inverse_rope_fp8_kernel_matches_torch(T, H, G, mn_major):
    from dsv4.strategies.o_proj.fp8_common import fused_inverse_rope_fp8_quant, inverse_rope_fp8_quant

    g = torch.Generator(device="cuda").manual_seed(T)
    o = (torch.randn(T, H, 512, generator=g, device="cuda") * 4).bfloat16()
    pos = torch.randint(0, 1_000_000, (T,), generator=g, device="cuda")
    rope = Rope.for_layer(tiny_spec(), 4)
    x, s = fused_inverse_rope_fp8_quant(o, rope.at(pos), G, mn_major_scales=mn_major)
    xr, sr = inverse_rope_fp8_quant(o, rope.at(pos), G)
    assert x.shape == xr.shape and s.shape == sr.shape
    assert torch.equal(s, sr)
    if mn_major:          # per group, [blocks, align(T, 4)]: what DeepGEMM takes without a copy
        ta, k = -(-T // 4) * 4, s.shape[2]
        assert s.permute(1, 0, 2).stride() == (k * ta, 1, ta)
    else:
        assert s.is_contiguous()
    same = (x.view(torch.uint8) == xr.view(torch.uint8)).float().mean()
    assert float(same) >= 0.999                      # FMA contraction may move a value across a rounding edge
    deq = lambda a, b: a.float().unflatten(-1, (-1, 128)) * b[..., None]       # noqa: E731
    assert rel_err(deq(x, s), deq(xr, sr)) <= 1e-3


def test_deepgemm_oproj_reads_the_activation_scales_in_place():
    """On sm90 the prologue writes the scales in DeepGEMM's layout: the call launches the prologue, the
    grouped product, and no copy or transpose of the scales."""
    if DEV.arch != "sm90":
        pytest.skip("the sm90 recipe's layout")
    rope = Rope.for_layer(tiny_spec(), 4)
    w, o, pos = oproj_case(64, 8)
    k = DeepGemmFp8OProj()
    prepared = k.prepare(w, device=DEV, dtype="bfloat16")
    rot = rope.at(pos)
    k(o, rot, prepared=prepared)                     # compiled and loaded before profiling
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        k(o, rot, prepared=prepared)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("inv_rope_fp8" in n for n in names), names
    assert not [n for n in names if "copy" in n.lower() or "transpose" in n.lower()], names
