"""Sparse MQA with sink (docs/numerics.md §2.7, §5.5), cache row layouts (§3.3), head padding (§4.2, §4.3)
and the reference output projection (§2.8), each against our own float64 formulas."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import published_angles, tiny_spec
from dsv4.values.seam import PagedCache
from dsv4.components.rope import Rope
from dsv4.values.device import DeviceInfo
from dsv4.strategies import (BucketHeadPadding, NoHeadPadding, OProjWeights, PlainRowLayout, ReferenceMQA,
                             ReferenceOProj, SparseKV)

D = 512
SCALE = D ** -0.5


# ---- fixtures built by hand -------------------------------------------------------------------
def make_pool(name: str, blocks: int, B: int, g, dtype: str = "float32"):
    """A PagedCache whose every slot holds a random row; returns it and the rows as stored (float64)."""
    lay = PlainRowLayout(name=dtype, dtype=dtype)
    cache = PagedCache(name=name, layout=lay, block_size=B, head_dim=D,
                       data=lay.allocate(num_blocks=blocks, block_size=B, head_dim=D, device="cpu"))
    rows = torch.randn(blocks * B, D, generator=g)
    perm = torch.randperm(blocks * B, generator=g)                   # write in a scrambled slot order
    cache.write(perm.to(torch.int32), rows[perm])
    stored = rows.double() if dtype == "float32" else rows.bfloat16().double()
    return cache, stored


def rand_lists(T: int, width: int, S: int, g, p_pad: float = 0.25):
    """Random global slot lists with -1 padding, and lens <= width (entries past lens must be ignored)."""
    idx = torch.randint(0, S, (T, width), generator=g)
    idx = torch.where(torch.rand(T, width, generator=g) < p_pad, torch.full_like(idx, -1), idx)
    lens = torch.randint(0, width + 1, (T,), generator=g)
    lens[0] = max(1, width - 3)                                       # at least one token has keys
    return idx.to(torch.int32), lens.to(torch.int32)


def dense_ref(q, sink, pools):
    """§2.7 literally, float64, one token at a time over the union of the valid rows of every pool.
    pools: list of (rows [S, D] float64, idx [T, W], lens [T]). Returns out [T, H, D], lse [T, H]."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.full((T, H), math.inf, dtype=torch.float64)
    for t in range(T):
        keys = [rows[int(i)] for rows, idx, lens in pools for c, i in enumerate(idx[t]) if c < int(lens[t]) and i >= 0]
        if not keys:
            continue                                                   # no valid key: 0, lse = +inf
        K = torch.stack(keys)                                          # [n, D], V = K
        s = SCALE * (q[t].double() @ K.T)                              # [H, n]
        m = s.max(-1, keepdim=True).values
        e = torch.exp(s - m)
        Z = e.sum(-1, keepdim=True) + torch.exp(sink.double()[:, None] - m)   # the sink: denominator only
        out[t] = (e @ K) / Z
        lse[t] = (m + torch.log(e.sum(-1, keepdim=True))).squeeze(-1)
    return out, lse


def plain_softmax_ref(q, pools):
    """No sink at all: softmax over the valid logits, times K."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        keys = [rows[int(i)] for rows, idx, lens in pools for c, i in enumerate(idx[t]) if c < int(lens[t]) and i >= 0]
        if keys:
            K = torch.stack(keys)
            out[t] = torch.softmax(SCALE * (q[t].double() @ K.T), -1) @ K
    return out


def rel(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖; 0 when both are exactly zero (a query with no valid key)."""
    out, ref = out.double(), ref.double()
    diff = float((out - ref).norm())
    return 0.0 if diff == 0 else diff / float(ref.norm())


def setup(T: int, H: int, seed: int, *, swa_w: int = 16, extra_w: int = 10, extra: bool = True,
          dtype: str = "float32"):
    g = torch.Generator().manual_seed(seed)
    swa, swa_rows = make_pool("swa", 6, 8, g, dtype)
    si, sl = rand_lists(T, swa_w, 48, g)
    pools = [(swa_rows, si, sl)]
    kw = dict(swa=swa, swa_indices=si, swa_lens=sl)
    if extra:
        ext, ext_rows = make_pool("compressed", 5, 4, g, dtype)
        ei, el = rand_lists(T, extra_w, 20, g)
        pools.append((ext_rows, ei, el))
        kw |= dict(extra=ext, extra_indices=ei, extra_lens=el)
    q = torch.randn(T, H, D, generator=g) * 2
    sink = torch.randn(H, generator=g)
    return q, sink, SparseKV(**kw), pools


