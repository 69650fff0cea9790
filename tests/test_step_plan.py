"""The step plan is a public value: an engine with its own pages and block tables fills one and calls the
layer without our Engine, and gets the oracle's outputs.

The "engine" here is written the way a serving engine's scheduler is: every request owns a fixed
range of pages in each page group (no allocator, nothing freed), tables are plain int32 tensors, and
each step it hands the layer `query_start`, `seq_lens` and the tables. Storage comes straight from the
cache layout's `allocate`.
"""
from __future__ import annotations

import pytest
import torch

from dsv4 import oracle as ref
from dsv4.checks.catalogue import strategies
from dsv4.components.builders import build_layer
from dsv4.components.kv_pool import LayerCaches, CompressorState
from dsv4.values.seam import PagedCache
from dsv4.components.plan import PageTable, StepPlan, TypePlan
from dsv4.values.layer_types import by_ratio
from dsv4.components.weights import random_layer_weights
from dsv4.values.device import DeviceInfo
from dsv4.strategies import NoHeadPadding, PlainRowLayout, ReferenceMQA, ReferenceOProj
from tests.conftest import chunked, drive, hidden_for, make_engine, tiny_spec

CPU = DeviceInfo(platform="cpu")
LAYOUT = PlainRowLayout(name="float32", dtype="float32")


