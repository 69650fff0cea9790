"""Experiments, deployments, sweeps and their reports.

- every experiment composes as a multirun, and so does every cell of its sweep; every deployment
  composes and its own preset passes `check` on its device; `mode=info` for another machine's
  deployment says package presence is unknown;
- one real `python run.py -m experiment=cache_by_kernel` on this CPU: one result.json per cell (the
  GPU kernels `incompatible`, with their reasons), summary.csv, summary.md and summary.png; the same
  folder with jobs missing (an interrupted sweep) summarizes with `mode=summarize`;
- in a multirun an incompatible cell is a row and the job returns; a real error is an `error` row, the
  other cells still run, the summary is written and the sweep exits 1;
- errors users hit are readable: an unknown experiment, a typo in an override, a deployment whose
  device is absent, `mode=summarize` without a folder;
- progress goes to a terminal only.
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from functools import partial
from importlib.util import find_spec
from itertools import product
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from dsv4.app.dispatch import run_command, run_config
from dsv4.checks.catalogue import GROUPS
from dsv4.app.job import make_job, problems_for, settings
from dsv4.app.modes.info import info
from dsv4.checks.compat import check
from dsv4.values.device import DeviceInfo, local_platform
from dsv4.values.errors import IncompatibleCombination
from dsv4.reports.report import result_row, step_progress, write_row
from dsv4.reports.sweep_summary import load_rows, summarize
from dsv4.reports.sweep_record import matrix
from tests.conftest import CONFIGS, ROOT, options, run_py

on_cpu_host = pytest.mark.skipif(local_platform() != "cpu", reason="expects a host without an accelerator")


EXPERIMENTS = options("experiment")
DEPLOYMENTS = options("deployment")


def compose_with_hydra(overrides=()):
    import dsv4.app.cli  # noqa: F401  (registers the ${dsv4.pid:} resolver of the run and sweep folders)

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONFIGS)):
            return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def sweep_cells(params: dict) -> list[list[str]]:
    """The cartesian product of an experiment's sweeper params (glob(*) over a group, or a comma list)."""
    axes = []
    for key, spec in params.items():
        spec = str(spec)
        if spec == "glob(*)":
            values = options(key)
        else:
            if "(" in spec:
                raise AssertionError(f"{key}: {spec}: this test expands only glob(*) and comma lists")
            values = [v.strip() for v in spec.split(",")]
        axes.append([f"{key}={v}" for v in values])
    return [list(cell) for cell in product(*axes)]


# one torch thread: the jobs are tiny, and on a busy 2-core machine more threads only contend
run_py = partial(run_py, extra_env={"OMP_NUM_THREADS": "1"}, timeout=300)


