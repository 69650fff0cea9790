"""mqa_kernel=flashinfer_sparse without FlashInfer and without a GPU.

`flashinfer.mla.trtllm_batch_decode_sparse_mla_dsv4` (flashinfer-python 0.6.15.post1) is modelled here in
torch from its documented contract -- the function's docstring and argument checks, docs/numerics.md §3.2,
§3.3, §4.3, §4.4, §5.5 -- written without looking at the adapter's marshalling: `trtllm_gen_contract` (sm100/sm103:
one combined table, SWA window derived from seq_lens) and `sm120_contract` (sm120/sm121: fp8_ds_mla pages,
SWA + extra lists). A fake `flashinfer` module whose API is that model is put in sys.modules, so the
adapter's real `__call__` runs end to end; its output is then compared with ReferenceMQA on the same
SparseKV. The check() verdicts of the option are at the end.
"""
from __future__ import annotations

import importlib.util
import inspect
import math
import os
import subprocess
import sys
import types
from dataclasses import replace
from itertools import pairwise

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from dsv4.speed.cases import random_pages
from dsv4.checks.catalogue import strategies
from dsv4.checks.compat import Combination, check
from dsv4.values.device import DeviceInfo
from dsv4.formats.row_format import RowKind
from dsv4.oracle import rel_err
from dsv4.values.spec import ModelSpec
from dsv4.strategies import (BucketHeadPadding, FlashInferSparse, Fp8DsMlaLayout, Fp8PerTensorLayout,
                             NoHeadPadding, PlainRowLayout, ReferenceMQA, ReferenceOProj, SparseKV)
from dsv4.strategies.mqa_kernel import flashinfer_sparse as fi
from tests.conftest import CONFIGS, ROOT, through

D = 512
SCALE = D ** -0.5
E4M3 = torch.float8_e4m3fn
SM90 = DeviceInfo(platform="cuda", arch="sm90", name="H200")
SM100 = DeviceInfo(platform="cuda", arch="sm100", name="B200")
SM103 = DeviceInfo(platform="cuda", arch="sm103", name="B300")
SM120 = DeviceInfo(platform="cuda", arch="sm120", name="RTX PRO 6000")
SM121 = DeviceInfo(platform="cuda", arch="sm121", name="GB10")
CPU = DeviceInfo(platform="cpu", name="CPU")

# The signature targeted (flashinfer-python 0.6.15.post1, flashinfer/mla/_core.py), in order.
API_PARAMS = ("query", "swa_kv_cache", "workspace_buffer", "sparse_indices", "compressed_kv_cache",
              "sparse_topk_lens", "seq_lens", "out", "bmm1_scale", "bmm2_scale", "sinks", "kv_layout",
              "cum_seq_lens_q", "max_q_len", "enable_pdl", "swa_topk_lens", "extra_sparse_indices",
              "extra_sparse_topk_lens")
HEADS = (8, 16, 32, 64, 128)
SWA_W = 128


# =====================================================================================================
# The API's documented contract, in float64
# =====================================================================================================
def _float_scale(x, name: str, *, tensor_ok: bool) -> float:
    if isinstance(x, torch.Tensor):
        if not tensor_ok:
            raise ValueError(f"{name}: SM120/SM121 expects a float")
        if x.dtype != torch.float32 or x.numel() != 1:
            raise TypeError(f"{name} tensor must be one float32 value")
        return float(x)
    return float(x)


def _attend(q, keys, valid, sinks, bmm1: float, bmm2: float):
    """q [T, H, D], keys [T, N, D] (V = K), valid [T, N], all float64: per token
    bmm2 · softmax-with-sink(bmm1 · q·k) · V over its valid keys (§2.7); 0 where none is valid."""
    s = bmm1 * torch.einsum("thd,tnd->thn", q, keys)
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    Z = e.sum(-1, keepdim=True)
    any_key = Z > 0
    if sinks is not None:
        Z = Z + torch.exp(sinks.double()[None, :, None] - m)          # the sink: denominator only
    out = bmm2 * torch.einsum("thn,tnd->thd", e, keys) / Z
    return torch.where(any_key, out, torch.zeros_like(out))


def _gather(rows, idx, valid, name: str):
    """rows[idx] where valid (zeros elsewhere); a valid slot outside the pool is an error."""
    bad = valid & (idx >= rows.shape[0])
    if bool(bad.any()):
        raise IndexError(f"{name}: slot {int(idx[bad][0])} is outside the pool ({rows.shape[0]} rows): a GPU "
                         "would read out of bounds")
    return torch.where(valid[..., None], rows[torch.where(valid, idx, 0).long()], torch.zeros((), dtype=rows.dtype))


def _plain_pool_rows(pool, kv_layout: str, qdtype, name: str):
    """sm100 pools: head dim 512, the query's dtype, one KV head; the kernel steps 512 elements per slot
    (page size 1 inside the kernel), so slot s is row s of the contiguous pool."""
    if pool.dim() == 3:
        if kv_layout != "HND":
            raise ValueError(f"{name} with ndim == 3 is only valid for kv_layout='HND'")
    elif pool.dim() == 4:
        head_axis = 1 if kv_layout == "HND" else 2
        if pool.shape[head_axis] != 1:
            raise ValueError(f"{name}: expected one KV head on axis {head_axis} for {kv_layout}")
    else:
        raise ValueError(f"{name}: expected ndim 3 or 4")
    if pool.dtype != qdtype:
        raise ValueError(f"{name} dtype must match query dtype, got {pool.dtype} and {qdtype}")
    if pool.shape[-1] != D:
        raise ValueError(f"{name}: head dim must be 512")
    if not pool.is_contiguous():
        raise ValueError(f"{name}: the kernel addresses slot * 512 elements; pool must be contiguous rows")
    return pool.reshape(-1, D).double()