def check(out, lse, ref_out, ref_lse):
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert bool((lse[torch.isinf(lse)] > 0).all())
    fin = torch.isfinite(ref_lse)
    if fin.any():      # lse can be ~0: relative to max(1, |lse|)
        assert bool(((lse[fin].double() - ref_lse[fin]).abs() <= 1e-5 * ref_lse[fin].abs().clamp(min=1)).all())
    assert rel(out, ref_out) <= 1e-5


# ---- the kernel contract ----------------------------------------------------------------------
@pytest.mark.parametrize("H", [1, 3, 8, 64, 128])
def test_reference_mqa_matches_dense_softmax_with_sink(H):
    q, sink, kv, pools = setup(T=6, H=H, seed=H)
    out, lse = ReferenceMQA()(q, kv, sink=sink, scale=SCALE)
    assert out.shape == (6, H, D) and out.dtype == q.dtype
    assert lse.shape == (6, H) and lse.dtype == torch.float32
    check(out, lse, *dense_ref(q, sink, pools))


def test_entries_past_lens_are_ignored():
    q, sink, kv, pools = setup(T=5, H=4, seed=21)
    out, _ = ReferenceMQA()(q, kv, sink=sink, scale=SCALE)
    # the same call with every entry past lens replaced by a (valid-looking) slot must not change
    cols = torch.arange(kv.swa_indices.shape[1])[None, :]
    si = torch.where(cols < kv.swa_lens[:, None], kv.swa_indices, torch.zeros_like(kv.swa_indices))
    cols = torch.arange(kv.extra_indices.shape[1])[None, :]
    ei = torch.where(cols < kv.extra_lens[:, None], kv.extra_indices, torch.full_like(kv.extra_indices, 3))
    kv2 = SparseKV(swa=kv.swa, swa_indices=si, swa_lens=kv.swa_lens, extra=kv.extra, extra_indices=ei,
                   extra_lens=kv.extra_lens)
    out2, _ = ReferenceMQA()(q, kv2, sink=sink, scale=SCALE)
    assert torch.equal(out, out2)
    # while counting them (lens = width) does change the answer
    kv3 = SparseKV(swa=kv.swa, swa_indices=si, swa_lens=torch.full_like(kv.swa_lens, si.shape[1]), extra=kv.extra,
                   extra_indices=ei, extra_lens=kv.extra_lens)
    assert rel(ReferenceMQA()(q, kv3, sink=sink, scale=SCALE)[0], out) > 1e-3


def test_swa_only_call():
    q, sink, kv, pools = setup(T=7, H=8, seed=5, extra=False)
    out, lse = ReferenceMQA()(q, kv, sink=sink, scale=SCALE)
    check(out, lse, *dense_ref(q, sink, pools))


def test_sink_minus_inf_is_plain_softmax():
    q, _, kv, pools = setup(T=6, H=8, seed=7)
    sink = torch.full((8,), -math.inf)
    out, lse = ReferenceMQA()(q, kv, sink=sink, scale=SCALE)
    ref = plain_softmax_ref(q, pools)
    assert rel(out, ref) <= 1e-5
    check(out, lse, *dense_ref(q, sink, pools))


def test_sink_plus_inf_gives_zero_output_and_lse_without_sink():
    q, _, kv, pools = setup(T=6, H=8, seed=8)
    sink = torch.full((8,), math.inf)
    out, lse = ReferenceMQA()(q, kv, sink=sink, scale=SCALE)
    assert bool((out == 0).all())
    _, ref_lse = dense_ref(q, torch.zeros(8), pools)                 # lse never includes the sink
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert fin.any() and rel(lse[fin], ref_lse[fin]) <= 1e-6


