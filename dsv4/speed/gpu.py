"""What every GPU bench script (bench/*.py) checks before anything else: that this machine has a CUDA GPU."""
from __future__ import annotations


def require_gpu(script: str) -> None:
    """A bench script that times GPU kernels, run on a machine without a CUDA GPU: refused in one line, before
    it imports a kernel package or does any work, as `mode=bench` is refused there."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"error: {script} times GPU kernels: this machine has no CUDA GPU (torch {torch.__version__});"
                         f" run it on a machine with one (here: python run.py mode=check, mode=run)")
