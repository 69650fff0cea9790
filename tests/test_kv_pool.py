"""The paged pool and the step plan's addressing (docs/numerics.md §3.1 slot ids, §2.6 the window).

Expected slots and windows are derived here from the block tables and the spec formulas, never from
the plan's own code; the SWA tests also write a row per position (its value encodes the position) and
read it back through the slots the plan hands out, so they check addressing end to end, across page
reuse.
"""
from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.components.builders import build_pool
from dsv4.components.engine import Engine, Segment
from dsv4.components.kv_pool import BlockAllocator, KVPool, PageGroup, PoolConfig, RowRule
from dsv4.values.seam import PagedCache
from dsv4.values.layer_types import by_ratio
from dsv4.values.device import DeviceInfo
from dsv4.values.errors import InvalidRequest
from dsv4.strategies import PlainRowLayout
from tests.conftest import tiny_spec

F32 = PlainRowLayout(name="float32", dtype="float32")
DIM = 4


def group(name: str, block_size: int, blocks: int, rule: RowRule, seed: int | None = None) -> PageGroup:
    g = PageGroup(name=name, block_size=block_size, num_blocks=blocks, rule=rule, knob=f"{name}_blocks")
    if seed is not None:                      # hand pages out in a scrambled order
        pages = g.allocator.take(blocks)
        random.Random(seed).shuffle(pages)
        g.allocator.give(pages)
    return g


def make_pool(*, W: int, swa_bs: int, swa_blocks: int, ratio: int = 1, comp_bs: int = 4, comp_blocks: int = 16,
              state_blocks: int = 16, seed: int | None = None) -> KVPool:
    groups = {"swa": group("swa", swa_bs, swa_blocks, RowRule(keep=W), seed)}
    if ratio > 1:
        reach = by_ratio(ratio).reach
        groups[f"entries{ratio}"] = group("compressed", comp_bs, comp_blocks, RowRule(per=ratio), seed)
        groups[f"state{ratio}"] = group("state", reach, state_blocks, RowRule(keep=reach, tail_only=True), seed)
    return KVPool(groups=groups, layers={}, window=W)


class Driver:
    """Steps through a pool as the Engine does (lengths, reserve, plan, commit), without layers."""

    def __init__(self, pool: KVPool, W: int) -> None:
        self.pool = pool
        self.engine = Engine(spec=tiny_spec(sliding_window=W), layers={}, pools=[pool], device="cpu")
        self.lengths: dict = {}

    def add(self, rid) -> None:
        self.pool.add(rid)
        self.lengths[rid] = 0

    def segments(self, step: dict) -> tuple[Segment, ...]:
        segs, off = [], 0
        for rid, n in step.items():
            segs.append(Segment(rid=rid, start=self.lengths[rid], offset=off, count=n))
            off += n
        return tuple(segs)

    def reserve(self, step: dict):
        return self.pool.reserve({rid: (self.lengths[rid], self.lengths[rid] + n) for rid, n in step.items()})

    def plan(self, step: dict):
        segs = self.segments(step)
        return self.engine.build_plan(self.pool, self.engine.plan_inputs(self.pool, segs),
                                      num_tokens=sum(step.values())), segs

    def commit(self, step: dict) -> None:
        new = {rid: self.lengths[rid] + n for rid, n in step.items()}
        self.pool.commit(new)
        self.lengths.update(new)


