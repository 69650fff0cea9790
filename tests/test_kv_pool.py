"""The paged KV pool (DSV4_SPEC §3.1 slot ids, §5.8 index construction, §2.6 SWA set).

Expected slots and windows are derived here from the block tables and the spec formulas; the
SWA tests also write a row per position (its value encodes the position) and read it back through
the slots the pool hands out, so they check addressing end to end, across page reuse.
"""
from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import tiny_spec
from dsv4.components.builders import PoolConfig, build_layer_kv
from dsv4.components.kv_pool import BlockAllocator, LayerKV, PagedCache, Segment, StepMeta
from dsv4.device import DeviceInfo
from dsv4.errors import InvalidRequest
from dsv4.strategies import PlainRowLayout

F32 = PlainRowLayout(name="float32", dtype="float32")
DIM = 4


def make_cache(name: str, block_size: int, blocks: int, *, shuffle_seed: int | None = None) -> PagedCache:
    alloc = BlockAllocator(blocks)
    if shuffle_seed is not None:               # hand pages out in a scrambled order
        pages = alloc.take(blocks)
        random.Random(shuffle_seed).shuffle(pages)
        alloc.give(pages)
    return PagedCache(name=name, layout=F32, block_size=block_size, head_dim=DIM, allocator=alloc,
                      data=F32.allocate(num_blocks=blocks, block_size=block_size, head_dim=DIM, device="cpu"))


def make_kv(*, W: int, swa_bs: int, swa_blocks: int, ratio: int = 1, comp_bs: int = 4, comp_blocks: int = 16,
            idx_blocks: int | None = None, seed: int | None = None) -> LayerKV:
    swa = make_cache("swa", swa_bs, swa_blocks, shuffle_seed=seed)
    comp = make_cache("compressed", comp_bs, comp_blocks, shuffle_seed=seed) if ratio > 1 else None
    idx = make_cache("indexer", comp_bs, comp_blocks if idx_blocks is None else idx_blocks,
                     shuffle_seed=seed) if ratio == 4 else None
    return LayerKV(ratio=ratio, window=W, swa=swa, compressed=comp, indexer=idx)


def meta_for(kv: LayerKV, step: dict) -> StepMeta:
    """Every request of `step` (rid -> new tokens) continues at its current length."""
    segs, pos, off = [], [], 0
    for rid, n in step.items():
        start = kv.requests[rid].seq_len
        segs.append(Segment(rid=rid, start=start, offset=off, count=n))
        pos.append(torch.arange(start, start + n))
        off += n
    seg_of = torch.repeat_interleave(torch.arange(len(segs)), torch.tensor([s.count for s in segs]))
    return StepMeta(segments=tuple(segs), positions=torch.cat(pos), segment_of_token=seg_of)


def own_slot(table: list[int], idx: int, B: int) -> int:
    """§3.1: slot = table[idx // B] * B + idx % B; -1 for -1."""
    return -1 if idx < 0 else table[idx // B] * B + idx % B


def position_of_slot(table: list[int], slot: int, B: int) -> int:
    """Invert a slot through the table: (page, offset) -> logical page -> position."""
    page, off = divmod(slot, B)
    assert table.count(page) == 1, (table, slot)
    return table.index(page) * B + off


def row_for(rid_no: int, p: int):
    return torch.tensor([float(p), float(rid_no), 1.0 + p % 7, -2.0 * rid_no])


def free_set(kv: LayerKV) -> dict:
    return {n: sorted(c.allocator._free) for n, c in kv.caches.items()}


def free_counts(kv: LayerKV) -> dict:
    return {n: c.allocator.num_free for n, c in kv.caches.items()}


def tables(kv: LayerKV) -> dict:
    return {rid: {n: list(t) for n, t in r.tables.items()} for rid, r in kv.requests.items()}


# ---- the allocator ----------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(nb=st.integers(1, 12), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 14)), max_size=25),
       seed=st.integers(0, 99))
def test_block_allocator_take_give(nb, ops, seed):
    alloc = BlockAllocator(nb)
    rng = random.Random(seed)
    held: list[int] = []
    assert alloc.num_free == nb
    for is_take, k in ops:
        if is_take:
            if k > alloc.num_free:
                before = alloc.num_free
                with pytest.raises(RuntimeError):
                    alloc.take(k)
                assert alloc.num_free == before          # a refused take takes nothing
                continue
            got = alloc.take(k)
            assert len(got) == k == len(set(got))
            assert all(0 <= b < nb for b in got)
            assert not set(got) & set(held)             # never hands out a page that is in use
            held += got
        else:
            rng.shuffle(held)
            back, held = held[:k], held[k:]
            alloc.give(back)
        assert alloc.num_free == nb - len(held)
    alloc.give(held)
    assert sorted(alloc.take(nb)) == list(range(nb))     # every page came back exactly once
    assert alloc.num_free == 0


