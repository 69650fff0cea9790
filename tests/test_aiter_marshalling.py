"""mqa_kernel=aiter_sparse, o_proj=rocm_bf16 and cache_layout=fp8_ds_mla_fnuz without aiter and without a GPU.

Targeted: amd-aiter 0.1.7.post2.dev18. Its functions are modelled here in torch from their contracts --
`aiter/mla.py` and the C++ checks of `mla_decode_stage1_asm_fwd` (csrc/py_itfs_cu/asm_mla.cu) in that
wheel, aiter's own torch reference of the MLA decode (`torch_mla_extend` in op_tests/test_mla.py: the
rows kv_indices[kv_indptr[b]:kv_indptr[b+1]] of a [pages, page_size, 1, 576] buffer, logits
sm_scale·q·k over all 576 dims, V = the first kv_lora_rank = 512 dims), the docstring and asserts of
`aiter.ops.triton.batched_gemm_bf16.batched_gemm_bf16`, and `aiter.utility.dtypes` (fp8 =
float8_e4m3fnuz on gfx942, float8_e4m3fn on gfx950) -- written without looking at the adapter's
marshalling. A fake `aiter` package with that API goes into sys.modules, so the adapters' real
`__call__`s run end to end; their outputs are compared with ReferenceMQA / ReferenceOProj on the same
inputs. Then the FNUZ record byte for byte against an independent packer, the page converters, the
oracle's FNUZ rounding, and check()'s verdicts for gfx942 / gfx950 against CUDA and CPU devices.

None of this has run on AMD hardware.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import os
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from dsv4.speed.cases import random_pages
from dsv4.checks.catalogue import strategies
from dsv4.checks.compat import Combination, check
from dsv4.components.rope import Rope
from dsv4.values.device import DeviceInfo
from dsv4.formats.fp8_ds_mla import fnuz_to_ocp_pages, ocp_to_fnuz_pages
from dsv4.oracle import rel_err, round_rows
from dsv4.values.spec import ModelSpec
from dsv4.strategies import (AiterSparseMQA, BucketHeadPadding, FlashInferSparse, FlashMLASparse,
                             Fp8DsMlaFnuzLayout, Fp8DsMlaLayout, OProjWeights, PlainRowLayout,
                             ReferenceMQA, ReferenceOProj, RocmBf16OProj, SparseKV)
from dsv4.strategies.mqa_kernel import aiter_sparse as ai
from dsv4.strategies.o_proj.rocm_bf16 import grouped_input
from dsv4.strategies.protocols import Needs
from tests.conftest import CONFIGS, ROOT, run_py, through, tiny_spec

D, QK, SCALE = 512, 576, 512 ** -0.5
GFX942 = DeviceInfo(platform="rocm", arch="gfx942", name="MI300X")
GFX950 = DeviceInfo(platform="rocm", arch="gfx950", name="MI355X")
GFX90A = DeviceInfo(platform="rocm", arch="gfx90a", name="MI250X")
SM90 = DeviceInfo(platform="cuda", arch="sm90", name="H200")
SM100 = DeviceInfo(platform="cuda", arch="sm100", name="B200")
SM120 = DeviceInfo(platform="cuda", arch="sm120", name="RTX PRO 6000")
CPU = DeviceInfo(platform="cpu", name="CPU")
ARCH_FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
ARCH_LAYOUT = {"gfx942": Fp8DsMlaFnuzLayout(), "gfx950": Fp8DsMlaLayout()}

# The signatures targeted (amd-aiter 0.1.7.post2.dev18), in order.
MLA_DECODE_PARAMS = ("q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens",
                     "max_seqlen_q", "sm_scale", "logit_cap", "num_kv_splits", "num_kv_splits_indptr",
                     "work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
                     "reduce_partial_map", "q_scale", "kv_scale")
BGEMM_PARAMS = ("XQ", "WQ", "bias", "dtype", "splitK", "YQ", "config")


# =====================================================================================================
# The functions' contracts, in float64
# =====================================================================================================
def _int32_vector(t, name: str, n: int | None = None):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-d int32 tensor")
    if n is not None and t.numel() != n:
        raise ValueError(f"{name} must have {n} entries, got {t.numel()}")


def mla_decode_contract(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                        sm_scale, logit_cap, num_kv_splits, work_meta_data):
    """float64 [total_s, nhead, v_head_dim] that aiter.mla.mla_decode_fwd writes into `o` (non-persistent,
    bf16 q and bf16 kv: the only path modelled; the others are refused)."""
    if logit_cap > 0:
        raise ValueError(f"logit_cap={logit_cap} is not support yet")                 # the Python assert
    if kv_buffer.dim() != 4:
        raise ValueError("kv_buffer must be [num_page, page_size, nhead_kv, qk_head_dim]")
    num_page, page_size, nhead_kv, qk = kv_buffer.shape
    if nhead_kv != 1:
        raise ValueError("only support num_kv_heads==1 for now")                      # the C++ check
    if q.dim() != 3 or q.shape[2] != qk:
        raise ValueError("only support head_size == KV.size(3) for now")
    if not q.is_contiguous():
        raise ValueError("only support Q.is_contiguous() for now")
    if work_meta_data is not None:
        raise NotImplementedError("persistent mode is not modelled")
    if q.dtype != torch.bfloat16 or kv_buffer.dtype != torch.bfloat16:
        raise NotImplementedError("only bf16 q over bf16 kv is modelled")
    total_s, nhead, v_dim = o.shape
    if o.dtype != torch.bfloat16 or tuple(q.shape[:2]) != (total_s, nhead) or v_dim > qk:
        raise ValueError("o must be bf16 [total_s, nhead, v_head_dim] with q's tokens and heads")
    if nhead not in (16, 128):
        raise AssertionError(f"nhead={nhead} not supported")                          # get_meta_param's assert
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError("num_kv_splits must be >= 1")
    _int32_vector(qo_indptr, "qo_indptr")
    bs = qo_indptr.numel() - 1
    _int32_vector(kv_indptr, "kv_indptr", bs + 1)
    _int32_vector(kv_indices, "kv_indices")
    _int32_vector(kv_last_page_lens, "kv_last_page_lens", bs)
    qo, kvp = qo_indptr.long().tolist(), kv_indptr.long().tolist()
    if qo[0] != 0 or qo[-1] != total_s or any(b < a for a, b in zip(qo, qo[1:])):
        raise ValueError("qo_indptr must run from 0 to total_s, non-decreasing")
    if kvp[0] != 0 or kvp[-1] > kv_indices.numel() or any(b < a for a, b in zip(kvp, kvp[1:])):
        raise ValueError("kv_indptr must run from 0, non-decreasing, within kv_indices")
    if max(b - a for a, b in zip(qo, qo[1:])) > max_seqlen_q:
        raise ValueError("a batch has more queries than max_seqlen_q")
    if sm_scale is None:
        sm_scale = 1.0 / qk ** 0.5
    rows = kv_buffer.reshape(num_page * page_size, qk).double()
    out = torch.zeros(total_s, nhead, v_dim, dtype=torch.float64)
    for b in range(bs):
        pages = kv_indices[kvp[b]:kvp[b + 1]].long()
        if pages.numel() == 0:
            raise ValueError(f"batch {b} has no KV entry: the kernel's output is undefined there")
        if bool(((pages < 0) | (pages >= num_page)).any()):
            raise IndexError(f"batch {b} names page {int(pages.min())}..{int(pages.max())} outside [0, {num_page}): "
                             "a GPU would read out of bounds")
        last = int(kv_last_page_lens[b])
        if not 1 <= last <= page_size:
            raise ValueError("kv_last_page_lens must be in [1, page_size]")
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None]).flatten()
        slots = slots[: (len(pages) - 1) * page_size + last]                 # the last page's valid rows
        k = rows[slots]
        qs = q[qo[b]:qo[b + 1]].double()
        s_q, s_k = qs.shape[0], k.shape[0]
        logits = torch.einsum("qhd,kd->hqk", qs, k) * sm_scale
        causal = torch.ones(s_q, s_k, dtype=torch.bool).tril(diagonal=s_k - s_q)
        logits = logits.masked_fill(~causal[None], -math.inf)
        out[qo[b]:qo[b + 1]] = torch.einsum("hqk,kd->qhd", torch.softmax(logits, -1), k[:, :v_dim])
    return out


def make_aiter(arch: str, calls: list):
    """A fake `aiter` package for `arch`: dtypes.fp8, mla.mla_decode_fwd, ops.triton.batched_gemm_bf16."""
    def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       sm_scale=None, logit_cap=0.0, num_kv_splits=None, num_kv_splits_indptr=None,
                       work_meta_data=None, work_indptr=None, work_info_set=None, reduce_indptr=None,
                       reduce_final_map=None, reduce_partial_map=None, q_scale=None, kv_scale=None):
        kw = dict(q=q, kv_buffer=kv_buffer, o=o, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                  kv_last_page_lens=kv_last_page_lens, max_seqlen_q=max_seqlen_q, sm_scale=sm_scale,
                  logit_cap=logit_cap, num_kv_splits=num_kv_splits, work_meta_data=work_meta_data)
        calls.append(("mla_decode_fwd", kw))
        res = mla_decode_contract(**kw)
        o.copy_(res.to(torch.bfloat16))                                   # the kernel writes bf16 into o
        # non-persistent mode returns its (split logits, final_lse); that lse is never filled
        return o, torch.full(o.shape[:2], math.nan)

    def batched_gemm_bf16(XQ, WQ, bias=None, dtype=torch.bfloat16, splitK=None, YQ=None, config=None):
        """Y[i] = X[i] @ W[i]^T (+ bias), X (B, M, K), W (B, N, K) in bf16 or fp16."""
        calls.append(("batched_gemm_bf16", dict(XQ=XQ, WQ=WQ, bias=bias, dtype=dtype, splitK=splitK)))
        if XQ.shape[0] != WQ.shape[0]:
            raise AssertionError("Incompatible Batch dimensions!!!")
        if XQ.shape[2] != WQ.shape[2]:
            raise AssertionError("Incompatible K dimensions!!!")
        if dtype not in (torch.bfloat16, torch.float16) or splitK is not None:
            raise AssertionError("bf16/fp16 output only, no splitK on Triton")
        if XQ.dtype not in (torch.bfloat16, torch.float16) or WQ.dtype != XQ.dtype:
            raise TypeError("XQ and WQ must both be bf16 or fp16")
        y = torch.einsum("bmk,bnk->bmn", XQ.double(), WQ.double())
        if bias is not None:
            y = y + bias.double()
        if YQ is not None:
            return YQ.copy_(y.to(dtype))
        return y.to(dtype)

    pkg = types.ModuleType("aiter")
    pkg.__path__ = []
    pkg.dtypes = types.SimpleNamespace(fp8=ARCH_FP8.get(arch, torch.uint8), bf16=torch.bfloat16)
    pkg.mla = types.ModuleType("aiter.mla")
    pkg.mla.mla_decode_fwd = mla_decode_fwd
    ops, triton = types.ModuleType("aiter.ops"), types.ModuleType("aiter.ops.triton")
    bg = types.ModuleType("aiter.ops.triton.batched_gemm_bf16")
    bg.batched_gemm_bf16 = batched_gemm_bf16
    ops.__path__, triton.__path__ = [], []
    pkg.ops, ops.triton, triton.batched_gemm_bf16 = ops, triton, bg
    return {"aiter": pkg, "aiter.mla": pkg.mla, "aiter.ops": ops, "aiter.ops.triton": triton,
            "aiter.ops.triton.batched_gemm_bf16": bg}


@pytest.fixture
def fake_aiter(monkeypatch):
    """install(arch) puts the fake aiter for `arch` into sys.modules; returns the list of its calls."""
    def install(arch: str) -> list:
        calls: list = []
        for name, mod in make_aiter(arch, calls).items():
            monkeypatch.setitem(sys.modules, name, mod)
        return calls
    return install


def test_the_fakes_have_the_targeted_signatures():
    mods = make_aiter("gfx950", [])
    assert tuple(inspect.signature(mods["aiter.mla"].mla_decode_fwd).parameters) == MLA_DECODE_PARAMS
    assert tuple(inspect.signature(mods["aiter.ops.triton.batched_gemm_bf16"].batched_gemm_bf16).parameters) \
        == BGEMM_PARAMS
    assert ai.AITER_VERSION == "0.1.7.post2.dev18"


def _signature_in_source(path: Path, func: str) -> tuple[str, ...]:
    tree = ast.parse(path.read_text())
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == func]
    return tuple(a.arg for a in fn.args.args + fn.args.kwonlyargs)


@pytest.mark.skipif(not os.environ.get("DSV4_AITER_SRC"),
                    reason="set DSV4_AITER_SRC to an unpacked amd-aiter wheel to compare with its sources")
def test_the_targeted_signatures_are_the_wheels():
    """Read (never imported: it needs ROCm) from the unpacked wheel: the signatures, aiter's fp8 per
    arch, and the head counts its MLA decode takes."""
    src = Path(os.environ["DSV4_AITER_SRC"]) / "aiter"
    assert _signature_in_source(src / "mla.py", "mla_decode_fwd") == MLA_DECODE_PARAMS
    assert _signature_in_source(src / "ops/triton/batched_gemm_bf16.py", "batched_gemm_bf16") == BGEMM_PARAMS
    dtypes_src = (src / "utility/dtypes.py").read_text()
    assert '"gfx942": {"fp8": torch.float8_e4m3fnuz}' in dtypes_src
    assert '"gfx950": {"fp8": torch.float8_e4m3fn}' in dtypes_src
    assert "get_mgc = {16: 16, 128: 16}" in (src / "mla.py").read_text()


# =====================================================================================================
# Cases
# =====================================================================================================
def layer_case(kind: str, layout, seed: int, *, W: int = 128, K: int = 29) -> SparseKV:
    """SWA window max(0, p-W+1)..p per token (-1 after it), and for c4a a top-K of distinct compressed
    entries < (p+1)//4 (-1 padded), for c128a entries 0..(p+1)//128 - 1, through random block tables."""
    g = torch.Generator().manual_seed(seed)
    p = torch.cat((torch.tensor([0, 1, 3, 127, 128, 300]), torch.randint(0, 500, (5,), generator=g)))
    T = p.shape[0]
    swa = random_pages("swa", 16, 64, g, layout)
    local = (p - W + 1).clamp(min=0)[:, None] + torch.arange(W)[None]
    local = torch.where(local <= p[:, None], local, -1)
    tab = torch.stack([torch.randperm(16, generator=g) for _ in range(T)])
    kw = dict(swa=swa, swa_indices=through(tab, local, 64).int(), swa_lens=(p + 1).clamp(max=W).int(), layer_type=kind)
    if kind == "c4a":
        comp = random_pages("compressed", 4, 64, g, layout)
        n_c = (p + 1) // 4
        lists = []
        for t in range(T):
            k = min(int(n_c[t]), K)
            sel = torch.randperm(int(n_c[t]), generator=g)[:k]
            lists.append(torch.cat((sel, torch.full((K - k,), -1, dtype=torch.long))))
        lc = torch.stack(lists)
        ctab = torch.stack([torch.randperm(4, generator=g) for _ in range(T)])
        kw |= dict(extra=comp, extra_indices=through(ctab, lc, 64).int(), extra_lens=(lc >= 0).sum(1).int())
    elif kind == "c128a":
        comp = random_pages("compressed", 4, 2, g, layout)
        n_c = (p + 1) // 128
        lc = torch.arange(4)[None].expand(T, 4)
        lc = torch.where(lc < n_c[:, None], lc, -1)
        ctab = torch.stack([torch.randperm(4, generator=g) for _ in range(T)])
        kw |= dict(extra=comp, extra_indices=through(ctab, lc, 2).int(), extra_lens=n_c.int())
    return SparseKV(**kw)


