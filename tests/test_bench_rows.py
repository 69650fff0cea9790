"""The benches' rows and the tables made from them (no GPU: the figures are given): a measurement becomes a
well-formed stamped row in a file named by its stamp, a printed table's cells become numbers, newer rows
replace older figures of the same case in a table and its stamp line says which run gave what, and
docs/benchmarks.md's tables are exactly what its row files make -- a hand edit of one fails here."""
from __future__ import annotations

import importlib.util
import json
import re

import pytest

from dsv4.speed.rows import RowFile, measurement, open_rows, printed_rows, problems, read, stamp
from dsv4.speed.tables import differences, load, regenerate, render
from tests.conftest import ROOT

DOC, ROWS = ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "bench" / "rows"
# the rows files the rendering tests read (figures of them are named below), whatever rows are added later
FIXTURE_FILES = ("2026-12-02_eb6a5d8_nvidia-h200.jsonl", "2026-12-04_9339392_nvidia-h200.jsonl")
H200 = {"name": "NVIDIA H200", "sm": "sm90", "sms": 132}
PACKAGES = {"torch": "2.11.0+cu130", "triton": "3.6.0"}


def fixture_rows() -> list[dict]:
    """The rows of FIXTURE_FILES, oldest first, as `load` orders a folder's."""
    return [r for r in load(ROWS) if any(r in read(ROWS / name) for name in FIXTURE_FILES)]


def hand_edit(text: str) -> str:
    """The document with one cell of the DSV4-Flash decode grid's first row typed over."""
    start = text.index("\n| c4a |", text.index("<!-- table: grid/dsv4_flash/decode -->")) + 1
    end = text.index("\n", start)
    return text[:end] + " 1 |" + text[end:]


def given_stamp(date="2026-12-05", commit="abc1234", time=None) -> dict:
    return stamp(date=date, commit=commit, card=H200, packages=PACKAGES, time=time)


def test_a_measurement_becomes_a_stamped_row_in_a_file_named_by_its_stamp(tmp_path):
    out = RowFile(folder=tmp_path / "rows", stamp=given_stamp(time="10:00:00"))
    assert not out.path.parent.exists()                     # nothing measured: nothing written
    out([measurement("grid/dsv4_flash/decode", case={"layer": "c4a", "requests @ context": "1 @ 8192"},
                     ours={"ours": 101.23456, "ours / faster engine": 0.96432171, "replay == eager": True},
                     peers={"vLLM": 105.3, "SGLang": None}, fastest=["ours", "vLLM"])])
    assert out.path == tmp_path / "rows" / "2026-12-05_abc1234_nvidia-h200.jsonl"
    (r,) = read(out.path)
    assert problems(r) == []
    assert r["table"] == "grid/dsv4_flash/decode" and r["unit"] == "µs"
    assert r["case"] == {"layer": "c4a", "requests @ context": "1 @ 8192"}
    assert r["ours"] == {"ours": 101.2, "ours / faster engine": 0.9643, "replay == eager": True}   # 4 digits kept
    assert r["peers"] == {"vLLM": 105.3, "SGLang": None}
    assert r["columns"] == ["layer", "requests @ context", "ours", "ours / faster engine", "replay == eager", "vLLM",
                            "SGLang"]
    assert r["stamp"] == {"date": "2026-12-05", "time": "10:00:00", "commit": "abc1234", "card": H200,
                          "packages": PACKAGES}
    out([measurement("x", case={"a": 1}, ours={"b": 2.0})])                     # appended, not replaced
    assert [r["table"] for r in read(out.path)] == ["grid/dsv4_flash/decode", "x"]


def test_a_printed_table_becomes_rows_with_its_numbers_read_back():
    headers = ["case", "b", "mqa_kernel", "µs", "of bf16 peak", "rel err vs first", "FlashMLA µs"]
    cells = [["h64 128+512", 64, "triton_sparse", "93.9", "45%", "1.2e-03", 86.7],
             ["memory (MiB)", "", "", "", "", "", ""]]                      # a heading inside the table: no row
    (r,) = printed_rows("bench/mqa", headers, cells, keys=3, peers=["FlashMLA µs"], unit=None,
                        given={"step": "64x2@8192"})
    assert r["case"] == {"step": "64x2@8192", "case": "h64 128+512", "b": 64, "mqa_kernel": "triton_sparse"}
    assert r["ours"] == {"µs": 93.9, "of bf16 peak": "45%", "rel err vs first": 0.0012}
    assert r["peers"] == {"FlashMLA µs": 86.7} and r["columns"] == ["step", *headers]
    assert problems(r | {"stamp": given_stamp()}) == []