# ---- slot ids ---------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), swa_bs=st.integers(1, 6), comp_bs=st.integers(1, 5),
       steps=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=6))
def test_slot_ids_follow_the_block_table(seed, swa_bs, comp_bs, steps):
    W = 1000                                             # nothing freed: every row stays addressable
    # big enough for the longest schedule (2 x 6 x 9 tokens, one row per page) with nothing freed
    kv = make_kv(W=W, swa_bs=swa_bs, swa_blocks=120, ratio=4, comp_bs=comp_bs, comp_blocks=64, seed=seed)
    for rid in "ab":
        kv.add(rid)
    g = torch.Generator().manual_seed(seed)
    for na, nb in steps:
        step = {r: n for r, n in (("a", na), ("b", nb)) if n}
        if not step:
            continue
        kv.reserve(step)
        meta = meta_for(kv, step)
        T = meta.positions.shape[0]
        # write slots of the step's own tokens
        ws = kv.swa_write_slots(meta)
        assert ws.dtype == torch.int32
        for t in range(T):
            seg = meta.segments[int(meta.segment_of_token[t])]
            assert int(ws[t]) == own_slot(kv.requests[seg.rid].tables["swa"], int(meta.positions[t]), swa_bs)
        # arbitrary per-token rows (compressed entries so far, with -1 padding)
        for name in ("compressed", "indexer", "swa"):
            B = kv.caches[name].block_size
            hi = torch.tensor([(kv.requests[meta.segments[int(s)].rid].seq_len + meta.segments[int(s)].count)
                               // (4 if name != "swa" else 1) for s in meta.segment_of_token])
            local = (torch.rand(T, 7, generator=g) * hi[:, None]).long()
            local = torch.where(torch.rand(T, 7, generator=g) < 0.3, torch.full_like(local, -1), local)
            local = torch.where(hi[:, None] > 0, local, torch.full_like(local, -1))
            slots = kv.global_slots(name, meta, local)
            assert slots.dtype == torch.int32 and slots.shape == local.shape
            for t in range(T):
                tab = kv.requests[meta.segments[int(meta.segment_of_token[t])].rid].tables[name]
                assert slots[t].tolist() == [own_slot(tab, int(i), B) for i in local[t]]
        for rid, n in step.items():
            kv.commit(rid, kv.requests[rid].seq_len + n, {})
        for rid in "ab":                                 # request_rows: rows 0..n-1 of one request
            n = kv.requests[rid].seq_len // 4
            if n:
                tab = kv.requests[rid].tables["compressed"]
                assert kv.request_rows("compressed", rid, n).tolist() == [own_slot(tab, i, comp_bs) for i in range(n)]


def _run_and_check_swa(kv: LayerKV, schedule: list[dict], rid_no: dict) -> int:
    """Drive `schedule` through reserve / write / swa_indices / commit, checking every step.
    Returns the number of distinct (request, logical page) pairs ever used."""
    W, B = kv.window, kv.caches["swa"].block_size
    swa = kv.caches["swa"]
    logical_pages = set()
    for step in schedule:
        kv.reserve(step)
        meta = meta_for(kv, step)
        rows = torch.stack([row_for(rid_no[s.rid], s.start + i) for s in meta.segments for i in range(s.count)])
        swa.write(kv.swa_write_slots(meta), rows)
        idx, lens = kv.swa_indices(meta)
        assert idx.dtype == torch.int32 and lens.dtype == torch.int32 and idx.shape[1] == W
        read = swa.read(idx)
        for t in range(meta.positions.shape[0]):
            p = int(meta.positions[t])
            seg = meta.segments[int(meta.segment_of_token[t])]
            table = kv.requests[seg.rid].tables["swa"]
            L = min(p + 1, W)
            window = list(range(max(0, p - W + 1), p + 1))
            assert int(lens[t]) == L
            assert (idx[t, L:] == -1).all()
            got = [position_of_slot(table, int(s), B) for s in idx[t, :L]]
            assert got == window                                     # exactly the window, via the table
            assert read[t, :L, 0].tolist() == [float(q) for q in window]   # ... and the rows there are ours
            assert (read[t, :L, 1] == rid_no[seg.rid]).all()
        for rid, n in step.items():
            new_len = kv.requests[rid].seq_len + n
            kv.commit(rid, new_len, {})
            table = kv.requests[rid].tables["swa"]
            first = max(0, new_len - W + 1)                           # lowest position still readable
            assert len(table) == math.ceil(new_len / B)
            for b, page in enumerate(table):
                behind = (b + 1) * B <= first                          # page wholly behind the window
                assert (page == -1) == behind, (b, page, first, table)
                logical_pages.add((rid, b))
        live = [p for r in kv.requests.values() for p in r.tables["swa"] if p >= 0]
        assert len(live) == len(set(live))                            # no page shared between requests
        assert swa.allocator.num_free == swa.allocator.num_blocks - len(live)
        assert not set(live) & set(swa.allocator._free)
    return len(logical_pages)


@settings(max_examples=30, deadline=None)
@given(W=st.integers(1, 20), B=st.integers(1, 8), seed=st.integers(0, 99),
       chunks=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=14))
def test_swa_indices_window_freeing_and_reuse(W, B, seed, chunks):
    cmax = max(max(a, b) for a, b in chunks)
    per_req = math.ceil((W - 1 + cmax) / B) + 1                      # the most pages one request holds
    kv = make_kv(W=W, swa_bs=B, swa_blocks=2 * per_req, seed=seed)
    kv.add("a")
    kv.add("b")
    schedule = [{r: n for r, n in (("a", a), ("b", b)) if n} for a, b in chunks]
    schedule = [s for s in schedule if s]
    _run_and_check_swa(kv, schedule, {"a": 1, "b": 2})


def test_swa_pages_are_reused_long_decode():
    """40 single-token decode steps through a 3-page pool: pages behind the window come back and are reused."""
    kv = make_kv(W=4, swa_bs=2, swa_blocks=3, seed=1)
    kv.add("r")
    used = _run_and_check_swa(kv, [{"r": 3}] + [{"r": 1}] * 37, {"r": 5})
    assert used == 20 > kv.caches["swa"].allocator.num_blocks        # 20 logical pages lived in 3 physical ones
    assert kv.requests["r"].tables["swa"][:18] == [-1] * 18
    kv.release("r")
    assert kv.caches["swa"].allocator.num_free == 3


def test_swa_pages_freed_on_commit_return_to_allocator():
    kv = make_kv(W=5, swa_bs=4, swa_blocks=8)
    kv.add("r")
    kv.reserve({"r": 12})                                            # pages for positions 0..11
    assert kv.caches["swa"].allocator.num_free == 5
    pages = list(kv.requests["r"].tables["swa"])
    kv.commit("r", 12, {})                                           # future queries read >= 12-5+1 = 8
    assert kv.requests["r"].tables["swa"] == [-1, -1, pages[2]]
    assert kv.caches["swa"].allocator.num_free == 7
    assert set(pages[:2]) <= set(kv.caches["swa"].allocator._free)
    kv.commit("r", 12, {})                                           # idempotent
    assert kv.caches["swa"].allocator.num_free == 7


# ---- reserve / rollback / release -------------------------------------------------------------
@pytest.mark.parametrize("small,knob", [("swa", "swa_blocks"), ("compressed", "compressed_blocks"),
                                        ("indexer", "compressed_blocks")])
def test_reserve_refuses_when_pool_too_small_taking_nothing(small, knob):
    sizes = {"swa": 20, "compressed": 20, "indexer": 20}
    sizes[small] = 2                                                 # only this cache is too small
    kv = make_kv(W=4, swa_bs=4, swa_blocks=sizes["swa"], ratio=4, comp_bs=2, comp_blocks=sizes["compressed"],
                 idx_blocks=sizes["indexer"], seed=3)
    kv.add("a")
    kv.add("b")
    kv.reserve({"a": 4})                                             # fits: 1 swa page, 1 entry -> 1 page
    kv.commit("a", 4, {})
    before_free, before_sets, before_tables = free_counts(kv), free_set(kv), tables(kv)
    with pytest.raises(InvalidRequest) as e:
        kv.reserve({"a": 20, "b": 4})                                # 6 swa pages, 3 + 1 compressed pages
    msg = str(e.value)
    assert f"{small} cache" in msg
    assert f"workload.kv_pool.{knob}" in msg
    assert free_counts(kv) == before_free                            # no page taken from ANY cache
    assert free_set(kv) == before_sets
    assert tables(kv) == before_tables
    kv.reserve({"a": 4})                                             # the pool still works afterwards


def test_reserve_is_atomic_across_requests():
    kv = make_kv(W=8, swa_bs=4, swa_blocks=4)
    for r in "abc":
        kv.add(r)
    before = (free_counts(kv), tables(kv))
    with pytest.raises(InvalidRequest) as e:                         # each fits alone, not together
        kv.reserve({"a": 8, "b": 8, "c": 4})
    assert "swa" in str(e.value) and "workload.kv_pool.swa_blocks" in str(e.value)
    assert (free_counts(kv), tables(kv)) == before
    kv.reserve({"a": 8, "b": 8})
    assert kv.caches["swa"].allocator.num_free == 0


def test_reserve_refusal_with_the_builder_pool():
    """build_layer_kv with the tiny spec (layer 1: ratio 4, with an indexer cache)."""
    spec = tiny_spec()
    dev = DeviceInfo(platform="cpu")
    kv = build_layer_kv(spec=spec, layer=1, layout=F32, device=dev,
                        pool=PoolConfig(swa_block_size=8, compressed_block_tokens=32, swa_blocks=3,
                                        compressed_blocks=8))
    assert set(kv.caches) == {"swa", "compressed", "indexer"}
    assert kv.window == spec.sliding_window and kv.ratio == 4
    kv.add(0)
    before = free_counts(kv)
    with pytest.raises(InvalidRequest) as e:
        kv.reserve({0: 40})                                          # 5 SWA pages of 8 > 3
    assert "swa cache" in str(e.value) and "workload.kv_pool.swa_blocks" in str(e.value)
    assert free_counts(kv) == before
    taken = kv.reserve({0: 24})
    assert taken == {0: {"swa": 3, "compressed": 1, "indexer": 1}}


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), prior=st.lists(st.integers(0, 12), min_size=1, max_size=3),
       new=st.lists(st.integers(0, 12), min_size=1, max_size=3), ratio=st.sampled_from([1, 4, 128]))
