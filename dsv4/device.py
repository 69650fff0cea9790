"""The machine a combination is checked for and run on, as a value (never a global).

`deployment=` gives it (`device:` in the config); `detect()` reads the local machine lazily.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from dsv4.errors import ConfigError
from dsv4.settings import above, one_of, parse

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
        return parse(cls, node, "device")

    @property
    def torch_device(self) -> str:
        """The torch device string tensors go to (ROCm builds of torch also say "cuda")."""
        return "cpu" if self.platform == "cpu" else "cuda"

    def describe(self) -> str:
        parts = [self.platform + (f"/{self.arch}" if self.arch else "")]
        if self.name:
            parts.append(f"({self.name})")
        return " ".join(parts)


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
