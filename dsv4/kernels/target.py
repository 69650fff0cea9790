"""The device facts our kernels' calls are planned by, as one value (`Target`): resolved once from the device
by a strategy's `prepare` (`device_target`), so that no call asks the GPU, or reads whether Triton interprets
the kernels, again; with them, whether a call may be planned by the step's size at all (`fixed_order`).

Plain Python, torch imported only where a GPU is asked and Triton only where its interpreter is: the
strategies' needs() import what sits beside it, and the CPU path resolves its (absent) Target here without
either kernel stack installed."""
from __future__ import annotations

import functools
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
    # programmatic dependent launch (NVIDIA sm90+): a kernel that takes part is launched with the attribute, may
    # be launched under the previous kernel's tail and waits for that kernel before it reads or writes memory
    pdl: bool = False
    # batch_invariant=true: every call of a shape does the same sums in the same order, whatever the step's size
    # (its rows, its tokens, its lists' widths); the launch may follow the size only where the sums do not
    fixed_order: bool = False


def check_on_gpu(tensor, who: str) -> None:
    """Refuse a call of our kernels on tensors that are not on a GPU: the layer chose its Triton ops
    (dsv4.components.layer_ops.TritonOps) for a GPU when it was built, and a CPU tensor there is a one-line
    error, never a silent switch to the torch code."""
    if not tensor.is_cuda:
        raise ValueError(f"{who}: GPU tensors need TritonOps (our kernels), CPU tensors TorchOps; "
                         f"given TritonOps with {tensor.device.type} tensors")


@functools.cache
def device_arch(device) -> str:
    """'sm90'-style name of a CUDA device ('rocm' on ROCm, 'cpu' otherwise): the arch plan_kernel sees."""
    if device.type != "cuda":
        return "cpu"
    import torch

    if getattr(torch.version, "hip", None):
        return "rocm"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def arch_at_least(arch: str, sm: int) -> bool:
    """Whether `arch` ('sm90'-style) names an NVIDIA GPU of compute capability `sm` (e.g. 90) or newer."""
    return arch.startswith("sm") and int(arch[2:]) >= sm


E4M3_SM = 89          # NVIDIA GPUs from this compute capability on convert OCP e4m3 in hardware
PDL_SM = 90           # and from this one launch kernels as programmatic dependents (griddepcontrol)


def gpu_launches_dependents(gpu) -> bool:
    """Whether our kernels compiled for Triton's GPUTarget `gpu` are launched as programmatic dependents (their
    `compile_cases`): NVIDIA GPUs from PDL_SM on, as `target` sets Target.pdl."""
    return gpu.backend == "cuda" and gpu.arch >= PDL_SM


def target(*, platform: str, arch: str, torch_device: str, fixed_order: bool = False) -> Target:
    """A device (a DeviceInfo's platform, arch and torch device) as our kernels' calls are planned: its
    processors and L2 asked once; under Triton's interpreter the 'interpreter', with a few processors, so that
    splitting is exercised. What a strategy's `prepare` resolves; `fixed_order`: batch_invariant=true's
    launches (Target.fixed_order)."""
    from dsv4.kernels.launch import interpreted   # a GPU's kernels are Triton's: check() asked for it

    if interpreted():
        return Target(arch="interpreter", native_e4m3=False, processors=4, interpret=True, fixed_order=fixed_order)
    import torch

    nvidia = platform == "cuda" and arch.startswith("sm")
    props = torch.cuda.get_device_properties(torch_device)
    return Target(arch=arch if nvidia else platform, native_e4m3=nvidia and arch_at_least(arch, E4M3_SM),
                  processors=props.multi_processor_count, l2_bytes=props.L2_cache_size, fixed_order=fixed_order,
                  pdl=nvidia and arch_at_least(arch, PDL_SM))


def device_target(device, *, fixed_order: bool = False) -> Target | None:
    """`target` of a DeviceInfo's device, what a layer or an option resolves once when it is built; None for
    the CPU (or anything that is not a DeviceInfo of a GPU), where the torch code runs (a kernel called there
    anyway plans by its tensors' device)."""
    if getattr(device, "platform", None) not in ("cuda", "rocm"):
        return None
    return target(platform=device.platform, arch=device.arch, torch_device=device.torch_device,
                  fixed_order=fixed_order)


@functools.lru_cache(maxsize=None)
def target_of(device) -> Target:
    """`target` of a torch device, for calls made without a prepared one (the benches, direct callers)."""
    arch = device_arch(device)
    return target(platform="rocm" if arch == "rocm" else device.type, arch=arch, torch_device=str(device))