def own_slot(table: list[int], idx: int, B: int) -> int:
    """§3.1: slot = table[idx // B] * B + idx % B; -1 for -1 or a row without a page."""
    if idx < 0 or idx // B >= len(table) or table[idx // B] < 0:
        return -1
    return table[idx // B] * B + idx % B


def position_of_slot(table: list[int], slot: int, B: int) -> int:
    """Invert a slot through the table: (page, offset) -> logical page -> position."""
    page, off = divmod(slot, B)
    assert table.count(page) == 1, (table, slot)
    return table.index(page) * B + off


def row_for(rid_no: int, p: int):
    return torch.tensor([float(p), float(rid_no), 1.0 + p % 7, -2.0 * rid_no])


def free_sets(pool: KVPool) -> dict:
    return {n: sorted(g.allocator.free_pages()) for n, g in pool.groups.items()}


def tables(pool: KVPool) -> dict:
    return {n: {rid: list(t) for rid, t in g.tables.items()} for n, g in pool.groups.items()}


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
@given(seed=st.integers(0, 10_000), swa_bs=st.integers(1, 6), comp_bs=st.integers(1, 5), ratio=st.sampled_from([4, 128]),
       steps=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=6))
def test_plan_slots_follow_the_block_tables(seed, swa_bs, comp_bs, ratio, steps):
    W = 1000                                             # nothing freed: every row stays addressable
    pool = make_pool(W=W, swa_bs=swa_bs, swa_blocks=120, ratio=ratio, comp_bs=comp_bs, comp_blocks=64,
                     state_blocks=16, seed=seed)
    d = Driver(pool, W)
    for rid in "ab":
        d.add(rid)
    reach = by_ratio(ratio).reach
    for na, nb in steps:
        step = {r: n for r, n in (("a", na), ("b", nb)) if n}
        if not step:
            continue
        d.reserve(step)
        plan, segs = d.plan(step)
        for seg in segs:
            swa_t, ent_t = pool.swa.tables[seg.rid], pool.entries(ratio).tables[seg.rid]
            st_t = pool.state(ratio).tables[seg.rid]
            new_len = seg.start + seg.count
            for i in range(seg.count):
                t, p = seg.offset + i, seg.start + i
                assert int(plan.positions[t]) == p and int(plan.step_start[t]) == seg.start
                assert int(plan.swa.write_slots[t]) == own_slot(swa_t, p, swa_bs)
                e = plan.entries[ratio]
                assert int(e.counts[t]) == (p + 1) // ratio
                closes = (p + 1) % ratio == 0
                assert int(e.close_slots[t]) == (own_slot(ent_t, (p + 1) // ratio - 1, comp_bs) if closes else -1)
                kept = p >= new_len - reach + 1           # the rows a later step's compressor reaches
                s = int(plan.state[ratio].write_slots[t])
                assert s == (own_slot(st_t, p, reach) if kept else -1) and (s >= 0) == kept
                if ratio == 128:                         # every visible entry, in order, then -1
                    vis = plan.entries[ratio].visible[t].tolist()
                    n = (p + 1) // ratio
                    assert vis[:n] == [own_slot(ent_t, j, comp_bs) for j in range(n)] and set(vis[n:]) <= {-1}
        for name, g in pool.groups.items():          # the tables in the plan are the pool's
            tab = plan.swa.table if name == "swa" else (plan.state if name.startswith("state") else plan.entries)
            pages = tab.pages if name == "swa" else tab[ratio].table.pages
            for i, seg in enumerate(segs):
                row = g.tables[seg.rid]
                assert pages[i, :len(row)].tolist() == row and set(pages[i, len(row):].tolist()) <= {-1}
        d.commit(step)


def _run_and_check_swa(d: Driver, schedule: list[dict], rid_no: dict) -> int:
    """Drive `schedule` through reserve / plan / write / read / commit, checking every step.
    Returns the number of distinct (request, logical page) pairs ever used."""
    pool = d.pool
    g = pool.swa
    W, B = pool.window, g.block_size
    swa = PagedCache(name="swa", layout=F32, block_size=B, head_dim=DIM,
                     data=F32.allocate(num_blocks=g.num_blocks, block_size=B, head_dim=DIM, device="cpu"))
    logical_pages = set()
    for step in schedule:
        d.reserve(step)
        plan, segs = d.plan(step)
        rows = torch.stack([row_for(rid_no[s.rid], s.start + i) for s in segs for i in range(s.count)])
        swa.write(plan.swa.write_slots, rows)
        idx, lens = plan.swa.indices, plan.swa.lens
        assert idx.dtype == torch.int32 and lens.dtype == torch.int32 and idx.shape[1] == W
        read = swa.read(idx)
        for seg in segs:
            table = g.tables[seg.rid]
            for i in range(seg.count):
                t, p = seg.offset + i, seg.start + i
                L = min(p + 1, W)
                window = list(range(max(0, p - W + 1), p + 1))
                assert int(lens[t]) == L
                assert (idx[t, L:] == -1).all()
                got = [position_of_slot(table, int(s), B) for s in idx[t, :L]]
                assert got == window                                     # exactly the window, via the table
                assert read[t, :L, 0].tolist() == [float(q) for q in window]   # ... and the rows there are ours
                assert (read[t, :L, 1] == rid_no[seg.rid]).all()
        d.commit(step)
        for rid in step:
            new_len = d.lengths[rid]
            table = g.tables[rid]
            first = max(0, new_len - W + 1)                           # lowest position still readable
            assert len(table) == math.ceil(new_len / B)
            for b, page in enumerate(table):
                behind = (b + 1) * B <= first                          # page wholly behind the window
                assert (page == -1) == behind, (b, page, first, table)
                logical_pages.add((rid, b))
        live = [p for t in g.tables.values() for p in t if p >= 0]
        assert len(live) == len(set(live))                            # no page shared between requests
        assert g.allocator.num_free == g.num_blocks - len(live)
        assert not set(live) & set(g.allocator.free_pages())
    return len(logical_pages)


@settings(max_examples=30, deadline=None)
@given(W=st.integers(1, 20), B=st.integers(1, 8), seed=st.integers(0, 99),
       chunks=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=14))
def test_swa_indices_window_freeing_and_reuse(W, B, seed, chunks):
    cmax = max(max(a, b) for a, b in chunks)
    per_req = math.ceil((W - 1 + cmax) / B) + 1                      # the most pages one request holds
    d = Driver(make_pool(W=W, swa_bs=B, swa_blocks=2 * per_req, seed=seed), W)
    d.add("a")
    d.add("b")
    schedule = [{r: n for r, n in (("a", a), ("b", b)) if n} for a, b in chunks]
    _run_and_check_swa(d, [s for s in schedule if s], {"a": 1, "b": 2})


def test_swa_pages_are_reused_long_decode():
    """40 single-token decode steps through a 3-page pool: pages behind the window come back and are reused."""
    d = Driver(make_pool(W=4, swa_bs=2, swa_blocks=3, seed=1), 4)
    d.add("r")
    used = _run_and_check_swa(d, [{"r": 3}] + [{"r": 1}] * 37, {"r": 5})
    assert used == 20 > d.pool.swa.num_blocks                        # 20 logical pages lived in 3 physical ones
    assert d.pool.swa.tables["r"][:18] == [-1] * 18
    d.pool.release("r")
    assert d.pool.swa.allocator.num_free == 3


def test_swa_pages_freed_on_commit_return_to_allocator():
    d = Driver(make_pool(W=5, swa_bs=4, swa_blocks=8), 5)
    d.add("r")
    d.reserve({"r": 12})                                             # pages for positions 0..11
    assert d.pool.swa.allocator.num_free == 5
    pages = list(d.pool.swa.tables["r"])
    d.commit({"r": 12})                                              # future queries read >= 12-5+1 = 8
    assert d.pool.swa.tables["r"] == [-1, -1, pages[2]]
    assert d.pool.swa.allocator.num_free == 7
    assert set(pages[:2]) <= set(d.pool.swa.allocator.free_pages())
    d.pool.commit({"r": 12})                                         # idempotent
    assert d.pool.swa.allocator.num_free == 7


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("chunk", [1, 3, 37, 300])
def test_compressor_state_pages_stay_bounded(ratio, chunk):
    """Whatever the step size, a request holds at most two state pages after a commit (its last coff·R
    positions), takes at most two more within a step, and the rows kept are exactly the last reach."""
    reach = by_ratio(ratio).reach
    d = Driver(make_pool(W=8, swa_bs=64, swa_blocks=64, ratio=ratio, comp_bs=4, comp_blocks=64, state_blocks=4), 8)
    d.add("r")
    while d.lengths["r"] < 900:
        step = {"r": chunk}
        d.reserve(step)
        assert d.pool.state(ratio).live_pages("r") <= 4
        plan, _ = d.plan(step)
        kept = sorted(int(p) for p, s in zip(plan.positions, plan.state[ratio].write_slots) if s >= 0)
        n = d.lengths["r"] + chunk
        assert kept == list(range(max(d.lengths["r"], n - reach + 1), n))
        d.commit(step)
        assert d.pool.state(ratio).live_pages("r") <= 2


# ---- reserve / rollback / release -------------------------------------------------------------
@pytest.mark.parametrize("small", ["swa", "entries4", "state4"])
def test_reserve_refuses_when_pool_too_small_taking_nothing(small):
    sizes = {"swa": 20, "entries4": 20, "state4": 20}
    sizes[small] = 2 if small != "state4" else 3                     # only this group is too small
    pool = make_pool(W=4, swa_bs=4, swa_blocks=sizes["swa"], ratio=4, comp_bs=2, comp_blocks=sizes["entries4"],
                     state_blocks=sizes["state4"], seed=3)
    d = Driver(pool, 4)
    for r in "abc":
        d.add(r)
    d.reserve({"a": 4})                                              # fits: 1 swa page, 1 entry, 1 state page
    d.commit({"a": 4})
    before = free_sets(pool), tables(pool)
    with pytest.raises(InvalidRequest) as e:
        d.reserve({"a": 20, "b": 4, "c": 4})                         # 6 swa pages, 3 + 1 + 1 entry pages, 6 state
    msg = str(e.value)
    assert f"of the {pool.groups[small].name} cache" in msg and f"workload.kv_pool.{pool.groups[small].knob}" in msg
    assert (free_sets(pool), tables(pool)) == before                 # no page taken from ANY group
    d.reserve({"a": 4})                                              # the pool still works afterwards


def test_reserve_is_atomic_across_requests():
    d = Driver(make_pool(W=8, swa_bs=4, swa_blocks=4), 8)
    for r in "abc":
        d.add(r)
    before = (free_sets(d.pool), tables(d.pool))
    with pytest.raises(InvalidRequest) as e:                         # each fits alone, not together
        d.reserve({"a": 8, "b": 8, "c": 4})
    assert "swa" in str(e.value) and "workload.kv_pool.swa_blocks" in str(e.value)
    assert (free_sets(d.pool), tables(d.pool)) == before
    d.reserve({"a": 8, "b": 8})
    assert d.pool.swa.allocator.num_free == 0


def test_reserve_refusal_with_the_builder_pool():
    """build_pool with the tiny spec's three layer types: every group, and a refusal naming its knob."""
    spec = tiny_spec()
    pool = build_pool(spec=spec, layers=[0, 1, 2], layout=F32, device=DeviceInfo(platform="cpu"), dtype="float32",
                      pool=PoolConfig(swa_block_size=8, compressed_block_tokens=32, swa_blocks=3,
                                      compressed_blocks=8, max_requests=2))
    assert set(pool.groups) == {"swa", "entries4", "state4", "entries128", "state128"}
    assert pool.window == spec.sliding_window and pool.ratios() == (4, 128)
    assert pool.groups["state4"].num_blocks == 8                     # 4 pages per request
    c = pool.layers[1]
    assert c.ratio == 4 and c.compressed is not None and c.indexer_keys is not None and c.indexer_state is not None
    assert c.state.width == 2 * spec.head_dim and c.indexer_state.width == 2 * spec.index_head_dim
    pool.add(0)
    before = free_sets(pool)
    with pytest.raises(InvalidRequest) as e:
        pool.reserve({0: (0, 40)})                                   # 5 SWA pages of 8 > 3
    assert "swa cache" in str(e.value) and "workload.kv_pool.swa_blocks" in str(e.value)
    assert free_sets(pool) == before
    res = pool.reserve({0: (0, 24)})
    assert {n: len(t[0][1]) for n, t in res.taken.items()} == {"swa": 3, "entries4": 1, "state4": 1,
                                                                "entries128": 0, "state128": 1}


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), prior=st.lists(st.integers(0, 12), min_size=1, max_size=3),
       new=st.lists(st.integers(0, 12), min_size=1, max_size=3), ratio=st.sampled_from([1, 4, 128]))
