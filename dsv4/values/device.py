"""The machine a combination is checked for and run on, as a value (never a global).

`deployment=` gives it (`device:` in the config); `detect()` reads the local machine lazily.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from dsv4.values.errors import ConfigError
from dsv4.values.settings import above, one_of, parse

PLATFORMS = ("cpu", "cuda", "rocm")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceInfo:
    platform: str = one_of(PLATFORMS)   # cpu | cuda | rocm
    arch: str = ""         # sm80, sm89, sm90, sm100, sm120, gfx942, gfx950; "" on cpu
    name: str = ""         # human name: "H200", "CPU"
    memory_gib: float | None = above(0, None)   # the accelerator's memory as its driver reports it (None: on
                                                # the CPU, what this machine has free; elsewhere unknown)

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ConfigError(f"device.platform={self.platform!r}: expected one of {', '.join(PLATFORMS)}")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "DeviceInfo":
        node = dict(cfg)
        for k in ("arch", "name"):
            if node.get(k) is None:
                node[k] = ""
        dev = parse(cls, node, "device")
        wrong = arch_problem(dev)
        if wrong:
            raise ConfigError(wrong)
        return dev

    @property
    def torch_device(self) -> str:
        """The torch device string tensors go to (ROCm builds of torch also say "cuda")."""
        return "cpu" if self.platform == "cpu" else "cuda"

    def describe(self) -> str:
        parts = [self.platform + (f"/{self.arch}" if self.arch else "")]
        if self.name:
            parts.append(f"({self.name})")
        return " ".join(parts)


# how each platform names its architectures, with an example (an empty arch: not said)
ARCH_NAMES = {"cpu": None, "cuda": ("sm", "sm90"), "rocm": ("gfx", "gfx942")}


def arch_problem(dev: DeviceInfo) -> str | None:
    """A device whose arch is not one of its platform's (a CPU with `sm90`, a CUDA GPU with `gfx942`): what is
    wrong and the fix; None if it is fine. Options choose their kernels by the arch, so it must be the
    platform's own."""
    names = ARCH_NAMES[dev.platform]
    if not dev.arch or (names and dev.arch.startswith(names[0]) and dev.arch[len(names[0]):].isalnum()):
        return None
    if names is None:
        return (f"device.arch={dev.arch}: a cpu device has no arch; fix: device.arch=null (or a GPU deployment, "
                f"e.g. deployment=h200)")
    return (f"device.arch={dev.arch}: not a {dev.platform} arch (those are named like {names[1]}); "
            f"fix: device.arch={names[1]} (or device.arch=null)")


def local_platform() -> str:
    """Which platform this machine has, without importing torch (for `mode=check`)."""
    if os.path.exists("/dev/kfd"):
        return "rocm"
    if os.path.exists("/proc/driver/nvidia/version"):
        return "cuda"
    return "cpu"


def detect() -> DeviceInfo:
    """The local machine's first accelerator, or the CPU. Imports torch."""
    import torch

    if not torch.cuda.is_available():
        return DeviceInfo(platform="cpu", name="CPU")
    props = torch.cuda.get_device_properties(0)
    gib = props.total_memory / 2 ** 30
    if getattr(torch.version, "hip", None):
        arch = str(getattr(props, "gcnArchName", "")).split(":")[0]
        return DeviceInfo(platform="rocm", arch=arch, name=props.name, memory_gib=gib)
    return DeviceInfo(platform="cuda", arch=f"sm{props.major}{props.minor}", name=props.name, memory_gib=gib)
