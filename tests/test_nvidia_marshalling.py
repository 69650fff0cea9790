"""The FlashMLA and DeepGEMM adapters' marshalling on the CPU, against torch models of the vendors'
documented contracts (fake `flash_mla` / `deep_gemm` modules; the real kernels run in test_gpu_nvidia).

flash_mla_with_kvcache (sgl-flash-mla 1.0.0 docstring): q (b, s_q, h_q, 512) bf16 with h_q in {64, 128};
k_cache (num_blocks, page_block_size, 1, 584) uint8 in the MODEL1 format (a page's B·576 data bytes, then
its B·8 scale bytes; page stride from the tensor), indices (b, s_q, topk) int32 of page*B + offset, only
exactly -1 invalid, topk a multiple of 64; topk_length (b,) int32: only the leftmost entries count; the
same for the extra cache; attn_sink (h_q,) f32 scales the output by exp(lse)/(exp(lse)+exp(sink));
returns out (b, s_q, h_q, 512) and lse (b, h_q, s_q). fp8_einsum("bhr,hdr->bhd", (x, sx), (w, sw), z,
recipe): x e4m3 [b, h, r] with one scale per 1×128, w e4m3 [h, d, r] with one per 128×128 (recipe
(1, 128, 128)) or per 1×128 row block (recipe (1, 1, 128)); z bf16 [b, h, d].
"""
from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from dsv4.speed.cases import random_pages
from dsv4.components.rope import Rope
from dsv4.values.device import DeviceInfo
from dsv4.oracle import rel_err
from dsv4.strategies import (DeepGemmFp8OProj, FlashMLASparse, OProjWeights, ReferenceMQA, ReferenceOProj,
                             SparseKV)
from tests.conftest import fp8_block_product, tiny_spec


def decode_model1_page(page_bytes: torch.Tensor, B: int) -> torch.Tensor:
    """One page's B rows from its raw bytes (the MODEL1 record), float32 [B, 512]."""
    data = page_bytes[: B * 576].view(B, 576)
    e = page_bytes[B * 576: B * 584].view(B, 8)[:, :7].float() - 127
    nope = data[:, :448].contiguous().view(torch.float8_e4m3fn).float() * torch.exp2(e).repeat_interleave(64, 1)
    return torch.cat((nope, data[:, 448:].contiguous().view(torch.bfloat16).float()), 1)