def test_rollback_returns_exactly_the_pages_taken(seed, prior, new, ratio):
    pool = make_pool(W=6, swa_bs=3, swa_blocks=40, ratio=ratio, comp_bs=2, comp_blocks=40, state_blocks=40, seed=seed)
    d = Driver(pool, 6)
    rids = list(range(max(len(prior), len(new))))
    for r in rids:
        d.add(r)
    step = {r: n for r, n in zip(rids, prior) if n}
    if step:
        d.reserve(step)
        d.commit(step)
    before_sets, before_tables = free_sets(pool), tables(pool)
    res = d.reserve({r: n for r, n in zip(rids, new)})
    for name, g in pool.groups.items():                              # taken = what the tables gained
        gained = {p for rid in rids for p in g.tables[rid]} - {p for t in before_tables[name].values() for p in t}
        got = set(before_sets[name]) - set(free_sets(pool)[name])
        assert got == gained - {-1}
        assert sum(len(t[1]) for t in res.taken[name].values()) == len(got)
    pool.rollback(res)
    assert free_sets(pool) == before_sets
    assert tables(pool) == before_tables


def test_release_returns_every_page():
    d = Driver(make_pool(W=5, swa_bs=2, swa_blocks=30, ratio=4, comp_bs=2, comp_blocks=30, state_blocks=30, seed=9), 5)
    for r in "ab":
        d.add(r)
    _run_and_check_swa(d, [{"a": 7, "b": 3}, {"a": 5}, {"b": 9}, {"a": 1, "b": 1}], {"a": 1, "b": 2})
    assert all(g.allocator.num_free < g.num_blocks for g in d.pool.groups.values())
    d.pool.release("a")
    for g in d.pool.groups.values():
        assert "a" not in g.tables
        assert g.allocator.num_free == g.num_blocks - sum(p >= 0 for p in g.tables["b"])
    d.pool.release("b")
    for g in d.pool.groups.values():
        assert sorted(g.allocator.free_pages()) == list(range(g.num_blocks))


