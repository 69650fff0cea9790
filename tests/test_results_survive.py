"""Results that survive: every run writes a folder of its own (two started in one second too), its
`result.json` once and whole, never replaced by what fails after it (a reader that closes stdout or stderr
early), and a run refuses up front a folder that already holds a result, a dump folder that already holds
files, and a run folder or dump folder that another run is writing into now; a sweep refuses a folder that
already holds a sweep, or that another sweep is writing into, before any cell runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from dsv4.app.dispatch import run_config
from dsv4.app.callbacks import FoldersCallback
from dsv4.values.errors import IncompatibleCombination
from dsv4.reports.report import write_row
from dsv4.app.targets import FolderBusy, hold
from tests.conftest import ROOT, run_py

TINY = ("model=dsv4_tiny", "workload.prompt_lens=[20,9]", "workload.decode_steps=1")


def start(cwd, *args):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_two_runs_started_together_write_two_folders(tmp_path):
    runs = [start(tmp_path, *TINY) for _ in range(2)]
    for r in runs:
        out, err = r.communicate(timeout=300)
        assert r.returncode == 0, out + err
    rows = sorted((tmp_path / "outputs").glob("*/result.json"))
    assert len(rows) == 2 and all(json.loads(p.read_text())["status"] == "ok" for p in rows)


@pytest.mark.slow
def test_a_closed_stdout_leaves_the_result_as_it_was(tmp_path):
    """`python run.py | head -1`: the reader goes away after one line; the run still finishes, quietly (no
    traceback, status 0), and its row says ok."""
    r = start(tmp_path, *TINY)
    assert r.stdout.readline().startswith("run: ")
    r.stdout.close()
    err = r.stderr.read()
    r.wait(timeout=300)
    assert r.returncode == 0 and "Traceback" not in err and "Exception ignored" not in err, err
    rows = list((tmp_path / "outputs").glob("*/result.json"))
    assert len(rows) == 1 and json.loads(rows[0].read_text())["status"] == "ok"


@pytest.mark.slow
def test_a_folder_that_holds_a_result_is_refused_before_the_work(tmp_path):
    first = run_py(*TINY, run_dir=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr
    row = (tmp_path / "result.json").read_text()
    again = run_py(*TINY, run_dir=tmp_path, timeout=300)
    assert again.returncode == 1 and "hydra.run.dir" in again.stderr and "fix:" in again.stderr
    assert "Traceback" not in again.stderr and "verdict" not in again.stdout
    assert (tmp_path / "result.json").read_text() == row


@pytest.mark.slow
def test_a_dump_folder_with_files_is_refused_unless_overwrite_is_said(tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "spec.json").write_text("{}")
    r = run_py("model=dsv4_tiny", "mode=check", f"dump_dir={dump}", run_dir=tmp_path / "a")
    assert r.returncode == 1 and "dump_dir" in r.stderr and "dump_overwrite=true" in r.stderr, r.stderr
    ok = run_py("model=dsv4_tiny", "mode=check", f"dump_dir={dump}", "dump_overwrite=true", run_dir=tmp_path / "b")
    assert ok.returncode == 0, ok.stderr
    empty = run_py("model=dsv4_tiny", "mode=check", f"dump_dir={tmp_path / 'new'}", run_dir=tmp_path / "c")
    assert empty.returncode == 0, empty.stderr


def test_a_row_is_written_whole_and_once(tmp_path, capsys):
    first = write_row(tmp_path, {"status": "ok"})
    assert json.loads(first.read_text()) == {"status": "ok"}
    assert write_row(tmp_path, {"status": "error"}) == first          # the first row is the job's result
    assert json.loads(first.read_text()) == {"status": "ok"} and "not replaced" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]     # no temporary file left behind


@pytest.mark.slow
def test_a_closed_stderr_leaves_the_result_as_it_was(tmp_path):
    """`python run.py 2>&1 | head -1`: the progress lines on stderr meet the closed pipe as the table does."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    r = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *TINY], cwd=tmp_path, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert r.stdout.readline().startswith("run: ")
    r.stdout.close()
    r.wait(timeout=300)
    rows = list((tmp_path / "outputs").glob("*/result.json"))
    assert len(rows) == 1
    row = json.loads(rows[0].read_text())
    assert row["status"] == "ok" and r.returncode == 0, row.get("error")