def messy_case(layout, seed: int) -> SparseKV:
    """As loose as a SparseKV allows: -1 holes, ids past the pool, entries past the length, a query
    with no SWA row (0), one with no row at all (1)."""
    g = torch.Generator().manual_seed(seed)
    swa, comp = random_pages("swa", 3, 64, g, layout), random_pages("compressed", 5, 2, g, layout)
    T = 9

    def lists(width, n):
        idx = torch.randint(0, n + 15, (T, width), generator=g)
        idx = torch.where(torch.rand(T, width, generator=g) < 0.2, -1, idx)
        return idx.int(), torch.randint(0, width + 1, (T,), generator=g).int()

    si, sl = lists(40, swa.num_slots)
    ei, el = lists(13, comp.num_slots)
    sl[0] = sl[1] = 0
    el[1] = 0
    el[0] = max(int(el[0]), 3)
    ei[0, :3] = torch.tensor([0, 1, 2], dtype=torch.int32)
    return SparseKV(swa=swa, swa_indices=si, swa_lens=sl, extra=comp, extra_indices=ei, extra_lens=el)


def make_q(T: int, H: int, Hp: int, seed: int):
    """Queries for H heads zero-padded to Hp, sinks -inf on the padding (as the layer pads)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(T, Hp, D)
    q[:, :H] = torch.randn(T, H, D, generator=g)
    sink = torch.full((Hp,), -math.inf)
    sink[:H] = torch.randn(H, generator=g) * 3
    return q, sink


def run(arch: str, q, kv, sink, install):
    """The adapter's real __call__ through the fake aiter: (out, lse, the recorded mla_decode_fwd kwargs)."""
    calls = install(arch)
    k = AiterSparseMQA()
    out, lse = k(q, kv, sink=sink, scale=SCALE, prepared=k.prepare(device=DeviceInfo(platform="rocm", arch=arch)))
    (name, kw), = calls
    assert name == "mla_decode_fwd"
    return out, lse, kw


