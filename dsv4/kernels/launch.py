"""Launching our Triton kernels with less host time than `kernel[grid](...)`.

An eager decode step is bound by the host's time per launch (docs/notes/2026-12-02-eager-host-time.md).
Besides the driver's launch, Triton's `JITFunction.run` binds the arguments, derives their specialization,
turns it and the launch options into a string key, reads its knobs and re-checks the kernel's globals on every
call. `launch` keeps only what a call needs once a kernel is compiled: Triton's own binder still derives the
specialization (dtypes, 16-byte alignment of pointers, integers equal to 1 or divisible by 16), so a call that
needs another compiled variant gets it -- from Triton's normal path, which compiles it -- and otherwise the
compiled variant is launched directly on the current stream: through the C launcher itself where the Triton is
one whose launcher calling convention is known here (3.5 and 3.6) and the kernel needs no scratch memory, else
through the compiled kernel's `run`.

Kernels are looked up by identity (a JITFunction's own hash recomputes its cache key in Python); the
grid arithmetic on the host is dsv4/values/sizes.py's; the device facts the kernels' wrappers plan by are
dsv4/kernels/target.py's.

Under the interpreter (`TRITON_INTERPRET=1`, the CPU tests) and while a launch hook is installed (a
profiler such as proton), it is exactly `kernel[grid](*args, **meta)`.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

try:
    from triton import knobs
except Exception:             # a Triton without knobs (before 3.4): every launch takes Triton's own path
    knobs = None

# Tritons whose CudaLauncher calls its C `launch(gx, gy, gz, stream, function, cooperative, pdl,
# global_scratch, profile_scratch, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)`
_DIRECT_C_LAUNCH = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2]) in {(3, 5), (3, 6)}


@triton.jit
def _probe(x_ptr):
    """A kernel of no work: whether Triton interprets this process's kernels (`interpreted`)."""
    pass


@triton.jit
def dependent_start(PDL: tl.constexpr):
    """A programmatic dependent's first step (Target.pdl; nothing without PDL): wait for the kernel before it
    (its writes visible, its reads of what this one overwrites done), then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def interpreted() -> bool:
    """Whether Triton interprets our kernels (TRITON_INTERPRET=1 when they were defined: the CPU tests)."""
    return not hasattr(_probe, "device_caches")


class _Kernel:
    """One JITFunction's launch state: its binder per device and its compiled variants by specialization."""
    __slots__ = ("binders", "fn", "variants")

    def __init__(self, fn) -> None:
        self.fn = fn              # held, so that the id this is filed under stays this kernel's
        self.binders: dict = {}   # device -> Triton's argument binder, None where this path does not apply
        self.variants: dict = {}  # (device, specialization, options) -> (compiled kernel, C launch or None)

    def binder(self, dev: int):
        """Triton's binder on device `dev`, as JITFunction.run calls it (Triton 3.4 to 3.9 keep it last in
        `device_caches[dev]`); None for a Triton that keeps it elsewhere."""
        if dev not in self.binders:
            entry = self.fn.device_caches[dev]          # a defaultdict: made on first use, as run() does
            ok = isinstance(entry, tuple) and len(entry) == 5 and callable(entry[4])
            self.binders[dev] = entry[4] if ok else None
        return self.binders[dev]


_KERNELS: dict[int, _Kernel] = {}      # id(JITFunction) -> its launch state (None: interpreted)


def _hooked() -> bool:
    if knobs is None:
        return True
    rt = knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    # a chain of hooks (Triton 3.5+) counts when it holds one; a single hook (older) when it is set
    return (enter is not None and bool(getattr(enter, "calls", True))) or \
        (leave is not None and bool(getattr(leave, "calls", True)))


def _c_launch(compiled):
    """The C launcher of a compiled kernel where it can be called directly (see the module docstring)."""
    run = compiled.run
    if not _DIRECT_C_LAUNCH or type(run).__name__ != "CudaLauncher":
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    c = getattr(run, "launch", None)
    return (c, run.launch_cooperative_grid, run.launch_pdl) if callable(c) else None