def trtllm_gen_contract(*, query, swa_kv_cache, workspace_buffer, sparse_indices, compressed_kv_cache,
                        sparse_topk_lens, seq_lens, bmm1_scale, bmm2_scale, sinks, kv_layout, cum_seq_lens_q,
                        max_q_len, **unused):
    """sm100/sm103: "The first 128 columns of sparse_indices are SWA entries into swa_kv_cache; remaining
    columns are compressed entries into compressed_kv_cache. sparse_topk_lens gives the total active
    sparse length for each query token and must include the fixed 128 SWA entries. seq_lens provides the
    original KV sequence length for the SWA validity window." Query i of request b reads SWA columns
    j < min(128, pos + 1), pos = seq_lens[b] - q_len_b + i, and compressed columns 128 <= j < its length.

    Every column it reads must name a row: FlashInfer's own test of this kernel pads the SWA columns past
    the window with -1 and notes that "the kernel must use real seq_lens instead of treating every SWA
    tile as full", i.e. the kernel does not skip a -1 it reads (its TMA would fetch a zero row: a key of
    logit 0, not a skipped one); its compressed lists have no -1 below their lengths. So a -1 in a read
    column is refused here rather than given a meaning. Columns past the window / length are not read."""
    if unused.get("swa_topk_lens") is not None or unused.get("extra_sparse_indices") is not None \
            or unused.get("extra_sparse_topk_lens") is not None:
        raise ValueError("swa_topk_lens / extra_sparse_* are only supported on SM120/SM121")
    if compressed_kv_cache is None or sparse_topk_lens is None or seq_lens is None:
        raise ValueError("trtllm-gen requires compressed_kv_cache, sparse_topk_lens and seq_lens")
    if query.dtype not in (torch.bfloat16, E4M3):
        raise ValueError(f"query must be bf16 or fp8 e4m3, got {query.dtype}")
    if cum_seq_lens_q is not None:
        if query.dim() != 3:
            raise ValueError("varlen query must be [sum_q, H, 512]")
        if cum_seq_lens_q.dtype != torch.int32 or cum_seq_lens_q.dim() != 1 or cum_seq_lens_q.numel() < 2:
            raise ValueError("cum_seq_lens_q must be int32 [batch + 1]")
        if max_q_len is None or max_q_len <= 0:
            raise ValueError("max_q_len is required (> 0) with cum_seq_lens_q")
        starts = [int(v) for v in cum_seq_lens_q]
        if starts[0] != 0 or starts[-1] != query.shape[0] or any(b < a for a, b in pairwise(starts)):
            raise ValueError("cum_seq_lens_q must run from 0 to sum_q, non-decreasing")
        q_lens = [b - a for a, b in pairwise(starts)]
        if max(q_lens) > max_q_len:
            raise ValueError("a request has more query tokens than max_q_len")
        qf = query
    else:
        if query.dim() != 4:
            raise ValueError("dense query must be [batch, q_len, H, 512]")
        qf = query.flatten(0, 1)
        q_lens = [query.shape[1]] * query.shape[0]
        starts = [i * query.shape[1] for i in range(query.shape[0] + 1)]
    T, H, hd = qf.shape
    if hd != D or H not in HEADS:
        raise ValueError(f"query heads must be in {HEADS} and head dim 512, got {tuple(qf.shape)}")
    if sparse_indices.dtype != torch.int32 or sparse_indices.dim() != 2 or sparse_indices.shape[0] != T:
        raise ValueError("sparse_indices must be int32 [sum_q, topk]")
    width = sparse_indices.shape[1]
    if width < SWA_W or width % 4:
        raise ValueError("sparse_indices must hold the 128 SWA columns and be a multiple of 4 wide")
    if sparse_topk_lens.dtype != torch.int32 or tuple(sparse_topk_lens.shape) != (T,):
        raise ValueError("sparse_topk_lens must be int32 [sum_q]")
    if bool((sparse_topk_lens < SWA_W).any()) or bool((sparse_topk_lens > width).any()):
        raise ValueError("sparse_topk_lens must include the 128 SWA entries and fit the table")
    B = len(q_lens)
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (B,):
        raise ValueError("seq_lens must be int32 [batch]")
    if any(int(seq_lens[b]) < q_lens[b] for b in range(B)):
        raise ValueError("seq_lens must be >= the per-request query lengths")
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (H,)):
        raise ValueError("sinks must be float32 [num_heads]")
    if kv_layout not in ("HND", "NHD"):
        raise ValueError("kv_layout must be HND or NHD")
    bmm1 = _float_scale(bmm1_scale, "bmm1_scale", tensor_ok=True)
    bmm2 = _float_scale(bmm2_scale, "bmm2_scale", tensor_ok=True)
    swa_rows = _plain_pool_rows(swa_kv_cache, kv_layout, query.dtype, "swa_kv_cache")
    comp_rows = _plain_pool_rows(compressed_kv_cache, kv_layout, query.dtype, "compressed_kv_cache")

    # per query token: its request's seq_len and query count, its index within the request
    req = torch.repeat_interleave(torch.arange(B), torch.tensor(q_lens))
    i = torch.arange(T) - torch.tensor(starts[:-1])[req]
    pos = seq_lens.long()[req] - torch.tensor(q_lens)[req] + i
    window = torch.clamp(pos + 1, max=SWA_W)
    col = torch.arange(width)[None, :]
    idx = sparse_indices.long()
    is_swa = col < SWA_W
    read = torch.where(is_swa, col < window[:, None], col < sparse_topk_lens.long()[:, None])
    if bool((read & (idx < 0)).any()):
        t, j = (int(v) for v in torch.nonzero(read & (idx < 0))[0])
        raise ValueError(f"query {t} reads column {j} (window {int(window[t])}, length "
                         f"{int(sparse_topk_lens[t])}), which holds {int(idx[t, j])}: not a row")
    keys = _gather(swa_rows, idx, read & is_swa, "swa_kv_cache") \
        + _gather(comp_rows, idx, read & ~is_swa, "compressed_kv_cache")
    return _attend(qf.double(), keys, read, sinks, bmm1, bmm2)


def ds_mla_pool_rows(pool, kv_layout: str, name: str):
    """Every row of a packed fp8_ds_mla pool, dequantized from its bytes (§3.2): page p starts at
    p * stride(0); token t's 448 e4m3 NoPE bytes + 64 bf16 RoPE dims at t*576, its 7 UE8M0 exponents
    at B*576 + t*8; x = e4m3 · 2^(e - 127) per 64 NoPE dims."""
    if pool.dtype != torch.uint8 or pool.shape[-1] != 584:
        raise ValueError(f"{name}: expected packed uint8 pages of 584 bytes per token")
    if pool.dim() == 3:
        nb, B = pool.shape[0], pool.shape[1]
    elif pool.dim() == 4:
        if kv_layout == "NHD" and pool.shape[2] == 1:
            nb, B = pool.shape[0], pool.shape[1]
        elif kv_layout == "HND" and pool.shape[1] == 1:
            nb, B = pool.shape[0], pool.shape[2]
        else:
            raise ValueError(f"{name}: one KV head expected for {kv_layout}, got {tuple(pool.shape)}")
    else:
        raise ValueError(f"{name}: expected ndim 3 or 4")
    stride = pool.stride(0)
    if stride < B * 584:
        raise ValueError(f"{name}: page stride {stride} < {B} * 584")
    pages = torch.as_strided(pool, (nb, stride), (stride, 1), pool.storage_offset())
    t = torch.arange(B)
    data = pages[:, (t * 576)[:, None] + torch.arange(576)]                   # [nb, B, 576]
    exps = pages[:, (B * 576 + t * 8)[:, None] + torch.arange(7)]             # [nb, B, 7]
    nope = data[..., :448].contiguous().view(E4M3).double()
    nope = nope * torch.exp2(exps.double() - 127).repeat_interleave(64, -1)
    rope = data[..., 448:].contiguous().view(torch.bfloat16).double()
    return torch.cat((nope, rope), -1).reshape(nb * B, D)