def test_this_machines_stamp_and_a_bad_row_refused(tmp_path):
    s = open_rows(tmp_path).stamp
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", s["date"]) and re.fullmatch(r"\d\d:\d\d:\d\d", s["time"])
    assert s["commit"] and s["card"]["name"] and "torch" in s["packages"]
    bad = tmp_path / "bad.jsonl"
    r = measurement("t", case={"a": 1}, ours={"b": 2}) | {"stamp": given_stamp()}
    bad.write_text(json.dumps(r) + "\n" + json.dumps(r | {"columns": ["b", "a"]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: columns: not the case's columns"):
        read(bad)
    assert "stamp: no commit" in problems(r | {"stamp": {"date": "2026-12-05", "card": H200, "packages": {}}})


def test_a_newer_row_replaces_a_figure_and_the_stamp_line_says_which_run_gave_what():
    old = given_stamp("2026-12-04", "1111111")
    new = given_stamp("2026-12-05", "2222222")
    rows = [measurement("t", case={"layer": "c4a"}, ours={"ours": 10.0, "triton": 12.0}, peers={"vLLM": 11.0},
                        fastest=["ours", "vLLM"]) | {"stamp": old},
            measurement("t", case={"layer": "c128a"}, ours={"ours": 9.0}, peers={"vLLM": 8.0},
                        fastest=["ours", "vLLM"]) | {"stamp": old},
            measurement("t", case={"layer": "c4a"}, ours={"ours": 12.5}, peers={"vLLM": 11.0},
                        fastest=["ours", "vLLM"]) | {"stamp": new}]
    line, table = render("t", rows).split("\n\n")
    assert line.replace("\n", " ") == (
        "Row 2 and row 1's \"triton\" measured 2026-12-04 at 1111111; row 1's \"ours\", \"vLLM\" measured 2026-12-05 at "
        "2222222; all on NVIDIA H200 (sm90, 132 SMs) with torch 2.11.0+cu130, triton 3.6.0; figures in µs.")
    assert table == ("| layer | ours | triton | vLLM |\n|---|---|---|---|\n"
                     "| c4a | 12.5 | 12.0 | **11.0** |\n"      # the newer ours, the older triton, the least of ours, vLLM
                     "| c128a | 9.0 | - | **8.0** |\n")


def test_the_grid_writes_its_points_as_rows_of_the_documents_grid_tables():
    """A point of `bench/layer_table.py --grid peers` as a row: the document's columns, its fastest backend
    by preset name; a newer run of a point replaces that line of the document's table."""
    from dsv4.speed.grid import HEADERS, grid_measurement, grid_row, preset_label
    from dsv4.speed.peers import Point

    p = Point("dsv4_flash", "c4a", "decode", 1, 1, 8192)
    row = grid_row(p, {preset_label("flashmla"): (99.0, True), preset_label("triton"): (101.0, True)},
                   {"vllm": 105.3, "sglang": 109.4})
    r = grid_measurement("dsv4_flash", p, row, HEADERS)
    assert r["table"] == "grid/dsv4_flash/decode" and r["case"] == {"layer": "c4a", "requests @ context": "1 @ 8192"}
    assert r["ours"] == {"fastest preset": "flashmla", "ours": 99.0, "triton preset": 101.0, "triton / ours": 1.02,
                         "ours / faster engine": 0.9402, "replay == eager": True}
    assert r["peers"] == {"vLLM": 105.3, "SGLang": 109.4}
    rows = fixture_rows() + [r | {"stamp": given_stamp("2099-01-01", "fffffff")}]
    body = render("grid/dsv4_flash/decode", rows)
    assert "| c4a | 1 @ 8192 | flashmla | 99.0 | 101.0 | 1.02 | 105.3 | 109.4 | 0.9402 | yes |" in body
    assert "| c4a | 16 @ 8192 | flashmla | 114 | 117 | 1.02 | 121 | 125 | 0.943 | - |" in body     # older, kept


def test_the_indexer_table_writes_the_documents_scores_and_top_k_table():
    """mode=bench's indexer rows (one per context, option and top-k) as the document's table: per context and
    option, the scores alone and each top-k after them, ours (the default top-k) and FlashInfer's as a peer."""
    from dsv4.speed.scorers import scores_top_k

    cells = [[8192, "deepgemm_fp8", "triton", 132, 3.0, 10.51, 19.87, 0.0, True],
             [8192, "deepgemm_fp8", "flashinfer", 132, 3.0, 10.51, 27.03, 0.0, True]]
    (r,) = scores_top_k(cells)
    assert r["table"] == "indexer/scores_top_k" and r["case"] == {"context": "8k", "indexer": "deepgemm_fp8"}
    assert r["ours"] == {"scores": 10.51, "scores + top-k, `top_k=triton`": 19.87}
    assert r["peers"] == {"scores + top-k, `top_k=flashinfer`": 27.03}
    body = render("indexer/scores_top_k", fixture_rows() + [r | {"stamp": given_stamp("2099-01-01")}])
    assert "\n| 8k | deepgemm_fp8 | 10.51 | **19.87** | 27.03 |\n" in body        # the document's columns, replaced
    assert "\n| 64k | triton_fp8 | 87.6 | 114 | **109** |\n" in body                # the others kept


def test_the_documents_tables_are_what_its_rows_make():
    """docs/benchmarks.md's tables come from docs/bench/rows (python bench/tables.py); its --check fails
    on a table edited by hand."""
    text = DOC.read_text(encoding="utf-8")
    rows = load(ROWS)
    assert len(re.findall(r"<!-- table: ", text)) >= 11
    assert differences(text, rows) == {}, "run: python bench/tables.py"
    assert regenerate(text, rows) == text
    edited = hand_edit(text)
    assert edited != text and list(differences(edited, rows)) == ["grid/dsv4_flash/decode"]
    with pytest.raises(ValueError, match=r"tables \['nosuch'\] have no rows"):
        regenerate(text + "\n<!-- table: nosuch -->\n<!-- end table -->\n", rows)


def test_the_generator_script_checks_and_writes(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "bench" / "tables.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--check"]) == 0
    doc = tmp_path / "benchmarks.md"
    doc.write_text(hand_edit(DOC.read_text(encoding="utf-8")), encoding="utf-8")
    assert script.main(["--check", "--doc", str(doc)]) == 1
    assert "the table grid/dsv4_flash/decode differs" in capsys.readouterr().out
    assert script.main(["--doc", str(doc)]) == 0 and script.main(["--check", "--doc", str(doc)]) == 0
    assert doc.read_text(encoding="utf-8") == DOC.read_text(encoding="utf-8")


def test_a_rows_folder_that_cannot_be_written_is_refused_before_any_table(compose_cfg, tmp_path):
    """`+bench_rows=PATH` is judged before the GPU is asked for anything (a file in the way here); outside
    mode=bench the setting is named as having no effect."""
    from dsv4.app.dispatch import run_config
    from dsv4.app.job import make_job
    from dsv4.checks.no_effect import inert_settings
    from dsv4.values.errors import ConfigError

    (tmp_path / "taken").write_text("")
    cfg = compose_cfg(["model=dsv4_tiny", "mode=bench", f"+bench_rows={tmp_path / 'taken'}"])
    with pytest.raises(ConfigError, match=r"^bench_rows=.*taken: .*; fix: \+bench_rows="):
        run_config(cfg, out_dir=tmp_path / "run")
    job = make_job(compose_cfg(["model=dsv4_tiny", f"+bench_rows={tmp_path}"]), out_dir=tmp_path / "run")
    assert inert_settings(job, [f"+bench_rows={tmp_path}"]) == [
        f"+bench_rows={tmp_path} has no effect: bench_rows is where mode=bench writes"]