def fake_flash_mla(calls: list):
    class Sched:
        def __init__(self):
            self.have_initialized, self.config = False, None

    def rows_of(cache, idx, length):
        nb, B = cache.shape[0], cache.shape[1]
        assert cache.shape[2:] == (1, 584) and cache.dtype == torch.uint8
        pool = torch.cat([decode_model1_page(cache[n].reshape(-1), B) for n in range(nb)])
        width = idx.shape[-1]
        assert width % 64 == 0 and idx.dtype == torch.int32 and idx.is_contiguous()
        valid = (idx != -1) & (torch.arange(width)[None, None, :] < length.long()[:, None, None])
        return pool[idx.clamp(min=0).long()], valid

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, sched, *, softmax_scale,
                               is_fp8_kvcache, indices, attn_sink, topk_length, use_legacy, extra_k_cache=None,
                               extra_indices_in_kvcache=None, extra_topk_length=None):
        b, s_q, h_q, d = q.shape
        assert q.dtype == torch.bfloat16 and d == 512 and h_q in (64, 128) and head_dim_v == 512
        assert is_fp8_kvcache and block_table is None and cache_seqlens is None
        assert attn_sink.shape == (h_q,) and attn_sink.dtype == torch.float32
        assert topk_length.shape == (b,) and topk_length.dtype == torch.int32
        config = (b, s_q, h_q, indices.shape[-1], None if extra_indices_in_kvcache is None else
                  extra_indices_in_kvcache.shape[-1])
        if sched.have_initialized:
            assert sched.config == config, "scheduler metadata reused with other shapes"
        sched.have_initialized, sched.config = True, config
        calls.append({"use_legacy": use_legacy, "sched": sched})
        kv, valid = rows_of(k_cache, indices, topk_length)
        if extra_k_cache is not None:
            ekv, evalid = rows_of(extra_k_cache, extra_indices_in_kvcache, extra_topk_length)
            kv, valid = torch.cat((kv, ekv), 2), torch.cat((valid, evalid), 2)
        logits = torch.einsum("bshd,bsnd->bshn", q.float(), kv) * softmax_scale
        logits = logits.masked_fill(~valid[:, :, None, :], -math.inf)
        lse = torch.logsumexp(logits, -1)                                     # [b, s_q, h_q]
        p = torch.softmax(logits, -1).nan_to_num(0.0)
        out = torch.einsum("bshn,bsnd->bshd", p, kv) * torch.sigmoid(lse - attn_sink)[..., None]
        out = torch.where(torch.isinf(lse)[..., None], 0.0, out)
        return out.bfloat16(), torch.where(torch.isinf(lse), math.inf, lse).transpose(1, 2)

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, *, attn_sink, topk_length, use_legacy):
        """The prefill kernel on bf16 rows kv [N, 1, 512] named by indices [T, 1, W] (-1 or past
        topk_length: none); out [T, H, 512], max logits, lse [T, H] (natural log, sink not included)."""
        T, _, d = q.shape
        assert q.dtype == kv.dtype == torch.bfloat16 and d == d_v == 512 and kv.shape[1:] == (1, 512)
        assert indices.shape[:2] == (T, 1) and indices.dtype == torch.int32 and indices.is_contiguous()
        assert indices.shape[-1] % 64 == 0 and topk_length.shape == (T,) and topk_length.dtype == torch.int32
        idx = indices[:, 0].long()
        assert int(idx.max()) < kv.shape[0]
        valid = (idx >= 0) & (torch.arange(idx.shape[1])[None] < topk_length.long()[:, None])
        rows = kv[idx.clamp(min=0), 0].float()                                # [T, W, 512]
        logits = torch.einsum("thd,twd->thw", q.float(), rows) * sm_scale
        logits = logits.masked_fill(~valid[:, None, :], -math.inf)
        lse = torch.logsumexp(logits, -1)
        p = torch.softmax(logits, -1).nan_to_num(0.0)
        out = torch.einsum("thw,twd->thd", p, rows) * torch.sigmoid(lse - attn_sink)[..., None]
        out = torch.where(torch.isinf(lse)[..., None], 0.0, out)
        return out.bfloat16(), logits.amax(-1), torch.where(torch.isinf(lse), math.inf, lse)

    mod = types.ModuleType("flash_mla")
    mod.get_mla_metadata = lambda *a, **k: (Sched(), None)
    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    mod.flash_mla_sparse_fwd = flash_mla_sparse_fwd
    return mod


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("extra_block,extra_w", [(None, 0), (64, 40), (2, 7)])
def test_flashmla_adapter_through_the_contract_equals_reference(monkeypatch, arch, extra_block, extra_w):
    calls: list = []
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla(calls))
    g = torch.Generator().manual_seed(len(arch) + extra_w)
    T, H = 5, 64
    swa = random_pages("swa", 3, 64, g)
    lens = torch.tensor([1, 16, 9, 16, 3], dtype=torch.int32)
    idx = torch.randint(0, swa.num_slots, (T, 16), generator=g)
    kw = dict(swa=swa, swa_indices=torch.where(torch.arange(16)[None] < lens[:, None], idx, -1).int(), swa_lens=lens)
    if extra_w:
        ext = random_pages("compressed", 8, extra_block, g)
        el = torch.randint(0, extra_w + 1, (T,), generator=g).int()
        e = torch.randint(0, ext.num_slots, (T, extra_w), generator=g)
        kw |= dict(extra=ext, extra_indices=torch.where(torch.arange(extra_w)[None] < el[:, None], e, -1).int(),
                   extra_lens=el)
    kv = SparseKV(layer_type="c4a", **kw)
    q = (torch.randn(T, H, 512, generator=g) * 2).bfloat16()
    sink = torch.randn(H, generator=g)
    sink[:3] = math.inf
    k = FlashMLASparse()
    prep = k.prepare(device=DeviceInfo(platform="cuda", arch=arch))
    plan = k.plan(tokens=T, layer_type="c4a")
    out, lse = k(q, kv, sink=sink, scale=512 ** -0.5, prepared=prep, plan=plan)
    ref, ref_lse = ReferenceMQA()(q.float(), kv, sink=sink, scale=512 ** -0.5)
    assert rel_err(out, ref) <= 1e-2 and out.dtype == q.dtype and out.shape == q.shape
    assert torch.allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert bool((out[:, :3] == 0).all())
    assert calls[0]["use_legacy"] is (arch == "sm90")
    # a second layer of the same type in the same step reuses the schedule; a new step's plan makes a new one
    k(q, kv, sink=sink, scale=512 ** -0.5, prepared=prep, plan=plan)
    assert calls[1]["sched"] is calls[0]["sched"] is plan.sched
    k(q, kv, sink=sink, scale=512 ** -0.5, prepared=prep, plan=k.plan(tokens=T, layer_type="c4a", previous=plan))
    assert calls[2]["sched"] is not calls[0]["sched"]
    k(q, kv, sink=sink, scale=512 ** -0.5, prepared=prep)           # no plan: a schedule of its own
    assert calls[3]["sched"] not in (calls[0]["sched"], calls[2]["sched"])
    # the layer's page views: one per cache buffer, made by the first call and kept by the layer's memo
    assert len(prep.pages.views) == (2 if extra_w else 1)