def test_lse_excludes_sink_and_sink_rescales_output():
    """§2.7: o = softmax(s) K * exp(lse) / (exp(lse) + exp(sink)); lse is the same for any sink."""
    q, _, kv, pools = setup(T=6, H=8, seed=9)
    sink = torch.linspace(-4, 6, 8)
    out, lse = ReferenceMQA()(q, kv, sink=sink, scale=SCALE)
    out0, lse0 = ReferenceMQA()(q, kv, sink=torch.full((8,), -math.inf), scale=SCALE)
    fin = torch.isfinite(lse)
    assert torch.equal(lse, lse0)
    plain = plain_softmax_ref(q, pools)
    L = lse.double()
    factor = torch.where(fin, torch.exp(L) / (torch.exp(L) + torch.exp(sink.double())[None, :]), torch.zeros_like(L))
    assert rel(out, plain * factor[..., None]) <= 1e-5
    # a logsumexp written from scratch for one token and head
    rows, idx, lens = pools[0]
    rows_e, idx_e, lens_e = pools[1]
    t, h = 0, 3
    keys = [rows[int(i)] for c, i in enumerate(idx[t]) if c < int(lens[t]) and i >= 0] + \
           [rows_e[int(i)] for c, i in enumerate(idx_e[t]) if c < int(lens_e[t]) and i >= 0]
    logits = [SCALE * float(q[t, h].double() @ k) for k in keys]
    assert len(logits) > 0
    assert float(lse[t, h]) == pytest.approx(math.log(sum(math.exp(x) for x in logits)), rel=1e-6)


def test_query_without_any_valid_key():
    q, sink, kv, pools = setup(T=5, H=8, seed=10)
    si, sl, ei, el = kv.swa_indices.clone(), kv.swa_lens.clone(), kv.extra_indices.clone(), kv.extra_lens.clone()
    sl[1], el[1] = 0, 0                                               # lens 0 in both pools
    si[2], ei[2] = -1, -1                                             # lists full of -1, lens = width
    sl[2], el[2] = si.shape[1], ei.shape[1]
    si[3], sl[3], el[3] = -1, si.shape[1], 2                          # only the extra pool has keys
    ei[3, :2] = torch.tensor([0, 19], dtype=torch.int32)
    kv = SparseKV(swa=kv.swa, swa_indices=si, swa_lens=sl, extra=kv.extra, extra_indices=ei, extra_lens=el)
    pools = [(pools[0][0], si, sl), (pools[1][0], ei, el)]
    out, lse = ReferenceMQA()(q, kv, sink=sink, scale=SCALE)
    for t in (1, 2):
        assert bool((out[t] == 0).all())
        assert bool((lse[t] == math.inf).all())
    assert bool(torch.isfinite(lse[[0, 3, 4]]).all())
    check(out, lse, *dense_ref(q, sink, pools))


def test_all_lists_full_of_minus_one():
    q, sink, kv, _ = setup(T=4, H=3, seed=11)
    kv = SparseKV(swa=kv.swa, swa_indices=torch.full_like(kv.swa_indices, -1),
                  swa_lens=torch.full_like(kv.swa_lens, kv.swa_indices.shape[1]), extra=kv.extra,
                  extra_indices=torch.full_like(kv.extra_indices, -1),
                  extra_lens=torch.full_like(kv.extra_lens, kv.extra_indices.shape[1]))
    for s in (sink, torch.full((3,), math.inf), torch.full((3,), -math.inf)):
        out, lse = ReferenceMQA()(q, kv, sink=s, scale=SCALE)
        assert bool((out == 0).all()) and not out.isnan().any()
        assert bool((lse == math.inf).all())


@pytest.mark.parametrize("H,Hp", [(5, 8), (8, 64), (64, 128)])
def test_padded_heads_do_not_change_real_heads(H, Hp):
    q, sink, kv, pools = setup(T=5, H=H, seed=H + Hp)
    qp = torch.cat((q, torch.zeros(5, Hp - H, D)), 1)
    sp = torch.cat((sink, torch.full((Hp - H,), -math.inf)))
    out, lse = ReferenceMQA()(q, kv, sink=sink, scale=SCALE)
    outp, lsep = ReferenceMQA()(qp, kv, sink=sp, scale=SCALE)
    assert outp.shape == (5, Hp, D)
    assert rel(outp[:, :H], out) <= 1e-6
    assert torch.equal(torch.isinf(lsep[:, :H]), torch.isinf(lse))
    fin = torch.isfinite(lse)
    assert rel(lsep[:, :H][fin], lse[fin]) <= 1e-6
    check(outp[:, :H], lsep[:, :H], *dense_ref(q, sink, pools))


