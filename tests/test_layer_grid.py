"""The layer grid's data and arithmetic (the timings themselves run on a GPU: bench/layer_table.py --grid
peers): the project's copy of the engines' published figures holds every point of the grid, a row puts
the fastest backend beside the faster engine, and a model the engines do not publish is refused."""
from __future__ import annotations

import csv

import pytest

import dsv4
from dsv4.speed.grid import bench_grid, grid_row, preset_label
from dsv4.speed.peers import (DECODE_POINTS, MODELS, PREFILL_POINTS, TABLES, Point, card_of, faster, grid,
                              published)


@pytest.mark.parametrize("card", sorted(TABLES))
def test_every_grid_point_has_the_engines_figures(card):
    figures = published(card)
    points = [p for m in MODELS for p in grid(m)]
    assert len(points) == len(MODELS) * 2 * (len(DECODE_POINTS) + len(PREFILL_POINTS)) == len(set(points))
    assert set(figures) == set(points)
    for p in points:
        assert set(figures[p]) <= {"vllm", "sglang"} and "vllm" in figures[p], p
        assert all(0 < us < 1e6 for us in figures[p].values()), p
    with open(TABLES[card], newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["version"] for r in rows} == {"0.24.0", "0.5.14"}
    # figures quoted in docs/benchmarks.md and docs/notes (the faster engine at one request, 8192 context)
    quoted = {"H200": (("c4a", "decode", 1, 8192, "vllm", 105.3), ("c128a", "prefill", 8192, 0, "sglang", 3115.1)),
              "H100": (("c4a", "decode", 1, 8192, "vllm", 115.2), ("c128a", "decode", 1, 8192, "vllm", 90.8))}
    for layer, mode, n, ctx, engine, us in quoted[card]:
        p = Point("dsv4_flash", layer, mode, *((n, 1, ctx) if mode == "decode" else (1, n, ctx)))
        assert figures[p][engine] == us


def test_the_few_request_points_are_a_part_of_the_grid():
    few = grid("dsv4_pro", max_requests=16)
    assert {(p.requests, p.context) for p in few if p.mode == "decode"} == {
        (n, c) for n, c in DECODE_POINTS if n <= 16} == {(1, 8192), (16, 8192), (1, 65536), (8, 65536), (16, 32768)}
    assert [p for p in few if p.mode == "prefill"] == [p for p in grid("dsv4_pro") if p.mode == "prefill"]
    assert set(few) < set(grid("dsv4_pro"))


def test_a_gpu_is_compared_with_its_own_cards_rows():
    assert card_of("NVIDIA H200") == "H200" and card_of("NVIDIA H100 80GB HBM3") == "H100"
    assert published("H100") != published("H200")
    with pytest.raises(ValueError, match="on the H200 and the H100 only; this GPU is NVIDIA A100"):
        card_of("NVIDIA A100-SXM4-80GB")


def test_a_row_sets_the_fastest_backend_beside_the_faster_engine():
    p = Point("dsv4_flash", "c4a", "decode", 1, 1, 8192)
    tri = preset_label("triton")
    times = {"a + b + c": (90.0, True), tri: (99.0, True)}
    row = grid_row(p, times, {"vllm": 105.0, "sglang": 120.0})
    assert row[:4] == ["c4a", "1 @ 8192", "a + b + c", 90.0]
    assert row[4] == 99.0 and row[5] == pytest.approx(1.1) and row[8] == pytest.approx(90 / 105) and row[9] is True
    assert faster({"vllm": 105.0, "sglang": 100.0}) == ("sglang", 100.0)
    assert grid_row(p, {"a + b + c": (90.0, False)}, {"vllm": 105.0})[4:6] == [None, None]
    assert grid_row(p, {"a + b + c": (90.0, False)}, {"vllm": 105.0})[9] is False
    assert grid_row(Point("dsv4_flash", "c4a", "prefill", 1, 8192, 0), {"a + b + c": (6e3, None)},
                    {"vllm": 7e3})[9] is None          # a prefill runs eagerly: nothing compared


def test_a_decode_row_gives_its_weights_share_of_the_copy_bandwidth():
    """150 MB of weights in 100 µs on a card that copies at 3000 GB/s: half its bandwidth; the fastest row's,
    and none without the weights or the bandwidth (a prefill, a grid of prefill points only)."""
    p = Point("dsv4_flash", "c4a", "decode", 1, 1, 8192)
    times = {"a + b + c": (100.0, True, 150_000_000), "d + e + f": (120.0, True, 150_000_000)}
    assert grid_row(p, times, {"vllm": 105.0}, copy_gbps=3000.0)[-1] == pytest.approx(0.5)
    assert grid_row(p, times, {"vllm": 105.0})[-1] is None
    assert grid_row(p, {"a + b + c": (100.0, None, None)}, {"vllm": 105.0}, copy_gbps=3000.0)[-1] is None



def test_a_batch_invariant_row_sets_its_fastest_beside_the_default():
    """batch_invariant=true: the fastest `[batch-invariant]` row and its ratio go after the triton preset's
    µs, and the fastest backend is chosen among the default rows (among all if only invariant ones ran)."""
    from dsv4.speed.layer import INVARIANT

    p = Point("dsv4_flash", "c128a", "decode", 1, 64, 4096)
    tri = preset_label("triton")
    fixed = {tri + INVARIANT: (117.0, True), "x" + INVARIANT: (108.0, True)}
    row = grid_row(p, {"a + b + c": (90.0, True), tri: (99.0, True), **fixed}, {"vllm": 100.0}, invariant=True)
    assert row[2:6] == ["a + b + c", 90.0, 99.0, 108.0]
    assert row[6] == pytest.approx(1.2) and row[7] == pytest.approx(1.1)
    alone = grid_row(p, fixed, {"vllm": 100.0}, invariant=True)          # the default rows ran out of memory
    assert alone[2:7] == ["x" + INVARIANT, 108.0, None, 108.0, 1.0]

def test_the_grid_refuses_what_it_cannot_compare(monkeypatch):
    """Before any work: a model the engines do not publish, a deployment this machine is not, backends
    that do not run here."""
    import dsv4.speed.grid as grid_mod
    from dsv4.speed.layer import Backend

    with pytest.raises(ValueError, match="publish DSV4-Flash and DSV4-Pro only"):
        bench_grid(dsv4.compose(["model=dsv4_tiny"], running=False))
    h200 = dsv4.compose(["deployment=h200"], running=False)
    if grid_mod.local_platform() != "cuda":
        with pytest.raises(ValueError, match="this machine's platform is"):
            bench_grid(h200)
    monkeypatch.setattr(grid_mod, "local_platform", lambda: "cuda")
    monkeypatch.setattr(grid_mod, "backends", lambda job: [Backend(label="a + b + c", combo=None)])
    wanted = r"none of the backends \['no \+ such'\] runs here; these do: \['a \+ b \+ c'\]"
    with pytest.raises(ValueError, match=wanted):
        bench_grid(h200, labels=["no + such"])
    monkeypatch.setattr(grid_mod, "gpu_name", lambda: "NVIDIA B200")
    with pytest.raises(ValueError, match="this GPU is NVIDIA B200"):
        bench_grid(h200)