@pytest.mark.parametrize("gather, sizes, fix", [
    (0, None, None),                       # never gathers: any step can be captured
    (1024, None, None),                    # gathers from 1024 tokens; the largest captured step has 256
    (128, None, "graph.capture_sizes=[1,2,4,8,16,32,64]"),
    (128, "[1,2,4,8,16,32,64]", None),
    (1, None, "graph.enabled=false"),      # every step gathers
    (128, "[1,2,4,8,16,32,64,128]", "graph.capture_sizes=[1,2,4,8,16,32,64]")])
def test_flashmla_prefill_gather_refuses_only_captured_steps_that_would_gather(compose_cfg, gather, sizes, fix):
    """The gather path sizes its workspace on the host, so a CUDA graph may capture only steps below
    prefill_gather_min_tokens: check() refuses graph.capture_sizes that reach it, with sizes that do not."""
    from dsv4.app.job import make_job
    from dsv4.checks.compat import check

    extra = [f"graph.capture_sizes={sizes}"] if sizes else []
    job = make_job(compose_cfg(["deployment=h200", f"mqa_kernel.prefill_gather_min_tokens={gather}", *extra]))
    problems = [p for p in check(job.combo, job.device) if p.group == "mqa_kernel"]
    assert [p.fix for p in problems] == ([fix] if fix else [])
    off = make_job(compose_cfg(["deployment=h200", f"mqa_kernel.prefill_gather_min_tokens={gather}",
                                "graph.enabled=false"]))
    assert not [p for p in check(off.combo, off.device) if p.group == "mqa_kernel"]


