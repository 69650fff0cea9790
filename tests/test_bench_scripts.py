"""The GPU bench scripts' edges on a machine without a GPU: refused in one line before any work, as
`mode=bench` is, and a table with a failed row ends with a non-zero status."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_layer_table_refuses_a_gpu_deployment_on_this_machine():
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench/layer_table.py", "--cases", "1x1@64", "--layer-types", "swa",
                        "--no-prefill"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "row:" not in r.stdout, r.stderr
    assert "deployment=h200: describes a cuda/sm90" in r.stderr and "fix: deployment=cpu" in r.stderr


def test_layer_table_ends_non_zero_when_a_row_failed(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("layer_table", ROOT / "bench" / "layer_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)

    def two_rows(job, cases, *, echo, **kw):       # the table as bench_layer_step makes it: one row failed
        echo(f"swa | a | - | 1 | 1 | 64 | {table.ERROR}RuntimeError: boom")
        echo("swa | b | - | 1 | 1 | 64 | 12.5")
        return "the table"

    monkeypatch.setattr(table, "bench_layer_step", two_rows)
    monkeypatch.setattr(sys, "argv", ["layer_table.py", "deployment=cpu", "--cases", "1x1@64"])
    with pytest.raises(SystemExit) as end:
        table.main()
    assert "1 of the table's rows failed" in str(end.value.code) and "boom" in str(end.value.code)
    assert "the table" in capsys.readouterr().out