def test_plan_validate_refuses_what_an_engine_got_wrong():
    """A plan an engine filled itself: pages outside the pool and rows without a page are named."""
    from dataclasses import replace

    from dsv4.components.plan import PageTable, StepPlan

    d = Driver(make_pool(W=4, swa_bs=2, swa_blocks=8, ratio=4, comp_bs=2, comp_blocks=8, state_blocks=8), 4)
    d.add("a")
    d.reserve({"a": 6})
    plan, _ = d.plan({"a": 6})
    plan.validate(swa_blocks=8, state_blocks={4: 8}, entry_blocks={4: 8})    # our own: fine
    bad = plan.swa.table.pages.clone()
    bad[0, 0] = 8
    wrong = replace(plan, swa=replace(plan.swa, table=replace(plan.swa.table, pages=bad)))
    with pytest.raises(ValueError, match=r"swa table names pages \[8\] outside the pool \[0, 8\)"):
        wrong.validate(swa_blocks=8)
    holes = StepPlan.build(query_start=plan.query_start, seq_lens=plan.seq_lens, window=4,
                           swa=PageTable(block_size=2, pages=torch.full((1, 3), -1, dtype=torch.int32)))
    with pytest.raises(ValueError, match="an SWA row of the step has no page"):
        holes.validate(swa_blocks=8)