def test_flashmla_prefill_gather_attends_what_the_reference_does(monkeypatch):
    """prefill_gather_min_tokens: the referenced rows gathered once into a bf16 workspace and re-indexed for
    flash_mla_sparse_fwd, through the contract's fake, equal ReferenceMQA on lists with -1 holes, entries
    past their lengths and ids past their pool (padding, as ReferenceMQA reads them: an SWA id past the
    SWA pool is not a compressed row), valid entries anywhere in the list, a query with none."""
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla([]))
    g = torch.Generator().manual_seed(7)
    T, H, W, EW = 6, 64, 24, 20
    swa, ext = random_pages("swa", 3, 64, g), random_pages("compressed", 4, 8, g)
    si = torch.randint(-1, swa.num_slots, (T, W), generator=g).int()
    ei = torch.randint(-1, ext.num_slots, (T, EW), generator=g).int()
    si[:, 1::5] = swa.num_slots + torch.arange(T)[:, None] % ext.num_slots        # past the SWA pool
    ei[:, 2::7] = ext.num_slots + 3                                                  # past the compressed pool
    sl = torch.tensor([W, 17, 0, 5, W, 1], dtype=torch.int32)
    el = torch.tensor([EW, 0, 0, 9, 3, EW], dtype=torch.int32)
    si[2], ei[2] = -1, -1
    kv = SparseKV(swa=swa, swa_indices=si, swa_lens=sl, extra=ext, extra_indices=ei, extra_lens=el,
                  layer_type="c4a")
    q = (torch.randn(T, H, 512, generator=g) * 2).bfloat16()
    sink = torch.randn(H, generator=g)
    k = FlashMLASparse(prefill_gather_min_tokens=1)
    out, lse = k(q, kv, sink=sink, scale=512 ** -0.5, prepared=k.prepare(device=DeviceInfo(platform="cuda",
                                                                                              arch="sm90")))
    ref, ref_lse = ReferenceMQA()(q.float(), kv, sink=sink, scale=512 ** -0.5)
    assert rel_err(out, ref) <= 1e-2 and out.dtype == q.dtype
    assert bool((out[2] == 0).all())
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and torch.allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)


def fake_deep_gemm(calls: list):
    def fp8_einsum(expr, a, b, d, recipe=(1, 128, 128)):
        assert expr == "bhr,hdr->bhd"
        (x, sx), (w, sw) = a, b
        assert x.dtype == w.dtype == torch.float8_e4m3fn and d.dtype == torch.bfloat16
        calls.append(recipe)
        if recipe == (1, 128, 128):
            assert sw.shape == (w.shape[0], w.shape[1] // 128, w.shape[2] // 128)
            d.copy_(fp8_block_product(x, sx, w, sw))
            return
        assert recipe == (1, 1, 128) and sw.shape == (w.shape[0], w.shape[1], w.shape[2] // 128)
        xd = (x.float().unflatten(-1, (-1, 128)) * sx[..., None]).flatten(-2)
        wd = w.float() * sw.repeat_interleave(128, 2)
        d.copy_(torch.einsum("bhr,hdr->bhd", xd, wd))

    mod = types.ModuleType("deep_gemm")
    mod.fp8_einsum = fp8_einsum
    return mod


@pytest.mark.parametrize("arch,recipe", [("sm90", (1, 128, 128)), ("sm100", (1, 1, 128))])
def test_deepgemm_adapter_through_the_contract(monkeypatch, arch, recipe):
    calls: list = []
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm(calls))
    g = torch.Generator().manual_seed(3)
    T, G, hpg, r = 7, 2, 2, 256
    w = OProjWeights(wo_a=torch.randn(G * r, hpg * 512, generator=g) / 32, groups=G)
    o = torch.randn(T, G * hpg, 512, generator=g).bfloat16()
    pos = torch.arange(100, 100 + T)
    rope = Rope.for_layer(tiny_spec(), 4)
    dev = DeviceInfo(platform="cpu", arch=arch)          # the recipe follows the arch; tensors stay on the CPU
    s = DeepGemmFp8OProj()
    y = s(o, rope.at(pos), prepared=s.prepare(w, device=dev, dtype="bfloat16"))
    assert calls == [recipe]
    ref = ReferenceOProj()
    y_ref = ref(o.float(), rope.at(pos), prepared=ref.prepare(w, device=dev, dtype="float32"))
    assert rel_err(y, y_ref) <= 6e-2
