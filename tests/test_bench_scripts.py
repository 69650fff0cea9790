"""The GPU bench scripts' edges on a machine without a GPU: refused in one line before any work (and before any
kernel package is imported), as `mode=bench` is; their --help and bad arguments answered by argparse;
bench/compare_dumps.py refuses what is not a dump; a table with a failed row ends with a non-zero status."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

GPU_SCRIPTS = ("bench_kernels", "bench_linear", "host_overhead", "layer_table", "probe_scaled_mm", "profile_layer",
               "tune_indexer", "tune_triton")

# each script run as `python bench/<script>.py ARGS` in one process, the kernel packages made unimportable (as in
# the base install): {command: [exit code or SystemExit's message, stderr]}
DRIVER = r"""
import contextlib, io, json, runpy, sys, traceback
for name in ("triton", "deep_gemm", "flash_mla", "flashinfer", "aiter"):
    sys.modules[name] = None
out = {}
for script, args in json.loads(sys.argv[1]):
    sys.argv, err, code = [script, *args], io.StringIO(), 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code
        except BaseException:
            traceback.print_exc()
            code = "raised"
    out[" ".join([script, *args])] = [code, err.getvalue()]
print(json.dumps(out))
"""


def run_scripts(cases: list[tuple[str, list[str]]]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA GPU")
def test_gpu_bench_scripts_refuse_a_cpu_in_one_line_and_answer_help_and_bad_arguments(tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "tensors.safetensors").write_bytes(b"not safetensors")
    cases = [(f"bench/{s}.py", args) for s in GPU_SCRIPTS for args in ([], ["--help"])]
    cases += [("bench/layer_table.py", ["deployment=cpu", "--cases", "1x1@64"]),     # was an empty table, exit 0
              ("bench/tune_triton.py", ["nosuch"]), ("bench/profile_layer.py", ["--requests", "x"]),
              ("bench/compare_dumps.py", []), ("bench/compare_dumps.py", [str(tmp_path), str(tmp_path)]),
              ("bench/compare_dumps.py", [str(dump), str(dump)])]
    got = run_scripts(cases)
    for script, args in cases:
        code, err = got[" ".join([script, *args])]
        what = f"{script} {args}: {code!r} {err[-2000:]}"
        assert "Traceback" not in err and code != "raised", what
        if args == ["--help"]:
            assert code == 0, what
        elif script == "bench/compare_dumps.py" and not args or "nosuch" in args or "x" in args:
            assert code == 2 and err.count("error:") == 1, what               # argparse's usage and its error
        elif script == "bench/compare_dumps.py":
            assert isinstance(code, str) and "\n" not in code and not err, what
            assert ("not a dump folder" in code) if args[0] == str(tmp_path) else ("not a readable safetensors" in code)
        else:
            assert code == (f"error: {script} times GPU kernels: this machine has no CUDA GPU (torch "
                            f"{torch.__version__}); run it on a machine with one (here: python run.py mode=check, "
                            "mode=run)"), what
            assert not err, what


def test_layer_table_ends_non_zero_when_a_row_failed(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("layer_table", ROOT / "bench" / "layer_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)

    def two_rows(job, cases, *, echo, **kw):       # the table as bench_layer_step makes it: one row failed
        echo(f"swa | a | - | 1 | 1 | 64 | {table.ERROR}RuntimeError: boom")
        echo("swa | b | - | 1 | 1 | 64 | 12.5")
        return "the table"

    monkeypatch.setattr(table, "bench_layer_step", two_rows)
    monkeypatch.setattr(table, "require_gpu", lambda script: None)          # the rows are made up: any machine
    monkeypatch.setattr(sys, "argv", ["layer_table.py", "deployment=cpu", "--cases", "1x1@64"])
    with pytest.raises(SystemExit) as end:
        table.main()
    assert "1 of the table's rows failed" in str(end.value.code) and "boom" in str(end.value.code)
    assert "the table" in capsys.readouterr().out
