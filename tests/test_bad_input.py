"""Bad input gets a clear error and harms nothing: no other request's pages, state or outputs change."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from dsv4 import oracle as ref
from dsv4.errors import IncompatibleCombination, InvalidRequest
from tests.conftest import chunked, drive, hidden_for, make_engine, tiny_spec


def snapshot(engine):
    """Every byte of every cache and compressor-state page, every block table, free list and length."""
    data = {(r, l, i): t.clone() for r, pool in enumerate(engine.pools) for l, c in pool.layers.items()
            for i, t in enumerate(c.tensors())}
    free = {(r, n): sorted(g.allocator._free) for r, pool in enumerate(engine.pools) for n, g in pool.groups.items()}
    tables = {(r, n): copy.deepcopy(g.tables) for r, pool in enumerate(engine.pools) for n, g in pool.groups.items()}
    return data, free, tables, {}, dict(engine.lengths)


def live_rows(engine):
    """What any request can still read: its SWA rows in the window, its compressed entries and indexer
    keys, its kept compressor-state rows -- each read through its page table."""
    out = {}
    for r, pool in enumerate(engine.pools):
        for l, c in pool.layers.items():
            for rid, n in engine.lengths.items():
                def rows(group, count, first=0, dev=c.swa.data.device):
                    g = pool.groups[group]
                    idx = torch.arange(first, count, device=dev)
                    table = torch.tensor(g.tables[rid] + [-1], device=dev)
                    page = table[(idx // g.block_size).clamp(max=len(table) - 1)]
                    return torch.where(page >= 0, page * g.block_size + idx % g.block_size, -1).int()
                swa = pool.groups["swa"]
                out[(r, l, rid, "swa")] = c.swa.read(rows("swa", n, swa.rule.first_kept(n)))
                if c.compressed is not None:
                    e = rows(f"entries{c.ratio}", n // c.ratio)
                    out[(r, l, rid, "compressed")] = c.compressed.read(e)
                    st = pool.groups[f"state{c.ratio}"]
                    s_rows = rows(f"state{c.ratio}", n, st.rule.first_kept(n)).long()
                    out[(r, l, rid, "state")] = c.state.data[s_rows]
                    if c.indexer_keys is not None:
                        out[(r, l, rid, "indexer")] = c.indexer_keys.read(e)
                        out[(r, l, rid, "indexer_state")] = c.indexer_state.data[s_rows]
    return out


def assert_unchanged(before, after):
    caches0, free0, tables0, states0, len0 = before
    caches1, free1, tables1, states1, len1 = after
    assert free0 == free1 and tables0 == tables1 and len0 == len1
    assert caches0.keys() == caches1.keys()
    assert all(torch.equal(caches0[k], caches1[k]) for k in caches0)
    assert states0.keys() == states1.keys()
    assert all(torch.equal(states0[k][0], states1[k][0]) and torch.equal(states0[k][1], states1[k][1])
               for k in states0)


def assert_rolled_back(before, rows0, eng):
    """After a step failed inside the forward: the same pages, tables, states and lengths, and every
    row any request can read unchanged (the failed step's own new slots may hold garbage)."""
    _, *rest0 = before
    _, *rest1 = snapshot(eng)
    assert all(map(_equal, rest0, rest1))          # free pages, tables, compressor states, lengths
    rows1 = live_rows(eng)
    assert rows0.keys() == rows1.keys() and all(torch.equal(rows0[k], rows1[k]) for k in rows0)


def _equal(x, y):
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, tuple):
        return len(x) == len(y) and all(map(_equal, x, y))
    return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def started_engine(**kw):
    spec = tiny_spec(**kw.pop("spec", {}))
    eng, W = make_engine(spec, **kw)
    X = hidden_for({"a": 80, "b": 80}, spec.hidden_size)
    drive(eng, {r: X[r][:40] for r in X}, chunked({"a": 40, "b": 40}, 13))
    return spec, eng, W, X


def step(eng, chunks: dict):
    xs = torch.cat([x for x, _ in chunks.values()])
    pos = torch.cat([torch.arange(s, s + len(x)) for x, s in chunks.values()])
    ids = [r for r, (x, _) in chunks.items() for _ in range(len(x))]
    return eng.step(xs, pos, ids)


