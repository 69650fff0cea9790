"""The paged, incremental reference layer against the whole-sequence float32 oracle."""
from __future__ import annotations

import pytest
import torch

from dsv4 import oracle as ref
from tests.conftest import chunked, drive, hidden_for, make_engine, tiny_spec

LENGTHS = {"long": 300, "mid": 45, "short": 9}      # long: 75 C4 entries > topk 8, 2 C128 entries
DECODE = [{r: 2 for r in LENGTHS}] * 3              # three MTP steps, 2 tokens per request


def run_case(layout: str, tp_size: int, dtype: str = "float32", seed: int = 0):
    spec = tiny_spec()
    eng, W = make_engine(spec, layout=layout, tp_size=tp_size, dtype=dtype, seed=seed)
    total = {r: n + 6 for r, n in LENGTHS.items()}
    X = hidden_for(total, spec.hidden_size, seed=seed + 1)
    outs, topk = drive(eng, X, chunked(LENGTHS, 37) + DECODE)
    return spec, W, X, outs, topk


def oracle(spec, W, X, layer, rid, topk, row_format):
    ratio = spec.compress_ratio(layer)
    sel = topk.get(layer, {}).get(rid)
    return ref.oracle_layer(spec.to_dump(), ratio, W[layer], X[rid], row_format=row_format,
                            topk=None if sel is None else sel.long())


@pytest.mark.parametrize("layout,tol", [("float32", 1e-5), ("bfloat16", 1e-4)])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_every_layer_type_matches_oracle(layout, tol, tp_size):
    spec, W, X, outs, topk = run_case(layout, tp_size, seed=tp_size)
    assert {spec.compress_ratio(l) for l in outs} == {1, 4, 128}
    for layer in outs:
        for rid in LENGTHS:
            o = oracle(spec, W, X, layer, rid, topk, layout)
            err = ref.rel_err(outs[layer][rid], o["out"])
            assert err <= tol, (layer, rid, err)
            if spec.compress_ratio(layer) == 4:
                g = ref.grade_selection(topk[layer][rid], o["scores"], spec.index_topk)
                assert g["count_ok"] == 1.0
                assert g["max_gap"] <= 1e-5, g          # anything but a near-tie is a wrong selection
                assert g["exact"] >= 0.9, g


def test_bf16_rows_cost_is_reported_against_unrounded_oracle():
    """bf16 rows agree with the bf16-rounding oracle, and visibly differ from exact float32 rows."""
    spec, W, X, outs, topk = run_case("bfloat16", 1)
    for layer in outs:
        rid = "long"
        rounded = ref.rel_err(outs[layer][rid], oracle(spec, W, X, layer, rid, topk, "bfloat16")["out"])
        exact = ref.rel_err(outs[layer][rid], oracle(spec, W, X, layer, rid, topk, "float32")["out"])
        assert rounded <= 1e-4
        assert 3e-4 <= exact <= 1e-2, exact


def test_bfloat16_activations_stay_close_to_float32_oracle():
    spec, W, X, outs, topk = run_case("bfloat16", 1, dtype="bfloat16")
    for layer in outs:
        for rid in LENGTHS:
            err = ref.rel_err(outs[layer][rid], oracle(spec, W, X, layer, rid, topk, "bfloat16")["out"])
            assert err <= 3e-2, (layer, rid, err)


def test_oracle_selection_drives_attention():
    """The oracle's `topk` argument really changes what a ratio-4 layer attends to: attending over
    the K worst-scored entries instead of the run's selection gives another output."""
    spec, W, X, outs, topk = run_case("float32", 1)
    layer = next(l for l in outs if spec.compress_ratio(l) == 4)
    sel = topk[layer]["long"].long()
    scores = oracle(spec, W, X, layer, "long", topk, "float32")["scores"]
    worst = ref._own_topk(torch.where(torch.isfinite(scores), -scores, scores), spec.index_topk)
    a = ref.oracle_layer(spec.to_dump(), 4, W[layer], X["long"], row_format="float32", topk=sel)["out"]
    b = ref.oracle_layer(spec.to_dump(), 4, W[layer], X["long"], row_format="float32", topk=worst)["out"]
    assert ref.rel_err(a, outs[layer]["long"]) <= 1e-5
    assert ref.rel_err(b, a) > 1e-3
