"""Processing order does not matter: one prefill, chunks of any size, token by token, MTP decode."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from dsv4 import oracle as ref
from tests.conftest import chunked, drive, hidden_for, make_engine, tiny_spec

LENGTHS = {"a": 270, "b": 23}       # a: 2 ratio-128 entries, 67 ratio-4 entries; b: short, mixed in


def outputs_for(schedule, W=None, seed=0, lengths=LENGTHS):
    spec = tiny_spec()
    eng, W = make_engine(spec, weights=W, seed=seed)
    X = hidden_for(lengths, spec.hidden_size, seed=7)
    outs, topk = drive(eng, X, schedule)
    return outs, topk, W


def assert_same(o1, o2, tol=1e-5):
    for layer in o1:
        for rid in o1[layer]:
            assert o1[layer][rid].shape == o2[layer][rid].shape
            assert ref.rel_err(o1[layer][rid], o2[layer][rid]) <= tol, (layer, rid)


def test_one_prefill_equals_chunks_equals_token_by_token():
    whole, topk_whole, W = outputs_for([dict(LENGTHS)])
    for chunk in (5, 7, 128):         # 5 and 7 put chunk boundaries inside ratio-4 blocks
        outs, topk, _ = outputs_for(chunked(LENGTHS, chunk), W)
        assert_same(whole, outs)
    tokens, topk_tok, _ = outputs_for(chunked(LENGTHS, 1), W)
    assert_same(whole, tokens)
    for layer in topk_whole:          # the indexer selects the same sets either way
        for rid in LENGTHS:
            a = [set(r[r >= 0].tolist()) for r in topk_whole[layer][rid]]
            b = [set(r[r >= 0].tolist()) for r in topk_tok[layer][rid]]
            assert sum(x == y for x, y in zip(a, b)) >= 0.95 * len(a)


def test_multi_token_decode_equals_single_token_decode():
    prompt = {"a": 250, "b": 20}
    mtp = [dict(prompt)] + [{"a": 3, "b": 3}] * 4              # crosses the 256-token ratio-128 boundary
    single = [dict(prompt)] + [{"a": 1, "b": 1}] * 12
    total = {"a": 262, "b": 32}
    o1, _, W = outputs_for(mtp, lengths=total)
    o2, _, _ = outputs_for(single, W, lengths=total)
    assert_same(o1, o2)


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.lists(st.integers(1, 9), min_size=1, max_size=6))
def test_random_schedules(chunks_a, chunks_b):
    """Random per-request chunkings, interleaved in one batch, give the whole-prefill outputs."""
    schedule, done = [], {"a": 0, "b": 0}
    i = 0
    while done["a"] < LENGTHS["a"] or done["b"] < LENGTHS["b"]:
        step = {}
        for rid, seq in (("a", chunks_a), ("b", chunks_b)):
            if done[rid] < LENGTHS[rid]:
                step[rid] = min(seq[i % len(seq)], LENGTHS[rid] - done[rid])
                done[rid] += step[rid]
        schedule.append(step)
        i += 1
    o, _, W = outputs_for(schedule, _WEIGHTS.get("W"))
    _WEIGHTS.setdefault("W", W)
    if "ref" not in _WEIGHTS:
        _WEIGHTS["ref"] = outputs_for([dict(LENGTHS)], W)[0]
    assert_same(_WEIGHTS["ref"], o)


_WEIGHTS: dict = {}


def test_request_order_within_batch_does_not_matter():
    o1, _, W = outputs_for([{"a": 40, "b": 23}, {"a": 230}])
    o2, _, _ = outputs_for([{"b": 23, "a": 40}, {"a": 230}], W)
    assert_same(o1, o2)