def contract_out(kw, q):
    """The contract's float64 output on the recorded arguments, back in [T, H, 512]."""
    return mla_decode_contract(**kw).view(q.shape)


def reference(q, kv, sink):
    """ReferenceMQA on what the kernel is handed: q rounded to bf16, rows as the layout reads them."""
    return ReferenceMQA()(q.bfloat16().float(), kv, sink=sink, scale=SCALE)[0]


# =====================================================================================================
# mqa_kernel=aiter_sparse through the fake API against ReferenceMQA
# =====================================================================================================
CASES = [pytest.param(arch, kind, 64, 64, id=f"{arch}-{kind}-h64")
         for arch in ("gfx942", "gfx950") for kind in ("swa", "c4a", "c128a")] + \
        [pytest.param("gfx950", "c4a", H, Hp, id=f"gfx950-c4a-h{H}to{Hp}")
         for H, Hp in ((16, 16), (40, 48), (128, 128))]


@pytest.mark.parametrize("arch,kind,H,Hp", CASES)
def test_adapter_through_the_contract_equals_reference(fake_aiter, arch, kind, H, Hp):
    kv = layer_case(kind, ARCH_LAYOUT[arch], seed=H + len(kind))
    q, sink = make_q(kv.swa_indices.shape[0], H, Hp, seed=Hp)
    out, lse, kw = run(arch, q, kv, sink, fake_aiter)
    ref = reference(q, kv, sink)
    assert rel_err(contract_out(kw, q)[:, :H], ref[:, :H]) <= 1e-6       # the marshalling, in float64
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(out[:, :H], ref[:, :H]) <= 1e-2                       # end to end, bf16 kernel output
    assert lse is None
    per_token, heads = (1, 128) if Hp == 128 else (Hp // 16, 16)
    T = q.shape[0]
    assert tuple(kw["q"].shape) == (T * per_token, heads, QK) and kw["max_seqlen_q"] == 1
    assert kw["sm_scale"] == pytest.approx(SCALE) and kw["kv_buffer"].shape[1:] == (1, 1, QK)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_loose_lists_mean_what_reference_reads(fake_aiter, arch):
    kv = messy_case(ARCH_LAYOUT[arch], seed=3)
    q, sink = make_q(9, 32, 32, seed=1)
    out, _, kw = run(arch, q, kv, sink, fake_aiter)
    ref = reference(q, kv, sink)
    assert rel_err(contract_out(kw, q), ref) <= 1e-6
    assert rel_err(out, ref) <= 1e-2
    assert bool((out[1] == 0).all())                  # query 1 names no row: 0, like ReferenceMQA
    assert rel_err(out[0], ref[0]) <= 1e-2            # query 0: compressed rows only


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_sinks_plus_minus_inf_and_exactness(fake_aiter, arch):
    kv = layer_case("c4a", ARCH_LAYOUT[arch], seed=5)
    q, sink = make_q(kv.swa_indices.shape[0], 16, 16, seed=2)
    sink[:3], sink[3:6] = math.inf, -math.inf
    sink[6:] = torch.tensor([math.pi, -math.e, 17.123456, -23.5, 0.0, 1e-3, 40.0, -60.0, 5.5, 2.2])
    out, _, kw = run(arch, q, kv, sink, fake_aiter)
    ref = reference(q, kv, sink)
    assert bool((out[:, :3] == 0).all())               # +inf sink: all mass to the sink
    assert rel_err(out[:, 3:], ref[:, 3:]) <= 1e-2
    # the three bf16 terms carry the sink to ~24 bits: the float64 contract matches far below bf16
    assert rel_err(contract_out(kw, q)[:, 3:], ref[:, 3:]) <= 1e-6


def test_float32_queries_come_back_float32(fake_aiter):
    kv = layer_case("c128a", ARCH_LAYOUT["gfx950"], seed=1)
    q, sink = make_q(kv.swa_indices.shape[0], 16, 16, seed=0)
    out, _, _ = run("gfx950", q, kv, sink, fake_aiter)
    assert out.dtype == torch.float32
    out, _, _ = run("gfx950", q.bfloat16(), kv, sink, fake_aiter)
    assert out.dtype == torch.bfloat16


def test_no_tokens_no_call(fake_aiter):
    calls = fake_aiter("gfx950")
    kv = layer_case("swa", ARCH_LAYOUT["gfx950"], seed=0)
    k = AiterSparseMQA()
    empty = SparseKV(swa=kv.swa, swa_indices=kv.swa_indices[:0], swa_lens=kv.swa_lens[:0])
    out, lse = k(torch.zeros(0, 16, D), empty, sink=torch.zeros(16), scale=SCALE, prepared=k.prepare(device=GFX950))
    assert out.shape == (0, 16, D) and lse is None and calls == []


# =====================================================================================================
# The marshalling pieces
# =====================================================================================================
def test_ragged_lists_are_csr_with_the_sink_key_first():
    rows = torch.tensor([[3, 5, -1], [-1, -1, -1], [1, 2, 4]], dtype=torch.int32)
    a = ai.ragged(rows, torch.tensor([2, 0, 3]), 1)
    assert a["qo_indptr"].tolist() == [0, 1, 2, 3] and a["max_seqlen_q"] == 1
    assert a["kv_indptr"].tolist() == [0, 3, 4, 8]
    assert a["kv_indices"].tolist() == [0, 3, 5, 0, 0, 1, 2, 4]
    assert a["kv_last_page_lens"].tolist() == [1, 1, 1]
    assert all(a[k].dtype == torch.int32 for k in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens"))
    b = ai.ragged(rows, torch.tensor([2, 0, 3]), 2)                 # two kernel rows per token
    assert b["kv_indptr"].tolist() == [0, 3, 6, 7, 8, 12, 16]
    assert b["kv_indices"].tolist() == [0, 3, 5, 0, 3, 5, 0, 0, 0, 1, 2, 4, 0, 1, 2, 4]
    assert b["qo_indptr"].tolist() == list(range(7))


def test_head_rows():
    assert ai.head_rows(128) == (1, 128)
    assert [ai.head_rows(h) for h in (16, 32, 48, 64, 112)] == [(1, 16), (2, 16), (3, 16), (4, 16), (7, 16)]
    for h in (8, 20, 144):
        with pytest.raises(ValueError, match="head_padding=buckets_mult16"):
            ai.head_rows(h)


def test_attended_rows_span_both_pools_in_order():
    kv = messy_case(Fp8DsMlaLayout(), seed=11)
    ids, n = ai.attended(kv)
    S = kv.swa.num_slots
    for t in range(ids.shape[0]):
        want = [int(s) for j, s in enumerate(kv.swa_indices[t]) if j < kv.swa_lens[t] and 0 <= s < S]
        want += [S + int(s) for j, s in enumerate(kv.extra_indices[t])
                 if j < kv.extra_lens[t] and 0 <= s < kv.extra.num_slots]
        assert ids[t, :n[t]].tolist() == want and bool((ids[t, n[t]:] == -1).all())


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_the_mla_record_holds_each_attended_row_once_and_exactly(arch):
    """fp8_ds_mla(_fnuz) pages -> aiter's 576-wide bf16 record -> the values the layout reads, bit for bit."""
    kv = layer_case("c4a", ARCH_LAYOUT[arch], seed=9)
    ids, _ = ai.attended(kv)
    buf, rows = ai.mla_buffer(kv, ids, fmt=ai.FP8_FORMAT[arch])
    assert buf.dtype == torch.bfloat16 and buf.shape[1:] == (1, 1, QK)
    flat = buf.view(-1, QK)
    sink_row = torch.zeros(QK)
    sink_row[list(ai.SINK_DIMS)] = 1
    assert torch.equal(flat[0].float(), sink_row)
    assert flat.shape[0] == 1 + len(torch.unique(ids[ids >= 0]))          # each distinct row once
    S = kv.swa.num_slots
    valid = ids >= 0
    got = flat[rows[valid].long()].float()
    sel = ids[valid]
    want = torch.empty(len(sel), D)
    want[sel < S] = kv.swa.read(sel[sel < S].int())
    want[sel >= S] = kv.extra.read((sel[sel >= S] - S).int())
    assert torch.equal(got[:, :D], want)                                   # e4m3 · 2^e and bf16 fit bf16
    assert bool((got[:, D:] == 0).all())
    assert bool((rows[~valid] == -1).all()) and bool((rows[valid] >= 1).all())


def test_sink_query_carries_the_sink_in_three_bf16_terms():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 16, D, generator=g)
    sink = torch.cat((torch.randn(12, generator=g) * 10, torch.tensor([math.inf, -math.inf, 1e30, 0.0])))
    x = ai.sink_query(q, sink, SCALE)
    assert x.dtype == torch.bfloat16 and x.shape == (3, 16, QK)
    assert torch.equal(x[..., :D], q.bfloat16())
    assert bool((x[..., ai.SINK_DIMS[-1] + 1:] == 0).all())
    carried = x[..., list(ai.SINK_DIMS)].double().sum(-1) * SCALE          # against the sink key's ones
    want = sink.double().clamp(-ai.SINK_LIMIT, ai.SINK_LIMIT)
    assert torch.allclose(carried, want.expand_as(carried), rtol=2e-7, atol=1e-9)


def test_reading_the_other_flavour_is_wrong_and_refused():
    """The hazard check() guards: OCP bytes decoded as FNUZ come out at half their value (and OCP's
    negative zero 0x80 as NaN); FNUZ bytes decoded as OCP at twice. The adapter refuses both."""
    g = torch.Generator().manual_seed(4)
    ocp, fnuz = random_pages("swa", 2, 64, g, Fp8DsMlaLayout()), random_pages("swa", 2, 64, g, Fp8DsMlaFnuzLayout())
    row = torch.randn(1, D, generator=g)
    row[0, 5] = -1e-20                                                # rounds to e4m3's -0 (byte 0x80)
    ocp.write(torch.tensor([0], dtype=torch.int32), row)
    slots = torch.arange(128)
    right = ai.decode_record_rows(ocp.data, slots, block_size=64, fp8=torch.float8_e4m3fn)
    wrong = ai.decode_record_rows(ocp.data, slots, block_size=64, fp8=torch.float8_e4m3fnuz)
    assert torch.equal(right, ocp.read(slots))
    nope_w, nope_r = wrong[:, :448], right[:, :448]
    nan = torch.isnan(nope_w)
    assert bool(nan[0, 5])
    assert torch.equal(nope_w[~nan], nope_r[~nan] / 2) and bool((nope_r[nan] == 0).all())
    twice = ai.decode_record_rows(fnuz.data, slots, block_size=64, fp8=torch.float8_e4m3fn)
    assert torch.equal(twice[:, :448], 2 * fnuz.read(slots)[:, :448])
    for cache, fmt, fix in ((ocp, "fnuz", "cache_layout=fp8_ds_mla_fnuz"), (fnuz, "ocp", "cache_layout=fp8_ds_mla")):
        with pytest.raises(ValueError, match=fix):
            ai.read_rows(cache, slots, fmt=fmt)
    with pytest.raises(ValueError, match="fp8_ds_mla pages"):
        ai.read_rows(random_pages("swa", 1, 8, g, PlainRowLayout(name="bf16", dtype="bfloat16")), slots[:4], fmt="ocp")


def test_call_refuses_mismatched_caches_and_devices(fake_aiter):
    k = AiterSparseMQA()
    kv = layer_case("swa", Fp8DsMlaLayout(), seed=1)
    q, sink = make_q(kv.swa_indices.shape[0], 16, 16, seed=0)
    fake_aiter("gfx942")
    with pytest.raises(ValueError, match="cache_layout=fp8_ds_mla_fnuz"):         # OCP pages on gfx942
        k(q, kv, sink=sink, scale=SCALE, prepared=k.prepare(device=GFX942))
    with pytest.raises(ValueError, match="device.arch"):                           # deployment says gfx950
        k(q, kv, sink=sink, scale=SCALE, prepared=k.prepare(device=GFX950))
    with pytest.raises(ValueError, match="prepare"):
        k(q, kv, sink=sink, scale=SCALE)
    for dev in (SM90, CPU, GFX90A):
        with pytest.raises(ValueError, match="mqa_kernel=reference"):
            k.prepare(device=dev)
    with pytest.raises(ValueError, match="buckets_mult16"):
        k(torch.zeros(2, 8, D), layer_case("swa", Fp8DsMlaFnuzLayout(), seed=1), sink=torch.zeros(8), scale=SCALE,
          prepared=k.prepare(device=GFX942))


# =====================================================================================================
# o_proj=rocm_bf16 through the fake batched GEMM against ReferenceOProj
# =====================================================================================================
@pytest.mark.parametrize("G,hpg,r", [(2, 4, 64), (1, 8, 128), (4, 2, 32)])
def test_rocm_bf16_oproj_through_the_contract(fake_aiter, G, hpg, r):
    calls = fake_aiter("gfx942")
    g = torch.Generator().manual_seed(G * 10 + hpg)
    T = 7
    w = OProjWeights(wo_a=torch.randn(G * r, hpg * D, generator=g) / 40, groups=G)
    o = torch.randn(T, G * hpg, D, generator=g).bfloat16()
    pos = torch.arange(300, 300 + T)
    rope = Rope.for_layer(tiny_spec(), 4)
    s = RocmBf16OProj()
    dev = DeviceInfo(platform="cpu", arch="gfx942")       # tensors stay on the CPU
    y = s(o, rope.at(pos), prepared=s.prepare(w, device=dev, dtype="bfloat16"))
    ((name, kw),) = calls
    assert name == "batched_gemm_bf16"
    assert tuple(kw["XQ"].shape) == (G, T, hpg * D) and tuple(kw["WQ"].shape) == (G, r, hpg * D)
    assert kw["XQ"].dtype == kw["WQ"].dtype == torch.bfloat16 and kw["XQ"].is_contiguous()
    ref = ReferenceOProj()
    want = ref(o.float(), rope.at(pos), prepared=ref.prepare(w, device=CPU, dtype="float32"))
    assert y.dtype == torch.bfloat16 and y.shape == want.shape
    assert rel_err(y, want) <= 1.5e-2
    same = ref(o, rope.at(pos), prepared=ref.prepare(w, device=CPU, dtype="bfloat16"))   # the same bf16 math
    assert rel_err(y, same) <= 1e-2
    assert s(o[:0], rope.at(pos[:0]), prepared=s.prepare(w, device=dev, dtype="bfloat16")).shape == (0, G * r)


def test_grouped_input_is_the_inverse_roped_groups():
    g = torch.Generator().manual_seed(1)
    o = torch.randn(5, 8, D, generator=g)
    pos = torch.arange(5) * 37
    rope = Rope.for_layer(tiny_spec(), 128)
    x = grouped_input(o, rope.at(pos), 2)
    want = rope.apply(o, pos, inverse=True).bfloat16().view(5, 2, 4 * D).transpose(0, 1)
    assert torch.equal(x, want) and x.is_contiguous()


# =====================================================================================================
# A layer of the engine with both aiter strategies (fake API) against the same layer on the reference
# =====================================================================================================
def _engine(spec, W, layout, strategies, device):
    from tests.conftest import make_engine

    return make_engine(spec, layers=tuple(W), weights=W, layout=layout, dtype="bfloat16", device=device,
                       head_padding=strategies.head_padding, mqa_kernel=strategies.mqa_kernel,
                       o_proj=strategies.o_proj)[0]


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_layer_steps_through_the_aiter_strategies_match_the_reference(fake_aiter, arch):
    from dsv4.components.weights import random_layer_weights
    from tests.conftest import chunked, drive, hidden_for

    calls = fake_aiter(arch)
    spec = tiny_spec()
    W = {l: random_layer_weights(spec, l, 0) for l in (0, 1, 2)}
    layout, pad = ARCH_LAYOUT[arch], BucketHeadPadding(name="buckets_mult16", buckets=tuple(range(16, 129, 16)))
    dev = DeviceInfo(platform="cpu", arch=arch)      # the arch picks the fp8 flavour; tensors stay on the CPU
    ref = _engine(spec, W, layout, strategies(mqa_kernel=ReferenceMQA(), o_proj=ReferenceOProj(), head_padding=pad,
                                              cache_layout=layout), dev)
    amd = _engine(spec, W, layout, strategies(mqa_kernel=AiterSparseMQA(), o_proj=RocmBf16OProj(), head_padding=pad,
                                              cache_layout=layout), dev)
    lengths = {"a": 150, "b": 40}
    X = hidden_for(lengths, spec.hidden_size)
    X = {r: torch.cat((x, torch.randn(2, spec.hidden_size, generator=torch.Generator().manual_seed(9))))
         for r, x in X.items()}
    schedule = chunked(lengths, 64) + [{"a": 2, "b": 2}]
    want, _ = drive(ref, X, schedule)
    got, _ = drive(amd, X, schedule)
    for layer in want:
        for r in want[layer]:
            assert rel_err(got[layer][r], want[layer][r]) <= 2e-2, (layer, r)
    assert {name for name, _ in calls} == {"mla_decode_fwd", "batched_gemm_bf16"}


# =====================================================================================================
# cache_layout=fp8_ds_mla_fnuz byte for byte, against an independent packer
# =====================================================================================================
def fnuz_byte(v: float) -> int:
    """float8_e4m3fnuz of v (bias 8, 3 mantissa bits, saturating at 240, round to nearest even, no -0)."""
    a = min(abs(v), 240.0)
    if a == 0.0:
        return 0
    E = max(math.frexp(a)[1] - 1, -7)              # floor(log2 a); -7 = the smallest normal exponent
    m = round(a / 2.0 ** (E - 3))                   # 8..16 (normal) or 0..7 (subnormal), ties to even
    if m == 16:
        E, m = E + 1, 8
    field, mant = (E + 8, m - 8) if m >= 8 else (0, m)
    b = (field << 3) | mant
    if b > 0x7F:
        b = 0x7F
    return 0 if b == 0 else b | (0x80 if v < 0 else 0)


def fnuz_value(b: int) -> float:
    if b == 0x80:
        return math.nan
    field, mant = (b >> 3) & 0xF, b & 7
    v = mant * 2.0 ** -10 if field == 0 else (1 + mant / 8) * 2.0 ** (field - 8)
    return -v if b & 0x80 else v


def test_the_fnuz_codec_agrees_with_torch():
    for b in range(256):
        want = torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fnuz).float().item()
        got = fnuz_value(b)
        assert (math.isnan(want) and math.isnan(got)) or want == got, b
        if b != 0x80:
            assert fnuz_byte(got) == b, b
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-12, 9, (20000,), generator=g).float())
    x = x.clamp(-240, 240)
    assert [fnuz_byte(v) for v in x.tolist()] == x.to(torch.float8_e4m3fnuz).view(torch.uint8).tolist()


