"""The base install (`pip install torch==2.13.0 -e .`: no `test` extra, so no Triton) runs everything the CPU
path does. Triton and the vendor kernel packages are imported only where a GPU path needs them; a process in
which importing them fails must still compose, build and step a layer with every option the CPU accepts.
(.ci/run also runs the README's first command in a fresh virtual environment, which has no Triton at all.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = ("triton", "deep_gemm", "flash_mla", "flashinfer", "aiter")

pytestmark = pytest.mark.slow

# the options of every group that check() accepts on this CPU with dsv4_tiny and the defaults (one swapped),
# each combination once (a group's default is the defaults' combination)
ACCEPTED = r"""
import json, warnings
import dsv4
from dsv4.checks import catalogue
from dsv4.values.errors import IncompatibleCombination

warnings.simplefilter("ignore")           # options that change nothing on the CPU say so
accepted, seen = [], []
for group in catalogue.GROUPS + catalogue.NESTED_GROUPS:
    for name in catalogue.options(group):
        try:
            combo = dsv4.compose(["model=dsv4_tiny", f"{group}={name}"]).combo
        except IncompatibleCombination:
            continue
        if combo not in seen:
            seen.append(combo)
            accepted.append(f"{group}={name}")
print(json.dumps(accepted))
"""

# each accepted option built and stepped (a prefill of 140 tokens, then a decode step) on every layer type
STEPS = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None               # `import name` raises ImportError, as where it is not installed
import torch
import dsv4

ran = []
for choice in json.loads(sys.argv[2]):
    job = dsv4.compose(["model=dsv4_tiny", choice])
    engine = dsv4.build_engine(job)
    x = torch.randn(142, job.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    engine.add_request("r")
    for start, n in [(0, 140), (140, 2)]:
        step = engine.step(x[start:start + n], torch.arange(start, start + n), ["r"] * n)
        for out in step.outputs.values():
            if not (torch.isfinite(out).all() and out.abs().sum() > 0):
                raise SystemExit(f"{choice}: a degenerate output")
    ran.append(choice)
print(json.dumps(ran))
"""


def _run(script: str, *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def accepted() -> list[str]:
    return _run(ACCEPTED)


def test_every_option_the_cpu_accepts_runs_without_the_optional_packages(accepted):
    assert {"indexer=triton_fp8", "linear=fp8_sim", "cache_layout=fp8_ds_mla"} <= set(accepted)
    assert _run(STEPS, json.dumps(OPTIONAL), json.dumps(accepted)) == accepted


def test_the_command_runs_without_the_optional_packages(tmp_path):
    """`python run.py` itself (the Quick start's first command), on dsv4_tiny, in a process without Triton."""
    script = ("import runpy, sys\n"
              f"for name in {OPTIONAL!r}: sys.modules[name] = None\n"
              f"sys.argv = ['run.py', 'model=dsv4_tiny', 'hydra.run.dir={tmp_path / 'run'}']\n"
              f"runpy.run_path({str(ROOT / 'run.py')!r}, run_name='__main__')\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)          # this checkout's dsv4, whatever is installed
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "ok"
