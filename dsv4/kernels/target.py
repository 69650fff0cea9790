"""The device facts our kernels' calls are planned by, as one value (`Target`): resolved once from the device
by a strategy's `prepare` (dsv4.kernels.launch.target), so that no call asks the GPU, or reads whether
Triton interprets the kernels, again; with them, whether a call may be planned by the step's size at all
(`fixed_order`). Plain Python: the strategies' needs() may import what sits beside it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """The device facts a call is planned by, resolved once from the device (the strategy's `prepare`), so
    that no call asks the GPU again."""
    arch: str             # 'sm90'-style for NVIDIA, 'rocm', 'interpreter' when Triton interprets the kernels
    native_e4m3: bool     # OCP e4m3 converted in hardware (NVIDIA sm89 and newer)
    processors: int       # streaming multiprocessors (compute units): what a launch has to fill
    interpret: bool = False
    l2_bytes: int = 0     # its last-level cache: rows of a pool larger than this come from DRAM
    # batch_invariant=true: every call of a shape does the same sums in the same order, whatever the step's size
    # (its rows, its tokens, its lists' widths); the launch may follow the size only where the sums do not
    fixed_order: bool = False


def check_kernels(kernels: Target | None, tensor, who: str) -> None:
    """Refuse a call whose tensors are not where its implementation runs: the kernels (a Target) take GPU
    tensors, the torch code (None) CPU ones; a mismatch is an error, never a silent switch to the other path."""
    if tensor.is_cuda != (kernels is not None):
        raise ValueError(f"{who}: GPU tensors need kernels=<the device's Target>, CPU tensors kernels=None; "
                         f"given {'a Target' if kernels is not None else 'None'} with {tensor.device.type} tensors")