def _segment(indices, lens, T: int, name: str):
    if indices.dtype != torch.int32:
        raise ValueError(f"{name} must be int32")
    if indices.dim() == 3:
        if indices.shape[:2] != (T, 1):
            raise ValueError(f"{name}: expected [{T}, 1, topk], got {tuple(indices.shape)}")
        indices = indices[:, 0]
    elif indices.dim() != 2 or indices.shape[0] != T:
        raise ValueError(f"{name}: expected [{T}, topk], got {tuple(indices.shape)}")
    if lens is not None and (lens.dtype != torch.int32 or tuple(lens.shape) != (T,)):
        raise ValueError(f"{name} lengths must be int32 [{T}]")
    return indices, lens


def sm120_contract(*, query, swa_kv_cache, workspace_buffer, sparse_indices, compressed_kv_cache,
                   swa_topk_lens, extra_sparse_indices, extra_sparse_topk_lens, bmm1_scale, bmm2_scale,
                   sinks, kv_layout, **unused):
    """sm120/sm121: "swa_kv_cache is the required packed uint8 SWA pool with 584 bytes per token.
    sparse_indices and swa_topk_lens describe the active SWA segment. To add a compressed segment,
    pass compressed_kv_cache ... and extra_sparse_indices with extra_sparse_topk_lens." BF16 query, one
    softmax over both segments; an entry counts if its column is below the length and it is not -1."""
    if _float_scale(bmm2_scale, "bmm2_scale", tensor_ok=False) != 1.0:
        raise ValueError("SM120 DSv4 sparse MLA does not support bmm2_scale")
    bmm1 = _float_scale(bmm1_scale, "bmm1_scale", tensor_ok=False)
    if query.dtype != torch.bfloat16:
        raise ValueError("SM120 DSv4 sparse MLA only supports BF16 query")
    qf = query if query.dim() == 3 else query.flatten(0, 1)
    T, H, hd = qf.shape
    if hd != D or H not in HEADS:
        raise ValueError(f"query heads must be in {HEADS} and head dim 512")
    if swa_topk_lens is None:
        raise ValueError("SM120 requires swa_topk_lens")
    if (extra_sparse_indices is None) != (extra_sparse_topk_lens is None):
        raise ValueError("extra_sparse_indices and extra_sparse_topk_lens go together")
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (H,)):
        raise ValueError("sinks must be float32 [num_heads]")
    segs = [(*_segment(sparse_indices, swa_topk_lens, T, "sparse_indices"),
             ds_mla_pool_rows(swa_kv_cache, kv_layout, "swa_kv_cache"), "swa_kv_cache")]
    if extra_sparse_indices is not None:
        if compressed_kv_cache is None:
            raise ValueError("compressed_kv_cache is required with extra_sparse_indices")
        segs.append((*_segment(extra_sparse_indices, extra_sparse_topk_lens, T, "extra_sparse_indices"),
                     ds_mla_pool_rows(compressed_kv_cache, kv_layout, "compressed_kv_cache"), "compressed_kv_cache"))
    keys, valid = [], []
    for idx, lens, rows, name in segs:
        idx = idx.long()
        ok = (idx >= 0) & (torch.arange(idx.shape[1])[None, :] < lens.long()[:, None])
        keys.append(_gather(rows, idx, ok, name))
        valid.append(ok)
    return _attend(qf.double(), torch.cat(keys, 1), torch.cat(valid, 1), sinks, bmm1, 1.0)


def contract(arch: str, **kw):
    """float64 output [sum_q, H, 512] of the API for `arch` (chosen from the query's device in the real one)."""
    if arch in ("sm100", "sm103"):
        return trtllm_gen_contract(**kw)
    if arch in ("sm120", "sm121"):
        return sm120_contract(**kw)
    raise ValueError(f"trtllm_batch_decode_sparse_mla_dsv4 supports SM100/SM103 or SM120/SM121, got {arch}")


def make_api(arch: str, calls: list):
    def trtllm_batch_decode_sparse_mla_dsv4(
            query, swa_kv_cache, workspace_buffer, sparse_indices, compressed_kv_cache=None,
            sparse_topk_lens=None, seq_lens=None, out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None,
            kv_layout="HND", cum_seq_lens_q=None, max_q_len=None, enable_pdl=None, swa_topk_lens=None,
            extra_sparse_indices=None, extra_sparse_topk_lens=None):
        kw = dict(query=query, swa_kv_cache=swa_kv_cache, workspace_buffer=workspace_buffer,
                  sparse_indices=sparse_indices, compressed_kv_cache=compressed_kv_cache,
                  sparse_topk_lens=sparse_topk_lens, seq_lens=seq_lens, bmm1_scale=bmm1_scale,
                  bmm2_scale=bmm2_scale, sinks=sinks, kv_layout=kv_layout, cum_seq_lens_q=cum_seq_lens_q,
                  max_q_len=max_q_len, swa_topk_lens=swa_topk_lens, extra_sparse_indices=extra_sparse_indices,
                  extra_sparse_topk_lens=extra_sparse_topk_lens)
        calls.append(dict(kw, out=out, enable_pdl=enable_pdl))
        res = contract(arch, **kw)
        shape = (query.shape[0], query.shape[1], query.shape[2], D) if query.dim() == 4 else (*query.shape[:2], D)
        if out is None:
            out = torch.empty(shape, dtype=torch.bfloat16)
        elif out.dtype != torch.bfloat16 or out.numel() != res.numel():
            raise ValueError("out must be bf16 with the query's token and head counts")
        out.copy_(res.view(out.shape).to(torch.bfloat16))             # the kernel writes bf16
        return out
    return trtllm_batch_decode_sparse_mla_dsv4


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """install(arch) puts a `flashinfer` package whose mla API is the contract for `arch` into
    sys.modules; returns the list its calls are recorded in."""
    def install(arch: str) -> list:
        calls: list = []
        pkg, mla = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.mla")
        mla.trtllm_batch_decode_sparse_mla_dsv4 = make_api(arch, calls)
        pkg.mla = mla
        monkeypatch.setitem(sys.modules, "flashinfer", pkg)
        monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
        return calls
    return install


def test_the_fake_has_the_targeted_signature():
    assert tuple(inspect.signature(make_api("sm100", [])).parameters) == API_PARAMS


# =====================================================================================================
# Cases
# =====================================================================================================
def layout_of(kind: str, kv_scale: float = 1.0, q_scale: float = 1.0):
    if kind == "bf16":
        return PlainRowLayout(name="bf16", dtype="bfloat16")
    if kind == "fp8_per_tensor":
        return Fp8PerTensorLayout(kv_scale=kv_scale, q_scale=q_scale)
    return Fp8DsMlaLayout()


