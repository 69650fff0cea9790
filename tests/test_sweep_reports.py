"""What a sweep's summary says, so that it does not mislead.

- heatmaps: errors on a log scale, and near-equal values near-equal colours (the colours painted are
  read back from the figure); costs on a linear scale from zero;
- cache_by_kernel shows the error against exact float32 rows (what fp8 costs) beside the same-rounding
  error, from a real run's rows;
- padding_by_tp shows padded heads per rank, the bytes they take and decode time relative to no
  padding, from a real two-cell sweep;
- a sweep in which no cell can run says so and exits 1;
- every field overridden on the command line is in every row (cells differing only in
  `mqa_kernel.chunk` read apart), and a checkpoint run's row names its weights and path;
- a bad `summary:` setting is a one-line error before any job runs.
"""
from __future__ import annotations

import csv
import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from dsv4.values.device import DeviceInfo, local_platform
from dsv4.values.errors import ConfigError, Problem
from dsv4.reports.heatmaps import color_norm, figure
from dsv4.reports.report import result_row, write_row
from dsv4.reports.sweep_summary import load_rows, markdown, pivot, summarize
from dsv4.reports.summary_metrics import DEFAULT_VIEW, METRICS, Scale, SummaryView
from tests.conftest import CONFIGS, run_py

on_cpu_host = pytest.mark.skipif(local_platform() != "cpu", reason="expects a host without an accelerator")
run_py = partial(run_py, extra_env={"OMP_NUM_THREADS": "1"}, timeout=300)
CPU = DeviceInfo(platform="cpu", name="CPU")


def ok_row(folder: Path, choices: dict, metrics: dict, settings: dict | None = None) -> Path:
    return write_row(folder, result_row(status="ok", problems=[], choices=choices, device=CPU,
                                        settings=settings or {"tp_size": 1}, metrics=metrics))


def hydra_record(job: Path, *, overrides: list[str], choices: dict, config: dict) -> None:
    """The `.hydra/` folder Hydra writes for a job when it starts."""
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(overrides)))
    (job / ".hydra" / "hydra.yaml").write_text(OmegaConf.to_yaml({"hydra": {"runtime": {"choices": choices}}}))
    (job / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(config))


# ---- heatmap colours -----------------------------------------------------------------------------------
def test_error_metrics_are_drawn_on_a_log_scale_and_costs_on_a_linear_one():
    assert {n for n, m in METRICS.items() if m.scale is Scale.LOG} == {"max_rel_err", "max_rel_err_vs_f32_kv",
                                                                              "max_rel_err_vs_float_linear"}
    assert all("err" not in n for n, m in METRICS.items() if m.scale is Scale.LINEAR)


def painted(rows, metric):
    """The RGBA colour the heatmap paints in each cell of its one column (one swept key), top to bottom."""
    fig = figure(pivot(rows), (metric,), "test")
    [image] = fig.axes[0].get_images()
    return image.to_rgba(image.get_array())[:, 0]


def test_near_equal_errors_get_near_equal_colours_and_a_decade_apart_do_not(tmp_path):
    values = {"bf16": 3.24e-7, "float32": 3.26e-7, "fp8_ds_mla": 3.28e-7}
    for i, (layout, v) in enumerate(values.items()):
        ok_row(tmp_path / str(i), {"cache_layout": layout}, {"max_rel_err": v})
    colours = painted(load_rows(tmp_path), METRICS["max_rel_err"])
    assert np.abs(colours[0] - colours[2]).max() < 0.05, "3.24e-7 and 3.28e-7 look alike"
    norm = color_norm(METRICS["max_rel_err"], list(values.values()))
    assert norm.vmax / norm.vmin >= 10 - 1e-9, "the colour bar spans at least a decade"
    assert abs(float(norm(3.24e-7)) - float(norm(3.28e-7))) < 0.01
    far = color_norm(METRICS["max_rel_err_vs_f32_kv"], [3.26e-7, 2.18e-3, 3.3e-2])
    assert float(far(3.3e-2)) - float(far(2.18e-3)) > 0.15 and float(far(2.18e-3)) - float(far(3.26e-7)) > 0.6


