"""NVIDIA kernels on a real GPU, against the reference on the same pages. Skipped without sm90/sm100."""
from __future__ import annotations

import pytest
import torch

from dsv4.components.kv_pool import BlockAllocator, PagedCache
from dsv4.components.rope import Rope
from dsv4.device import DeviceInfo
from dsv4.reference import rel_err
from dsv4.strategies import (DeepGemmFp8OProj, FlashMLASparse, Fp8DsMlaLayout, OProjWeights, ReferenceMQA,
                             ReferenceOProj, SparseKV, TorchFp8OProj)
from dsv4.strategies.fp8_oproj import inverse_rope_fp8_quant, quantize_weight_blocks
from tests.conftest import tiny_spec


def _device():
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return DeviceInfo(platform="cuda", arch=f"sm{major}{minor}", name=torch.cuda.get_device_name())


DEV = _device()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEV is None or DEV.arch not in ("sm90", "sm100"),
                                                  reason="needs an sm90/sm100 CUDA GPU (FlashMLA, DeepGEMM)")]


def paged(name, blocks, B, g):
    """An fp8_ds_mla PagedCache on the GPU with a random row in every slot, written in scrambled order."""
    lay = Fp8DsMlaLayout()
    c = PagedCache(name=name, layout=lay, block_size=B, head_dim=512, allocator=BlockAllocator(blocks),
                   data=lay.allocate(num_blocks=blocks, block_size=B, head_dim=512, device="cuda"))
    n = blocks * B
    c.write(torch.randperm(n, generator=g, device="cuda").int(), torch.randn(n, 512, generator=g, device="cuda"))
    return c


def sparse_case(T, H, *, extra_block, extra_w, seed, swa_w=128, swa_blocks=16, extra_blocks=64):
    """q, SparseKV and sinks with random slot lists (-1 padded past random lengths) over random pages."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    swa = paged("swa", swa_blocks, 64, g)
    idx = torch.randint(0, swa.num_slots, (T, swa_w), generator=g, device="cuda")
    lens = torch.randint(1, swa_w + 1, (T,), generator=g, device="cuda")
    cols = torch.arange(swa_w, device="cuda")[None]
    kw = dict(swa=swa, swa_indices=torch.where(cols < lens[:, None], idx, -1).int(), swa_lens=lens.int())
    if extra_w:
        ext = paged("compressed", extra_blocks, extra_block, g)
        e = torch.randint(0, ext.num_slots, (T, extra_w), generator=g, device="cuda")
        el = torch.randint(0, extra_w + 1, (T,), generator=g, device="cuda")
        ecols = torch.arange(extra_w, device="cuda")[None]
        kw |= dict(extra=ext, extra_indices=torch.where(ecols < el[:, None], e, -1).int(), extra_lens=el.int())
    q = (torch.randn(T, H, 512, generator=g, device="cuda") * 3).bfloat16()
    sink = torch.randn(H, generator=g, device="cuda")
    return q, SparseKV(scratch={}, **kw), sink


@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("extra_block,extra_w", [(None, 0), (64, 512), (2, 256)])
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("gather", [0, 1])
def test_flashmla_matches_reference_on_the_same_pages(H, extra_block, extra_w, T, gather):
    q, kv, sink = sparse_case(T, H, extra_block=extra_block, extra_w=extra_w, seed=H + T + extra_w)
    k = FlashMLASparse(prefill_gather_min_tokens=gather)
    out, lse = k(q, kv, sink=sink, scale=512 ** -0.5, prepared=k.prepare(device=DEV))
    ref, ref_lse = ReferenceMQA()(q.float(), kv, sink=sink, scale=512 ** -0.5)
    assert rel_err(out, ref) <= 1e-2
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert rel_err(lse[fin], ref_lse[fin]) <= 1e-4


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
    metadata, the second reuses it (no new entry) and gives what a fresh schedule gives."""
    q, kv, sink = sparse_case(16, 64, extra_block=64, extra_w=512, seed=11)
    k = FlashMLASparse()
    prep = k.prepare(device=DEV)
    first, _ = k(q, kv, sink=sink, scale=512 ** -0.5, prepared=prep)
    assert len(kv.scratch) == 1
    sched = next(iter(kv.scratch.values()))
    assert sched.have_initialized and sched.tile_scheduler_metadata is not None
    q2 = torch.randn_like(q.float()).bfloat16()              # another layer: new q, same shapes and lengths
    again, _ = k(q2, kv, sink=sink, scale=512 ** -0.5, prepared=prep)
    assert len(kv.scratch) == 1 and next(iter(kv.scratch.values())) is sched
    fresh_kv = SparseKV(**{f: getattr(kv, f) for f in ("swa", "swa_indices", "swa_lens", "extra", "extra_indices",
                                                      "extra_lens")}, scratch={})
    fresh, _ = k(q2, fresh_kv, sink=sink, scale=512 ** -0.5, prepared=prep)
    assert torch.equal(again, fresh)
    assert not torch.equal(first, again)


def oproj_case(T, G, seed=0):
    g = torch.Generator().manual_seed(seed)
    hpg, r, hid = 8, 1024, 4096
    w = OProjWeights(wo_a=torch.randn(G * r, hpg * 512, generator=g) * (hpg * 512) ** -0.5,
                     wo_b=torch.randn(hid, G * r, generator=g) * (G * r) ** -0.5, groups=G)
    o = torch.randn(T, G * hpg, 512, generator=g).cuda().bfloat16()
    pos = torch.randint(0, 100_000, (T,), generator=g).cuda()
    return w, o, pos


@pytest.mark.parametrize("strategy", [DeepGemmFp8OProj(), TorchFp8OProj()], ids=lambda s: s.name)
@pytest.mark.parametrize("T,G", [(1, 8), (33, 8), (256, 2)])
def test_fp8_oproj_matches_fp8_simulation_and_reference(strategy, T, G):
    spec = tiny_spec()
    rope = Rope.for_layer(spec, 4)
    w, o, pos = oproj_case(T, G)
    y = strategy(o, pos, rope=rope, prepared=strategy.prepare(w, device=DEV, dtype="bfloat16"))
    ref = ReferenceOProj()
    y_ref = ref(o.float(), pos, rope=rope, prepared=ref.prepare(w, device=DEV, dtype="float32"))
    # exactly the fp8 numerics, simulated in float32
    x, xs = inverse_rope_fp8_quant(o, pos, rope, G)
    wq, ws = quantize_weight_blocks(w.wo_a.cuda().view(G, 1024, -1))
    xd = (x.float().unflatten(-1, (-1, 128)) * xs[..., None]).flatten(-2)
    wd = wq.float() * ws.repeat_interleave(128, 1).repeat_interleave(128, 2)
    z = torch.einsum("tgk,gnk->tgn", xd, wd).bfloat16()
    y_sim = z.flatten(1).float() @ w.wo_b.cuda().bfloat16().float().T
    assert rel_err(y, y_sim) <= 2e-2
    assert rel_err(y, y_ref) <= 6e-2          # fp8 activations and weights against float