_OBSERVERS: list = []        # observe(): called with (kernel, args, meta) before each launch


@contextlib.contextmanager
def observe(fn):
    """Within the block, `fn(kernel, args, meta)` sees every launch (compiled or interpreted) before it runs:
    what a kernel is called with, e.g. to derive the specialization Triton compiles it for."""
    _OBSERVERS.append(fn)
    try:
        yield
    finally:
        _OBSERVERS.remove(fn)


def launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """kernel[grid](*args, **meta), with the specialization's compiled kernel launched directly."""
    for fn in _OBSERVERS:
        fn(kernel, args, meta)
    k = _KERNELS.get(id(kernel), False)
    if k is False:
        k = _KERNELS[id(kernel)] = _Kernel(kernel) if hasattr(kernel, "device_caches") else None
    if k is None or _hooked():                     # interpreted, or a profiler's hook is set
        kernel[grid](*args, **meta)
        return
    dev = torch._C._cuda_getDevice()
    binder = k.binders.get(dev) or k.binder(dev)
    if binder is None:
        kernel[grid](*args, **meta)
        return
    bound, spec, options = binder(*args, **meta)          # the call's specialization, as Triton derives it
    key = (dev, tuple(spec), tuple(options.items()))
    hit = k.variants.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **meta)            # compiled (or found) and launched by Triton
        k.variants[key] = (compiled, _c_launch(compiled))
        return
    compiled, c = hit
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(dev)
    if c is not None:
        c[0](grid[0], g1, g2, stream, compiled.function, c[1], c[2], None, None, compiled.packed_metadata, None,
             None, None, *bound.values())
    else:
        compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *bound.values())


def variants(kernel) -> int:
    """How many compiled variants `launch` keeps for `kernel` (0 under the interpreter)."""
    k = _KERNELS.get(id(kernel))
    return len(k.variants) if k else 0


def compiled() -> dict[str, int]:
    """Compiled variants `launch` has launched so far, by kernel name: each new one was compiled or loaded
    from Triton's cache on the host, inside the step that first needed it."""
    return {k.fn.fn.__name__: len(k.variants) for k in _KERNELS.values() if k is not None and k.variants}


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileCase:
    """One specialization of a kernel as its wrapper launches it, stated by the kernel's own module (its
    `compile_cases(gpu)`) so that dsv4/kernels/compile_check.py compiles it for GPUs this machine does not
    have: the constexprs, the Triton type of each pointer and float argument (every other argument an
    int32), the int arguments the launcher sees divisible by 16 (pointers always are), the launch options."""
    kernel: Any                                   # the @triton.jit (or Gluon) function
    constexprs: dict[str, Any]
    pointers: dict[str, str]                      # argument -> "*bf16", "*u8", ...
    floats: frozenset[str] = frozenset()          # float32 scalars
    divisible: frozenset[str] = frozenset()
    num_warps: int = 4
    options: dict[str, Any] = field(default_factory=dict)    # other compile options (maxnreg)


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
    """t whose rows (its first dimension) may be strided -- a column slice -- but each of whose rows is dense
    (itself when it is; a kernel told the row stride reads it); otherwise t made contiguous."""
    shape, strides, dense = t.shape, t.stride(), 1
    for i in range(t.dim() - 1, 0, -1):
        if shape[i] != 1 and strides[i] != dense:
            return t.contiguous()
        dense *= shape[i]
    return t


def full_rows(t):
    """A 2-D t as a contiguous tensor without a copy where it is a column slice [:, :n] of one (DeepGEMM's
    padded score rows): that tensor, its extra columns included (for a reader told each row's length);
    otherwise t made contiguous."""
    if t.is_contiguous():
        return t
    rows, stride = t.shape[0], t.stride(0)
    held = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    if t.stride(1) == 1 and stride >= t.shape[1] and rows * stride <= held:
        return t.as_strided((rows, stride), (stride, 1))
    return t.contiguous()