def test_rollback_returns_exactly_the_pages_taken(seed, prior, new, ratio):
    kv = make_kv(W=6, swa_bs=3, swa_blocks=40, ratio=ratio, comp_bs=2, comp_blocks=40, seed=seed)
    rids = list(range(max(len(prior), len(new))))
    for r in rids:
        kv.add(r)
    step = {r: n for r, n in zip(rids, prior) if n}
    if step:
        kv.reserve(step)
        for r, n in step.items():
            kv.commit(r, n, {})
    before_sets, before_tables = free_set(kv), tables(kv)
    taken = kv.reserve({r: n for r, n in zip(rids, new)})
    after_tables = tables(kv)
    for r, per in taken.items():                                     # taken = what the tables grew by
        for name, k in per.items():
            assert len(after_tables[r][name]) - len(before_tables[r][name]) == k
            assert after_tables[r][name][: len(before_tables[r][name])] == before_tables[r][name]
    got = {n: set(before_sets[n]) - set(s) for n, s in free_set(kv).items()}
    for name in kv.caches:
        assert got[name] == {p for r in taken for p in after_tables[r][name][len(before_tables[r][name]):]}
    kv.rollback(taken)
    assert free_set(kv) == before_sets
    assert tables(kv) == before_tables


def test_release_returns_every_page():
    kv = make_kv(W=5, swa_bs=2, swa_blocks=30, ratio=4, comp_bs=2, comp_blocks=30, seed=9)
    for r in "ab":
        kv.add(r)
    _run_and_check_swa(kv, [{"a": 7, "b": 3}, {"a": 5}, {"b": 9}, {"a": 1, "b": 1}], {"a": 1, "b": 2})
    assert all(c.allocator.num_free < c.allocator.num_blocks for c in kv.caches.values())
    kv.release("a")
    assert "a" not in kv.requests
    live_b = {n: sum(p >= 0 for p in t) for n, t in kv.requests["b"].tables.items()}
    for n, c in kv.caches.items():
        assert c.allocator.num_free == c.allocator.num_blocks - live_b[n]
    kv.release("b")
    for c in kv.caches.values():
        assert sorted(c.allocator._free) == list(range(c.allocator.num_blocks))
    assert kv.bytes_in_use() == 0


def test_global_slots_refuses_rows_never_reserved():
    kv = make_kv(W=100, swa_bs=2, swa_blocks=8)
    kv.add("a")
    kv.reserve({"a": 3})                                             # pages for positions 0..3
    meta = meta_for(kv, {"a": 3})
    with pytest.raises(RuntimeError, match="without a page"):
        kv.global_slots("swa", meta, torch.tensor([[0, 1, 2, 9]] * 3))   # position 9: no page reserved