@pytest.mark.parametrize("chunk,T", [(4, 11), (1, 3), (5, 5), (3, 1)])
def test_more_tokens_than_chunk(chunk, T):
    q, sink, kv, pools = setup(T=T, H=8, seed=chunk * 100 + T)
    out, lse = ReferenceMQA(chunk=chunk)(q, kv, sink=sink, scale=SCALE)
    assert out.shape == (T, 8, D) and lse.shape == (T, 8)
    check(out, lse, *dense_ref(q, sink, pools))
    out64, lse64 = ReferenceMQA(chunk=64)(q, kv, sink=sink, scale=SCALE)
    assert rel(out, out64) <= 1e-6 and torch.equal(torch.isinf(lse), torch.isinf(lse64))


@settings(max_examples=15, deadline=None)
@given(T=st.integers(1, 9), H=st.integers(1, 12), chunk=st.integers(1, 6), swa_w=st.integers(1, 20),
       extra_w=st.integers(1, 12), seed=st.integers(0, 10_000))
def test_reference_mqa_random_shapes(T, H, chunk, swa_w, extra_w, seed):
    q, sink, kv, pools = setup(T=T, H=H, seed=seed, swa_w=swa_w, extra_w=extra_w)
    out, lse = ReferenceMQA(chunk=chunk)(q, kv, sink=sink, scale=SCALE)
    check(out, lse, *dense_ref(q, sink, pools))


# ---- cache layouts ----------------------------------------------------------------------------
def test_bf16_layout_reads_back_the_rounded_row_exactly():
    g = torch.Generator().manual_seed(12)
    lay = PlainRowLayout(name="bf16", dtype="bfloat16")
    data = lay.allocate(num_blocks=4, block_size=3, head_dim=D, device="cpu")
    assert data.dtype == torch.bfloat16 and data.shape == (4, 3, D)
    rows = torch.randn(12, D, generator=g) * torch.logspace(-3, 3, 12)[:, None]
    slots = torch.randperm(12, generator=g).to(torch.int32)
    lay.access(data, block_size=3, gpu=False).write(slots, rows)
    got = lay.read(data, slots, block_size=3)
    assert got.dtype == torch.float32
    assert torch.equal(got, rows.bfloat16().float())                 # bf16-rounded, nothing else
    assert not torch.equal(got, rows)                                 # it did round
    # -1 reads as zeros, and a -1 write touches nothing
    pad = torch.tensor([[slots[0], -1], [-1, slots[5]]], dtype=torch.int32)
    r = lay.read(data, pad, block_size=3)
    assert torch.equal(r[0, 0], rows[0].bfloat16().float()) and bool((r[0, 1] == 0).all())
    before = data.clone()
    lay.access(data, block_size=3, gpu=False).write(torch.tensor([-1, -1], dtype=torch.int32), torch.randn(2, D))
    assert torch.equal(data, before)
    # float32 rows are stored as they are
    lay32 = PlainRowLayout(name="float32", dtype="float32")
    d32 = lay32.allocate(num_blocks=4, block_size=3, head_dim=D, device="cpu")
    lay32.access(d32, block_size=3, gpu=False).write(slots, rows)
    assert torch.equal(lay32.read(d32, slots, block_size=3), rows)


def test_reference_mqa_over_bf16_cache():
    q, sink, kv, pools = setup(T=6, H=8, seed=13, dtype="bfloat16")   # pools hold the bf16-rounded rows
    out, lse = ReferenceMQA()(q, kv, sink=sink, scale=SCALE)
    check(out, lse, *dense_ref(q, sink, pools))


# ---- head padding -----------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(buckets=st.lists(st.integers(1, 256), min_size=1, max_size=6), heads=st.integers(1, 300))
def test_bucket_head_padding_smallest_bucket_that_holds(buckets, heads):
    pol = BucketHeadPadding(name="b", buckets=tuple(buckets))
    fits = [b for b in buckets if b >= heads]
    assert pol.padded_heads(heads) == (min(fits) if fits else None)
    assert pol.supported() == tuple(sorted(buckets))