def expected_record(row_bf16: list[float]) -> tuple[list[int], list[int]]:
    """One row's 576 data bytes and 8 scale bytes, from the description in fp8_fnuz's docstring."""
    import struct

    nope, exps = [], []
    for k in range(7):
        blk = row_bf16[64 * k: 64 * k + 64]
        amax = max(max(abs(v) for v in blk), 1e-4)
        e = math.ceil(math.log2(amax / 224.0))
        nope += [fnuz_byte(max(-224.0, min(224.0, v / 2.0 ** e))) for v in blk]
        exps.append(max(0, min(255, e + 127)))
    rope = []
    for v in row_bf16[448:]:
        bits = struct.unpack("<I", struct.pack("<f", v))[0] >> 16
        rope += [bits & 0xFF, bits >> 8]
    return nope + rope, exps + [0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 31 - 1), mag=st.integers(-30, 12), zeros=st.booleans())
def test_fnuz_record_is_byte_exact_and_never_nan(seed, mag, zeros):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(3, D, generator=g) * 2.0 ** mag
    if zeros:
        rows[0, :64] = 0.0
        rows[1, 64:128] = -0.0
        rows[2, :448] = -1e-30
    data, scales = Fp8DsMlaFnuzLayout().pack(rows)
    assert not bool((data[:, :448] == 0x80).any())
    x = rows.bfloat16().float()
    for i in range(3):
        want_d, want_s = expected_record(x[i].tolist())
        assert data[i].tolist() == want_d and scales[i].tolist() == want_s
    back = Fp8DsMlaFnuzLayout().unpack(data, scales)
    # within half an e4m3fnuz step of the row at its block's scale; RoPE dims exact
    e = scales[:, :7].float() - 127
    sc = torch.exp2(e).repeat_interleave(64, -1)
    y = (x[:, :448] / sc).abs()
    step = torch.where(y >= 2.0 ** -7, torch.exp2(torch.floor(torch.log2(y.clamp_min(1e-30))) - 3),
                       torch.tensor(2.0 ** -10))
    assert bool(((back[:, :448] - x[:, :448]).abs() <= step / 2 * sc).all())
    assert torch.equal(back[:, 448:], x[:, 448:])


