"""How the Triton kernel tests run on this machine: compiled on a GPU (the tests are marked gpu), else
interpreted (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU, before any test module is imported)."""
from __future__ import annotations

import os

import pytest
import torch

GPU = torch.cuda.is_available()
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton>=3.7)")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])
if INTERPRET:
    MARK = pytest.mark.skipif(VERSION < (3, 7), reason="Triton's interpreter before 3.7 cannot take loaded "
                              "loop bounds with NumPy 2 (int() of a 1-element array)")
    DEVICE, BIG = "cpu", False
else:
    MARK = pytest.mark.gpu
    DEVICE, BIG = "cuda", True

# what the layer's own pieces (dsv4/components) are given to run on tensors on DEVICE, as a layer built for this
# machine resolves it: the GPU's Target (their kernels), or None (their torch code, on CPU tensors)
if INTERPRET:
    KERNELS = None
else:
    from dsv4.values.device import detect
    from dsv4.kernels.target import device_target

    KERNELS = device_target(detect())