def rows_by_job(sweep: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/result.json")}


# ---- composition -----------------------------------------------------------------------------------------
def test_the_three_ablations_exist():
    assert {"cache_by_kernel", "padding_by_tp", "o_proj_ablation"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_as_a_multirun_and_every_cell_composes(compose_cfg, experiment):
    cfg = compose_with_hydra([f"experiment={experiment}"])
    assert cfg.hydra.mode.name == "MULTIRUN", "experiments run as sweeps: hydra.mode: MULTIRUN"
    assert cfg.model.name == "dsv4_tiny", "experiments are sized for the CPU"
    params = OmegaConf.to_container(cfg.hydra.sweeper.params)
    assert params, "an experiment sweeps something"
    for key in params:
        assert key in GROUPS or key in cfg, f"sweeper param {key} is neither a group nor a config key"
    cells = sweep_cells(params)
    assert len(cells) >= 2
    verdicts = []
    for cell in cells:
        job = make_job(compose_cfg([f"experiment={experiment}", *cell]))
        for override in cell:
            key, value = override.split("=")
            got = getattr(job.combo, key).name if key in GROUPS else str(settings(job)[key])
            assert got == value, override
        problems = check(job.combo, job.device)
        assert all(p.fix for p in problems), [p.line() for p in problems]
        verdicts.append(not problems)
    assert any(verdicts), f"experiment={experiment}: no cell can run on a CPU"


DATE_DIR = r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+"          # the time and the process id


def test_a_plain_sweep_goes_to_multirun_date():
    cfg = compose_with_hydra(["model=dsv4_tiny"])
    assert re.fullmatch(rf"multirun/{DATE_DIR}", cfg.hydra.sweep.dir), cfg.hydra.sweep.dir


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_an_experiments_own_settings_win_over_config_yaml(experiment):
    """Its sweep folder (no hydra.sweep.dir on the command line) and its summary config: config.yaml's
    own values come first in its defaults list, so an experiment's replace them."""
    node = OmegaConf.load(CONFIGS / "experiment" / f"{experiment}.yaml")
    for deployment in ("cpu", "h200"):
        cfg = compose_with_hydra([f"experiment={experiment}", f"deployment={deployment}"])
        assert re.fullmatch(rf"multirun/{experiment}/{DATE_DIR}", cfg.hydra.sweep.dir), cfg.hydra.sweep.dir
        for key, value in OmegaConf.to_container(node).get("summary", {}).items():
            assert OmegaConf.to_container(cfg.summary)[key] == value, f"summary.{key}"
        if deployment == "h200":             # and a deployment's values still win over config.yaml's
            assert cfg.graph.enabled is True


def _leaves(node: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        out |= _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_every_value_a_deployment_sets_wins_over_config_yaml(deployment):
    node = OmegaConf.to_container(OmegaConf.load(CONFIGS / "deployment" / f"{deployment}.yaml"))
    node.pop("defaults", None)
    cfg = compose_with_hydra([f"deployment={deployment}"])
    for key, value in _leaves(node).items():
        assert OmegaConf.select(cfg, key) == value, f"deployment={deployment} sets {key}={value}"


def test_config_yaml_summary_is_the_default_view():
    from dsv4.reports.summary_metrics import DEFAULT_VIEW, SummaryView

    node = OmegaConf.load(CONFIGS / "config.yaml").summary
    assert SummaryView.from_config(OmegaConf.to_container(node)) == DEFAULT_VIEW


@pytest.mark.slow
@on_cpu_host
def test_sweeps_write_where_the_readme_says_without_a_sweep_dir_override(tmp_path):
    """`python run.py -m experiment=NAME` from a folder: multirun/NAME/<date_time>/ there; a plain `-m`
    sweep: multirun/<date_time>/."""
    def sweep(*args):
        env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"OMP_NUM_THREADS": "1"}
        return subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
    r = sweep("experiment=cache_by_kernel", "mqa_kernel=reference", "cache_layout=float32")
    assert r.returncode == 0, r.stderr[-3000:]
    [folder] = (tmp_path / "multirun").iterdir()
    assert folder.name == "cache_by_kernel"
    [stamp] = folder.iterdir()
    assert re.fullmatch(DATE_DIR, stamp.name)
    assert json.loads((stamp / "0" / "result.json").read_text())["status"] == "ok"
    assert (stamp / "summary.md").exists() and str(stamp.relative_to(tmp_path)) in r.stdout
    r = sweep("mode=check", "model=dsv4_tiny")
    assert r.returncode == 0, r.stderr[-3000:]
    plain = [p for p in (tmp_path / "multirun").iterdir() if p.name != "cache_by_kernel"]
    assert len(plain) == 1 and re.fullmatch(DATE_DIR, plain[0].name) and (plain[0] / "0").is_dir()


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_deployment_composes_and_its_preset_is_valid_on_its_device(compose_cfg, deployment):
    node = OmegaConf.to_container(OmegaConf.load(CONFIGS / "deployment" / f"{deployment}.yaml"))
    job = make_job(compose_cfg([f"deployment={deployment}"]), choices={"deployment": deployment})
    assert job.device == DeviceInfo.from_config(node["device"])
    assert job.combo.tp_size == node["tp_size"] and job.combo.dtype == node["dtype"]
    assert check(job.combo, job.device) == [], [p.line() for p in check(job.combo, job.device)]
    running = problems_for(job, running=True)
    if job.device.platform in ("cpu", local_platform()):
        assert not [p for p in running if p.group == "deployment"]
    else:                               # named here, refused as a run: the device is not this machine
        assert [p.fix for p in running if p.group == "deployment"] == ["deployment=cpu"]
    for experiment in EXPERIMENTS:      # an experiment on another machine's deployment composes too
        make_job(compose_cfg([f"experiment={experiment}", f"deployment={deployment}"]))


def test_the_six_deployments_exist():
    assert {"cpu", "h200", "b200", "rtx_pro_6000", "mi300x", "mi355x"} <= set(DEPLOYMENTS)
    rocm = {d: OmegaConf.load(CONFIGS / "deployment" / f"{d}.yaml").device.arch for d in ("mi300x", "mi355x")}
    assert rocm == {"mi300x": "gfx942", "mi355x": "gfx950"}


@on_cpu_host
def test_info_for_another_machines_deployment_says_packages_are_unknown(compose_cfg):
    text = info(make_job(compose_cfg(["deployment=h200"])))
    assert "packages unknown: looked for only on a cuda machine" in text
    assert "flash_mla unknown" in text and "deep_gemm unknown" in text
    assert "missing" not in text
    if find_spec("flash_mla") is None:
        here = info(make_job(compose_cfg([])))
        assert "flash_mla missing" in here and "unknown" not in here


# ---- one real sweep ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "cache_by_kernel"
    r = run_py("-m", "experiment=cache_by_kernel", f"hydra.sweep.dir={out}")
    return out, r


@pytest.mark.slow
@on_cpu_host
def test_cache_by_kernel_sweep_writes_a_row_per_cell_and_a_summary(sweep, compose_cfg):
    out, r = sweep
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    kernels, layouts = options("mqa_kernel"), options("cache_layout")
    rows = rows_by_job(out)
    assert len(rows) == len(kernels) * len(layouts) == len([p for p in out.iterdir() if p.is_dir()])
    cells = {(row["choices.mqa_kernel"], row["choices.cache_layout"]): row for row in rows.values()}
    assert set(cells) == set(product(kernels, layouts))
    for (kernel, layout), row in cells.items():
        assert row["choices.model"] == "dsv4_tiny" and row["choices.experiment"] == "cache_by_kernel"
        job = make_job(compose_cfg(["experiment=cache_by_kernel", f"mqa_kernel={kernel}", f"cache_layout={layout}"]))
        expected = check(job.combo, job.device, here=local_platform())
        if not expected:
            assert row["status"] == "ok", row.get("error")
            assert row["metrics.max_rel_err"] < 1e-3
        else:                           # a row with check()'s problems, reasons and fixes
            assert row["status"] == "incompatible"
            assert row["problems"] == [p.as_dict() for p in expected]
            assert all(p["fix"] for p in row["problems"])
        if kernel != "reference":       # the GPU kernels: refused for this device, saying so
            assert row["status"] == "incompatible"
            mine = [p for p in row["problems"] if p["group"] == "mqa_kernel" and p["value"] == kernel]
            assert any("this device is cpu" in p["reason"] for p in mine), row["problems"]
    assert cells[("reference", "bf16")]["status"] == "ok"
    md = (out / "summary.md").read_text()
    assert "| mqa_kernel \\ cache_layout |" in md
    assert "✗ incompatible: mqa_kernel=flashmla_sparse" in md
    n_ok = sum(row["status"] == "ok" for row in rows.values())
    assert f"{len(rows)} jobs: {n_ok} ok, {len(rows) - n_ok} incompatible, 0 error" in md
    assert "# Sweep summary" in r.stdout, "the callback prints the summary at the end of the sweep"
    png = (out / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    with (out / "summary.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    assert {row["status"] for row in table} == {"ok", "incompatible"}
    # stderr is not a terminal: progress comes as whole lines, one per finished step, no terminal rewriting
    assert "prefill step 1/5 done\n" in r.stderr and "\r" not in r.stderr and "\x1b[" not in r.stderr


@pytest.mark.slow
@on_cpu_host
def test_an_interrupted_sweep_summarizes_every_cell_of_its_matrix(sweep, tmp_path):
    """Jobs that started without a row and cells that never started are all `missing` rows: the
    summary lists the whole matrix multirun.yaml records, not only the job folders there are."""
    out, r = sweep
    assert r.returncode == 0, r.stderr[-3000:]
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    for name in ("summary.md", "summary.csv", "summary.png"):
        (cut / name).unlink()
    rows = rows_by_job(cut)
    never = sorted(rows, key=int)[-2:]
    ok = next(j for j, row in rows.items() if row["status"] == "ok" and j not in never)
    bad = next(j for j, row in rows.items() if row["status"] == "incompatible" and j not in never)
    (cut / ok / "result.json").unlink()              # started, killed before writing its row
    (cut / bad / "result.json").unlink()
    for job in never:                                # never started
        shutil.rmtree(cut / job)
    s = run_py("mode=summarize", f"+sweep_dir={cut}", f"hydra.run.dir={tmp_path / 'run'}")
    assert s.returncode == 0, s.stderr[-3000:]
    md = (cut / "summary.md").read_text()
    assert f"{len(rows)} jobs:" in md and "4 missing" in md
    assert "4 jobs have no result.json (2 started, 2 never started" in md
    assert md.count("missing: no result.json") >= 2 and md.count("missing: never started") >= 2
    assert "not run" not in md, "every cell of the matrix has its row"
    assert (cut / "summary.png").exists()
    with (cut / "summary.csv").open() as f:
        table = {row["job"]: row for row in csv.DictReader(f)}
    assert len(table) == len(rows)
    missing = [j for j, row in table.items() if row["status"] == "missing"]
    assert sorted(missing, key=int) == sorted([ok, bad, *never], key=int)
    assert table[ok]["choices.mqa_kernel"] == "reference", "a missing row keeps the choices Hydra recorded"
    for job in never:                                # ... and a cell that never started, its overrides
        gone = rows[job]
        assert table[job]["missing"] == "never started"
        assert (table[job]["choices.mqa_kernel"], table[job]["choices.cache_layout"]) == (
            gone["choices.mqa_kernel"], gone["choices.cache_layout"])


@pytest.mark.slow
@on_cpu_host
def test_the_recorded_matrix_numbers_cells_as_hydra_numbers_jobs(sweep):
    out, _ = sweep
    grid = matrix(out)
    assert grid is not None and len(grid.cells) == len(rows_by_job(out))
    for cell in grid.cells:
        recorded = (out / grid.folder(cell) / ".hydra" / "overrides.yaml").read_text()
        assert list(cell.overrides) == OmegaConf.to_container(OmegaConf.create(recorded)), cell


@pytest.mark.slow
@on_cpu_host
def test_a_sweep_with_an_error_runs_every_cell_summarizes_and_exits_1(tmp_path):
    """A cell that cannot even be made into a job (an option's invalid field) is an error row; the other
    cells still run; the sweep exits 1."""
    out = tmp_path / "sweep"
    r = run_py("-m", "model=dsv4_tiny", "mqa_kernel=reference", "mqa_kernel.chunk=0,16", "workload=sweep",
               "workload.layers=[0]", f"hydra.sweep.dir={out}")
    assert r.returncode == 1
    assert "1 of 2 jobs failed with an error" in r.stderr
    rows = {row["error"] if row["status"] == "error" else row["status"]: row for row in rows_by_job(out).values()}
    assert set(rows) == {"ok", "ConfigError: mqa_kernel.chunk=0: expected a whole number >= 1"}
    md = (out / "summary.md").read_text()
    assert "ConfigError: mqa_kernel.chunk=0: expected a whole number >= 1" in md
    assert (out / "summary.png").exists()


# ---- multirun handling, in process -----------------------------------------------------------------------
def test_multirun_incompatible_cell_is_a_row_and_returns(compose_cfg, tmp_path):
    cfg = compose_cfg(["model=dsv4_tiny", "tp_size=3"])
    assert run_config(cfg, out_dir=tmp_path, multirun=True) is None
    row = json.loads((tmp_path / "result.json").read_text())
    assert row["status"] == "incompatible" and row["problems"][0]["group"] == "tp_size"
    with pytest.raises(IncompatibleCombination):
        run_config(cfg, out_dir=tmp_path / "single")


def test_multirun_error_is_a_row_printed_and_returns(compose_cfg, tmp_path, monkeypatch, capsys):
    import dsv4.app.runner

    def boom(job):
        raise RuntimeError("kernel exploded")
    monkeypatch.setattr(dsv4.app.runner, "execute", boom)
    cfg = compose_cfg(["model=dsv4_tiny"])
    assert run_config(cfg, out_dir=tmp_path, multirun=True) is None
    row = json.loads((tmp_path / "result.json").read_text())
    assert row["status"] == "error" and row["error"] == "RuntimeError: kernel exploded"
    err = capsys.readouterr().err
    assert "Traceback" in err and "kernel exploded" in err
    with pytest.raises(RuntimeError, match="kernel exploded"):       # a single run re-raises
        run_config(cfg, out_dir=tmp_path / "single")


def test_multirun_config_error_before_the_job_is_a_row(compose_cfg, tmp_path, capsys):
    cfg = compose_cfg(["model=dsv4_tiny", "cache_layout.dtype=float16"])
    assert run_command(cfg, choices={"cache_layout": "bf16"}, out_dir=str(tmp_path), multirun=True) is None
    row = json.loads((tmp_path / "result.json").read_text())
    assert row["status"] == "error" and "cache_layout=bf16" in row["error"]
    assert "device.platform" not in row and row["choices.cache_layout"] == "bf16"
    err = capsys.readouterr().err
    assert "ConfigError: cache_layout=bf16" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        run_command(cfg, choices={}, out_dir=str(tmp_path / "single"))


@pytest.mark.parametrize("name, target", [("summarize", "SummarizeCallback"), ("folders", "FoldersCallback")])
def test_each_callback_is_a_plain_class_with_the_six_hooks(name, target):
    import dsv4.app.callbacks

    cfg = compose_with_hydra([])
    assert cfg.hydra.callbacks[name]._target_ == f"dsv4.app.callbacks.{target}"
    cls = getattr(dsv4.app.callbacks, target)
    assert cls.__mro__ == (cls, object)
    for hook in ("on_run_start", "on_run_end", "on_multirun_start", "on_multirun_end", "on_job_start", "on_job_end"):
        assert callable(getattr(cls(), hook))


def test_summarize_callback_summarizes_run_sweeps_and_exits_1_on_errors(tmp_path, capsys):
    from dsv4.app.callbacks import SummarizeCallback

    dev = DeviceInfo(platform="cpu", name="CPU")
    write_row(tmp_path / "0", result_row(status="ok", problems=[], choices={"mqa_kernel": "reference"}, device=dev,
                                         settings={}, metrics={"max_rel_err": 1e-7}))
    config = OmegaConf.create({"mode": "check", "hydra": {"sweep": {"dir": str(tmp_path)}}})
    SummarizeCallback().on_multirun_end(config=config)           # check/info sweeps write no rows
    assert not (tmp_path / "summary.md").exists()
    config.mode = "run"
    SummarizeCallback().on_multirun_end(config=config)
    assert (tmp_path / "summary.md").exists() and "# Sweep summary" in capsys.readouterr().out
    write_row(tmp_path / "1", result_row(status="error", problems=[], choices={"mqa_kernel": "reference"},
                                         device=dev, settings={}, error="RuntimeError: boom"))
    with pytest.raises(SystemExit, match="1 of 2 jobs failed with an error"):
        SummarizeCallback().on_multirun_end(config=config)
    assert "error: RuntimeError: boom" in (tmp_path / "summary.md").read_text()


def test_summarize_on_rows_written_by_hand(tmp_path):
    """Pure summarize: an ok row, an error whose message has a `|`, an incompatible row and a job that
    Hydra started (.hydra/) without a row."""
    dev = DeviceInfo(platform="cpu", name="CPU")
    base = {"model": "dsv4_tiny", "o_proj": "reference"}
    write_row(tmp_path / "0", result_row(status="ok", problems=[], choices=base | {"mqa_kernel": "reference"},
                                         device=dev, settings={"tp_size": 1},
                                         metrics={"swa": {"decode_ms_step": 1.5}, "c4a": {"decode_ms_step": 2.5},
                                                  "max_rel_err": 3e-7}))
    write_row(tmp_path / "1", result_row(status="error", problems=[], choices=base | {"mqa_kernel": "reference"},
                                         device=dev, settings={"tp_size": 2}, error="ValueError: a | b"))
    from dsv4.values.errors import Problem
    p = Problem(group="mqa_kernel", value="flashmla_sparse", reason="runs on cuda", fix="mqa_kernel=reference")
    write_row(tmp_path / "2", result_row(status="incompatible", problems=[p],
                                         choices=base | {"mqa_kernel": "flashmla_sparse"}, device=dev,
                                         settings={"tp_size": 1}))
    (tmp_path / "3" / ".hydra").mkdir(parents=True)
    (tmp_path / "3" / ".hydra" / "overrides.yaml").write_text("- mqa_kernel=flashmla_sparse\n- tp_size=2\n")
    (tmp_path / "3" / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  runtime:\n    choices:\n      model: dsv4_tiny\n      o_proj: reference\n"
        "      mqa_kernel: flashmla_sparse\n      hydra/launcher: basic\n")
    (tmp_path / "3" / ".hydra" / "config.yaml").write_text("tp_size: 2\ndtype: float32\n")
    s = summarize(tmp_path)
    assert [r["status"] for r in load_rows(tmp_path)] == ["ok", "error", "incompatible", "missing"]
    assert s.counts == {"ok": 1, "mismatch": 0, "incompatible": 1, "error": 1, "missing": 1}
    md = s.markdown
    assert "| mqa_kernel \\ tp_size | 1 | 2 |" in md
    assert "| reference | 3.00e-07 | error: ValueError: a \\| b |" in md
    assert "| reference | 4 | error: ValueError: a \\| b |" in md          # decode ms/step summed over layers
    assert "✗ incompatible: mqa_kernel=flashmla_sparse" in md and "missing: no result.json" in md
    assert "fix: `mqa_kernel=reference`" in md
    assert "Fixed: o_proj=reference, model=dsv4_tiny, dtype=float32." in md
    assert s.png_path is not None and s.png_path.stat().st_size > 5_000


# ---- readable errors -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_unknown_experiment_lists_the_experiments(tmp_path):
    r = run_py("-m", "experiment=nosuch", f"hydra.sweep.dir={tmp_path}")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "Could not find 'experiment/nosuch'" in r.stderr
    assert "Available options in 'experiment'" in r.stderr
    assert all(e in r.stderr for e in EXPERIMENTS)
    assert not list(tmp_path.iterdir()), "nothing ran"


@pytest.mark.slow
def test_override_typo_in_a_sweep_is_named(tmp_path):
    r = run_py("-m", "experiment=cache_by_kernel", "mqa_kernal=reference", f"hydra.sweep.dir={tmp_path}")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "Could not override 'mqa_kernal'" in r.stderr
    assert not list(tmp_path.iterdir()), "nothing ran"


@pytest.mark.slow
@on_cpu_host
def test_sweep_on_a_deployment_whose_device_is_absent_is_incompatible_rows(tmp_path):
    r = run_py("-m", "model=dsv4_tiny", "deployment=h200", "mqa_kernel=reference", f"hydra.sweep.dir={tmp_path}")
    assert r.returncode == 1, r.stderr[-3000:]             # no cell could run: the sweep says so and fails
    assert "error: no cell of the sweep ran: all 1 are incompatible" in r.stderr and "Traceback" not in r.stderr
    [row] = rows_by_job(tmp_path).values()
    assert row["status"] == "incompatible"
    dep = [p for p in row["problems"] if p["group"] == "deployment"]
    assert dep and dep[0]["fix"] == "deployment=cpu" and "this machine's platform is cpu" in dep[0]["reason"]
    assert "deployment=h200" in r.stderr and "fix: deployment=cpu" in r.stderr


@pytest.mark.slow
def test_summarize_without_a_folder_says_what_to_give(tmp_path):
    r = run_py("mode=summarize", f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "mode=summarize needs the sweep folder: +sweep_dir=PATH" in r.stderr
    r = run_py("mode=summarize", f"+sweep_dir={tmp_path / 'nosuch'}", f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0 and "no such directory" in r.stderr and "Traceback" not in r.stderr


# ---- progress ------------------------------------------------------------------------------------------
class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_rewrites_one_line_on_a_terminal_and_writes_a_line_per_step_elsewhere():
    from dsv4.app.workload import Workload, run_workload
    from tests.conftest import make_engine, tiny_spec

    spec = tiny_spec()
    engine, _ = make_engine(spec, layout="float32")
    wl = Workload(prompt_lens=(40, 20), prefill_chunk=16, decode_steps=2, decode_tokens=1)
    log = io.StringIO()                                          # a pipe or a file: a line per finished step
    run_workload(engine, wl, hidden_size=spec.hidden_size, seed=0, progress=step_progress(log))
    n = len(wl.steps())
    want = [f"  {phase} step {i + 1}/{n} done" for i, (phase, _) in enumerate(wl.steps())]
    assert log.getvalue().splitlines() == want
    engine, _ = make_engine(spec, layout="float32")
    tty = FakeTTY()
    run_workload(engine, wl, hidden_size=spec.hidden_size, seed=0, progress=step_progress(tty))
    text = tty.getvalue()
    assert "prefill step 1/5, layer 0 (swa) 1/3" in text
    assert "prefill step 1/5, layer 1 (c4a) 2/3" in text
    assert f"decode step {n}/{n}, layer 2 (c128a) 3/3" in text
    assert text.endswith(f"decode step {n}/{n}\n")
    assert text.count("\n") == 1, "one line, rewritten in place"
