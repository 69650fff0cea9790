"""Our Triton kernels compile for GPUs CI does not have (dsv4.kernels.compile_check): mqa_kernel=triton_sparse
for an A100 (integer e4m3 decoding), the H200 reading bf16 rows and MI300 reading FNUZ bytes; o_proj=triton_fp8's
e4m3 product for an L40/4090; triton_sparse's one-pass Gluon kernel for the H200 (Gluon has no interpreter, so
on the CPU this is its only check). Compiled in a fresh process, since the other Triton tests import the kernels
under TRITON_INTERPRET=1."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# not imported here: Triton reads TRITON_INTERPRET once, and tests/conftest.py sets it for this process
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton>=3.7)")


@pytest.mark.parametrize("job", ["cuda:80/fp8_ds_mla", "cuda:90/bfloat16", "hip:gfx942/fp8_ds_mla_fnuz",
                                 "cuda:89/o_proj", "cuda:90/hopper"])
def test_kernels_compile_for(job):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "dsv4.kernels.compile_check", job], env=env, capture_output=True,
                       text=True, timeout=900, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compiled in" in r.stdout