def test_bad_request_in_a_batch_is_refused_whole_and_touches_nothing():
    spec, eng, W, X = started_engine()
    eng.add_request("c")
    bad = torch.randn(5, spec.hidden_size)
    bad[2, 7] = float("nan")
    before = snapshot(eng)
    with pytest.raises(InvalidRequest, match=r"request 'c': hidden_states contain NaN"):
        step(eng, {"a": (X["a"][40:45], 40), "c": (bad, 0)})
    assert_unchanged(before, snapshot(eng))
    # a and b continue exactly as if c had never been there
    ref_eng, _ = make_engine(spec, weights=W)
    drive(ref_eng, {r: X[r][:40] for r in X}, chunked({"a": 40, "b": 40}, 13))
    o1 = step(eng, {"a": (X["a"][40:45], 40), "b": (X["b"][40:42], 40)})
    o2 = step(ref_eng, {"a": (X["a"][40:45], 40), "b": (X["b"][40:42], 40)})
    for layer in o1.outputs:
        assert torch.equal(o1.outputs[layer], o2.outputs[layer])


def test_failure_inside_the_forward_is_rolled_back():
    spec, eng, W, X = started_engine()

    @dataclass(frozen=True)
    class Boom:
        name: str = "boom"

        def plan(self, **k):
            return None

        def __call__(self, *a, **k):
            raise RuntimeError("kernel exploded")

    layer = next(l for l in eng.layers if spec.compress_ratio(l) == 4)
    kernel = eng.layers[layer][0].mqa_kernel
    eng.layers[layer][0].mqa_kernel = Boom()
    before, rows0 = snapshot(eng), live_rows(eng)
    with pytest.raises(RuntimeError, match="kernel exploded"):
        step(eng, {"a": (X["a"][40:70], 40)})      # allocates new pages and closes compressor blocks
    assert_rolled_back(before, rows0, eng)
    eng.layers[layer][0].mqa_kernel = kernel
    o = step(eng, {"a": (X["a"][40:80], 40), "b": (X["b"][40:80], 40)})
    for l, y in o.outputs.items():           # the retried step is exact against the oracle
        for rid, rows in (("a", slice(0, 40)), ("b", slice(40, 80))):
            want = ref.oracle_layer(spec.to_dump(), spec.compress_ratio(l), W[l], X[rid], row_format="float32",
                                    topk=None if l not in o.topk else torch.cat(
                                        (torch.full((40, spec.index_topk), -1), o.topk[l][rows].long())))
            assert ref.rel_err(y[rows], want["out"][40:80]) <= 1e-5


def test_request_longer_than_the_pool():
    spec, eng, W, X = started_engine(swa_blocks=40, compressed_blocks=4, compressed_block_tokens=32)
    eng.add_request("huge")
    before = snapshot(eng)
    with pytest.raises(InvalidRequest, match=r"KV pool full: request 'huge' needs 7 pages of the ratio-4 compressed cache, "
                                             r"more than the whole pool .*raise workload.kv_pool.compressed_blocks"):
        step(eng, {"huge": (torch.randn(200, spec.hidden_size), 0)})
    assert_unchanged(before, snapshot(eng))
    with pytest.raises(InvalidRequest, match=r"KV pool full: the step needs \d+ new pages of the ratio-4 compressed cache"):
        step(eng, {"a": (X["a"][40:80], 40), "huge": (torch.randn(60, spec.hidden_size), 0)})
    assert_unchanged(before, snapshot(eng))


def test_positions():
    spec, eng, W, X = started_engine(spec={"max_position_embeddings": 45})
    with pytest.raises(InvalidRequest, match=r"request 'a': positions must continue at 40 \(40..44\), got 41..45"):
        eng.step(X["a"][40:45], torch.arange(41, 46), ["a"] * 5)
    with pytest.raises(InvalidRequest, match=r"position 47 is beyond the model's range \(max_position_embeddings=45\)"):
        step(eng, {"a": (X["a"][40:48], 40)})
    step(eng, {"a": (X["a"][40:45], 40)})         # up to the last position is fine
    with pytest.raises(InvalidRequest, match=r"positions must be an integer tensor"):
        eng.step(X["b"][40:42], torch.tensor([40.0, 41.0]), ["b", "b"])


def test_unknown_and_malformed_requests():
    spec, eng, W, X = started_engine()
    before = snapshot(eng)
    with pytest.raises(InvalidRequest, match=r"unknown request 'zz' \(known: 'a', 'b'\)"):
        step(eng, {"a": (X["a"][40:42], 40), "zz": (X["b"][:2], 0)})
    with pytest.raises(InvalidRequest, match=r"request 'a': its tokens must be contiguous"):
        eng.step(X["a"][40:43], torch.tensor([40, 41, 42]), ["a", "b", "a"])
    with pytest.raises(InvalidRequest, match=r"hidden_states must be a float tensor \[T, 256\]"):
        eng.step(X["a"][40:42, :100], torch.tensor([40, 41]), ["a", "a"])
    with pytest.raises(InvalidRequest, match=r"2 entries for 3 tokens"):
        eng.step(X["a"][40:43], torch.tensor([40, 41, 42]), ["a", "a"])
    with pytest.raises(InvalidRequest, match="already exists"):
        eng.add_request("a")
    with pytest.raises(InvalidRequest, match="unknown request 'q'"):
        eng.release("q")
    assert_unchanged(before, snapshot(eng))