@pytest.mark.slow
def test_a_run_folder_another_run_writes_into_is_refused_before_the_work(tmp_path):
    """Two runs on one hydra.run.dir at the same time: the one that comes second (here: while this process
    holds the folder, as a running run does) is refused with one line, and writes nothing there."""
    out = tmp_path / "run"
    with hold(out, what="hydra.run.dir"):
        r = run_py(*TINY, run_dir=out, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "run: " not in r.stdout, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: hydra.run.dir={out}: another process is writing into this folder now (one's output would replace "
        f"the other's); fix: hydra.run.dir=<a new folder>, or wait until it ends")
    assert not (out / "result.json").exists()


def test_a_dump_folder_another_run_writes_into_is_refused_before_the_work(compose_cfg, tmp_path):
    dump = tmp_path / "dump"
    cfg = compose_cfg([*TINY, f"dump_dir={dump}"])
    with hold(dump, what="dump_dir"), pytest.raises(IncompatibleCombination, match="dump_dir=.*another process"):
        run_config(cfg, out_dir=tmp_path / "run")
    row = json.loads((tmp_path / "run" / "result.json").read_text())
    assert row["status"] == "incompatible" and row["problems"][0]["group"] == "dump_dir"
    assert not any(dump.iterdir())


def test_a_folder_is_held_for_the_run_and_let_go_after(tmp_path):
    busy = pytest.raises(FolderBusy, match="another process is writing into this folder")
    with hold(tmp_path, what="hydra.run.dir"), busy, hold(tmp_path, what="hydra.run.dir"):
        pass
    with hold(tmp_path, what="hydra.run.dir"):          # released at the end of the block
        pass
    assert not list(tmp_path.iterdir())                 # a lock leaves nothing in the folder


@pytest.mark.slow
def test_a_lock_left_by_a_killed_run_does_not_block(tmp_path):
    code = ("import sys, time; from pathlib import Path; from dsv4.app.targets import hold\n"
            "with hold(Path(sys.argv[1]), what='hydra.run.dir'):\n"
            "    print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(FolderBusy), hold(tmp_path, what="hydra.run.dir"):
        pass
    holder.kill()
    holder.wait(timeout=30)
    holder.stdout.close()
    with hold(tmp_path, what="hydra.run.dir"):
        pass


def a_sweep_folder(path):
    (path / "0" / ".hydra").mkdir(parents=True)
    write_row(path / "0", {"status": "ok"})
    (path / "multirun.yaml").write_text("hydra: {}\n")
    return {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_a_second_sweep_into_a_sweeps_folder_is_refused_before_any_cell(tmp_path):
    """Not a mix of both sweeps' rows under one summary: refused before any cell, nothing in it changed."""
    before = a_sweep_folder(tmp_path)
    r = run_py("-m", *TINY, "mqa_kernel.chunk=16,32", f"hydra.sweep.dir={tmp_path}", timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "Launching" not in r.stdout + r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: hydra.sweep.dir={tmp_path} already holds a sweep (multirun.yaml and 1 job folder(s): 0): a second "
        f"sweep would mix its rows with those; fix: hydra.sweep.dir=<a new folder> (or leave it out: every sweep "
        f"gets a folder of its own), or summarize this one again: python run.py mode=summarize "
        f"+sweep_dir={tmp_path}")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def sweep_config(path):
    return OmegaConf.create({"mode": "run", "hydra": {"sweep": {"dir": str(path)}}})


def test_a_sweep_folder_another_sweep_writes_into_is_refused(tmp_path):
    first = FoldersCallback()
    first.on_multirun_start(config=sweep_config(tmp_path))         # an empty folder: a new sweep
    with pytest.raises(SystemExit, match="hydra.sweep.dir=.*another process is writing into this folder now"):
        FoldersCallback().on_multirun_start(config=sweep_config(tmp_path))
    first.on_multirun_end(config=sweep_config(tmp_path))
    FoldersCallback().on_multirun_start(config=sweep_config(tmp_path / "elsewhere"))
