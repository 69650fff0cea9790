"""Launching our Triton kernels with less host time than `kernel[grid](...)`.

An eager decode step is bound by the host's time per launch (docs/benchmarks.md). Besides the driver's
launch, Triton's `JITFunction.run` binds the arguments, derives their specialization, turns it and the
launch options into a string key, reads its knobs and re-checks the kernel's globals on every call.
`launch` keeps only what a call needs once a kernel is compiled: Triton's own binder still derives the
specialization (dtypes, 16-byte alignment of pointers, integers equal to 1 or divisible by 16), so a
call that needs another compiled variant gets it -- from Triton's normal path, which compiles it -- and
otherwise the compiled variant is launched directly on the current stream.

Under the interpreter (`TRITON_INTERPRET=1`, the CPU tests) and while a launch hook is installed (a
profiler such as proton), it is exactly `kernel[grid](*args, **meta)`.
"""
from __future__ import annotations

import torch

try:
    from triton import knobs
except Exception:             # a Triton without knobs (before 3.4): every launch takes Triton's own path
    knobs = None

_COMPILED: dict = {}     # (kernel, device, specialization, options) -> triton CompiledKernel
_BINDERS: dict = {}      # (kernel, device) -> Triton's argument binder, None where this path does not apply


def _hooked() -> bool:
    if knobs is None:
        return True
    rt = knobs.runtime
    # a chain of hooks (Triton 3.5+) counts when it holds one; a single hook (older) when it is set
    return any(h is not None and bool(getattr(h, "calls", True)) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


def _binder(kernel, dev: int):
    """Triton's binder of `kernel` on device `dev`, as JITFunction.run calls it (Triton 3.4 to 3.9 keep it
    last in `device_caches[dev]`); None for an interpreted kernel or a Triton that keeps it elsewhere."""
    key = (kernel, dev)
    if key not in _BINDERS:
        entry = kernel.device_caches[dev]           # a defaultdict: made on first use, as run() does
        ok = isinstance(entry, tuple) and len(entry) == 5 and callable(entry[4])
        _BINDERS[key] = entry[4] if ok else None
    return _BINDERS[key]


def launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """kernel[grid](*args, **meta), with the specialization's compiled kernel launched directly."""
    if not hasattr(kernel, "device_caches") or _hooked():      # interpreted, or a profiler's hook is set
        kernel[grid](*args, **meta)
        return
    dev = torch._C._cuda_getDevice()
    binder = _binder(kernel, dev)
    if binder is None:
        kernel[grid](*args, **meta)
        return
    bound, spec, options = binder(*args, **meta)          # the call's specialization, as Triton derives it
    key = (kernel, dev, tuple(spec), tuple(options.items()))
    compiled = _COMPILED.get(key)
    if compiled is None:
        _COMPILED[key] = kernel[grid](*args, **meta)     # compiled (or found) and launched by Triton
        return
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(dev), compiled.function,
                 compiled.packed_metadata, None, None, None, *bound.values())


# ---- arguments in the form a kernel reads, without a dispatcher call when they already are -----------
def as_f32(t):
    """t as a contiguous float32 tensor (itself when it is one: `.float().contiguous()` costs host time
    even when it returns its input)."""
    return t if t.dtype is torch.float32 and t.is_contiguous() else t.float().contiguous()


def as_i32(t):
    """t as a contiguous int32 tensor (itself when it is one)."""
    return t if t.dtype is torch.int32 and t.is_contiguous() else t.int().contiguous()


def as_dense(t):
    """t contiguous (itself when it is)."""
    return t if t.is_contiguous() else t.contiguous()


def rows_dense(t):
    """A 2-D t whose rows may be strided (a column slice) but whose columns are adjacent."""
    return t if t.stride(1) == 1 else t.contiguous()