def test_releasing_a_request_returns_its_pages_and_leaves_others():
    spec, eng, W, X = started_engine()
    free0 = {n: g.allocator.num_free for n, g in eng.pools[0].groups.items()}
    groups = eng.pools[0].groups
    a_pages = {n: sum(b >= 0 for b in g.tables["a"]) for n, g in groups.items()}
    b_before = {n: list(g.tables["b"]) for n, g in groups.items()}
    eng.release("a")
    for n, g in groups.items():
        assert g.allocator.num_free == free0[n] + a_pages[n]
        assert "a" not in g.tables and g.tables["b"] == b_before[n]


def test_heads_not_divisible_by_tp_size_is_refused_before_building(compose_cfg, tmp_path):
    from dsv4.app import main

    cfg = compose_cfg(["model=dsv4_tiny", "tp_size=3"])
    with pytest.raises(IncompatibleCombination, match=r"tp_size=3: must divide num_attention_heads=8 and o_groups=2"):
        main(cfg, out_dir=tmp_path)
    import json
    row = json.loads((tmp_path / "result.json").read_text())
    assert row["status"] == "incompatible" and row["problems"][0]["fix"] == "tp_size=2"


def test_non_finite_rows_are_refused_naming_layer_and_token():
    """A NaN that arises inside the layer (here: an inf weight) is never packed into a page: the step is
    refused after the forward (one read of the layers' fault flags), the failing layer's cache bytes are
    as they were, and every row any request can read is unchanged."""
    spec, eng, W, X = started_engine()
    swa_layer = next(l for l in eng.layers if spec.compress_ratio(l) == 1)
    module = eng.layers[swa_layer][0]
    kv_rows = module.w_in[spec.q_lora_rank:]             # the wkv rows of the fused input projection
    saved = kv_rows.clone()
    kv_rows[:, 3] = float("inf")
    before, rows0 = snapshot(eng), live_rows(eng)
    own = [t.clone() for t in eng.pools[0].layers[swa_layer].tensors()]
    with pytest.raises(InvalidRequest, match=rf"non-finite swa row \(layer {swa_layer}, request 'b', position 40\)"):
        step(eng, {"b": (X["b"][40:44], 40)})
    assert_rolled_back(before, rows0, eng)
    assert all(torch.equal(a, b) for a, b in zip(own, eng.pools[0].layers[swa_layer].tensors()))
    kv_rows.copy_(saved)

    c128 = next(l for l in eng.layers if spec.compress_ratio(l) == 128)
    layer = eng.layers[c128][0]
    layer.w_in[sum(layer.in_sizes[:2]) + 7] = float("nan")   # the compressor's candidate channel 7
    before, rows0 = snapshot(eng), live_rows(eng)
    with pytest.raises(InvalidRequest, match=rf"non-finite compressed row \(layer {c128}, request 'a', compressed entry 0 "
                                             r"closed at position 127\)"):
        step(eng, {"a": (torch.randn(100, spec.hidden_size), 40)})
    assert_rolled_back(before, rows0, eng)


def test_a_prompt_past_the_models_positions_is_refused_before_the_work():
    """A request whose prompt and decode steps reach past max_position_embeddings is refused by check (and so
    before `run` allocates anything), naming the request and the longest prompt that fits."""
    from dataclasses import replace

    import dsv4
    from dsv4.errors import IncompatibleCombination
    from dsv4.job import workload_problems

    base = dsv4.compose(["model=dsv4_tiny", "workload.kv_pool.swa_blocks=100",
                         "workload.kv_pool.compressed_blocks=4200"], running=False)
    fits = replace(base, workload=replace(base.workload, prompt_lens=(1048570, 5)))
    assert fits.workload.total_len(0) == 1048576
    assert workload_problems(fits) == []       # (a job this long is judged by its memory next: run's grading)
    with pytest.raises(IncompatibleCombination, match=r"request 0 reaches position 1048576.*at most 1048570 tokens"):
        dsv4.compose(["model=dsv4_tiny", "workload.prompt_lens=[1048571,5]", "workload.kv_pool.swa_blocks=100000",
                      "workload.kv_pool.compressed_blocks=100000"], running=False)