def layer_case(kind: str, layout, T: int, seed: int, *, K: int = 37, positions=None):
    """A SparseKV the way the layer makes one, vLLM-style (§2.6, §5.5): per token at position p the SWA window
    max(0, p-127)..p in order (fewer than 128 near the start, -1 after), and for `kind` c4a a top-K list
    of distinct compressed entries < (p+1)//4 in score order (-1 padded), for c128a entries
    0..(p+1)//128-1 (width: the largest count), through random per-token block tables."""
    g = torch.Generator().manual_seed(seed)
    if positions is None:
        positions = torch.cat((torch.tensor([0, 1, 5, 126, 127, 128, 300]), torch.randint(0, 400, (T,), generator=g)))
    p = torch.as_tensor(positions)[:T] if len(positions) >= T else torch.as_tensor(positions)
    T = p.shape[0]
    swa = random_pages("swa", 16, 64, g, layout)
    tab = torch.stack([torch.randperm(16, generator=g) for _ in range(T)])
    lo = (p - SWA_W + 1).clamp(min=0)
    local = lo[:, None] + torch.arange(SWA_W)[None]
    local = torch.where(local <= p[:, None], local, torch.full_like(local, -1))
    kw = dict(swa=swa, swa_indices=through(tab, local, 64).to(torch.int32),
              swa_lens=torch.minimum(p + 1, torch.full_like(p, SWA_W)).to(torch.int32), layer_type=kind)
    if kind == "c4a":
        comp = random_pages("compressed", 8, 64, g, layout)
        n_c = (p + 1) // 4
        rows = []
        for t in range(T):
            k = min(int(n_c[t]), K)
            sel = torch.randperm(int(n_c[t]), generator=g)[:k] if k else torch.zeros(0, dtype=torch.long)
            rows.append(torch.cat((sel, torch.full((K - k,), -1, dtype=torch.long))))
        local_c = torch.stack(rows)
        ctab = torch.stack([torch.randperm(8, generator=g) for _ in range(T)])
        kw |= dict(extra=comp, extra_indices=through(ctab, local_c, 64).to(torch.int32),
                   extra_lens=(local_c >= 0).sum(1).to(torch.int32))
    elif kind == "c128a":
        comp = random_pages("compressed", 8, 2, g, layout)
        n_c = (p + 1) // 128
        width = max(1, int(n_c.max()))
        local_c = torch.arange(width)[None].expand(T, width)
        local_c = torch.where(local_c < n_c[:, None], local_c, torch.full_like(local_c, -1))
        ctab = torch.stack([torch.randperm(8, generator=g) for _ in range(T)])
        kw |= dict(extra=comp, extra_indices=through(ctab, local_c, 2).to(torch.int32), extra_lens=n_c.to(torch.int32))
    return SparseKV(**kw)


def messy_case(layout, T: int, seed: int, *, extra: bool = True):
    """Lists as loose as a SparseKV allows: -1 holes, slot ids past the pool, entries past the length,
    a query with no SWA row, one with nothing at all."""
    g = torch.Generator().manual_seed(seed)
    swa = random_pages("swa", 4, 64, g, layout)

    def lists(width, S):
        idx = torch.randint(0, S + 20, (T, width), generator=g)       # some past the pool: padding
        idx = torch.where(torch.rand(T, width, generator=g) < 0.2, torch.full_like(idx, -1), idx)
        lens = torch.randint(0, width + 1, (T,), generator=g)
        return idx.to(torch.int32), lens.to(torch.int32)

    si, sl = lists(SWA_W, swa.num_slots)
    sl[0], sl[1] = 0, 0
    kw = dict(swa=swa, swa_indices=si, swa_lens=sl)
    if extra:
        comp = random_pages("compressed", 6, 2, g, layout)
        ei, el = lists(23, comp.num_slots)
        el[1] = 0
        kw |= dict(extra=comp, extra_indices=ei, extra_lens=el)
    return SparseKV(**kw)


def make_q(T: int, H: int, Hp: int, seed: int):
    """RMS-normed-sized queries for H heads, zero-padded to Hp (as the layer pads); sinks -inf on padding."""
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.zeros(T, Hp, D)
    q[:, :H] = torch.randn(T, H, D, generator=g)
    sink = torch.full((Hp,), float("-inf"))
    sink[:H] = torch.randn(H, generator=g)
    return q, sink


def kernel_q(layout, q):
    """The query the kernel is given, back in float32 (written here from §3.3, not taken from the adapter)."""
    if layout.row_format.kind is RowKind.FP8_PER_TENSOR:
        return (q.float() / layout.q_scale).clamp(-448, 448).to(E4M3).float() * layout.q_scale
    return q.bfloat16().float()


def run(arch: str, q, kv, sink, install):
    """The adapter's real __call__ through the fake API: (out, lse, the recorded kwargs)."""
    calls = install(arch)
    k = FlashInferSparse()
    out, lse = k(q, kv, sink=sink, scale=SCALE, prepared=k.prepare(device=DeviceInfo(platform="cuda", arch=arch)))
    assert len(calls) == 1
    return out, lse, calls[0]


def contract_float(arch: str, kw):
    return contract(arch, **{k: v for k, v in kw.items() if k not in ("out", "enable_pdl")})


# =====================================================================================================
# The adapter through the fake API against ReferenceMQA
# =====================================================================================================
CASES = [pytest.param(arch, lay, kind, H, Hp, id=f"{arch}-{lay}-{kind}-h{H}to{Hp}")
         for arch, lay in (("sm100", "bf16"), ("sm100", "fp8_per_tensor"), ("sm103", "bf16"),
                           ("sm120", "fp8_ds_mla"), ("sm121", "fp8_ds_mla"))
         for kind in ("swa", "c4a", "c128a")
         for H, Hp in ((5, 8), (64, 64))]


@pytest.mark.parametrize("arch,lay,kind,H,Hp", CASES)
def test_adapter_through_the_contract_equals_reference(fake_flashinfer, arch, lay, kind, H, Hp):
    layout = layout_of(lay, kv_scale=2.0, q_scale=0.25)         # non-unit scales: their folding shows
    kv = layer_case(kind, layout, 9, seed=Hp + len(kind))
    q, sink = make_q(kv.swa_indices.shape[0], H, Hp, seed=H)
    out, lse, kw = run(arch, q, kv, sink, fake_flashinfer)

    ref_q = kernel_q(layout, q)                                  # what the kernel is handed, exactly
    ref, _ = ReferenceMQA()(ref_q, kv, sink=sink, scale=SCALE)
    # float paths: the contract evaluated in float64 on the adapter's arguments
    assert rel_err(contract_float(arch, kw)[:, :H], ref[:, :H]) <= 1e-5
    # end to end: the kernel's bf16 output, returned in q's dtype
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(out[:, :H], ref[:, :H]) <= 1e-2
    if lay == "fp8_per_tensor":
        # against the float query: only e4m3 rounding of q is left
        exact, _ = ReferenceMQA()(q, kv, sink=sink, scale=SCALE)
        assert rel_err(out[:, :H], exact[:, :H]) <= 5e-2
    assert lse is None                                   # the API returns no log-sum-exp