def test_costs_start_at_zero_so_near_equal_times_look_alike_and_cells_without_numbers_are_grey(tmp_path):
    ok_row(tmp_path / "0", {"cache_layout": "bf16"}, {"swa": {"decode_ms_step": 6.07}})
    ok_row(tmp_path / "1", {"cache_layout": "float32"}, {"swa": {"decode_ms_step": 6.27}})
    write_row(tmp_path / "2", result_row(status="incompatible", problems=[], choices={"cache_layout": "fp8_ds_mla"},
                                         device=CPU, settings={"tp_size": 1}))
    norm = color_norm(METRICS["decode_ms_step"], [6.07, 6.27])
    assert norm.vmin == 0.0 and abs(float(norm(6.07)) - float(norm(6.27))) < 0.05
    colours = painted(load_rows(tmp_path), METRICS["decode_ms_step"])
    assert np.abs(colours[0] - colours[1]).max() < 0.1
    assert np.allclose(colours[2][:3], [0xd9 / 255] * 3, atol=0.01), "an incompatible cell is grey, not a colour"


# ---- what the experiments show -------------------------------------------------------------------------
def view(experiment: str) -> SummaryView:
    node = OmegaConf.to_container(OmegaConf.load(CONFIGS / "config.yaml").summary)
    node |= OmegaConf.to_container(OmegaConf.load(CONFIGS / "experiment" / f"{experiment}.yaml")).get("summary", {})
    return SummaryView.from_config(node)


def test_cache_by_kernel_tables_and_plots_the_error_against_exact_float32_rows(tmp_path):
    v = view("cache_by_kernel")
    assert METRICS["max_rel_err_vs_f32_kv"] in v.tables and METRICS["max_rel_err_vs_f32_kv"] in v.heatmaps
    assert METRICS["max_rel_err"] in v.tables and METRICS["max_rel_err"] in v.heatmaps
    for i, (layout, same, exact) in enumerate([("bf16", 3.24e-7, 2.18e-3), ("fp8_ds_mla", 3.28e-7, 3.3e-2)]):
        ok_row(tmp_path / str(i), {"mqa_kernel": "reference", "cache_layout": layout},
               {"c4a": {"rel_err": same, "rel_err_vs_f32_kv": exact}, "max_rel_err": same})
    md = markdown(load_rows(tmp_path), tmp_path, v)
    assert "## max_rel_err_vs_f32_kv: vs the float32 oracle on exact float32 rows" in md
    assert "| bf16 | 2.18e-03 |\n| fp8_ds_mla | 3.30e-02 |" in md, "rows written without the max: the worst layer's"
    assert "| bf16 | 3.24e-07 |\n| fp8_ds_mla | 3.28e-07 |" in md


@on_cpu_host
def test_a_run_row_has_the_error_against_exact_float32_rows_for_every_layout(compose_cfg, tmp_path):
    from dsv4.app.dispatch import run_config

    for layout in ("fp8_ds_mla", "float32"):
        cfg = compose_cfg(["experiment=cache_by_kernel", "mqa_kernel=reference", f"cache_layout={layout}"])
        run_config(cfg, out_dir=tmp_path / layout, multirun=True)
    fp8, f32 = (json.loads((tmp_path / x / "result.json").read_text()) for x in ("fp8_ds_mla", "float32"))
    assert 1e-2 < fp8["metrics.max_rel_err_vs_f32_kv"] < 1e-1 and fp8["metrics.max_rel_err"] < 1e-5
    assert f32["metrics.max_rel_err_vs_f32_kv"] == f32["metrics.max_rel_err"], "float32 rows are the exact rows"