def test_fnuz_holds_the_same_values_as_fp8_ds_mla_and_the_oracle_rounds_to_them():
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(500, D, generator=g) * torch.exp2(torch.randint(-16, 10, (500, 1), generator=g).float())
    rows[:5, :100] = 0.0
    fnuz, ocp = Fp8DsMlaFnuzLayout(), Fp8DsMlaLayout()
    vf, vo = fnuz.unpack(*fnuz.pack(rows)), ocp.unpack(*ocp.pack(rows))
    assert torch.equal(vf, vo)
    assert torch.equal(round_rows(rows, "fp8_ds_mla_fnuz"), vf)          # the oracle, its own code path
    assert torch.equal(round_rows(rows, "fp8_ds_mla_fnuz"), round_rows(rows, "fp8_ds_mla"))
    (df, sf), (do, so) = fnuz.pack(rows), ocp.pack(rows)
    assert torch.equal(sf[:, :7], so[:, :7] + 1) and bool((sf[:, 7] == 0).all())
    nope = do[:, :448]
    assert torch.equal(df[:, :448], torch.where(nope == 0x80, torch.zeros_like(nope), nope))
    assert torch.equal(df[:, 448:], do[:, 448:])


@pytest.mark.parametrize("B,blocks", [(64, 5), (2, 33)])
def test_page_converters_round_trip(B, blocks):
    """fp8_ds_mla pages -> fp8_ds_mla_fnuz pages: byte-equal to writing FNUZ directly; back: the same
    values (OCP's negative zeros come back as +0)."""
    g = torch.Generator().manual_seed(B)
    ocp, fnuz = Fp8DsMlaLayout(), Fp8DsMlaFnuzLayout()
    n = blocks * B
    slots = torch.randperm(n, generator=g)[: n - 3].int()               # three slots never written
    rows = torch.randn(len(slots), D, generator=g) * 3
    po = ocp.allocate(num_blocks=blocks, block_size=B, head_dim=D, device="cpu")
    pf = fnuz.allocate(num_blocks=blocks, block_size=B, head_dim=D, device="cpu")
    ocp.access(po, block_size=B, gpu=False).write(slots, rows)
    fnuz.access(pf, block_size=B, gpu=False).write(slots, rows)
    conv = ocp_to_fnuz_pages(po, B)
    assert torch.equal(conv, pf)
    assert fnuz.page_bytes(B, D) == ocp.page_bytes(B, D) and fnuz.bytes_per_token(D) == 584
    back = fnuz_to_ocp_pages(conv, B)
    assert torch.equal(ocp.read(back, slots, block_size=B), ocp.read(po, slots, block_size=B))
    assert torch.equal(fnuz.read(conv, slots, block_size=B), ocp.read(po, slots, block_size=B))
    bad = conv.clone()
    bad[0, 5] = 0x80
    with pytest.raises(ValueError, match="no OCP counterpart"):
        fnuz_to_ocp_pages(bad, B)