@pytest.mark.parametrize("arch,lay", [("sm100", "bf16"), ("sm100", "fp8_per_tensor"), ("sm120", "fp8_ds_mla")])
@pytest.mark.parametrize("extra", [True, False], ids=["two_lists", "swa_only"])
def test_loose_lists_mean_what_reference_reads(fake_flashinfer, arch, lay, extra):
    """-1 holes, out-of-pool ids, entries past the length, empty queries: same attended set as ReferenceMQA."""
    layout = layout_of(lay)
    kv = messy_case(layout, 11, seed=7 + extra)
    q, sink = make_q(11, 16, 16, seed=3)
    out, _, kw = run(arch, q, kv, sink, fake_flashinfer)
    ref, _ = ReferenceMQA()(kernel_q(layout, q), kv, sink=sink, scale=SCALE)
    swa, comp = _truth(kv)
    keep = torch.ones(len(swa), dtype=torch.bool)
    if arch == "sm100":
        # TRTLLM-gen always reads >= 1 SWA column: a query with compressed rows but no SWA row (never made
        # by the layer) is not expressible (it also attends to the placeholder); one with no row at all is 0
        keep = torch.tensor([bool(s_) or not c for s_, c in zip(swa, comp)])
        assert rel_err(fi_out_zeroed(contract_float(arch, kw), kv)[keep], ref[keep]) <= 1e-5
    else:
        assert rel_err(contract_float(arch, kw), ref) <= 1e-5
    assert rel_err(out[keep], ref[keep]) <= 1e-2
    assert bool((out[1] == 0).all())                              # query 1 attends to nothing


def fi_out_zeroed(out, kv):
    """What the adapter does to the kernel's output on sm100: rows of queries naming no row are 0."""
    swa, comp = _truth(kv)
    empty = torch.tensor([not s_ and not c for s_, c in zip(swa, comp)])
    return torch.where(empty[:, None, None], torch.zeros((), dtype=out.dtype), out)


@pytest.mark.parametrize("arch,lay", [("sm100", "bf16"), ("sm120", "fp8_ds_mla")])
def test_sink_infinities(fake_flashinfer, arch, lay):
    layout = layout_of(lay)
    kv = layer_case("c4a", layout, 6, seed=1)
    q, sink = make_q(kv.swa_indices.shape[0], 8, 8, seed=2)
    sink[:3], sink[3:6] = float("inf"), float("-inf")
    out, _, _ = run(arch, q, kv, sink, fake_flashinfer)
    ref, _ = ReferenceMQA()(kernel_q(layout, q), kv, sink=sink, scale=SCALE)
    assert bool((out[:, :3] == 0).all())
    assert rel_err(out[:, 3:], ref[:, 3:]) <= 1e-2


def test_float32_activations_are_cast_and_returned_in_their_dtype(fake_flashinfer):
    kv = layer_case("c128a", layout_of("bf16"), 5, seed=4)
    q, sink = make_q(kv.swa_indices.shape[0], 32, 32, seed=4)
    out, _, kw = run("sm100", q.double(), kv, sink, fake_flashinfer)
    assert out.dtype == torch.float64 and kw["query"].dtype == torch.bfloat16


def test_no_tokens(fake_flashinfer):
    calls = fake_flashinfer("sm100")
    kv = layer_case("c4a", layout_of("bf16"), 4, seed=0)
    kv = replace(kv, swa_indices=kv.swa_indices[:0], swa_lens=kv.swa_lens[:0], extra_indices=kv.extra_indices[:0],
                 extra_lens=kv.extra_lens[:0])
    k = FlashInferSparse()
    out, lse = k(torch.zeros(0, 8, D), kv, sink=torch.zeros(8), scale=SCALE, prepared=k.prepare(device=SM100))
    assert out.shape == (0, 8, D) and lse is None and calls == []


# ---- the contract is not a pushover: what the adapter must get right changes the answer -------------------
@pytest.mark.parametrize("arch,lay", [("sm100", "fp8_per_tensor"), ("sm120", "fp8_ds_mla")])
def test_the_contract_notices_wrong_marshalling(fake_flashinfer, arch, lay):
    layout = layout_of(lay, kv_scale=2.0, q_scale=0.25)
    kv = layer_case("c4a", layout, 8, seed=5)
    q, sink = make_q(kv.swa_indices.shape[0], 8, 8, seed=5)
    _, _, kw = run(arch, q, kv, sink, fake_flashinfer)
    ref, _ = ReferenceMQA()(kernel_q(layout, q), kv, sink=sink, scale=SCALE)
    good = contract_float(arch, kw)
    assert rel_err(good, ref) <= 1e-5
    if arch == "sm100":
        wrong = [dict(kw, bmm1_scale=SCALE),                      # q / kv scales not folded in
                 dict(kw, bmm2_scale=1.0),
                  dict(kw, seq_lens=(kw["seq_lens"] - 1).clamp(min=1)),       # window one short
                  dict(kw, sparse_topk_lens=(kw["sparse_topk_lens"] - 1).clamp(min=SWA_W))]  # last entry dropped
    else:
        wrong = [dict(kw, bmm1_scale=SCALE * 1.5),
                  dict(kw, swa_topk_lens=(kw["swa_topk_lens"] - 1).clamp(min=0)),
                  dict(kw, extra_sparse_topk_lens=(kw["extra_sparse_topk_lens"] - 1).clamp(min=0))]
    for w in wrong:
        assert rel_err(contract_float(arch, w), ref) > 1e-3
    with pytest.raises(ValueError):                              # the documented checks hold in the model too
        contract_float(arch, dict(kw, query=kw["query"].float()))


# =====================================================================================================
# The pure marshalling functions
# =====================================================================================================
def _truth(kv):
    """Per token the SWA and compressed slots the SparseKV means, in order (ReferenceMQA's reading)."""
    def rows(idx, lens, S):
        return [[int(i) for c, i in enumerate(idx[t]) if c < int(lens[t]) and 0 <= int(i) < S]
                for t in range(idx.shape[0])]
    swa = rows(kv.swa_indices, kv.swa_lens, kv.swa.num_slots)
    comp = rows(kv.extra_indices, kv.extra_lens, kv.extra.num_slots) if kv.extra is not None else [[] for _ in swa]
    return swa, comp


