"""The layer's Triton kernels against their torch specifications, on fresh random inputs built through the
real components (StepPlan.build on small page tables, Compressor, Indexer, the cache layouts):

- layer_front: q rows (bf16 and float32, heads padded or not), KV rows (strided, float32 product output,
  non-finite rows, faults), stored by the kernel itself into fp8_ds_mla / FNUZ / plain-row pages;
- compress: the state rows written (exactly) and the closed entries (ratios 4 and 128, head_dim 512 and
  128; rows from the step, from earlier steps' state pages and absent before position 0; NaN rows), and
  stored by the kernel itself as the layouts write them;
- cache_write: fp8_ds_mla records (OCP and FNUZ) byte for byte on pages of 1, 2, 3 and 64 rows, with
  zero rows, huge values, e4m3 ties and subnormals, skipped slots (untouched bytes stay); plain rows;
- indexer_logits: decode- and prefill-like groups, groups spanning two requests, padding, a visible
  entry without a page, several launch shapes; keys as FP4 and fp8 records; the front kernel's indexer
  queries and the compress kernel's FP4 keys (the published numerics), both compressors of a ratio-4
  layer in one launch; deepgemm_fp8's query kernel, and its scores through a fake of DeepGEMM's contract;
  the top-k lists, the page lookup of a selection made elsewhere and indexer.top_k=flashinfer through a
  fake of FlashInfer's contract (the real one on a GPU);
- every launcher with T = 0.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tiny shapes); on a GPU they are compiled (tests
marked gpu) and a decode-sized indexer case runs as well. The torch paths always run on CPU copies.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.triton_mode import BIG, DEVICE, MARK, OPS

from dsv4.components.compressor import Compressor
from dsv4.components.front import kv_rows, q_rows
from dsv4.components.indexer import Indexer
from dsv4.components.kv_pool import CompressorState
from dsv4.values.seam import PagedCache
from dsv4.components.plan import PageTable, StepPlan
from dsv4.components.rope import Rope
from dsv4.values.seam import RopeRows
from dsv4.kernels.front.cache_write import fp8_ds_mla_store, plain_rows_store, write_fp8_ds_mla_kernel, write_rows_kernel
from dsv4.kernels.front.compress import compress_kernel
from dsv4.kernels.indexer.indexer_logits import indexer_logits
from dsv4.kernels.front.layer_front import front_kernel, kv_rows_kernel, q_rows_kernel
from dsv4.oracle import rel_err
from dsv4.values.sizes import round_up
from dsv4.strategies import ExactIndexer, Fp8DsMlaFnuzLayout, Fp8DsMlaLayout, PlainRowLayout

pytestmark = MARK

EPS = 1e-6
HID = 16
ROPE = Rope(freqs=tuple(10000.0 ** (-2 * i / 64) for i in range(32)))


def gen(seed: int):
    return torch.Generator().manual_seed(seed)


def dev(x):
    """A copy on DEVICE (a copy on the CPU too: kernels write into some of their inputs)."""
    return x.to(DEVICE, copy=True)


def bits(x):
    """x's bit patterns (an integer view of its element size): equal only where every bit is, -0.0 too."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def rope_rows(T: int, g) -> RopeRows:
    ang = torch.rand(T, 32, generator=g, dtype=torch.float64) * 1000
    return RopeRows(cos=ang.cos().float(), sin=ang.sin().float())


def assert_bf16_close(out, ref):
    """Elementwise within one bf16 ulp of the reference and at least 99% equal."""
    o, r = out.cpu().float(), ref.float()
    ulp = torch.ldexp(torch.ones_like(r), torch.frexp(r).exponent - 8)          # 2^(e-8) for |r| in [2^(e-1), 2^e)
    assert bool(((o - r).abs() <= torch.where(r == 0, 0.0, ulp)).all())
    assert float((o == r).float().mean()) >= 0.99