@pytest.mark.parametrize("heads,want64_128,want_pow2", [(1, 64, 8), (8, 64, 8), (9, 64, 16), (33, 64, 64),
                                                        (64, 64, 64), (65, 128, 128), (128, 128, 128),
                                                        (129, None, None)])
def test_shipped_bucket_sets(heads, want64_128, want_pow2):
    assert BucketHeadPadding(name="fm", buckets=(128, 64)).padded_heads(heads) == want64_128
    assert BucketHeadPadding(name="fi", buckets=(8, 16, 32, 64, 128)).padded_heads(heads) == want_pow2
    assert NoHeadPadding().padded_heads(heads) == heads
    assert NoHeadPadding().supported() == ()


@pytest.mark.parametrize("bad", [(), (0, 64), (-8,)])
def test_bucket_head_padding_rejects_bad_buckets(bad):
    with pytest.raises(ValueError):
        BucketHeadPadding(name="bad", buckets=bad)


# ---- output projection ------------------------------------------------------------------------
def own_o_proj(o, pos, ratio, wo_a, G):
    """Inverse GPT-J RoPE on the last 64 dims, then per group z_g = W_oa[g] . concat(heads of g)."""
    o = o.double().clone()
    T, H, _ = o.shape
    hpg = H // G
    for t in range(T):
        ang = published_angles(pos[t], ratio)                        # the published float32 angles, in float64
        c, s = ang.cos(), -ang.sin()                                  # inverse: sin -> -sin
        ev, od = o[t, :, -64::2].clone(), o[t, :, -63::2].clone()
        o[t, :, -64::2], o[t, :, -63::2] = ev * c - od * s, od * c + ev * s
    r = wo_a.shape[0] // G
    z = torch.zeros(T, G, r, dtype=torch.float64)
    for g in range(G):
        Wg = wo_a.double()[g * r:(g + 1) * r]                         # [r, hpg*D]
        for k in range(hpg):
            z[:, g] += o[:, g * hpg + k] @ Wg[:, k * D:(k + 1) * D].T
    return z.reshape(T, G * r)


@pytest.mark.parametrize("G,hpg,ratio", [(1, 8, 1), (2, 4, 4), (4, 2, 128), (2, 1, 1)])
def test_reference_o_proj_matches_own(G, hpg, ratio):
    g = torch.Generator().manual_seed(G * 10 + hpg + ratio)
    H, r, T = G * hpg, 32, 6
    wo_a = torch.randn(G * r, hpg * D, generator=g) * (hpg * D) ** -0.5
    o = torch.randn(T, H, D, generator=g)
    pos = torch.tensor([0, 1, 77, 4097, 65536, 1_000_000])
    proj = ReferenceOProj()
    prepared = proj.prepare(OProjWeights(wo_a=wo_a, groups=G), device=DeviceInfo(platform="cpu"),
                            dtype="float32")
    y = proj(o, Rope.for_layer(tiny_spec(), ratio).at(pos), prepared=prepared)
    assert y.shape == (T, G * r)
    ref = own_o_proj(o, pos, ratio, wo_a, G)
    assert rel(y, ref) <= 1e-5
    # the direction of the de-rotation matters: rotating forward instead is far off for p > 0
    wrong = own_o_proj(o, -pos, ratio, wo_a, G)               # forward rotation instead of inverse
    assert rel(y[1:], wrong[1:]) > 1e-3


def test_slots_beyond_the_pool_are_padding():
    """A slot id >= the pool's size is invalid, like -1 (FlashMLA: '-1 or >= s_kv invalid')."""
    q, sink, kv, pools = setup(T=5, H=4, seed=33)
    out, lse = ReferenceMQA()(q, kv, sink=sink, scale=SCALE)
    beyond = torch.where(kv.swa_indices < 0, torch.full_like(kv.swa_indices, kv.swa.num_slots + 7), kv.swa_indices)
    kv2 = SparseKV(swa=kv.swa, swa_indices=beyond, swa_lens=kv.swa_lens, extra=kv.extra,
                   extra_indices=kv.extra_indices, extra_lens=kv.extra_lens)
    out2, lse2 = ReferenceMQA()(q, kv2, sink=sink, scale=SCALE)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