@pytest.mark.parametrize("kind", ["swa", "c4a", "c128a", "messy"])
def test_combined_table(kind):
    layout = layout_of("bf16")
    kv = messy_case(layout, 9, seed=2) if kind == "messy" else layer_case(kind, layout, 10, seed=3)
    idx, lens = fi.combined_sparse_indices(kv)
    swa, comp = _truth(kv)
    K = 0 if kv.extra is None else kv.extra_indices.shape[1]
    assert idx.dtype == torch.int32 and lens.dtype == torch.int32 and idx.is_contiguous()
    assert idx.shape == (len(swa), SWA_W + -(-K // 4) * 4)
    assert idx.stride(0) % 4 == 0
    for t in range(len(swa)):
        row = idx[t].tolist()
        want = swa[t] or [0]                         # a query with no SWA row reads slot 0 as a placeholder
        assert row[:SWA_W] == want + [-1] * (SWA_W - len(want))              # window order, then -1
        assert row[SWA_W:] == comp[t] + [-1] * (idx.shape[1] - SWA_W - len(comp[t]))
        assert int(lens[t]) == SWA_W + len(comp[t])
    v = fi.varlen_args(idx)
    assert v["max_q_len"] == 1
    assert v["cum_seq_lens_q"].tolist() == list(range(len(swa) + 1)) and v["cum_seq_lens_q"].dtype == torch.int32
    assert v["seq_lens"].dtype == torch.int32
    assert v["seq_lens"].tolist() == [max(1, len(s)) for s in swa]           # the derived window = the SWA count
    if kind not in ("messy",):
        assert v["seq_lens"].tolist() == kv.swa_lens.tolist()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(1, 6), W=st.integers(1, SWA_W), K=st.integers(0, 19), seed=st.integers(0, 10_000))
def test_compaction_keeps_exactly_the_meant_entries_in_order(T, W, K, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, 70, (T, max(W, K)), generator=g).to(torch.int32)
    lens = torch.randint(0, idx.shape[1] + 2, (T,), generator=g).to(torch.int32)
    out, n = fi.compact(idx, lens, 64)
    for t in range(T):
        want = [int(i) for c, i in enumerate(idx[t]) if c < int(lens[t]) and 0 <= int(i) < 64]
        assert out[t].tolist() == want + [-1] * (idx.shape[1] - len(want)) and int(n[t]) == len(want)


@pytest.mark.parametrize("kind", ["swa", "c4a", "c128a"])
def test_two_pool_args(kind):
    kv = layer_case(kind, layout_of("fp8_ds_mla"), 8, seed=6)
    a = fi.two_pool_args(kv)
    swa, comp = _truth(kv)
    assert a["sparse_indices"].shape == (len(swa), SWA_W) and a["sparse_indices"].dtype == torch.int32
    assert a["swa_topk_lens"].tolist() == [len(s) for s in swa]
    if kv.extra is None:
        assert set(a) == {"sparse_indices", "swa_topk_lens"}
        return
    e = a["extra_sparse_indices"]
    assert e.dim() == 3 and e.shape[:2] == (len(swa), 1) and e.shape[2] % 64 == 0 and e.dtype == torch.int32
    assert a["extra_sparse_topk_lens"].tolist() == [len(c) for c in comp]
    for t in range(len(swa)):
        assert e[t, 0].tolist() == comp[t] + [-1] * (e.shape[2] - len(comp[t]))


def test_wider_swa_lists_are_refused():
    kv = layer_case("swa", layout_of("bf16"), 3, seed=0)
    kv = replace(kv, swa_indices=torch.cat((kv.swa_indices, kv.swa_indices[:, :8]), 1))
    with pytest.raises(ValueError, match="sliding_window must be 128"):
        fi.combined_sparse_indices(kv)
    with pytest.raises(ValueError, match="sliding_window must be 128"):
        fi.two_pool_args(kv)


def test_narrower_swa_lists_are_padded_to_the_128_columns():
    kv = layer_case("c128a", layout_of("bf16"), 6, seed=9, positions=[0, 3, 15, 15, 140, 300])
    lo = torch.tensor([0, 0, 0, 0, 125, 285])                      # a 16-wide window, as dsv4_tiny has
    narrow = replace(kv, swa_indices=kv.swa_indices.gather(1, (torch.arange(16)[None] + (lo - (torch.tensor(
        [0, 3, 15, 15, 140, 300]) - 127).clamp(min=0))[:, None]).clamp(max=127)),
        swa_lens=torch.tensor([1, 4, 16, 16, 16, 16], dtype=torch.int32))
    idx, _ = fi.combined_sparse_indices(narrow)
    assert idx.shape[1] == SWA_W + 4 and bool((idx[:, 16:SWA_W] == -1).all())


def test_pool_views_are_views_of_the_live_pages():
    g = torch.Generator().manual_seed(0)
    for lay, shape, kvl in (("bf16", (4, 64, D), "HND"), ("fp8_per_tensor", (4, 64, D), "HND")):
        c = random_pages("swa", 4, 64, g, layout_of(lay))
        v, layout = fi.kv_pool_views(c)
        assert tuple(v.shape) == shape and layout == kvl and v.data_ptr() == c.data.data_ptr() and v.is_contiguous()
    for B in (64, 2):
        c = random_pages("compressed", 3, B, g, Fp8DsMlaLayout())
        v, layout = fi.kv_pool_views(c)
        assert tuple(v.shape) == (3, B, 1, 584) and layout == "NHD" and v.data_ptr() == c.data.data_ptr()
        assert v.stride(0) == c.page_bytes                                   # our 576-aligned page stride kept
    c = random_pages("swa", 2, 8, g, PlainRowLayout(name="float32", dtype="float32"))
    with pytest.raises(ValueError, match="cache_layout=bf16"):
        fi.kv_pool_views(c)
    c = random_pages("swa", 2, 8, g, layout_of("bf16"))
    c = replace(c, data=c.data.transpose(0, 1))
    with pytest.raises(ValueError, match="contiguous"):
        fi.kv_pool_views(c)


def test_scales():
    assert fi.scales(layout_of("bf16"), SCALE) == (SCALE, 1.0)
    assert fi.scales(layout_of("fp8_ds_mla"), SCALE) == (SCALE, 1.0)
    b1, b2 = fi.scales(layout_of("fp8_per_tensor", kv_scale=2.0, q_scale=0.25), SCALE)
    assert b1 == pytest.approx(SCALE * 0.5) and b2 == 2.0
    with pytest.raises(ValueError):
        fi.scales(PlainRowLayout(name="float32", dtype="float32"), SCALE)


def test_call_args_name_only_the_targeted_parameters():
    g = torch.Generator().manual_seed(1)
    combined = {"query", "swa_kv_cache", "workspace_buffer", "sparse_indices", "compressed_kv_cache",
                "sparse_topk_lens", "seq_lens", "out", "bmm1_scale", "bmm2_scale", "sinks", "kv_layout",
                "cum_seq_lens_q", "max_q_len"}
    two_pool = {"query", "swa_kv_cache", "workspace_buffer", "sparse_indices", "compressed_kv_cache", "out",
                "bmm1_scale", "bmm2_scale", "sinks", "kv_layout", "swa_topk_lens", "extra_sparse_indices",
                "extra_sparse_topk_lens"}
    ws = torch.zeros(16, dtype=torch.int8)
    for mode, lay, want in (("trtllm_combined", "bf16", combined), ("sm120_two_pool", "fp8_ds_mla", two_pool)):
        kv = layer_case("c4a", layout_of(lay), 4, seed=int(torch.randint(0, 99, (1,), generator=g)))
        q, sink = make_q(kv.swa_indices.shape[0], 8, 8, seed=0)
        a = fi.call_args(q, kv, sink=sink, scale=SCALE, mode=mode, workspace=ws)
        assert set(a) == want and set(a) <= set(API_PARAMS)
        assert a["workspace_buffer"] is ws and a["out"].dtype == torch.bfloat16 and a["sinks"].dtype == torch.float32
    kv = layer_case("swa", layout_of("bf16"), 4, seed=0)
    a = fi.call_args(q[:kv.swa_indices.shape[0]], kv, sink=sink, scale=SCALE, mode="trtllm_combined", workspace=ws)
    assert a["compressed_kv_cache"] is a["swa_kv_cache"] and a["sparse_indices"].shape[1] == SWA_W
    with pytest.raises(ValueError, match="buckets_pow2"):
        fi.call_args(torch.zeros(2, 12, D), kv, sink=torch.zeros(12), scale=SCALE, mode="trtllm_combined", workspace=ws)
    with pytest.raises(ValueError, match="reads"):
        fi.call_args(q[:kv.swa_indices.shape[0]], kv, sink=sink, scale=SCALE, mode="sm120_two_pool", workspace=ws)


def test_prepare_and_the_lazy_workspace(fake_flashinfer):
    k = FlashInferSparse()
    for dev, mode in ((SM100, "trtllm_combined"), (SM103, "trtllm_combined"), (SM120, "sm120_two_pool"),
                      (SM121, "sm120_two_pool")):
        prep = k.prepare(device=dev)
        assert prep.mode == mode and prep.workspace_bytes == 128 * 1024 * 1024
    with pytest.raises(ValueError, match="sm100/sm103"):
        k.prepare(device=SM90)
    with pytest.raises(ValueError, match="prepare"):
        k(torch.zeros(1, 8, D), layer_case("swa", layout_of("bf16"), 1, seed=0), sink=torch.zeros(8), scale=SCALE)

    fake_flashinfer("sm100")
    prep = k.prepare(device=SM100)
    kv = layer_case("swa", layout_of("bf16"), 3, seed=0)
    q, sink = make_q(kv.swa_indices.shape[0], 8, 8, seed=0)
    plan = k.plan(tokens=q.shape[0], layer_type="swa")
    k(q, kv, sink=sink, scale=SCALE, prepared=prep, plan=plan)
    ws = plan.workspace
    assert ws.dtype == torch.int8 and ws.numel() == 128 * 1024 * 1024 and not bool(ws.any())
    k(q, kv, sink=sink, scale=SCALE, prepared=prep, plan=plan)       # another layer of the same step
    assert plan.workspace is ws
    later = k.plan(tokens=q.shape[0], layer_type="swa", previous=plan)    # the next step keeps it
    k(q, kv, sink=sink, scale=SCALE, prepared=prep, plan=later)
    assert later.workspace is ws


# =====================================================================================================
# A layer of the engine with this kernel (through the fake API) against the same layer with ReferenceMQA
# =====================================================================================================
def test_layer_steps_through_the_adapter_match_the_reference_kernel(fake_flashinfer):
    from tests.conftest import chunked, drive, hidden_for, make_engine, tiny_spec

    fake_flashinfer("sm100")
    spec = tiny_spec(sliding_window=128)
    lengths = {"a": 150, "b": 40}
    ref_engine, W = make_engine(spec, layout="bfloat16")
    fi_engine, _ = make_engine(spec, layout="bfloat16", weights=W)
    k = FlashInferSparse()
    for mods in fi_engine.layers.values():
        for m in mods:
            m.mqa_kernel, m.mqa_prepared = k, k.prepare(device=SM100)
    X = hidden_for(lengths, spec.hidden_size)
    schedule = chunked(lengths, 64) + [{"a": 2, "b": 2}]
    X = {r: torch.cat((x, torch.randn(2, spec.hidden_size, generator=torch.Generator().manual_seed(9))))
         for r, x in X.items()}
    ref, _ = drive(ref_engine, X, schedule)
    got, _ = drive(fi_engine, X, schedule)
    for layer in ref:
        for r in ref[layer]:
            assert rel_err(got[layer][r], ref[layer][r]) <= 2e-2, (layer, r)


# =====================================================================================================
# check() verdicts
# =====================================================================================================
def load_spec(name: str) -> ModelSpec:
    return ModelSpec.from_config(OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{name}.yaml")))


FLASH, PRO, TINY = load_spec("dsv4_flash"), load_spec("dsv4_pro"), load_spec("dsv4_tiny")
POW2 = BucketHeadPadding(name="buckets_pow2", buckets=(8, 16, 32, 64, 128))


def fi_combo(*, spec=FLASH, layout="bf16", head_padding=POW2, tp_size=1, dtype="bfloat16") -> Combination:
    from dsv4.checks.catalogue import instantiate_group

    lay = instantiate_group(OmegaConf.load(CONFIGS / "cache_layout" / f"{layout}.yaml"))
    chosen = strategies(mqa_kernel=FlashInferSparse(), o_proj=ReferenceOProj(), head_padding=head_padding,
                        cache_layout=lay)
    return Combination(spec=spec, strategies=chosen, tp_size=tp_size, dtype=dtype)


@pytest.mark.parametrize("dev", [SM100, SM103], ids=["sm100", "sm103"])
@pytest.mark.parametrize("layout", ["bf16", "fp8_per_tensor"])
def test_accepted_on_blackwell_dc_with_plain_rows(dev, layout):
    assert check(fi_combo(layout=layout), dev) == []
    assert check(fi_combo(layout=layout, tp_size=8), dev) == []              # 8 heads per rank
    assert check(fi_combo(layout=layout, spec=PRO, tp_size=4, dtype="float32"), dev) == []


@pytest.mark.parametrize("dev", [SM120, SM121], ids=["sm120", "sm121"])
def test_accepted_on_sm12x_with_fp8_ds_mla_and_bf16_activations(dev):
    assert check(fi_combo(layout="fp8_ds_mla"), dev) == []
    (p,) = check(fi_combo(layout="fp8_ds_mla", dtype="float32"), dev)
    assert (p.group, p.fix) == ("dtype", "dtype=bfloat16")


def test_refused_on_h200_naming_the_supported_archs_and_a_fix():
    (p,) = check(fi_combo(), SM90)
    assert (p.group, p.value) == ("mqa_kernel", "flashinfer_sparse")
    assert {"sm100", "sm103", "sm120"} <= set(p.supported) and "sm90" not in p.supported
    assert "sm100" in p.reason and "sm120" in p.reason and SM90.describe() in p.reason
    assert p.fix == "mqa_kernel=reference"
    assert check(fi_combo().with_choice("mqa_kernel", ReferenceMQA()), SM90) == []


def test_refused_on_cpu_with_a_fix():
    problems = check(fi_combo(), CPU)
    assert problems and all(p.fix for p in problems) and any("cpu" in p.reason for p in problems)


@pytest.mark.parametrize("dev,layout,fix", [(SM100, "fp8_ds_mla", "cache_layout=bf16"),
                                            (SM120, "bf16", "cache_layout=fp8_ds_mla"),
                                            (SM120, "fp8_per_tensor", "cache_layout=fp8_ds_mla"),
                                            (SM100, "float32", "cache_layout=bf16")])
def test_cache_layout_per_arch(dev, layout, fix):
    (p,) = check(fi_combo(layout=layout), dev)
    assert (p.group, p.value, p.fix) == ("cache_layout", layout, fix)
    assert "mqa_kernel=flashinfer_sparse" in p.reason
    assert check(fi_combo(layout=fix.split("=")[1]), dev) == []


def test_head_padding_fix_is_pow2():
    (p,) = check(fi_combo(spec=replace(FLASH, num_attention_heads=48), head_padding=NoHeadPadding(), tp_size=8), SM100)
    assert (p.group, p.fix) == ("head_padding", "head_padding=buckets_pow2") and "got 6" in p.reason


def test_refused_for_a_sliding_window_other_than_128():
    problems = check(fi_combo(spec=TINY, head_padding=NoHeadPadding()), SM100)
    (p,) = problems
    assert (p.group, p.value, p.supported) == ("mqa_kernel", "flashinfer_sparse", ("128",))
    assert p.fix == "mqa_kernel=reference"
    assert "model.sliding_window = 128" in p.reason and "model=dsv4_tiny has 16" in p.reason
    assert check(fi_combo(spec=replace(TINY, sliding_window=128), head_padding=NoHeadPadding()), SM100) == []


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed here")
def test_missing_package_is_named_when_checking_this_machine():
    (p,) = check(fi_combo(), SM100, here="cuda")
    assert "Python module 'flashinfer' not found (pip package flashinfer-python)" in p.reason
    assert "pip install flashinfer-python" in p.fix


def test_backend_preset_composes_and_is_valid_on_sm100(compose_cfg):
    from dsv4.app.job import make_job

    job = make_job(compose_cfg(["backend=flashinfer", "deployment=b200"]))
    assert [getattr(job.combo, g).name for g in ("mqa_kernel", "o_proj", "head_padding", "cache_layout")] == \
        ["flashinfer_sparse", "deepgemm_fp8", "buckets_pow2", "bf16"]
    assert check(job.combo, job.device) == []
    job = make_job(compose_cfg(["backend=flashinfer", "deployment=h200"]))
    assert [(p.group, p.value) for p in check(job.combo, job.device)] == [("mqa_kernel", "flashinfer_sparse")]


def test_check_imports_neither_torch_nor_flashinfer():
    code = ("import sys\n"
            "from dsv4.checks.compat import Combination, check\n"
            "from dsv4.values.device import DeviceInfo\n"
            "from dsv4.strategies import FlashInferSparse\n"
            "k = FlashInferSparse()\n"
            "for arch in ('sm90', 'sm100', 'sm120'):\n"
            "    k.needs(DeviceInfo(platform='cuda', arch=arch))\n"
            "assert not {'torch', 'flashinfer'} & set(sys.modules), sorted(m for m in sys.modules if 'torch' in m)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]


# =====================================================================================================
# Optional: the real wheel's Python wrapper on these arguments (its checks, FLASHINFER_VALIDATE_INPUTS)
# =====================================================================================================
REAL_WRAPPER_PROBE = r"""
import importlib.abc, importlib.machinery, os, sys
from unittest import mock
os.environ["FLASHINFER_VALIDATE_INPUTS"] = "1"

class Mocked(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # the wheel's GPU-side dependencies, absent on a CPU box: mocks (never reached below)
    ROOTS = {"tvm_ffi", "pynvml", "tqdm"}
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        m = mock.MagicMock(name=spec.name); m.__path__ = []; m.__spec__ = spec; m.__name__ = spec.name
        return m
    def exec_module(self, module):
        pass

sys.meta_path.append(Mocked())
import torch
import flashinfer.mla._core as core
import tests.test_flashinfer_marshalling as T
from dsv4.values.device import DeviceInfo
from dsv4.strategies import FlashInferSparse

seen = {}
core.device_support_pdl = lambda dev: False
core.get_device_sm_count = lambda dev: 148
core._get_trtllm_gen_multi_ctas_kv_counter_buffer = lambda *a: torch.zeros(1, dtype=torch.int32)
class Launcher:
    def trtllm_paged_attention_decode_sparse_mla_dsv4(self, *args):
        seen["trtllm"] = args
core.get_trtllm_gen_fmha_module = lambda: Launcher()
def sm120(**kw):
    B, ql = kw["query"].shape[:2]
    core._normalize_sparse_mla_segments(sparse_mla_segments=kw["sparse_mla_segments"], batch_size=B,
                                        q_len_per_request=ql, device=kw["query"].device)
    seen["sm120"] = kw
    return kw["out"]
core._trtllm_batch_decode_sparse_mla_sm120 = sm120
for arch, lay in (("sm100", "bf16"), ("sm100", "fp8_per_tensor"), ("sm120", "fp8_ds_mla")):
    core._resolve_dsv4_sparse_mla_backend = lambda dev, arch=arch: "sparse" if arch == "sm120" else "trtllm-gen"
    for kind in ("swa", "c4a", "c128a", "messy"):
        layout = T.layout_of(lay, kv_scale=2.0, q_scale=0.25)
        kv = T.messy_case(layout, 9, seed=1) if kind == "messy" else T.layer_case(kind, layout, 9, seed=2)
        q, sink = T.make_q(kv.swa_indices.shape[0], 5, 8, seed=0)
        k = FlashInferSparse()
        seen.clear()
        k(q, kv, sink=sink, scale=T.SCALE, prepared=k.prepare(device=DeviceInfo(platform="cuda", arch=arch)))
        assert set(seen) == {"trtllm" if arch == "sm100" else "sm120"}, (arch, kind, set(seen))
        if arch == "sm100":
            out, qf, primary, swa, ws, ctr, idx, seq_lens, lens, b1, b2, batch, q_len = seen["trtllm"][:13]
            assert (batch, q_len, tuple(qf.shape)) == (q.shape[0], 1, tuple(q.shape)), (batch, q_len)
            assert primary.stride(-2) == swa.stride(-2) == 512
print("REAL WRAPPER OK")
"""


@pytest.mark.skipif(not os.environ.get("DSV4_FLASHINFER_SRC"),
                    reason="set DSV4_FLASHINFER_SRC to an unpacked flashinfer-python wheel to run its wrapper here")
def test_the_real_wrappers_checks_accept_the_arguments():
    """In a subprocess (flashinfer stays unimportable in this one): the wheel's own
    trtllm_batch_decode_sparse_mla_dsv4 with FLASHINFER_VALIDATE_INPUTS=1 up to the launch, which is recorded."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((os.environ["DSV4_FLASHINFER_SRC"], str(ROOT)))}
    r = subprocess.run([sys.executable, "-c", REAL_WRAPPER_PROBE], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0 and "REAL WRAPPER OK" in r.stdout, r.stderr[-3000:]