def step_plan(spans, *, ratios=(4, 128), state_block=8, entry_block=2, pad=3, holes=(), seed=0, table_pages=1):
    """A StepPlan (on the CPU) of requests `spans` = [(first position, new tokens)], `pad` padding rows,
    each page group's table of distinct random pages, a multiple of `table_pages` wide; `holes` = [(ratio,
    request, logical page)] of state tables set to -1. Returns (plan, state pages per ratio as {ratio:
    num_blocks})."""
    g = gen(seed)
    B = len(spans)
    lens = torch.tensor([s + n for s, n in spans], dtype=torch.int32)
    qs = torch.tensor([0] + [n for _, n in spans], dtype=torch.int32).cumsum(0).int()
    longest = int(lens.max())

    def table(bs: int, rows: int) -> PageTable:
        P = round_up(max(1, -(-rows // bs)), table_pages)
        return PageTable(block_size=bs, pages=torch.randperm(B * P, generator=g).view(B, P).int())

    state = {r: table(state_block, longest) for r in ratios}
    for r, b, p in holes:
        state[r].pages[b, p] = -1
    entries = {r: table(entry_block, longest // r) for r in ratios}
    plan = StepPlan.build(query_start=qs, seq_lens=lens, swa=table(8, longest), window=16, state=state,
                          entries=entries, num_tokens=int(qs[-1]) + pad)
    return plan, {r: t.pages.numel() for r, t in state.items()}


def compressor(R: int, D: int, seed: int, dtype=None) -> Compressor:
    coff = 2 if R == 4 else 1
    g = gen(seed)
    return Compressor(wkv=torch.randn(coff * D, HID, generator=g) * HID ** -0.5,
                      wgate=torch.randn(coff * D, HID, generator=g) * 2 * HID ** -0.5,
                      ape=torch.randn(R, coff * D, generator=g) * 0.5, norm=1 + 0.1 * torch.randn(D, generator=g),
                      ratio=R, head_dim=D, eps=EPS, dtype=dtype)


def step_scores(comp: Compressor, T: int, g):
    """[T, 2·width] scores as the layer slices them: the compressor's columns of a wider projection."""
    x = torch.randn(T, HID, generator=g)
    return torch.cat((x @ comp.weights().T, torch.randn(T, 7, generator=g)), 1)[:, :2 * comp.width]


# ---- layer front ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,padded", [(5, 8), (4, 4)])
def test_q_rows(dtype, heads, padded):
    g = gen(heads * 10 + padded)
    T, D = 6, 512
    q = (torch.randn(T, heads, D, generator=g) * torch.rand(T, heads, 1, generator=g) * 5).to(dtype)
    rot = rope_rows(T, g)
    ref = q_rows(q, rot, padded_heads=padded, eps=EPS, dtype=dtype)
    out = q_rows_kernel(dev(q), dev(rot.cos), dev(rot.sin), padded_heads=padded, eps=EPS, dtype=dtype).cpu()
    assert out.dtype == dtype and out.shape == (T, padded, D)
    assert bool((out[:, heads:] == 0).all())
    if dtype == torch.float32:
        assert rel_err(out, ref) <= 1e-6
    else:
        assert_bf16_close(out, ref)


def test_q_rows_norm_rounds_as_the_published_code():
    """bf16 queries: q·rsqrt(mean(q²) + eps) with each step rounded to bf16, as the published code computes it
    on its bf16 tensor -- the squares, their mean, the sum with eps, the rsqrt (to the nearest) and the
    product --, then RoPE rounded once: our float64 chain of those steps, equal but for rare ties, and not
    the norm computed in float32 and rounded once."""
    g = gen(33)
    T, H, D = 6, 8, 512
    q = (torch.randn(T, H, D, generator=g) * torch.rand(T, H, 1, generator=g) * 5).bfloat16()
    rot = rope_rows(T, g)

    def bf(x):
        return x.to(torch.bfloat16).double()

    x = q.double()
    m = bf(bf(x * x).mean(-1, keepdim=True))
    r = bf(1 / torch.sqrt(bf(m + EPS)))
    y = bf(x * r)
    ev, od = y[..., -64::2].clone(), y[..., -63::2].clone()
    c, s_ = rot.cos.double()[:, None], rot.sin.double()[:, None]
    y[..., -64::2], y[..., -63::2] = ev * c - od * s_, od * c + ev * s_
    want = y.to(torch.bfloat16)
    got = q_rows(q, rot, padded_heads=H, eps=EPS, dtype=torch.bfloat16)
    same = float((got == want).float().mean())
    assert same >= 0.995, same
    once = RopeRows.rotate(rot, q.float() * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + EPS))
    assert float((got == once.bfloat16()).float().mean()) < same - 0.05     # the roundings change it


@pytest.mark.parametrize("dtype,wide", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)])
def test_kv_rows(dtype, wide):
    """Rows strided as the input projection's column slice -- in the activation dtype, or (`wide`) the
    float32 output of a compressed layer's one input product, rounded first --; rows with NaN or inf are
    refused: their slot -1, faults[0] set where the token has a slot, the other fault rows cleared."""
    g = gen(3)
    T, D = 7, 512
    kv = (torch.randn(T, D + 40, generator=g) * 3).to(torch.float32 if wide else dtype)[:, 40:]
    kv[2, 17] = float("nan")
    kv[5, 500] = float("inf")
    slots = torch.tensor([4, 9, 3, -1, 0, -1, 12], dtype=torch.int32)        # token 5: refused, no slot
    weight = 1 + 0.2 * torch.randn(D, generator=g)
    rot = rope_rows(T, g)
    ref_faults = torch.ones(3, T, dtype=torch.bool)
    ref, ref_store = kv_rows(kv, weight, rot, slots, ref_faults, eps=EPS, dtype=dtype)
    faults = dev(torch.ones(3, T, dtype=torch.bool))
    out, store = kv_rows_kernel(dev(kv), dev(weight), dev(rot.cos), dev(rot.sin), dev(slots), faults, eps=EPS,
                                dtype=dtype)
    out, store, faults = out.cpu(), store.cpu(), faults.cpu()
    assert out.dtype == torch.float32 and store.dtype == torch.int32
    assert torch.equal(store, ref_store) and store.tolist() == [4, 9, -1, -1, 0, -1, 12]
    assert torch.equal(faults, ref_faults) and faults[0].tolist() == [i == 2 for i in range(T)]
    assert not bool(faults[1:].any())
    ok = torch.tensor([i not in (2, 5) for i in range(T)])
    if dtype == torch.float32:
        assert rel_err(out[ok], ref[ok]) <= 1e-6
    else:
        # the NoPE dims are bf16 values; the RoPE dims float32 rotations of bf16 values (one bf16 ulp
        # where the rounding before the rotation differs)
        assert_bf16_close(out[ok, :448].bfloat16(), ref[ok, :448])
        assert rel_err(out[ok], ref[ok]) <= 1e-3


# ---- compressor -------------------------------------------------------------------------------------
# requests (first position, new tokens): entries closing with rows from this step, from earlier steps'
# state pages and (ratio 4, entry 0) absent rows before position 0
SPANS = {4: [(0, 9), (5, 3), (126, 4), (13, 12), (3, 1)], 128: [(0, 130), (126, 4), (100, 29)]}
CASES = [(4, 512), (4, 128), (128, 512)]


def compress_both(comp, scores, plan, state, R, fault_row: int = 1):
    """`Compressor.entries` (torch, on a copy of the state) and `compress_kernel` (on a device copy) ->
    (kernel's rows, store, faults, state; torch's rows, store, faults, state)."""
    rot = plan.rope_rows(ROPE, shift=R)
    T = plan.num_tokens
    ref_state = CompressorState(data=state.data.clone(), block_size=state.block_size, width=state.width)
    ref_faults = torch.ones(3, T, dtype=torch.bool)
    ref, ref_store = comp.entries(scores, plan, ref_state, rot, ref_faults, fault_row)
    data, faults = dev(state.data), dev(torch.ones(3, T, dtype=torch.bool))
    out, store = compress_kernel(dev(scores), dev(comp.ape), dev(comp.norm), dev(rot.cos), dev(rot.sin),
                                 dev(plan.positions), dev(plan.step_start), dev(plan.token_request),
                                 dev(plan.state[R].write_slots), dev(plan.entries[R].close_slots),
                                 dev(plan.state[R].table.pages), data, faults, fault_row, ratio=R, head_dim=comp.dim,
                                 state_block=state.block_size, eps=EPS, dtype=comp.dtype)
    return (out.cpu(), store.cpu(), faults.cpu(), data.cpu()), (ref, ref_store, ref_faults, ref_state.data)


@pytest.mark.parametrize("R,D", CASES)
def test_compress_writes_the_state_rows(R, D):
    """The rows a later step reads, exactly; nothing else of the state pages."""
    plan, blocks = step_plan(SPANS[R], seed=R + D)
    comp = compressor(R, D, seed=D)
    scores = step_scores(comp, plan.num_tokens, gen(1))
    state = CompressorState(data=torch.randn(blocks[R] * 8, 2 * comp.width, generator=gen(2)), block_size=8,
                            width=comp.width)
    (_, _, _, got), (_, _, _, want) = compress_both(comp, scores, plan, state, R)
    assert torch.equal(got, want)
    assert not torch.equal(state.data, want)


@pytest.mark.parametrize("R,D", CASES)
@pytest.mark.parametrize("fault_row,dtype", [(1, torch.float32), (2, torch.float32), (1, torch.bfloat16)])
def test_compress_closes_entries(R, D, fault_row, dtype):
    """The kernel's entries are the torch path's, with bf16 activations too (the pooled value and the
    norm's output rounded to bf16 by both)."""
    plan, blocks = step_plan(SPANS[R], seed=R * D)
    comp = compressor(R, D, seed=D + 1, dtype=dtype)
    scores = step_scores(comp, plan.num_tokens, gen(4))
    state = CompressorState(data=torch.randn(blocks[R] * 8, 2 * comp.width, generator=gen(5)) * 2, block_size=8,
                            width=comp.width)
    (out, store, faults, _), (ref, ref_store, ref_faults, _) = compress_both(comp, scores, plan, state, R, fault_row)
    closes = plan.entries[R].close_slots >= 0
    assert int(closes.sum()) >= 3
    assert torch.equal(store, ref_store) and torch.equal(store, plan.entries[R].close_slots)
    assert torch.equal(faults, ref_faults) and not bool(faults[fault_row].any())
    assert bool(faults[[r for r in range(3) if r != fault_row]].all())     # other layers' rows untouched
    assert bool((out[~closes] == 0).all())
    assert rel_err(out[closes], ref[closes]) <= 1e-6


@pytest.mark.parametrize("R,D", [(4, 128), (128, 512)])
def test_close_flags_entries_that_are_not_finite(R, D):
    """A NaN in one pooled row (of this step at ratio 4, of an earlier step's state at ratio 128) makes
    exactly the entries that pool it bad; the others are unchanged."""
    plan, blocks = step_plan(SPANS[R], seed=7)
    comp = compressor(R, D, seed=8)
    scores = step_scores(comp, plan.num_tokens, gen(9))
    state = CompressorState(data=torch.randn(blocks[R] * 8, 2 * comp.width, generator=gen(10)), block_size=8,
                      width=comp.width)
    if R == 4:      # request 3's position 17: its first half is pooled by the entry closing at 23 only
        t = int(plan.query_start[3]) + 17 - 13
        scores = scores.clone()
        scores[t, 3] = float("nan")
    else:           # request 1's position 50, read from the state pages by its entry closing at 127
        slot = int(plan.state[R].table.slots(torch.tensor([1]), torch.tensor([50], dtype=torch.int32)))
        state.data[slot, D + 9] = float("nan")
    (out, store, faults, _), (ref, ref_store, ref_faults, _) = compress_both(comp, scores, plan, state, R)
    bad = faults[1]
    assert int(bad.sum()) == 1 and torch.equal(faults, ref_faults) and torch.equal(store, ref_store)
    assert not bool(torch.isfinite(out[bad]).all())
    closes = plan.entries[R].close_slots >= 0
    assert torch.equal(store >= 0, closes & ~bad)
    good = closes & ~bad
    assert rel_err(out[good], ref[good]) <= 1e-6


def test_close_reads_state_row_0_for_a_missing_state_page():
    """A pooled position before the step whose state page is -1 reads state row 0, as the torch path's
    clamp(min=0) does (a plan never asks for it: the engine keeps the pages a later step reads)."""
    R, D = 4, 128
    plan, blocks = step_plan([(5, 3), (126, 4)], holes=[(4, 1, 15)], seed=11)       # positions 120..127
    comp = compressor(R, D, seed=12)
    scores = step_scores(comp, plan.num_tokens, gen(13))
    state = CompressorState(data=torch.randn(blocks[R] * 8, 2 * comp.width, generator=gen(14)), block_size=8,
                      width=comp.width)
    (out, store, faults, _), (ref, ref_store, ref_faults, _) = compress_both(comp, scores, plan, state, R)
    closes = plan.entries[R].close_slots >= 0
    assert int(closes.sum()) == 2 and torch.equal(faults, ref_faults) and torch.equal(store, ref_store)
    assert rel_err(out[closes], ref[closes]) <= 1e-6


# ---- cache writers ----------------------------------------------------------------------------------
def fp8_rows(N: int, g, dtype):
    """Rows whose 8 tiles of 64 dims span 2^-20..2^20, plus special rows: zeros, negative zeros, one huge
    value, e4m3 ties and subnormals at amax 448 (scale 1), amax 224 (amax/448 a power of two), amax below
    the 1e-4 floor, and values that are not bf16 (rounded to bf16 first)."""
    rows = torch.randn(N, 8, 64, generator=g) * 2.0 ** torch.randint(-20, 21, (N, 8, 1), generator=g)
    rows = rows.flatten(1)
    grid = torch.tensor([448.0, -448.0, 1.0, 1.0625, 1.1875, -1.1875, 240.0, 2.0 ** -9, 1.5 * 2.0 ** -9,
                         2.0 ** -10, -(2.0 ** -10), 0.75 * 2.0 ** -9, 2.0 ** -6, 15 / 16 * 2.0 ** -6, 3.0, 0.0,
                         -0.0, 416.0, 432.0, 2.5 * 2.0 ** -9, 3.5 * 2.0 ** -9, 1e-30, -1e-30])
    special = torch.zeros(8, 512)
    special[1] = -0.0
    special[2] = torch.randn(512, generator=g)
    special[2, 5] = 3e38
    special[3, :grid.numel()] = grid                                     # tile 0: amax 448, scale 1
    special[3, 64:64 + grid.numel()] = grid / 2                          # tile 1: amax 224
    special[3, 128:192] = torch.linspace(-5e-5, 5e-5, 64)                # tile 2: under the 1e-4 floor
    special[4] = torch.randn(512, generator=g) * 1e-3 + 1 / 3            # not bf16 values
    special[5] = 3.3e38 * torch.rand(512, generator=g).sign()
    special[6] = torch.randn(512, generator=g) * 2.0 ** torch.randint(-126, 127, (512,), generator=g)
    special[7] = torch.randn(512, generator=g).clamp(-4, 4) * 2.0 ** -100
    rows = torch.cat((special, rows))[:N]
    return rows.to(dtype)


FP8_LAYOUTS = {False: Fp8DsMlaLayout(), True: Fp8DsMlaFnuzLayout()}


@pytest.mark.parametrize("fnuz", [False, True], ids=["ocp", "fnuz"])
@pytest.mark.parametrize("bs,extra", [(1, 0), (2, 1), (3, 0), (64, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_ds_mla_writer_bytes(fnuz, bs, extra, dtype):
    """The bytes Fp8DsMlaLayout / Fp8DsMlaFnuzLayout write, on random pages; slots of -1 (rows with NaN
    and inf among them) write nothing; `extra` 576-byte blocks of page padding stay untouched."""
    lay = FP8_LAYOUTS[fnuz]
    g = gen(bs * 2 + fnuz)
    N = 24
    nb = -(-N // bs) + 1
    page_bytes = lay.page_bytes(bs, 512) + 576 * extra
    pages = torch.randint(0, 256, (nb, page_bytes), generator=g, dtype=torch.uint8)
    slots = torch.randperm(nb * bs, generator=g)[:N].int()
    slots[[9, 11, 15, 19, 23]] = -1
    rows = fp8_rows(N, g, dtype)
    rows[11] = float("nan")
    rows[15, 3] = float("inf")
    ref = pages.clone()
    lay.access(ref, block_size=bs, gpu=False).write(slots, rows)
    out = dev(pages)
    write_fp8_ds_mla_kernel(out, dev(slots), dev(rows), block_size=bs, fnuz=fnuz)
    out = out.cpu()
    assert torch.equal(out, ref), f"{int((out != ref).sum())} bytes differ"


@pytest.mark.parametrize("fnuz", [False, True], ids=["ocp", "fnuz"])
def test_fp8_ds_mla_writer_many_random_rows(fnuz):
    lay = FP8_LAYOUTS[fnuz]
    g = gen(20 + fnuz)
    bs, nb, N = 16, 8, 100
    pages = torch.randint(0, 256, (nb, lay.page_bytes(bs, 512)), generator=g, dtype=torch.uint8)
    slots = torch.randperm(nb * bs, generator=g)[:N].int()
    slots[::7] = -1
    rows = torch.randn(N, 512, generator=g) * torch.exp(torch.randn(N, 1, generator=g) * 3)
    ref = pages.clone()
    lay.access(ref, block_size=bs, gpu=False).write(slots, rows)
    out = dev(pages)
    write_fp8_ds_mla_kernel(out, dev(slots), dev(rows), block_size=bs, fnuz=fnuz)
    assert torch.equal(out.cpu(), ref)
    assert torch.equal(lay.read(ref, slots, block_size=bs), lay.read(out.cpu(), slots, block_size=bs))


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16])
def test_plain_row_writer(cache_dtype, row_dtype):
    lay = PlainRowLayout(name=cache_dtype, dtype=cache_dtype)
    g = gen(30)
    cache = lay.allocate(num_blocks=3, block_size=4, head_dim=96, device="cpu")
    cache.copy_(torch.randn(cache.shape, generator=g))
    slots = torch.tensor([3, -1, 0, 11, 5, -1], dtype=torch.int32)
    rows = torch.randn(6, 96, generator=g).to(row_dtype)
    rows[1] = float("nan")
    ref = cache.clone()
    lay.access(ref, block_size=4, gpu=False).write(slots, rows)
    out = dev(cache)
    write_rows_kernel(out, dev(slots), dev(rows))
    assert torch.equal(out.cpu(), ref)


# ---- the row-making kernels storing into a cache themselves (RowStore) ------------------------------
STORE_LAYOUTS = {"fp8_ds_mla": Fp8DsMlaLayout(), "fp8_ds_mla_fnuz": Fp8DsMlaFnuzLayout(),
                 "bf16": PlainRowLayout(name="bf16", dtype="bfloat16"),
                 "float32": PlainRowLayout(name="float32", dtype="float32")}


def row_store(name: str, pages, bs: int):
    if name.startswith("fp8"):
        return fp8_ds_mla_store(pages, bs, fnuz=name.endswith("fnuz"))
    return plain_rows_store(pages, bs)


def random_cache(lay, blocks: int, bs: int, dim: int, g):
    """Pages of random bytes (so untouched bytes show), in the layout's storage."""
    pages = lay.allocate(num_blocks=blocks, block_size=bs, head_dim=dim, device="cpu")
    if pages.dtype == torch.uint8:
        return torch.randint(0, 256, pages.shape, generator=g, dtype=torch.uint8)
    return torch.randn(pages.shape, generator=g).to(pages.dtype)


@pytest.mark.parametrize("layout", list(STORE_LAYOUTS))
def test_kv_rows_store_into_the_cache(layout):
    """kv_rows_kernel(into=...) leaves the same cache bytes and faults as its rows written by the layout:
    refused rows and tokens without a slot store nothing."""
    lay, g, T, D, bs = STORE_LAYOUTS[layout], gen(50), 9, 512, 4
    kv = (torch.randn(T, D + 8, generator=g) * 2).bfloat16()[:, 8:]
    kv[4, 100] = float("nan")
    slots = torch.tensor([5, 0, -1, 11, 7, 2, 9, -1, 3], dtype=torch.int32)
    weight = 1 + 0.2 * torch.randn(D, generator=g)
    rot = rope_rows(T, g)
    pages = random_cache(lay, 3, bs, D, g)
    want_faults = torch.ones(3, T, dtype=torch.bool)
    rows, store = kv_rows(kv, weight, rot, slots, want_faults, eps=EPS, dtype=torch.bfloat16)
    want = pages.clone()
    lay.access(want, block_size=bs, gpu=False).write(store, rows)
    got, faults = dev(pages), dev(torch.ones(3, T, dtype=torch.bool))
    assert kv_rows_kernel(dev(kv), dev(weight), dev(rot.cos), dev(rot.sin), dev(slots), faults, eps=EPS,
                          dtype=torch.bfloat16, into=row_store(layout, got, bs)) is None
    assert torch.equal(faults.cpu(), want_faults) and faults[0].cpu().tolist() == [i == 4 for i in range(T)]
    if layout.startswith("fp8"):
        assert torch.equal(got.cpu(), want), f"{int((got.cpu() != want).sum())} bytes differ"
    else:          # the rows are the same up to the RoPE dims' last float32 bit (the two paths' own roundings)
        assert torch.equal(got.cpu() == pages, want == pages)
        assert rel_err(got.cpu().float(), want.float()) <= 1e-6


@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16"])
def test_front_kernel_makes_query_and_kv_rows_in_one_launch(layout):
    """front_kernel's one grid gives what q_rows_kernel and kv_rows_kernel give apart (the KV rows stored
    into the cache by the kernel), padded heads and all."""
    lay, g, T, H, PH, D, bs = STORE_LAYOUTS[layout], gen(60), 5, 3, 4, 512, 4
    q = (torch.randn(T, H, D, generator=g) * 2).bfloat16()
    kv = (torch.randn(T, D, generator=g) * 2).float()              # a compressed layer's float32 product
    kv[1, 7] = float("inf")
    slots = torch.tensor([3, 8, -1, 0, 6], dtype=torch.int32)
    weight = 1 + 0.2 * torch.randn(D, generator=g)
    rot = rope_rows(T, g)
    pages = random_cache(lay, 3, bs, D, g)
    args = (dev(rot.cos), dev(rot.sin))
    want_q = q_rows_kernel(dev(q), *args, padded_heads=PH, eps=EPS, dtype=torch.bfloat16)
    want_pages, want_faults = dev(pages), dev(torch.ones(3, T, dtype=torch.bool))
    kv_rows_kernel(dev(kv), dev(weight), *args, dev(slots), want_faults, eps=EPS, dtype=torch.bfloat16,
                   into=row_store(layout, want_pages, bs))
    got_pages, faults = dev(pages), dev(torch.ones(3, T, dtype=torch.bool))
    got_q, rows, _ = front_kernel(dev(q), dev(kv), dev(weight), *args, dev(slots), faults, padded_heads=PH, eps=EPS,
                               dtype=torch.bfloat16, into=row_store(layout, got_pages, bs))
    assert rows is None and got_q.shape == (T, PH, D)
    assert torch.equal(got_q.cpu(), want_q.cpu()) and bool((got_q[:, H:] == 0).all())
    assert torch.equal(got_pages.cpu(), want_pages.cpu()) and not torch.equal(got_pages.cpu(), pages)
    assert torch.equal(faults.cpu(), want_faults.cpu()) and faults[0].cpu().tolist() == [i == 1 for i in range(T)]


@pytest.mark.parametrize("iq_dtype", [torch.bfloat16, torch.float32])
def test_front_kernel_rotates_the_indexer_queries_in_the_same_launch(iq_dtype):
    """With the indexer's queries as a third part, front_kernel gives what rotate_rows_kernel gives for them
    and, for the query and KV rows, what it gives without them."""
    from dsv4.kernels.front.layer_front import rotate_rows_kernel

    g, T, H, D, Hi, Di, bs = gen(61), 5, 3, 512, 6, 128, 4
    q = (torch.randn(T, H, D, generator=g) * 2).bfloat16()
    kv = (torch.randn(T, D, generator=g) * 2).bfloat16()
    iq = torch.randn(T, Hi, Di, generator=g) * 3
    slots = torch.tensor([3, 8, -1, 0, 6], dtype=torch.int32)
    weight = 1 + 0.2 * torch.randn(D, generator=g)
    rot = rope_rows(T, g)
    pages = random_cache(STORE_LAYOUTS["fp8_ds_mla"], 3, bs, D, g)
    args = (dev(rot.cos), dev(rot.sin))
    results = []
    for with_iq in (False, True):
        got_pages, faults = dev(pages), dev(torch.ones(3, T, dtype=torch.bool))
        results.append((*front_kernel(dev(q), dev(kv), dev(weight), *args, dev(slots), faults, padded_heads=4, eps=EPS,
                                      dtype=torch.bfloat16, into=row_store("fp8_ds_mla", got_pages, bs),
                                      iq=dev(iq) if with_iq else None, iq_dtype=iq_dtype), got_pages, faults))
    (q0, _, none, pages0, faults0), (q1, _, got_iq, pages1, faults1) = results
    assert none is None and got_iq.dtype == iq_dtype and got_iq.shape == (T, Hi, Di)
    assert torch.equal(got_iq.cpu(), rotate_rows_kernel(dev(iq), *args, dtype=iq_dtype).cpu())
    assert rel_err(got_iq.cpu().float(), rot.rotate(iq)) <= (1e-6 if iq_dtype == torch.float32 else 4e-3)
    assert torch.equal(q0.cpu(), q1.cpu()) and torch.equal(pages0.cpu(), pages1.cpu())
    assert torch.equal(faults0.cpu(), faults1.cpu())
    # the queries as column blocks of one wider product (the layer's one qr product): read in place, the same rows
    def column_block(x):
        wide = torch.cat((x.flatten(1), torch.randn(T, 7, generator=g).to(x.dtype)), 1)
        return dev(wide)[:, :x[0].numel()].view(x.shape)
    q2, _, iq2 = front_kernel(column_block(q), dev(kv), dev(weight), *args, dev(slots), dev(faults0.new_ones(3, T)),
                              padded_heads=4, eps=EPS, dtype=torch.bfloat16, iq=column_block(iq), iq_dtype=iq_dtype,
                              into=row_store("fp8_ds_mla", dev(pages), bs))
    assert torch.equal(q2.cpu(), q1.cpu()) and torch.equal(iq2.cpu(), got_iq.cpu())


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "a NaN entry"])
@pytest.mark.parametrize("keys", ["mxfp4", "fp8", "bf16", "float32"])
def test_compress_kernel_stores_fp4_keys(keys, nan):
    """The indexer's compressor with the published FP4 numerics in the kernel (fp4=True): the cache holds
    exactly what the torch path stores -- its entries, rotated and FP4-simulated by the strategy, written by
    the layout (mxfp4 or fp8 records byte for byte, or bf16 / float32 rows) --, with the same state rows and faults;
    an entry that is not finite is refused and flagged before the numerics, as there."""
    from dsv4.kernels.front.cache_write import fp4_record_store, fp8_key_store
    from dsv4.kernels.front.compress import CompressJob, compress_kernels
    from dsv4.formats.indexer_numerics import IndexerNumerics
    from dsv4.strategies import Fp8KeyLayout, Mxfp4KeyLayout

    R, D = 4, 128
    plan, blocks = step_plan(SPANS[R], seed=81)
    bs, T = plan.entries[R].table.block_size, plan.num_tokens
    comp = compressor(R, D, seed=82)
    scores = step_scores(comp, T, gen(83))
    closing = int((plan.entries[R].close_slots >= 0).nonzero()[0])
    if nan:
        scores[closing, D + 5] = float("nan")             # its own candidate, which the entry it closes pools
    state = torch.randn(blocks[R] * 8, 2 * comp.width, generator=gen(84))
    lay = {"mxfp4": Mxfp4KeyLayout(head_dim=D), "fp8": Fp8KeyLayout(head_dim=D)}.get(keys) or STORE_LAYOUTS[keys]
    pages = random_cache(lay, plan.entries[R].table.pages.numel(), bs, D, gen(85))
    rot = plan.rope_rows(ROPE, shift=R)
    # the torch path: entries, the strategy's keys, the layout's write
    ref_state = CompressorState(data=state.clone(), block_size=8, width=comp.width)
    ref_faults = torch.ones(3, T, dtype=torch.bool)
    rows, store = comp.entries(scores, plan, ref_state, rot, ref_faults, 2)
    want = pages.clone()
    lay.access(want, block_size=bs, gpu=False).write(store, IndexerNumerics.FP4.apply(rows))
    got, faults, got_state = dev(pages), dev(torch.ones(3, T, dtype=torch.bool)), dev(state)
    into = {"mxfp4": fp4_record_store, "fp8": fp8_key_store}[keys](got, bs, D) if keys in ("mxfp4", "fp8") \
        else row_store(keys, got, bs)
    job = CompressJob(scores=dev(scores), ape=dev(comp.ape), norm=dev(comp.norm), state=got_state, head_dim=D,
                      fault_row=2, into=into, fp4=True)
    compress_kernels([job], dev(rot.cos), dev(rot.sin), dev(plan.positions), dev(plan.step_start),
                     dev(plan.token_request), dev(plan.state[R].write_slots), dev(plan.entries[R].close_slots),
                     dev(plan.state[R].table.pages), faults, ratio=R, state_block=8, eps=EPS)
    assert int((store >= 0).sum()) >= 3 and bool(ref_faults[2, closing]) == nan
    assert torch.equal(bits(got.cpu()), bits(want)) and not torch.equal(want, pages)     # -0.0 too
    assert torch.equal(faults[2].cpu(), ref_faults[2])
    assert torch.equal(got_state.cpu().view(torch.int32), ref_state.data.view(torch.int32))   # NaN rows too


def test_an_fp4_record_store_takes_fp4_rows_only():
    from dsv4.kernels.front.cache_write import fp4_record_store

    with pytest.raises(ValueError, match="FP4-simulated rows only"):
        kv_rows_kernel(dev(torch.zeros(2, 128)), dev(torch.ones(128)), dev(torch.zeros(2, 32)), dev(torch.zeros(2, 32)),
                       dev(torch.zeros(2, dtype=torch.int32)), dev(torch.zeros(3, 2, dtype=torch.bool)), eps=EPS,
                       dtype=torch.float32, into=fp4_record_store(dev(torch.zeros(2, 4 * 68, dtype=torch.uint8)), 4,
                                                                  128))


@pytest.mark.parametrize("iq_dtype,iq_in", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
def test_front_kernel_makes_fp4_indexer_queries(iq_dtype, iq_in):
    """iq_fp4: the indexer's query heads (the projection's output in float32, or in bf16 as a bf16 layer
    makes it) rotated by RoPE, then by the Hadamard transform and FP4-simulated in the kernel: what the
    torch path (rotate_rows, then fp4_sim's queries) gives -- also for heads holding a NaN or an infinity
    (NaN where torch has NaN, the same values elsewhere)."""
    from dsv4.formats.indexer_numerics import IndexerNumerics

    g, T, Hi, Di = gen(86), 5, 6, 128
    iq = torch.randn(T, Hi, Di, generator=g) * torch.exp(torch.randn(T, Hi, 1, generator=g) * 3)
    iq[1, 2, 7], iq[3, 0, 100], iq[4, 5, 64] = float("nan"), float("inf"), -float("inf")
    iq = iq.to(iq_in)
    rot = rope_rows(T, g)
    _, _, got = front_kernel(None, None, None, dev(rot.cos), dev(rot.sin), None, None, padded_heads=0, eps=EPS,
                             dtype=torch.bfloat16, iq=dev(iq), iq_dtype=iq_dtype, iq_fp4=True)
    rot_dev = RopeRows(cos=dev(rot.cos), sin=dev(rot.sin))
    want = IndexerNumerics.FP4.apply(OPS.rotate_rows(dev(iq), rot_dev)).to(iq_dtype)
    got, want = got.cpu(), want.cpu()
    assert got.dtype == iq_dtype and torch.equal(torch.isnan(got), torch.isnan(want))
    assert bool(torch.isnan(want[1, 2]).any()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(torch.signbit(got).masked_fill(torch.isnan(got), False),
                       torch.signbit(want).masked_fill(torch.isnan(want), False))          # -0.0 too


def test_two_compressors_in_one_launch_as_in_two():
    """A ratio-4 layer's compressor (head_dim 512, fp8_ds_mla entries) and its indexer's (128, plain keys)
    in one compress launch: the same state rows, stored entries and faults as each in its own launch."""
    from dsv4.kernels.front.compress import CompressJob, compress_kernels

    R = 4
    plan, blocks = step_plan(SPANS[R], seed=71)
    bs, T = plan.entries[R].table.block_size, plan.num_tokens
    comps = [compressor(R, 512, seed=72), compressor(R, 128, seed=73)]
    scores = [step_scores(c, T, gen(74 + i)) for i, c in enumerate(comps)]
    states = [torch.randn(blocks[R] * 8, 2 * c.width, generator=gen(76 + i)) for i, c in enumerate(comps)]
    layouts = ["fp8_ds_mla", "bf16"]
    caches = [random_cache(STORE_LAYOUTS[lay], plan.entries[R].table.pages.numel(), bs, c.dim, gen(78 + i))
              for i, (lay, c) in enumerate(zip(layouts, comps))]
    rot = plan.rope_rows(ROPE, shift=R)
    shared = (dev(rot.cos), dev(rot.sin), dev(plan.positions), dev(plan.step_start), dev(plan.token_request),
              dev(plan.state[R].write_slots), dev(plan.entries[R].close_slots), dev(plan.state[R].table.pages))

    def run(groups):
        st, pg = [dev(x) for x in states], [dev(x) for x in caches]
        faults = dev(torch.ones(3, T, dtype=torch.bool))
        jobs = [CompressJob(scores=dev(scores[i]), ape=dev(c.ape), norm=dev(c.norm), state=st[i], head_dim=c.dim,
                            fault_row=1 + i, into=row_store(layouts[i], pg[i], bs)) for i, c in enumerate(comps)]
        for group in groups:
            out = compress_kernels([jobs[i] for i in group], *shared, faults, ratio=R, state_block=8, eps=EPS)
            assert out == [None] * len(group)
        return [x.cpu() for x in (*st, *pg, faults[1:])]

    together, apart = run([(0, 1)]), run([(0,), (1,)])
    assert all(torch.equal(a, b) for a, b in zip(together, apart))
    assert not torch.equal(together[2], caches[0]) and not torch.equal(together[3], caches[1])


@pytest.mark.parametrize("R,D,layout", [(4, 512, "fp8_ds_mla"), (4, 128, "bf16"), (128, 512, "fp8_ds_mla_fnuz"),
                                        (4, 128, "float32")])
def test_compress_stores_into_the_cache(R, D, layout):
    """compress_kernel(into=...) stores exactly the closed entries, as their rows written by the layout."""
    plan, blocks = step_plan(SPANS[R], seed=R + 3 * D)
    comp = compressor(R, D, seed=D + 2)
    scores = step_scores(comp, plan.num_tokens, gen(51))
    state = CompressorState(data=torch.randn(blocks[R] * 8, 2 * comp.width, generator=gen(52)), block_size=8,
                            width=comp.width)
    lay, bs = STORE_LAYOUTS[layout], plan.entries[R].table.block_size
    pages = random_cache(lay, plan.entries[R].table.pages.numel(), bs, D, gen(53))
    (rows, store, faults, data), _ = compress_both(comp, scores, plan, state, R)
    want = pages.clone()
    lay.access(want, block_size=bs, gpu=False).write(store, rows)
    rot = plan.rope_rows(ROPE, shift=R)
    got, got_faults, got_state = dev(pages), dev(torch.ones(3, plan.num_tokens, dtype=torch.bool)), dev(state.data)
    compress_kernel(dev(scores), dev(comp.ape), dev(comp.norm), dev(rot.cos), dev(rot.sin), dev(plan.positions),
                    dev(plan.step_start), dev(plan.token_request), dev(plan.state[R].write_slots),
                    dev(plan.entries[R].close_slots), dev(plan.state[R].table.pages), got_state, got_faults, 1,
                    ratio=R, head_dim=D, state_block=8, eps=EPS, into=row_store(layout, got, bs))
    assert int((store >= 0).sum()) >= 3
    assert torch.equal(got_faults.cpu(), faults) and torch.equal(got_state.cpu(), data)
    assert torch.equal(got.cpu(), want)


def test_a_store_of_the_wrong_width_is_refused():
    cs = dev(torch.zeros(2, 32))
    plain = plain_rows_store(dev(torch.zeros(2, 4, 128)), 4)
    with pytest.raises(ValueError, match="cannot store rows of 512"):
        kv_rows_kernel(dev(torch.zeros(2, 512)), dev(torch.ones(512)), cs, cs, dev(torch.zeros(2, dtype=torch.int32)),
                       dev(torch.zeros(3, 2, dtype=torch.bool)), eps=EPS, dtype=torch.float32, into=plain)


# ---- indexer ----------------------------------------------------------------------------------------
def indexer_case(spans, heads: int, dim: int, *, bs: int = 4, holes=(), pad: int = 3, seed: int = 0,
                 dtype: str = "float32"):
    """q, w, the keys' PagedCache (rows in `dtype`), the plan and the Indexer for requests `spans`; `holes` =
    [(request, logical page)] of the entries table set to -1."""
    g = gen(seed)
    plan, _ = step_plan(spans, ratios=(4,), entry_block=bs, pad=pad, seed=seed)
    table = plan.entries[4].table
    for b, p in holes:
        table.pages[b, p] = -1
    lay = PlainRowLayout(name=dtype, dtype=dtype)
    nb = table.pages.numel()
    keys = PagedCache(name="indexer_keys", layout=lay, data=(torch.randn(nb, bs, dim, generator=g) / 4).to(
        getattr(torch, dtype)), block_size=bs, head_dim=dim)
    T = plan.num_tokens
    q = torch.randn(T, heads, dim, generator=g)
    w = torch.randn(T, heads, generator=g) * (dim * heads) ** -0.5
    idx = Indexer(wq_b=torch.zeros(1), weights_proj=torch.zeros(1), compressor=None, n_heads=heads, head_dim=dim,
                  topk=16, strategy=ExactIndexer())
    return q, w, keys, plan, idx


def run_indexer(q, w, keys, plan, idx, **launch):
    dkeys = PagedCache(name=keys.name, layout=keys.layout, data=dev(keys.data), block_size=keys.block_size,
                       head_dim=keys.head_dim)
    ents = plan.entries[4]
    return indexer_logits(dev(q), dev(w), dkeys, dev(ents.table.pages), dev(plan.token_request), dev(ents.counts),
                          width=ents.width, w_scale=idx.weight_scale, **launch).cpu()


def assert_scores(out, ref, tol=1e-6):
    fin = torch.isfinite(ref)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert torch.equal(fin, torch.isfinite(out)) and bool((out[~fin] == float("-inf")).all())
    assert rel_err(out[fin], ref[fin]) <= tol


# decode pairs, a one-token request (groups that span two requests), a prefill chunk, padding
INDEXER_SPANS = [(40, 2), (77, 1), (13, 12), (200, 2), (3, 1), (90, 2)]
LAUNCHES = [dict(block_n=16, blocks_per_program=2), dict(),
            dict(block_n=32, blocks_per_program=3, num_warps=4, stages=2)]


@pytest.mark.parametrize("heads,dim", [(8, 128), (5, 64)])
@pytest.mark.parametrize("launch", LAUNCHES, ids=["bn16x2", "planned", "bn32x3s2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_indexer_logits(heads, dim, launch, dtype):
    """float32 keys: float32-exact scores; bf16 keys: the queries rounded to bf16 in both paths, so only
    the order of the float32 sums differs."""
    q, w, keys, plan, idx = indexer_case(INDEXER_SPANS, heads, dim, holes=[(2, 1)], seed=heads + dim, dtype=dtype)
    ref = idx.scores(q, w, keys, plan)
    out = run_indexer(q, w, keys, plan, idx, **launch)
    assert_scores(out, ref)
    assert bool((ref[int(plan.query_start[2]) + 11, 4:6] == 0).all())    # visible entries without a page: 0
    assert bool(torch.isinf(out[plan.num_tokens - 3:]).all())             # padding rows see nothing


def record_twin(keys, record: str = "mxfp4"):
    """The same keys as records (Mxfp4KeyLayout's FP4 or Fp8KeyLayout's fp8 pages) and as bf16 rows of the
    values they hold."""
    from dsv4.strategies import Fp8KeyLayout, Mxfp4KeyLayout

    bs, dim = keys.block_size, keys.head_dim
    lay = (Mxfp4KeyLayout if record == "mxfp4" else Fp8KeyLayout)(head_dim=dim)
    pages = lay.allocate(num_blocks=keys.data.shape[0], block_size=bs, head_dim=dim, device="cpu")
    slots = torch.arange(keys.num_slots)
    lay.access(pages, block_size=bs, gpu=False).write(slots, keys.read(slots))
    rec = PagedCache(name="indexer_keys", layout=lay, data=pages, block_size=bs, head_dim=dim)
    rows = PagedCache(name="indexer_keys", layout=PlainRowLayout(name="bf16", dtype="bfloat16"),
                      data=lay.read(pages, slots, block_size=bs).bfloat16().view(-1, bs, dim), block_size=bs,
                      head_dim=dim)
    return rec, rows


@pytest.mark.parametrize("record", ["mxfp4", "fp8"])
@pytest.mark.parametrize("launch", LAUNCHES[:2], ids=["bn16x2", "planned"])
def test_indexer_logits_reads_key_records(launch, record):
    """Keys as 68-byte FP4 or 132-byte fp8 records: the kernel decodes them to the bf16 values they hold
    (fp8 records of keys that are not FP4-simulated: e4m3 values, exact in bf16), so at the planned
    launch its scores equal its scores of bf16 rows of those values bit for bit (at another launch shape on
    a GPU the tensor cores may sum the same exact products in another order: equal within float32
    rounding), and the torch path's."""
    q, w, keys, plan, idx = indexer_case(INDEXER_SPANS, 8, 128, holes=[(2, 1)], seed=17)
    rec, rows = record_twin(keys, record)
    out = run_indexer(q, w, rec, plan, idx, **launch)
    as_rows = run_indexer(q, w, rows, plan, idx, **launch)
    if launch:
        assert_scores(out, as_rows)
    else:
        assert torch.equal(out, as_rows)
    of_records = idx.scores(q, w, rec, plan)
    assert_scores(out, of_records)
    assert torch.equal(of_records, idx.scores(q, w, rows, plan))


def e4m3_case(seed: int, holes=((2, 1),)):
    """indexer_case's step with FP4-simulated queries and keys (fp4_sim's values: exact in e4m3 over each
    head's or key's power-of-two scale), the queries also in e4m3 with their scales in the head weights."""
    from dsv4.formats.indexer_numerics import IndexerNumerics
    from dsv4.strategies.indexer.key_layouts import fp8_queries

    q, w, keys, plan, idx = indexer_case(INDEXER_SPANS, 8, 128, holes=holes, seed=seed)
    fp4 = IndexerNumerics.FP4
    q = fp4.apply(q)
    keys.data.copy_(fp4.apply(keys.data.flatten(0, 1)).view(keys.data.shape))
    q8, wq = fp8_queries(q, w, 1.0)                # the kernel applies w_scale
    return q, w, q8.squeeze(1), wq, keys, plan, idx


@pytest.mark.parametrize("launch", LAUNCHES[:2], ids=["bn16x2", "planned"])
def test_indexer_logits_e4m3_queries_on_fp8_records(launch):
    """e4m3 queries (each head over its power-of-two scale, the scale in the head weight) against fp8
    records, as indexer=triton_fp8 scores them -- an e4m3 product on sm89+, the decoded values elsewhere
    (here, interpreted): for FP4-simulated values both operands are exact and so are the products, so
    the scores equal those of the bf16 queries against bf16 rows of the same keys (bit for bit at the
    planned launch) and the torch path's."""
    q, w, q8, wq, keys, plan, idx = e4m3_case(23)
    rec, rows = record_twin(keys, "fp8")
    out = run_indexer(q8, wq, rec, plan, idx)
    launch_out = run_indexer(q8, wq, rec, plan, idx, **launch) if launch else out
    ref = run_indexer(q, w, rows, plan, idx, **launch)
    assert torch.equal(out, run_indexer(q, w, rows, plan, idx))
    assert_scores(launch_out, ref)
    assert_scores(out, idx.scores(q, w, rows, plan))


def fake_deep_gemm_logits(calls: list):
    """A `deep_gemm` module whose paged-logits calls keep the contract of its 0.1.5 wheel as our adapter uses
    it: the schedule from the lengths, then per token t (a batch row, next_n = 1) and visible entry j <
    context_lens[t], through block_table[t, j // B], sum_h weights[t, h] * ReLU(q[t, 0, h] . k_j), k_j the
    page's e4m3 row j % B times its float32 scale (a page: B x D e4m3 bytes, then B scales); rows returned
    padded past max_context_len (NaN there and past each length), as a column slice."""
    import types

    def get_paged_mqa_logits_metadata(lens, block_size, num_sms):
        assert lens.dtype == torch.int32 and lens.dim() == 2 and lens.shape[1] == 1 and num_sms == 132
        calls.append(("schedule", block_size))
        return ("schedule", lens.clone())

    def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                             clean_logits=False, indices=None):
        T, next_n, H, D = q.shape
        nb, B = kv_cache.shape[:2]
        assert q.dtype == torch.float8_e4m3fn and next_n == 1 and kv_cache.dtype == torch.uint8
        assert kv_cache.shape[2:] == (1, D + 4) and weights.shape == (T, H) and weights.dtype == torch.float32
        assert context_lens.shape == (T, 1) and block_table.dtype == context_lens.dtype == torch.int32
        assert schedule_meta[0] == "schedule" and torch.equal(schedule_meta[1], context_lens) and not clean_logits
        assert bool((context_lens >= 1).all()) and bool((block_table >= 0).all()) and int(block_table.max()) < nb
        calls.append(("logits", max_context_len))
        flat = kv_cache.reshape(nb, -1)
        vals = flat[:, :B * D].contiguous().view(torch.float8_e4m3fn).float().view(nb, B, D)
        scales = flat[:, B * D:B * (D + 4)].contiguous().view(torch.float32)
        keys = (vals * scales[..., None]).view(nb * B, D)
        out = torch.full((T, max_context_len + 64), float("nan"))
        for t in range(T):
            n = int(context_lens[t, 0])
            j = torch.arange(n)
            k = keys[block_table[t, j // B].long() * B + j % B]
            out[t, :n] = (torch.einsum("hd,nd->hn", q[t, 0].float(), k).relu() * weights[t, :, None]).sum(0)
        return out[:, :max_context_len]

    mod = types.ModuleType("deep_gemm")
    mod.get_num_sms = lambda: 132
    mod.get_paged_mqa_logits_metadata = get_paged_mqa_logits_metadata
    mod.fp8_paged_mqa_logits = fp8_paged_mqa_logits
    return mod


def test_deepgemm_fp8_scores_through_its_contract(monkeypatch):
    """indexer=deepgemm_fp8's marshalling on the CPU, through a fake of DeepGEMM's paged-logits contract:
    the step's plan (every token its own batch row; a row that sees nothing is given one entry), the fp8
    records' pages as DeepGEMM reads them, the e4m3 queries and folded weights -> the scores of every
    visible entry equal our kernel's of the same queries and records (exact products, float32 sums)."""
    from dsv4.strategies import DeepGemmFp8Indexer

    calls: list = []
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm_logits(calls))
    _q, _w, q8, wq, keys, plan, idx = e4m3_case(31, holes=())
    rec, _ = record_twin(keys, "fp8")
    ents = plan.entries[4]
    ix = DeepGemmFp8Indexer()
    ip = ix.plan(token_request=plan.token_request, counts=ents.counts, pages=ents.table.pages,
                 block_size=ents.table.block_size)
    # e4m3 queries come as the layer's front kernel makes them: their weights carry the weight scale
    got = ix.scores(q8.unsqueeze(1), wq * idx.weight_scale, rec, ents.table.pages, plan.token_request, ents.counts,
                    width=ents.width, w_scale=idx.weight_scale, plan=ip)
    assert calls == [("schedule", ents.table.block_size), ("logits", ents.width)]
    want = run_indexer(q8, wq, rec, plan, idx)
    vis = torch.arange(ents.width)[None] < ents.counts[:, None]
    assert got.shape[0] == plan.num_tokens and got.shape[1] >= ents.width and bool(vis.any())
    assert rel_err(got[:, :ents.width][vis], want[vis]) <= 1e-6
    assert bool((ents.counts == 0).any()) and torch.equal(ip.lens.view(-1), ents.counts.clamp(min=1))


def test_indexer_logits_refuses_e4m3_queries_without_fp8_records():
    _q, _w, q8, wq, keys, plan, idx = e4m3_case(24)
    for other in (keys, record_twin(keys, "mxfp4")[0]):
        with pytest.raises(ValueError, match="e4m3 queries are scored against fp8 records"):
            run_indexer(q8, wq, other, plan, idx)


def test_indexer_scoring_is_planned_by_the_target_its_strategy_prepared():
    """The device is an input: an indexer option scored by our kernel resolves the device's facts once in
    prepare(), and its calls plan by that value (here one that says sm90: the pipelined launch), not by
    asking the GPU or the environment again; the same scores either way."""
    from dataclasses import replace

    from dsv4.values.device import DeviceInfo
    from dsv4.kernels.launch import observe
    from dsv4.kernels.target import device_arch, target_of
    from dsv4.strategies import ExactIndexer

    dev_ = torch.device(DEVICE)
    here = ExactIndexer().prepare(head_dim=64, device=DeviceInfo(platform="cpu") if dev_.type == "cpu" else
                                  DeviceInfo(platform="cuda", arch=device_arch(dev_)))
    assert here == (None if dev_.type == "cpu" else target_of(dev_))
    here = here or target_of(dev_)
    q, w, keys, plan, idx = indexer_case(INDEXER_SPANS, 8, 64, seed=3)
    stages = []
    with observe(lambda kernel, args, meta: stages.append(meta["STAGES"])):
        want = run_indexer(q, w, keys, plan, idx, target=here)
        got = run_indexer(q, w, keys, plan, idx, target=replace(here, arch="sm90"))
        other = run_indexer(q, w, keys, plan, idx, target=replace(here, arch="sm80"))
    assert stages[1] > 1 and stages[2] == 1 and stages[0] == (stages[1] if here.arch == "sm90" else 1)
    assert torch.equal(got, want) and torch.equal(other, want)


def test_triton_fp8_prepares_the_target_its_product_plans_by():
    from dsv4.values.device import DeviceInfo
    from dsv4.strategies import TritonFp8OProj
    from dsv4.strategies.protocols import OProjWeights

    g = gen(5)
    w = OProjWeights(wo_a=torch.randn(256, 256, generator=g), groups=2)
    assert TritonFp8OProj().prepare(w, device=DeviceInfo(platform="cpu"), dtype="bfloat16").target is None


@pytest.mark.skipif(not BIG, reason="decode-sized: GPU only")
def test_indexer_logits_decode_sized():
    """64 requests x 2 tokens, 64 heads of 128 dims, ~1000-2000 visible entries of 4096: the same scores as
    the torch path (tf32x3 products for float32 keys, bf16 products for bf16 ones)."""
    g = gen(40)
    starts = torch.randint(4000, 8000, (64,), generator=g).tolist()
    for dtype in ("float32", "bfloat16"):
        q, w, keys, plan, idx = indexer_case([(s, 2) for s in starts], 64, 128, bs=64, pad=0, seed=41, dtype=dtype)
        ref = idx.scores(q, w, keys, plan)
        assert_scores(run_indexer(q, w, keys, plan, idx), ref, tol=2e-6)
    for record in ("mxfp4", "fp8"):                                # records: as bf16 rows of their values
        rec, rows = record_twin(keys, record)
        assert torch.equal(run_indexer(q, w, rec, plan, idx), run_indexer(q, w, rows, plan, idx))
    # FP4-simulated values, e4m3 queries against fp8 records (the tensor cores' e4m3 product on sm89+)
    from dsv4.formats.indexer_numerics import IndexerNumerics
    from dsv4.strategies.indexer.key_layouts import fp8_queries

    fp4 = IndexerNumerics.FP4
    q = fp4.apply(q)
    keys.data.copy_(fp4.apply(keys.data.flatten(0, 1).float()).view(keys.data.shape))
    rec, rows = record_twin(keys, "fp8")
    q8, wq = fp8_queries(q, w, 1.0)                # the kernel applies w_scale
    assert torch.equal(run_indexer(q8.squeeze(1), wq, rec, plan, idx), run_indexer(q, w, rows, plan, idx))


# ---- empty steps ------------------------------------------------------------------------------------
def test_empty_steps():
    z = torch.zeros
    cs = dev(z(0, 32))
    assert q_rows_kernel(dev(z(0, 3, 512)), cs, cs, padded_heads=4, eps=EPS, dtype=torch.bfloat16).shape == (0, 4, 512)
    faults = dev(z(3, 0, dtype=torch.bool))
    i32, i64 = dev(z(0, dtype=torch.int32)), dev(z(0, dtype=torch.int64))
    rows, store = kv_rows_kernel(dev(z(0, 512)), dev(z(512)), cs, cs, i32, faults, eps=EPS, dtype=torch.float32)
    assert rows.shape == (0, 512) and store.shape == (0,)
    state = dev(z(8, 2048))
    rows, store = compress_kernel(dev(z(0, 2048)), dev(z(4, 1024)), dev(z(512)), cs, cs, i32, i32, i64, i32, i32,
                                  dev(z(1, 2, dtype=torch.int32)), state, faults, 1, ratio=4, head_dim=512,
                                  state_block=8, eps=EPS)
    assert rows.shape == (0, 512) and store.shape == (0,)
    write_fp8_ds_mla_kernel(dev(z(2, 576 * 2, dtype=torch.uint8)), i32, dev(z(0, 512)), block_size=1)
    write_rows_kernel(dev(z(2, 4, 96)), i32, dev(z(0, 96)))
    keys = PagedCache(name="k", layout=PlainRowLayout(name="float32", dtype="float32"), data=dev(z(2, 4, 128)),
                      block_size=4, head_dim=128)
    out = indexer_logits(dev(z(0, 8, 128)), dev(z(0, 8)), keys, dev(z(1, 2, dtype=torch.int32)), i64, i32, width=8)
    assert out.shape == (0, 8)
    assert bool((state == 0).all())


# ---- compiled for GPUs this machine may not have ----------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_layer_kernels_compile_for_sm90():
    """dsv4.kernels.compile_check's `layer` job, in a fresh process (Triton reads TRITON_INTERPRET once)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "dsv4.kernels.compile_check", "cuda:90/layer"], env=env,
                       capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compiled in" in r.stdout


@pytest.mark.parametrize("N,dtype", [(128, torch.float32), (192, torch.bfloat16), (1536, torch.bfloat16)])
def test_norm_rows(N, dtype):
    """The q_lora RMSNorm, any width (Pro's 1536 is not a power of two), strided input."""
    from dsv4.components.norms import rms_norm
    from dsv4.kernels.front.layer_front import norm_rows_kernel

    g = torch.Generator().manual_seed(N)
    x = torch.randn(7, N + 64, generator=g)[:, :N].to(dtype)
    w = 1 + 0.1 * torch.randn(N, generator=g)
    got = norm_rows_kernel(x.to(DEVICE), w.to(DEVICE), eps=1e-6, dtype=dtype).cpu()
    want = rms_norm(x, w, 1e-6).to(dtype)
    assert got.dtype == dtype and got.shape == (7, N)
    assert float((got.float() - want.float()).norm() / want.float().norm()) <= (1e-6 if dtype == torch.float32 else 4e-3)


def test_rotate_rows():
    """The indexer queries' RoPE: every head's last 64 dims, float32."""
    from dsv4.components.rope import Rope
    from dsv4.kernels.front.layer_front import rotate_rows_kernel
    from tests.conftest import tiny_spec

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 8, 128, generator=g)
    rot = Rope.for_layer(tiny_spec(), 4).at(torch.tensor([0, 3, 17, 4096, 70001]))
    got = rotate_rows_kernel(x.to(DEVICE), rot.cos.to(DEVICE), rot.sin.to(DEVICE)).cpu()
    want = rot.rotate(x)
    assert float((got - want).norm() / want.norm()) <= 1e-6
    assert torch.equal(got[..., :64], x[..., :64])


TOPK_LAUNCHES = [dict(), dict(block=16, radix=4, num_warps=4), dict(block=64, radix=2, num_warps=4),
                 dict(block=32, radix=8, num_warps=4), dict(block=16, radix=4, num_warps=4, cap=64, sample=16),
                 dict(block=16, radix=8, num_warps=2, cap=32, sample=32, warp_cols=16)]


def topk_case():
    """Rows for the top-k (test_topk_lists says what they hold) -> scores, counts, pages, req, K, block size."""
    g = torch.Generator().manual_seed(4)
    T, width, K, bs = 10, 200, 16, 4
    scores = torch.randn(T, width, generator=g) * 10.0 ** torch.randint(-3, 4, (T, 1), generator=g)
    counts = torch.tensor([0, 3, 16, 17, 200, 122, 9, 150, 200, 200], dtype=torch.int32)
    scores[5] = -scores[5].abs()                     # every score negative
    scores[7, :150] = torch.where(torch.arange(150) % 3 == 0, 2.0, torch.rand(150, generator=g))  # 50 tied at 2
    picked = torch.arange(16) * 200 // 16            # cap64's sample: the only good entries of row 8
    scores[8] = torch.rand(width, generator=g)
    scores[8, picked] = 100.0 + torch.arange(16.0)
    scores[9] = torch.where(torch.rand(width, generator=g) < 0.6, 5.0, torch.rand(width, generator=g))
    scores = scores.masked_fill(torch.arange(width)[None] >= counts[:, None], float("-inf"))
    pages = torch.randperm(200, generator=g)[:2 * 50].view(2, 50).int()
    pages[1, 0] = -1                                 # row 3 takes 16 of its 17: some of entries 0-3
    req = torch.tensor([0, 0, 1, 1, 1, 0, 1, 0, 1, 0])
    return scores, counts, pages, req, K, bs


def assert_topk_lists(local, slots, lens, scores, counts, pages, req, K, bs, *, index_order=True):
    """The best min(K, visible) entries of each row, the lowest indices among ties at the K-th score (in
    index order, or in any order), then -1; their slots through the table; their counts."""
    from dsv4.components.plan import PageTable

    local, slots, lens = local.cpu(), slots.cpu(), lens.cpu()
    assert lens.tolist() == [min(K, int(c)) for c in counts]
    order = torch.sort(-scores, dim=1, stable=True).indices         # best first, ties by index
    for t in range(scores.shape[0]):
        k = int(lens[t])
        got = local[t, :k] if index_order else local[t, :k].sort().values
        assert torch.equal(got, order[t, :k].sort().values.int()), t
        assert bool((local[t, k:] == -1).all()) and bool((slots[t, k:] == -1).all())
    assert torch.equal(slots, PageTable(block_size=bs, pages=pages).slots(req, local))


@pytest.mark.parametrize("launch", TOPK_LAUNCHES, ids=["planned", "b16r4", "b64r2", "b32r8", "cap64", "cap32w2"])
def test_topk_lists(launch):
    """The radix select against a stable sort: the best min(K, visible) entries, the lowest indices among
    ties at the K-th score (scores over decades, all negative, 50 tied among 150), slots through the table
    (-1 where a visible entry has no page), -1 padding, counts; rows wider than a block. With a small `cap`
    every path runs: rows searched whole, rows searched over their sampled candidates, and rows whose
    candidates do not hold the top K (a sample of the row's best entries only; 120 ties at the best) that
    are searched whole after all."""
    from dsv4.kernels.indexer.topk_lists import topk_lists

    scores, counts, pages, req, K, bs = topk_case()
    local, slots, lens = topk_lists(scores.to(DEVICE), counts.to(DEVICE), pages.to(DEVICE), req.to(DEVICE),
                                    topk=K, block_size=bs, **launch)
    assert_topk_lists(local, slots, lens, scores, counts, pages, req, K, bs)
    assert int((scores[9] == 5.0).sum()) > 64        # more ties than any cap's candidates
    assert bool((slots == -1).sum() > (local == -1).sum())      # the entry without a page


def test_slot_lists():
    """A selection made elsewhere (a stable sort's, best first) -> its slots through the table and its
    counts, as topk_lists gives them (indexer.top_k=flashinfer's page lookup)."""
    from dsv4.components.plan import PageTable
    from dsv4.kernels.indexer.topk_lists import slot_lists

    scores, counts, pages, req, K, bs = topk_case()
    order = torch.sort(-scores, dim=1, stable=True).indices[:, :K].int()
    local = torch.where(torch.arange(K)[None] < counts.clamp(max=K)[:, None], order, -1)
    slots, lens = slot_lists(local.to(DEVICE), pages.to(DEVICE), req.to(DEVICE), block_size=bs)
    assert torch.equal(slots.cpu(), PageTable(block_size=bs, pages=pages).slots(req, local))
    assert lens.cpu().tolist() == [min(K, int(c)) for c in counts]
    assert bool((slots.cpu() == -1).sum() > (local == -1).sum())    # the entry without a page


def fake_flashinfer(calls: list):
    """A `flashinfer` module whose top_k_ragged_transform keeps its documented contract (contiguous float32
    rows, int32 offsets and lengths; per row the indices of its top min(k, length) entries plus the offset,
    -1 after them) and selects by a stable sort, ties to the lower index; rows are read up to their length."""
    import types

    def top_k_ragged_transform(input, offsets, lengths, k, deterministic=False, tie_break=0, dsa_graph_safe=False,
                               row_starts=None):
        assert input.is_contiguous() and input.dtype == torch.float32 and input.dim() == 2
        assert offsets.dtype == lengths.dtype == torch.int32 and offsets.shape == lengths.shape == input.shape[:1]
        assert not len(lengths) or int(lengths.max()) <= input.shape[1]
        calls.append({"deterministic": deterministic, "tie_break": tie_break, "width": input.shape[1]})
        out = torch.full((input.shape[0], k), -1, dtype=torch.int32, device=input.device)
        for r in range(input.shape[0]):
            n = int(lengths[r])
            best = torch.sort(-input[r, :n], stable=True).indices[:k]
            out[r, :len(best)] = best.int() + offsets[r]
        return out

    mod = types.ModuleType("flashinfer")
    mod.top_k_ragged_transform = top_k_ragged_transform
    return mod


def test_flashinfer_top_k_through_its_contract(monkeypatch):
    """indexer.top_k=flashinfer's marshalling, through a fake of FlashInfer's documented contract: its
    deterministic mode with ties to the lower index, zero offsets, the rows' counts as lengths (a column
    slice of padded rows read as the whole rows, NaN past the slice), then our page lookup -- the lists,
    slots and counts of test_topk_lists' stable sort, in any order."""
    from dsv4.strategies.indexer.top_k.flashinfer import PREFER_LOWER_INDEX, FlashInferTopK

    calls: list = []
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer(calls))
    scores, counts, pages, req, K, bs = topk_case()
    args = (dev(counts), dev(pages), dev(req))
    got = FlashInferTopK()(dev(scores), *args, topk=K, block_size=bs)
    assert_topk_lists(*got, scores, counts, pages, req, K, bs, index_order=False)
    assert calls == [{"deterministic": True, "tie_break": PREFER_LOWER_INDEX, "width": scores.shape[1]}]
    padded = dev(torch.full((scores.shape[0], scores.shape[1] + 8), float("nan")))
    padded[:, :scores.shape[1]] = dev(scores)
    again = FlashInferTopK()(padded[:, :scores.shape[1]], *args, topk=K, block_size=bs)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    assert calls[-1]["width"] == scores.shape[1] + 8                  # the padded rows, not a copy of the slice
    empty = FlashInferTopK()(dev(scores[:0]), dev(counts[:0]), dev(pages), dev(req[:0]), topk=K, block_size=bs)
    assert [tuple(x.shape) for x in empty] == [(0, K), (0, K), (0,)] and len(calls) == 2     # no call for no rows


@pytest.mark.skipif(not BIG or importlib.util.find_spec("flashinfer") is None,
                    reason="FlashInfer's top-k: a CUDA GPU and flashinfer-python")
@pytest.mark.parametrize("width", [0, 2048, 32768])
def test_flashinfer_top_k_selects_what_triton_selects(width):
    """indexer.top_k=flashinfer against the stable sort (test_topk_lists' rows) and, at decode sizes (128
    rows of 2,048 and 32,768 entries, K = 512, some rows partly visible, some with every score tied), against
    indexer.top_k=triton: the same entries, slots and counts; the same lists on a second call, and from
    padded rows (a column slice, NaN past the visible entries)."""
    from dsv4.strategies import FlashInferTopK, TritonTopK

    fi, ours = FlashInferTopK(), TritonTopK()
    if not width:
        scores, counts, pages, req, K, bs = topk_case()
        got = fi(scores.to(DEVICE), counts.to(DEVICE), pages.to(DEVICE), req.to(DEVICE), topk=K, block_size=bs)
        assert_topk_lists(*got, scores, counts, pages, req, K, bs, index_order=False)
        return
    g = torch.Generator(device=DEVICE).manual_seed(width)
    K, bs, T = 512, 64, 128
    scores = torch.randn(T, width, device=DEVICE, generator=g)
    scores[5] = 1.0
    counts = torch.full((T,), width, dtype=torch.int32, device=DEVICE)
    counts[::3] = torch.randint(1, width, (len(counts[::3]),), device=DEVICE, generator=g).int()
    pages = torch.randperm(64 * width // bs, device=DEVICE, generator=g).view(64, -1).int()
    req = torch.arange(64, device=DEVICE).repeat_interleave(2)
    a = fi(scores, counts, pages, req, topk=K, block_size=bs)
    b = ours(scores, counts, pages, req, topk=K, block_size=bs)
    assert torch.equal(a[2], b[2])
    assert torch.equal(a[0].sort(1).values, b[0].sort(1).values)
    assert torch.equal(a[1].sort(1).values, b[1].sort(1).values)
    assert all(torch.equal(x, y) for x, y in zip(a, fi(scores, counts, pages, req, topk=K, block_size=bs)))
    padded = torch.full((T, width + 96), float("nan"), device=DEVICE)     # rows as DeepGEMM pads them
    padded[:, :width] = scores
    invisible = torch.arange(width, device=DEVICE)[None] >= counts[:, None]
    padded[:, :width][invisible] = float("nan")                            # never read either
    assert all(torch.equal(x, y) for x, y in zip(a, fi(padded[:, :width], counts, pages, req, topk=K, block_size=bs)))


def test_fp8_queries_kernel_is_the_torch_path():
    """deepgemm_fp8's queries in one launch: the e4m3 bytes and the folded head weights of fp8_queries,
    bit for bit (FP4-simulated queries, raw ones over many decades, a zero head; strided weight rows)."""
    from dsv4.kernels.indexer.fp8_queries import fp8_queries_kernel
    from dsv4.strategies.indexer.key_layouts import fp8_queries
    from dsv4.formats.fp4 import fp4_sim

    g, T, H, D = gen(91), 6, 5, 128
    q = torch.randn(T, H, D, generator=g) * torch.exp(torch.randn(T, H, 1, generator=g) * 4)
    q[0] = fp4_sim(q[0])
    q[1, 2] = 0
    w = torch.randn(T, 2 * H, generator=g)[:, 1:H + 1]
    for qq in (q, q.bfloat16()):
        got_q, got_w = fp8_queries_kernel(dev(qq), dev(w), 0.25)
        want_q, want_w = fp8_queries(qq, w, 0.25)
        assert got_q.shape == (T, 1, H, D) and got_q.dtype == torch.float8_e4m3fn
        assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(bits(got_w.cpu()), bits(want_w))


def test_front_kernel_makes_fp8_indexer_queries():
    """iq_dtype e4m3: the front's indexer queries as deepgemm_fp8 scores them -- RoPE, FP4 numerics, then
    `fp8_queries` with the head weights (strided rows) -- bit for bit, beside the query and KV parts."""
    from dsv4.formats.indexer_numerics import IndexerNumerics
    from dsv4.strategies.indexer.key_layouts import fp8_queries

    g, T, Hi, Di = gen(87), 5, 6, 128
    iq = torch.randn(T, Hi, Di, generator=g) * torch.exp(torch.randn(T, Hi, 1, generator=g) * 3)
    iq[2, 1] = 0
    w = torch.randn(T, 2 * Hi, generator=g)[:, 2:Hi + 2]
    rot = rope_rows(T, g)
    q = torch.randn(T, 3, 64, generator=g)
    got_q, _, (q8, wq) = front_kernel(dev(q), None, None, dev(rot.cos), dev(rot.sin), None, None, padded_heads=4,
                                      eps=EPS, dtype=torch.bfloat16, iq=dev(iq), iq_dtype=torch.float8_e4m3fn,
                                      iq_fp4=True, iq_weights=dev(w), iq_w_scale=0.125)
    rows = IndexerNumerics.FP4.apply(OPS.rotate_rows(dev(iq), RopeRows(cos=dev(rot.cos), sin=dev(rot.sin))))
    want_q8, want_w = fp8_queries(rows.cpu().bfloat16(), w, 0.125)
    assert q8.shape == (T, 1, Hi, Di) and q8.dtype == torch.float8_e4m3fn and wq.shape == (T, Hi)
    assert torch.equal(q8.cpu().view(torch.uint8), want_q8.view(torch.uint8))
    assert torch.equal(bits(wq.cpu()), bits(want_w))
    assert torch.equal(got_q.cpu(), q_rows_kernel(dev(q), dev(rot.cos), dev(rot.sin), padded_heads=4, eps=EPS,
                                                  dtype=torch.bfloat16).cpu())
    with pytest.raises(ValueError, match="head weights"):
        front_kernel(None, None, None, dev(rot.cos), dev(rot.sin), None, None, padded_heads=0, eps=EPS,
                     dtype=torch.bfloat16, iq=dev(iq), iq_dtype=torch.float8_e4m3fn, iq_fp4=True)


# ---- what a step's sizes make the kernels compile -------------------------------------------------------
def nvidia_specialization(kernel, args, meta):
    """The specialization Triton compiles `kernel` for on an NVIDIA GPU when called with args/meta (its key:
    each argument's type and divisibility or value class, the constexprs and launch options), derived with
    Triton's own argument binder, with or without a GPU."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(kernel, JITFunction):       # the interpreter's: the same function and settings, compiled
        kw = {k: kernel.kwargs.get(k) for k in ("do_not_specialize", "do_not_specialize_on_alignment")}
        kernel = JITFunction(kernel.fn, **kw)
    binder = create_function_from_signature(kernel.signature, kernel.params, CUDABackend)
    _, spec, options = binder(*args, **meta)
    return repr((spec, sorted(options.items())))


def step_kernels(spans, pad: int, seed: int) -> dict[str, set]:
    """The layer's Triton kernels on one step of requests `spans` (block tables a multiple of 16 pages wide,
    as an engine makes them) -> {kernel name: the specializations it was launched with}."""
    from dsv4.kernels.front.compress import CompressJob, compress_kernels
    from dsv4.kernels.products.fp8_grouped_gemm import grouped_fp8_gemm
    from dsv4.kernels.products.inv_rope_fp8 import inv_rope_fp8_quant
    from dsv4.kernels.launch import observe
    from dsv4.kernels.mqa.sparse_mqa import sparse_mqa
    from dsv4.kernels.mqa.sparse_plan import TwoPassLaunch
    from dsv4.kernels.indexer.topk_lists import topk_lists
    from dsv4.values.seam import SparseKV

    g, R, D, Di, H, Hi, K = gen(seed), 4, 128, 64, 3, 4, 8
    plan, blocks = step_plan(spans, ratios=(R,), entry_block=4, pad=pad, seed=seed, table_pages=16)
    T, ents = plan.num_tokens, plan.entries[R]
    seen: dict[str, set] = {}
    rot, faults = plan.rope_rows(ROPE), dev(torch.zeros(3, T, dtype=torch.bool))
    swa = PagedCache(name="swa", layout=STORE_LAYOUTS["bf16"], data=dev(random_cache(
        STORE_LAYOUTS["bf16"], plan.swa.table.pages.numel(), 8, D, g)), block_size=8, head_dim=D)
    comp = PagedCache(name="compressed", layout=STORE_LAYOUTS["bf16"], data=dev(random_cache(
        STORE_LAYOUTS["bf16"], ents.table.pages.numel(), 4, D, g)), block_size=4, head_dim=D)
    keys = PagedCache(name="indexer_keys", layout=STORE_LAYOUTS["float32"], data=dev(random_cache(
        STORE_LAYOUTS["float32"], ents.table.pages.numel(), 4, Di, g)), block_size=4, head_dim=Di)
    with observe(lambda kernel, args, meta: seen.setdefault(kernel.fn.__name__, set()).add(
            nvidia_specialization(kernel, args, meta))):
        q, _, iq = front_kernel(dev(torch.randn(T, H, D, generator=g).bfloat16()), dev(torch.randn(T, D, generator=g)),
                                dev(1 + 0.1 * torch.randn(D, generator=g)), dev(rot.cos), dev(rot.sin),
                                dev(plan.swa.write_slots), faults, padded_heads=4, eps=EPS, dtype=torch.bfloat16,
                                into=swa.store, iq=dev(torch.randn(T, Hi, Di, generator=g)), iq_dtype=torch.float32)
        comps = [compressor(R, D, seed=seed + 1), compressor(R, Di, seed=seed + 2)]
        # the compressors' columns of one wider product, as the layer slices them
        jobs = [CompressJob(scores=dev(torch.randn(T, 2 * c.width + 7, generator=g))[:, :2 * c.width], ape=dev(c.ape), norm=dev(c.norm),
                            state=dev(torch.randn(blocks[R] * 8, 2 * c.width, generator=g)), head_dim=c.dim,
                            fault_row=1 + i, into=cache.store) for i, (c, cache) in enumerate(zip(comps, (comp, keys)))]
        erot = plan.rope_rows(ROPE, shift=R)
        compress_kernels(jobs, dev(erot.cos), dev(erot.sin), dev(plan.positions), dev(plan.step_start),
                         dev(plan.token_request), dev(plan.state[R].write_slots), dev(ents.close_slots),
                         dev(plan.state[R].table.pages), faults, ratio=R, state_block=8, eps=EPS)
        scores = indexer_logits(iq, dev(torch.randn(T, Hi, generator=g)), keys, dev(ents.table.pages),
                                dev(plan.token_request), dev(ents.counts), width=ents.width)
        _, slots, lens = topk_lists(scores, dev(ents.counts), dev(ents.table.pages), dev(plan.token_request), topk=K,
                                    block_size=4)
        kv = SparseKV(swa=swa, swa_indices=dev(plan.swa.indices), swa_lens=dev(plan.swa.lens), extra=comp,
                      extra_indices=slots, extra_lens=lens)
        out, _ = sparse_mqa(q, kv, sink=dev(torch.zeros(4)), scale=D ** -0.5, variant="two_pass",
                            two_pass=TwoPassLaunch(block_n=16, block_h=4, block_d=64, num_warps_pv=4))  # unplanned
        x = out.float().clamp(-8, 8).to(torch.float8_e4m3fn).view(T, 2, 2 * D)
        grouped_fp8_gemm(x, torch.ones(T, 2, 2 * D // 128, device=DEVICE),
                         dev(torch.randn(2, 128, 2 * D, generator=g).to(torch.float8_e4m3fn)),
                         torch.ones(2, 1, 2 * D // 128, device=DEVICE))
        inv_rope_fp8_quant(out, dev(rot.cos), dev(rot.sin), 2, mn_major_scales=True)
    return seen


def test_a_steps_sizes_and_lengths_compile_no_new_variant():
    """Two steps of different token counts (one of them 1), request mixes, lengths and table widths (16 and
    32 pages): every kernel of the layer is specialized the same way for both, so a decode step of new
    lengths compiles nothing (TABLE_PAGES-wide tables and aligned plan inputs keep what Triton specializes
    on: integers' divisibility by 16, pointers' alignment; token counts are not specialized)."""
    a = step_kernels([(40, 2), (77, 1), (13, 2)], pad=3, seed=90)
    b = step_kernels([(200, 2), (3, 1), (90, 9), (150, 1)], pad=0, seed=91)
    c = step_kernels([(33, 1)], pad=0, seed=92)
    assert set(a) == {"_front_kernel", "_compress_kernel", "_indexer_kernel", "_topk_lists_kernel", "_scores_kernel",
                      "_pv_kernel", "_grouped_fp8_kernel", "_inv_rope_fp8_kernel"}
    for name in a:
        assert len(a[name]) == 1 and a[name] == b[name] == c[name], name
