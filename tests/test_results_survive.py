"""Results that survive: every run writes a folder of its own (two started in one second too), its
`result.json` once and whole, never replaced by what fails after it (a reader that closes stdout early), and
a run refuses up front a folder that already holds a result or a dump folder that already holds files."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from dsv4.report import write_row
from tests.conftest import ROOT, run_py

TINY = ("model=dsv4_tiny", "workload.prompt_lens=[20,9]", "workload.decode_steps=1")


def start(cwd, *args):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_two_runs_started_together_write_two_folders(tmp_path):
    runs = [start(tmp_path, *TINY) for _ in range(2)]
    for r in runs:
        out, err = r.communicate(timeout=300)
        assert r.returncode == 0, out + err
    rows = sorted((tmp_path / "outputs").glob("*/result.json"))
    assert len(rows) == 2 and all(json.loads(p.read_text())["status"] == "ok" for p in rows)


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


def test_a_folder_that_holds_a_result_is_refused_before_the_work(tmp_path):
    first = run_py(*TINY, run_dir=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr
    row = (tmp_path / "result.json").read_text()
    again = run_py(*TINY, run_dir=tmp_path, timeout=300)
    assert again.returncode == 1 and "hydra.run.dir" in again.stderr and "fix:" in again.stderr
    assert "Traceback" not in again.stderr and "verdict" not in again.stdout
    assert (tmp_path / "result.json").read_text() == row


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