@pytest.mark.slow
@on_cpu_host
def test_padding_by_tp_reports_padded_heads_their_bytes_and_time_against_no_padding(tmp_path):
    out = tmp_path / "sweep"
    r = run_py("-m", "experiment=padding_by_tp", "head_padding=none,buckets_64_128", "tp_size=2",
               f"hydra.sweep.dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["choices.head_padding"]: row for row in load_rows(out)}
    padded = rows["buckets_64_128"]
    assert (padded["metrics.heads_per_rank"], padded["metrics.padded_heads_per_rank"]) == (4, 64)
    assert padded["metrics.padding_bytes_per_token"] == 2 * 60 * 512 * 4      # q + kernel output, float32
    assert rows["none"]["metrics.padding_bytes_per_token"] == 0
    md = (out / "summary.md").read_text()
    assert "## heads per rank → padded heads" in md
    assert "| buckets_64_128 | 4 → 64 |" in md and "| none | 4 |" in md
    assert "| buckets_64_128 | 240 |" in md, "KiB per token and layer"
    assert "## decode ms/step (sum over the workload's layers, wall time), relative to head_padding=none" in md
    relative = md.split("relative to head_padding=none")[1].split("\n## ")[0]
    assert "| none | 1.00× |" in relative
    measured = METRICS["decode_ms_step"].value(padded) / METRICS["decode_ms_step"].value(rows["none"])
    assert f"| buckets_64_128 | {measured:.2f}× |" in relative


# ---- a sweep where nothing ran -------------------------------------------------------------------------
@pytest.mark.slow
@on_cpu_host
def test_a_sweep_in_which_every_cell_is_incompatible_says_so_and_exits_1(tmp_path):
    out = tmp_path / "sweep"
    r = run_py("-m", "experiment=padding_by_tp", "head_padding=none,buckets_pow2", "tp_size=4",
               f"hydra.sweep.dir={out}")
    assert r.returncode == 1
    assert f"error: no cell of the sweep ran: all 2 are incompatible (rows and reasons: {out / 'summary.md'})" \
        in r.stderr
    assert "Traceback" not in r.stderr
    md = (out / "summary.md").read_text()
    assert "**No cell of the sweep ran: all 2 are incompatible**" in md and "fix: `tp_size=2`" in md


def test_the_callback_fails_a_sweep_without_one_ok_row(tmp_path):
    from dsv4.app.callbacks import SummarizeCallback

    p = Problem(group="mqa_kernel", value="flashmla_sparse", reason="runs on cuda", fix="mqa_kernel=reference")
    write_row(tmp_path / "0", result_row(status="incompatible", problems=[p], choices={"mqa_kernel": "flashmla_sparse"},
                                         device=CPU, settings={}))
    (tmp_path / "1" / ".hydra").mkdir(parents=True)                 # started, never wrote its row
    (tmp_path / "1" / ".hydra" / "overrides.yaml").write_text("- mqa_kernel=reference\n")
    config = OmegaConf.create({"mode": "run", "hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit, match=r"no cell of the sweep ran \(0 ok, 1 incompatible, 0 error, 1 missing\)"):
        SummarizeCallback().on_multirun_end(config=config)
    ok_row(tmp_path / "1", {"mqa_kernel": "reference"}, {"max_rel_err": 1e-7})
    SummarizeCallback().on_multirun_end(config=config)           # one cell ran: the sweep is fine


# ---- every override in every row -----------------------------------------------------------------------
@pytest.mark.slow
@on_cpu_host
def test_cells_that_differ_only_in_a_field_override_read_apart(tmp_path):
    out = tmp_path / "sweep"
    r = run_py("-m", "model=dsv4_tiny", "workload=sweep", "mqa_kernel.chunk=16,64", "workload.decode_steps=1",
               f"hydra.sweep.dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    with (out / "summary.csv").open() as f:
        table = list(csv.DictReader(f))
    assert sorted(row["overrides.mqa_kernel.chunk"] for row in table) == ["16", "64"]
    assert {row["overrides.workload.decode_steps"] for row in table} == {"1"}
    md = (out / "summary.md").read_text()
    assert "| mqa_kernel.chunk | value |" in md
    assert "\n| 16 | " in md and "\n| 64 | " in md
    assert "decode_steps=1" in md.split("Fixed: ")[1].splitlines()[0]


def test_a_checkpoint_runs_row_names_its_weights_and_path(tmp_path):
    base = {"model": "dsv4_flash", "mqa_kernel": "reference"}
    for i, (weights, overrides) in enumerate([("random", []),
                                               ("checkpoint", ["weights=checkpoint", "checkpoint.path=/models/F"])]):
        job = tmp_path / str(i)
        hydra_record(job, overrides=overrides, choices=base,
                     config={"tp_size": 1, "dtype": "float32", "seed": 0, "weights": weights,
                             "checkpoint": {"path": "/models/F" if weights == "checkpoint" else None}})
        ok_row(job, base, {"max_rel_err": 1e-7 * (i + 1)})
    rows = load_rows(tmp_path)
    assert [r["settings.weights"] for r in rows] == ["random", "checkpoint"]
    assert rows[1]["settings.checkpoint.path"] == "/models/F" and "settings.checkpoint.path" not in rows[0]
    assert not any(k.startswith("overrides.") for k in rows[1]), "weights and the path are settings, once"
    md = summarize(tmp_path, DEFAULT_VIEW).markdown
    assert "| weights | value |\n|---|---|\n| checkpoint | 2.00e-07 |\n| random | 1.00e-07 |" in md
    assert "checkpoint.path=/models/F" in md.split("Fixed: ")[1].splitlines()[0]


# ---- the pivot's axes ----------------------------------------------------------------------------------
def test_a_key_that_follows_the_swept_ones_is_no_axis(tmp_path):
    """With one process per rank, `processes` follows tp_size: the pivot stays head_padding x tp_size."""
    for i, (padding, tp) in enumerate([(p, tp) for p in ("none", "buckets_pow2") for tp in (1, 2)]):
        ok_row(tmp_path / str(i), {"head_padding": padding}, {"max_rel_err": 3e-7},
               settings={"tp_size": tp, "processes": tp})
    md = markdown(load_rows(tmp_path), tmp_path)
    assert "| head_padding \\ tp_size | 1 | 2 |" in md and "not run" not in md
    assert "Varying with head_padding / tp_size: processes (in summary.csv)." in md


def test_the_recorded_sweep_axes_are_the_pivots_axes(tmp_path):
    """A sweep over backend presets: the presets' strategies vary with it, the table is by backend."""
    import yaml

    for i, (backend, kernel) in enumerate([("reference", "reference"), ("triton", "triton_sparse")]):
        ok_row(tmp_path / str(i), {"backend": backend, "mqa_kernel": kernel}, {"max_rel_err": 1e-7 * (i + 1)})
    assert "| mqa_kernel | value |" in markdown(load_rows(tmp_path), tmp_path), "no record: the first varying key"
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                    "params": {"backend": "reference,triton"}},
        "overrides": {"task": ["model=dsv4_tiny"]}, "sweep": {"subdir": "${hydra.job.num}"},
        "runtime": {"choices": {"backend": "reference", "mqa_kernel": "reference", "model": "dsv4_tiny"}}}}))
    md = summarize(tmp_path, DEFAULT_VIEW).markdown
    assert "| backend | value |\n|---|---|\n| reference | 1.00e-07 |\n| triton | 2.00e-07 |" in md
    assert "Varying with backend: mqa_kernel (in summary.csv)." in md


# ---- bad summary settings ------------------------------------------------------------------------------
@pytest.mark.parametrize("node, message", [
    ({"tables": ["max_rel_err", "nosuch"]}, "summary.tables: unknown metric 'nosuch'; available: max_rel_err,"),
    ({"heatmaps": "max_rel_err"}, "summary.heatmaps='max_rel_err': expected a list of metric names"),
    ({"baseline": "head_padding=none"}, "summary.baseline='head_padding=none': expected one KEY: VALUE"),
    ({"tabels": []}, "summary.tabels: unknown key; summary takes tables, heatmaps, baseline"),
])
def test_a_bad_summary_setting_is_named(node, message):
    with pytest.raises(ConfigError) as e:
        SummaryView.from_config(node)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.slow
def test_a_bad_summary_setting_stops_the_sweep_before_any_job(tmp_path):
    out = tmp_path / "sweep"
    r = run_py("-m", "experiment=cache_by_kernel", "summary.tables=[max_rel_err,nosuch]", f"hydra.sweep.dir={out}")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: summary.tables: unknown metric 'nosuch'")
    assert not out.exists(), "nothing ran"
