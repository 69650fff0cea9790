"""How the Triton kernel tests run on this machine: compiled on a GPU (the tests are marked gpu), else
interpreted (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU, before any test module is imported)."""
from __future__ import annotations

import os

import pytest
import torch

from dsv4.components.layer_ops import layer_ops

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

# what the layer's own pieces (dsv4/components) run on tensors on DEVICE, as a layer built for this machine
# chooses it (dsv4.components.layer_ops): the GPU's Triton ops (their kernels), or the torch ops (on CPU tensors)
if INTERPRET:
    OPS = layer_ops(None)
else:
    from dsv4.values.device import detect
    from dsv4.kernels.target import device_target

    OPS = layer_ops(device_target(detect()))