def test_fnuz_layout_in_a_paged_cache_reads_what_reference_mqa_expects():
    """ReferenceMQA reads FNUZ pages through the layout on any device: it decodes nothing natively."""
    g = torch.Generator().manual_seed(2)
    c = random_pages("swa", 3, 64, g, Fp8DsMlaFnuzLayout())
    rows = torch.randn(5, D, generator=g)
    c.write(torch.tensor([0, 7, 64, 100, -1], dtype=torch.int32), rows)
    got = c.read(torch.tensor([0, 7, 64, 100, -1], dtype=torch.int32))
    assert torch.equal(got[:4], round_rows(rows[:4], "fp8_ds_mla_fnuz")) and bool((got[4] == 0).all())


# =====================================================================================================
# check() verdicts: gfx942 / gfx950 against CUDA and CPU devices
# =====================================================================================================
def load_spec(name: str) -> ModelSpec:
    return ModelSpec.from_config(OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{name}.yaml")))


def option(group: str, name: str):
    from dsv4.checks.catalogue import instantiate_group

    return instantiate_group(OmegaConf.load(CONFIGS / group / f"{name}.yaml"))


FLASH, PRO = load_spec("dsv4_flash"), load_spec("dsv4_pro")


def aiter_combo(*, layout="fp8_ds_mla", spec=FLASH, tp_size=1, head_padding="none", dtype="bfloat16",
                mqa_kernel=None, o_proj=None) -> Combination:
    chosen = strategies(mqa_kernel=mqa_kernel or option("mqa_kernel", "aiter_sparse"),
                        o_proj=o_proj or option("o_proj", "rocm_bf16"),
                        head_padding=option("head_padding", head_padding), cache_layout=option("cache_layout", layout))
    return Combination(spec=spec, strategies=chosen, tp_size=tp_size, dtype=dtype)


# (device, cache_layout) -> the problems' (group, value, fix), for the aiter backend at tp 1
MATRIX = {
    ("gfx950", "fp8_ds_mla"): [],
    ("gfx950", "fp8_ds_mla_fnuz"): [("cache_layout", "fp8_ds_mla_fnuz", "cache_layout=fp8_ds_mla")],
    ("gfx950", "bf16"): [("cache_layout", "bf16", "cache_layout=fp8_ds_mla")],
    ("gfx942", "fp8_ds_mla_fnuz"): [],
    ("gfx942", "fp8_ds_mla"): [("cache_layout", "fp8_ds_mla", "cache_layout=fp8_ds_mla_fnuz")],
    ("gfx942", "bf16"): [("cache_layout", "bf16", "cache_layout=fp8_ds_mla_fnuz")],
}
DEVS = {"gfx942": GFX942, "gfx950": GFX950, "gfx90a": GFX90A, "sm90": SM90, "sm100": SM100, "cpu": CPU}


@pytest.mark.parametrize("arch,layout", MATRIX, ids=[f"{a}-{l}" for a, l in MATRIX])
def test_aiter_backend_on_rocm(arch, layout):
    problems = check(aiter_combo(layout=layout), DEVS[arch])
    assert [(p.group, p.value, p.fix) for p in problems] == MATRIX[(arch, layout)], [p.line() for p in problems]
    for p in problems:
        assert "mqa_kernel=aiter_sparse" in p.reason and DEVS[arch].describe() in p.reason
        assert check(aiter_combo(layout=p.fix.split("=")[1]), DEVS[arch]) == []


def test_gfx942_refusal_says_why_ocp_bytes_cannot_be_read_there():
    (p,) = check(aiter_combo(layout="fp8_ds_mla"), GFX942)
    assert "FNUZ e4m3 (float8_e4m3fnuz" in p.reason and p.supported == ("fp8_ds_mla_fnuz",)
    (p,) = check(aiter_combo(layout="fp8_ds_mla_fnuz"), GFX950)
    assert "OCP e4m3 (float8_e4m3fn" in p.reason and "stores FNUZ e4m3" in p.reason and "half or twice" in p.reason


@pytest.mark.parametrize("dev", ["sm90", "sm100", "cpu", "gfx90a"])
def test_aiter_backend_refused_off_gfx942_gfx950_with_fixes(dev):
    problems = check(aiter_combo(), DEVS[dev])
    by = {(p.group, p.value): p for p in problems}
    assert by[("mqa_kernel", "aiter_sparse")].fix == "mqa_kernel=reference"
    assert by[("o_proj", "rocm_bf16")].fix == "o_proj=reference"
    assert set(by[("mqa_kernel", "aiter_sparse")].supported) == ({"rocm"} if dev != "gfx90a" else {"gfx942", "gfx950"})
    assert all(p.fix for p in problems) and any(DEVS[dev].describe() in p.reason for p in problems)


def test_heads_per_rank_must_be_a_multiple_of_16():
    assert check(aiter_combo(spec=FLASH, tp_size=4), GFX950) == []                  # 16 heads
    assert check(aiter_combo(spec=PRO, tp_size=1), GFX950) == []                    # 128 heads
    (p,) = check(aiter_combo(spec=FLASH, tp_size=8), GFX950)                       # 8 heads
    assert (p.group, p.value, p.fix) == ("head_padding", "none", "head_padding=buckets_mult16")
    assert check(aiter_combo(spec=FLASH, tp_size=8, head_padding="buckets_mult16"), GFX950) == []
    (p,) = check(aiter_combo(spec=replace(FLASH, num_attention_heads=40, o_groups=8), tp_size=1), GFX950)
    assert p.fix == "head_padding=buckets_mult16" and "got 40" in p.reason


def test_bfloat16_activations():
    problems = check(aiter_combo(dtype="float32"), GFX950)
    assert {(p.group, p.fix) for p in problems} == {("dtype", "dtype=bfloat16")}


@pytest.mark.parametrize("dev,kernel,fix", [(SM90, FlashMLASparse(), "cache_layout=fp8_ds_mla"),
                                            (SM100, FlashMLASparse(), "cache_layout=fp8_ds_mla"),
                                            (SM100, FlashInferSparse(), "cache_layout=bf16"),
                                            (SM120, FlashInferSparse(), "cache_layout=fp8_ds_mla")])
def test_nvidia_kernels_never_read_fnuz(dev, kernel, fix):
    c = aiter_combo(layout="fp8_ds_mla_fnuz", mqa_kernel=kernel, o_proj=ReferenceOProj(),
                    head_padding="buckets_pow2", spec=replace(FLASH, sliding_window=128))
    problems = [p for p in check(c, dev) if p.group == "cache_layout"]
    assert [(p.value, p.fix) for p in problems] == [("fp8_ds_mla_fnuz", fix)]
    assert "stores FNUZ e4m3" in problems[0].reason


@pytest.mark.parametrize("dev", DEVS.values(), ids=DEVS.keys())
def test_reference_reads_fnuz_pages_anywhere(dev):
    c = aiter_combo(layout="fp8_ds_mla_fnuz", mqa_kernel=ReferenceMQA(), o_proj=ReferenceOProj())
    assert check(c, dev) == []


def test_the_generic_fp8_format_rule():
    """A kernel that reads a layout of any name but decodes its fp8 bytes in one flavour."""
    from dataclasses import dataclass

    @dataclass(frozen=True, slots=True, kw_only=True)
    class OcpReader:
        name: str = "ocp_reader"

        def needs(self, device) -> Needs:
            return Needs(fp8_formats=frozenset({"ocp"}))

    c = aiter_combo(layout="fp8_ds_mla_fnuz", mqa_kernel=OcpReader(), o_proj=ReferenceOProj())
    (p,) = check(c, SM90)
    assert (p.group, p.value) == ("cache_layout", "fp8_ds_mla_fnuz")
    assert "mqa_kernel=ocp_reader reads the cache" in p.reason and "half or twice" in p.reason
    assert check(aiter_combo(layout="fp8_ds_mla", mqa_kernel=OcpReader(), o_proj=ReferenceOProj()), SM90) == []


@pytest.mark.skipif(importlib.util.find_spec("aiter") is not None, reason="aiter is installed here")
def test_missing_package_is_named_when_checking_this_machine():
    problems = check(aiter_combo(), GFX950, here="rocm")
    assert {p.value for p in problems} == {"aiter_sparse", "rocm_bf16"}
    assert all("Python module 'aiter' not found (pip package amd-aiter)" in p.reason for p in problems)
    assert check(aiter_combo(), GFX950, here="cpu") == []


# ---- the presets and deployments, composed ------------------------------------------------------------
def test_backend_preset_on_the_rocm_deployments(compose_cfg):
    from dsv4.app.job import make_job

    job = make_job(compose_cfg(["backend=aiter", "deployment=mi355x"]))
    assert [getattr(job.combo, g).name for g in ("mqa_kernel", "o_proj", "head_padding", "cache_layout")] == \
        ["aiter_sparse", "rocm_bf16", "none", "fp8_ds_mla"]
    assert check(job.combo, job.device) == []
    job = make_job(compose_cfg(["backend=aiter", "deployment=mi300x"]))
    if job.combo.cache_layout.name == "fp8_ds_mla":        # the deployment does not pick the FNUZ record itself
        (p,) = check(job.combo, job.device)
        assert (p.group, p.fix) == ("cache_layout", "cache_layout=fp8_ds_mla_fnuz")
    job = make_job(compose_cfg(["backend=aiter", "deployment=mi300x", "cache_layout=fp8_ds_mla_fnuz"]))
    assert check(job.combo, job.device) == []
    job = make_job(compose_cfg(["backend=aiter", "deployment=h200"]))
    problems = check(job.combo, job.device)
    assert {(p.group, p.fix) for p in problems} >= {("mqa_kernel", "mqa_kernel=reference"),
                                                    ("o_proj", "o_proj=reference")}
    graphs = [p for p in problems if p.fix == "graph.enabled=false"]     # the h200 deployment replays CUDA graphs
    assert [p.group for p in graphs] == ["mqa_kernel"]
    assert all("cuda/sm90" in p.reason for p in problems if p.group in ("mqa_kernel", "o_proj") and p not in graphs)


def test_check_imports_neither_torch_nor_aiter():
    code = ("import sys\n"
            "from dsv4.values.device import DeviceInfo\n"
            "from dsv4.strategies import AiterSparseMQA, RocmBf16OProj, Fp8DsMlaFnuzLayout\n"
            "for arch in ('gfx942', 'gfx950', 'sm90'):\n"
            "    d = DeviceInfo(platform='rocm', arch=arch)\n"
            "    AiterSparseMQA().needs(d); RocmBf16OProj().needs(d); Fp8DsMlaFnuzLayout().needs(d)\n"
            "assert not {'torch', 'aiter'} & set(sys.modules), sorted(m for m in sys.modules if 'torch' in m)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.skipif(os.path.exists("/dev/kfd") or os.path.exists("/proc/driver/nvidia/version"),
                    reason="expects a host without an accelerator")
def test_cli_check_aiter_on_mi355x_and_h200(tmp_path):
    r = run_py("mode=check", "deployment=mi355x", "backend=aiter", run_dir=tmp_path / "ok")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rocm/gfx950" in r.stdout and "mqa_kernel=aiter_sparse" in r.stdout
    r = run_py("mode=check", "deployment=h200", "backend=aiter", run_dir=tmp_path / "no")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    for s in ("mqa_kernel=aiter_sparse", "fix: mqa_kernel=reference", "fix: o_proj=reference", "cuda/sm90"):
        assert s in r.stderr, s


# =====================================================================================================
# Optional: the real wheel's Python wrapper `aiter.mla.mla_decode_fwd` on these arguments
# =====================================================================================================
REAL_WRAPPER_PROBE = r'''
import importlib.util, math, sys, types
import torch
import tests.test_aiter_marshalling as T       # before the stubs below go into sys.modules
from dsv4.values.device import DeviceInfo
from dsv4.oracle import rel_err
from dsv4.strategies import AiterSparseMQA, ReferenceMQA

src = sys.argv[1]
seen = {"stage1": [], "stage2": []}

class Kernel:                                   # a @triton.jit function: kernel[grid](...) is recorded
    def __init__(self, fn):
        self.fn = fn
    def __getitem__(self, grid):
        return lambda *a, **k: seen["stage2"].append(grid)

triton, tl = types.ModuleType("triton"), types.ModuleType("triton.language")
triton.jit = lambda fn=None, **kw: Kernel(fn) if fn is not None else Kernel
triton.next_power_of_2 = lambda n: 1 << (n - 1).bit_length()
triton.language = tl
tl.constexpr, tl.int64 = "constexpr", "int64"
sys.modules.update({"triton": triton, "triton.language": tl})

def stage1(Q, KV, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_lens, num_kv_splits_indptr,
           work_meta_data, work_indptr, work_info_set, max_seqlen_q, softmax_scale, splitData, splitLse,
           output, q_scale=None, kv_scale=None):
    # the checks of csrc/py_itfs_cu/asm_mla.cu and its kernel choice for bf16 q over bf16 kv
    assert Q.is_contiguous() and KV.size(2) == 1 and Q.size(2) == KV.size(3)
    assert Q.dtype == KV.dtype == torch.bfloat16 and num_kv_splits_indptr is not None
    gqa = Q.size(1) // KV.size(2)
    assert gqa in (16, 128), gqa
    kernel = "subQ128_mqa128" if gqa == 128 else ("subQ16_mqa16" if max_seqlen_q == 1 else "mask")
    seen["stage1"].append((kernel, splitData.shape, tuple(output.shape)))
    # and the attention itself (aiter's torch_mla_extend, page size 1), written to the final output
    rows = KV.reshape(-1, KV.size(3)).double()
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        k = rows[kv_page_indices[kv[b]:kv[b + 1]].long()]
        s = torch.einsum("qhd,kd->qhk", Q[qo[b]:qo[b + 1]].double(), k) * softmax_scale
        o = torch.einsum("qhk,kd->qhd", torch.softmax(s, -1), k[:, :output.size(2)])
        output[qo[b]:qo[b + 1]] = o.to(output.dtype)

aiter = types.ModuleType("aiter"); aiter.__path__ = []
aiter.dtypes = types.SimpleNamespace(fp8=getattr(torch, sys.argv[2]), bf16=torch.bfloat16, fp32=torch.float32)
aiter.mla_decode_stage1_asm_fwd = stage1
chip = types.ModuleType("aiter.jit.utils.chip_info"); chip.get_cu_num = lambda: 304
for name in ("aiter.jit", "aiter.jit.utils"):
    sys.modules[name] = types.ModuleType(name)
sys.modules.update({"aiter": aiter, "aiter.jit.utils.chip_info": chip})
spec = importlib.util.spec_from_file_location("aiter.mla", f"{src}/aiter/mla.py")
mla = importlib.util.module_from_spec(spec)
sys.modules["aiter.mla"] = aiter.mla = mla
spec.loader.exec_module(mla)

class TorchOnCpu:                               # the wrapper makes its split index on device="cuda"
    def __getattr__(self, name):
        return getattr(torch, name)
    @staticmethod
    def arange(*a, device=None, **k):
        return torch.arange(*a, **k)
mla.torch = TorchOnCpu()

arch = "gfx942" if sys.argv[2] == "float8_e4m3fnuz" else "gfx950"
for kind in ("swa", "c4a", "c128a", "messy"):
    for H in (16, 64, 128):
        mla.get_meta_param.cache_clear()
        layout = T.ARCH_LAYOUT[arch]
        kv = T.messy_case(layout, seed=2) if kind == "messy" else T.layer_case(kind, layout, seed=3)
        q, sink = T.make_q(kv.swa_indices.shape[0], H, H, seed=H)
        k = AiterSparseMQA()
        out, lse = k(q, kv, sink=sink, scale=T.SCALE, prepared=k.prepare(device=DeviceInfo(platform="rocm", arch=arch)))
        ref = ReferenceMQA()(q.bfloat16().float(), kv, sink=sink, scale=T.SCALE)[0]
        assert rel_err(out, ref) <= 1e-2, (kind, H, rel_err(out, ref))
        kernel, split, o_shape = seen["stage1"][-1]
        assert kernel == ("subQ128_mqa128" if H == 128 else "subQ16_mqa16"), kernel
        assert o_shape == ((q.shape[0], 128, 512) if H == 128 else (q.shape[0] * H // 16, 16, 512)), o_shape
print("REAL WRAPPER OK", len(seen["stage1"]), "calls")
'''


@pytest.mark.skipif(not os.environ.get("DSV4_AITER_SRC"),
                    reason="set DSV4_AITER_SRC to an unpacked amd-aiter wheel to run its mla_decode_fwd wrapper here")
@pytest.mark.parametrize("fp8", ["float8_e4m3fnuz", "float8_e4m3fn"], ids=["gfx942", "gfx950"])
def test_the_real_wrapper_takes_the_arguments(fp8):
    """In a subprocess: the wheel's own aiter/mla.py (its get_meta_param, buffers and stage-2 launch) with
    the ASM stage 1 replaced by its C++ checks and the attention it computes, Triton by a recorder."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", REAL_WRAPPER_PROBE, os.environ["DSV4_AITER_SRC"], fp8], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0 and "REAL WRAPPER OK" in r.stdout, r.stderr[-3000:]