class OwnEngine:
    """Fixed page ranges per request: request i owns pages [i·P, (i+1)·P) of every group."""

    def __init__(self, spec, layer: int, requests: int, max_len: int) -> None:
        self.spec, self.ratio = spec, spec.compress_ratio(layer)
        st = strategies(mqa_kernel=ReferenceMQA(), o_proj=ReferenceOProj(), head_padding=NoHeadPadding(),
                        cache_layout=LAYOUT)
        self.W = random_layer_weights(spec, layer, 3)
        self.layer = build_layer(spec=spec, layer=layer, weights=self.W, rank=0, tp_size=1, strategies=st,
                                 device=CPU, dtype="float32")
        self.blocks = {"swa": 8}
        self.pages = {"swa": -(-max_len // 8)}
        R = self.ratio
        if R > 1:
            self.blocks |= {"state": by_ratio(R).reach, "entries": 4}
            self.pages |= {"state": -(-max_len // by_ratio(R).reach), "entries": -(-(max_len // R) // 4)}

        def paged(name, lay, group, dim):
            n = requests * self.pages[group]
            return PagedCache(name=name, layout=lay, block_size=self.blocks[group], head_dim=dim,
                              data=lay.allocate(num_blocks=n, block_size=self.blocks[group], head_dim=dim, device="cpu"))

        def state(width):
            n = requests * self.pages["state"] * self.blocks["state"]
            return CompressorState(data=torch.zeros(n, 2 * width), block_size=self.blocks["state"], width=width)

        kw = {}
        D, Di = spec.head_dim, spec.index_head_dim
        if R > 1:
            coff = 2 if R == 4 else 1
            kw |= dict(compressed=paged("compressed", LAYOUT, "entries", D), state=state(coff * D))
        if R == 4:
            kw |= dict(indexer_keys=paged("indexer", PlainRowLayout(name="float32", dtype="float32"), "entries", Di), indexer_state=state(2 * Di))
        self.caches = LayerCaches(ratio=R, swa=paged("swa", LAYOUT, "swa", D), **kw)
        self.lengths = [0] * requests

    def table(self, group: str, rids) -> PageTable:
        P = self.pages[group]
        pages = torch.stack([torch.arange(r * P, (r + 1) * P, dtype=torch.int32) for r in rids])
        return PageTable(block_size=self.blocks[group], pages=pages)

    def step(self, chunks: dict[int, torch.Tensor]):
        rids = list(chunks)
        counts = [chunks[r].shape[0] for r in rids]
        qs = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        lens = torch.tensor([self.lengths[r] + c for r, c in zip(rids, counts)], dtype=torch.int32)
        kw = {}
        if self.ratio > 1:
            kw = dict(state={self.ratio: self.table("state", rids)}, entries={self.ratio: self.table("entries", rids)})
        plan = StepPlan.build(query_start=qs, seq_lens=lens, swa=self.table("swa", rids), window=self.spec.sliding_window,
                              **kw)
        plan.validate(swa_blocks=self.caches.swa.data.shape[0])
        if self.layer.indexer is not None:          # its indexer's per-step plan (None on the CPU)
            plan = plan.with_type_plans({self.layer.layer_type: TypePlan(
                indexer=self.layer.ops.index_plan(self.layer.indexer, plan))})
        out = self.layer(torch.cat([chunks[r] for r in rids]), plan, self.caches)
        assert not bool(out.faults.any())
        for r, c in zip(rids, counts):
            self.lengths[r] += c
        return out


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["swa", "c4a", "c128a"])
def test_an_engine_of_its_own_fills_the_plan_and_matches_the_oracle(layer):
    spec = tiny_spec()
    lengths = {0: 270, 1: 41}
    X = hidden_for({r: n + 4 for r, n in lengths.items()}, spec.hidden_size, seed=5)
    own = OwnEngine(spec, layer, requests=2, max_len=280)
    outs = {r: [] for r in lengths}
    topk = {r: [] for r in lengths}
    done = {r: 0 for r in lengths}
    schedule = chunked(lengths, 50) + [{0: 2, 1: 2}, {0: 2, 1: 2}]
    for step in schedule:
        chunk = {r: X[r][done[r]:done[r] + n] for r, n in step.items()}
        res = own.step(chunk)
        off = 0
        for r, n in step.items():
            outs[r].append(res.out[off:off + n])
            if res.topk is not None:
                topk[r].append(res.topk[off:off + n])
            off += n
            done[r] += n
    # our Engine, same weights, same schedule
    eng, _ = make_engine(spec, layers=(layer,), weights={layer: own.W})
    ours, our_topk = drive(eng, {r: X[r] for r in lengths}, schedule)
    for r in lengths:
        y = torch.cat(outs[r])
        sel = torch.cat(topk[r]).long() if topk[r] else None
        o = ref.oracle_layer(spec.to_dump(), spec.compress_ratio(layer), own.W, X[r], row_format="float32", topk=sel)
        assert ref.rel_err(y, o["out"]) <= 1e-5
        assert ref.rel_err(y, ours[layer][r]) <= 1e-6
        if sel is not None:
            assert torch.equal(torch.cat(topk[r]), our_topk[layer][r])


def test_an_eager_steps_plan_inputs_keep_their_alignment_and_table_widths():
    """What keeps a new step length from compiling a new kernel variant (dsv4.components.engine): every
    packed plan input starts 16-byte aligned in the one host-to-device buffer, and block tables are a
    multiple of TABLE_PAGES pages wide, whatever the step's requests and lengths."""
    from dsv4.components.engine import ALIGN, TABLE_PAGES, Segment, pack_inputs, unpack_inputs

    spec = tiny_spec()
    eng, _ = make_engine(spec, layout=LAYOUT, dtype="float32")
    X = hidden_for({"a": 70, "b": 9, "c": 1}, spec.hidden_size)
    drive(eng, X, [{"a": 70, "b": 9, "c": 1}])
    pool = eng.pools[0]
    for segs in ([Segment(rid="a", start=70, offset=0, count=1)],
                 [Segment(rid=r, start=n, offset=i, count=1) for i, (r, n) in enumerate({"a": 70, "b": 9}.items())],
                 [Segment(rid=r, start=n, offset=2 * i, count=2) for i, (r, n) in
                  enumerate({"a": 70, "b": 9, "c": 1}.items())]):
        reserved = pool.reserve({s.rid: (s.start, s.start + s.count) for s in segs})
        host = eng.plan_inputs(pool, segs)
        buf = torch.from_numpy(pack_inputs(host))
        parts = unpack_inputs(buf, host)
        for name, a in host.items():
            assert parts[name].storage_offset() % ALIGN == 0 and buf.data_ptr() % 16 == 0, name
            assert torch.equal(parts[name], torch.from_numpy(a)), name
            if name not in ("query_start", "seq_lens"):
                assert a.shape[1] % TABLE_PAGES == 0, name
                for i, seg in enumerate(segs):                  # the request's table, then -1
                    row = pool.groups[name].tables[seg.rid]
                    assert a[i, :len(row)].tolist() == list(row) and (a[i, len(row):] == -1).all(), name
        pool.rollback(reserved)


def test_runs_say_which_tokens_are_one_requests_consecutive_positions():
    """StepPlan.runs: per token, its index among its request's tokens of the step and how many are left (a
    request with no tokens adds nothing, padding rows are runs of one), the runs cut into groups of 2 and
    of 3 in order; and the SWA windows of a run's tokens are what the Hopper kernel's union assumes: each
    the one before it shifted by one position."""
    qs = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    lens = torch.tensor([300, 7, 130, 4], dtype=torch.int32)
    pages = torch.arange(4 * 5, dtype=torch.int32).view(4, 5)
    plan = StepPlan.build(query_start=qs, seq_lens=lens, swa=PageTable(block_size=64, pages=pages), window=128,
                          num_tokens=8)
    runs = plan.runs
    assert runs.tokens.dtype == torch.int32
    assert runs.tokens.tolist() == [[0, 2], [1, 1], [0, 3], [1, 2], [2, 1], [0, 1], [0, 1], [0, 1]]
    assert runs.groups(2).tolist() == [[0, 2], [2, 2], [4, 1], [5, 1], [6, 1], [7, 1], [0, 0], [0, 0]]
    assert runs.groups(3).tolist() == [[0, 2], [2, 3], [5, 1], [6, 1], [7, 1], [0, 0], [0, 0], [0, 0]]
    assert runs.groups(2) is runs.groups(2)             # once per step
    idx, n = plan.swa.indices, plan.swa.lens
    for t in (0, 2, 3):                     # the next token of the run: the same window, moved by one
        a, b = idx[t, :n[t]].tolist(), idx[t + 1, :n[t + 1]].tolist()
        assert b[:len(b) - 1] == a[len(a) - (len(b) - 1):] and len(b) - len(a) in (0, 1)


def test_each_layer_types_plans_are_made_once_per_step_into_a_frozen_plan():
    """Engine.type_plans: one (MQA kernel plan, indexer plan) per layer type, shared by its layers; the kernel is
    handed its previous step's plan, none for a graph capture (`fresh`). The step plan carrying them is a new,
    read-only value sharing the first's RoPE rows; the first is unchanged."""
    from dsv4.components.plan import NO_TYPE_PLAN

    spec = tiny_spec(num_hidden_layers=4, compress_ratios=[0, 4, 128, 4, 0])
    eng, _ = make_engine(spec, layers=(0, 1, 2, 3))
    calls = []

    class Kernel:
        def plan(self, *, tokens, layer_type, previous=None):
            calls.append((layer_type, previous))
            return f"{layer_type}#{len(calls)}"

    for ranks in eng.layers.values():
        ranks[0].mqa_kernel = Kernel()
    pool = eng.pools[0]
    plan = eng.build_plan(pool, eng.plan_inputs(pool, (), requests=2), num_tokens=2)
    types = ["swa", "c4a", "c128a"]
    first = eng.type_plans(plan, 0, fresh=True)
    assert calls == [(t, None) for t in types] and list(first) == types
    assert first["c4a"].indexer is None and first["swa"].indexer is None     # the torch path, no indexer
    second = eng.type_plans(plan, 0)
    assert calls[3:] == [(t, first[t].kernel) for t in types]
    eng.type_plans(plan, 0, fresh=True)
    assert calls[6:] == [(t, None) for t in types]

    typed = plan.with_type_plans(second)
    assert {t: typed.type_plan(t).kernel for t in types} == {t: second[t].kernel for t in types}
    assert typed.type_plan("c4a").indexer is None and typed.type_plan("c4a") is second["c4a"]
    assert typed.type_plan("absent") is NO_TYPE_PLAN and not plan.type_plans
    with pytest.raises(TypeError):
        typed.type_plans["swa"] = None
    rope = eng.layers[0][0].rope
    assert typed.rope_rows(rope) is plan.rope_rows(rope)
