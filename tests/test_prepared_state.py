"""What every shipped option's prepare() gives: None, or a frozen dataclass with slots -- typed fields, nothing
that can be reassigned or added to after build -- never a dict. Each option is prepared here, on the CPU, for
every one of a few devices its needs() allow: the choices it makes for a device are plain values, and the
weights it prepares stay on the CPU (the device's platform is then the CPU's, its arch the one allowed).
Without a GPU Triton runs interpreted, so the options that resolve the device's facts get the interpreter's."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.triton_mode import DEVICE  # noqa: F401  (skips this module where Triton is not installed)

from dsv4.checks.catalogue import options
from dsv4.values.device import DeviceInfo
from dsv4.strategies.protocols import LinearWeight, OProjWeights

# the CPU, then the deployments' GPUs (configs/deployment/)
DEVICES = (DeviceInfo(platform="cpu"), DeviceInfo(platform="cuda", arch="sm90"),
           DeviceInfo(platform="cuda", arch="sm100"), DeviceInfo(platform="cuda", arch="sm120"),
           DeviceInfo(platform="rocm", arch="gfx942"), DeviceInfo(platform="rocm", arch="gfx950"))
CASES = [(g, n) for g in ("mqa_kernel", "o_proj", "indexer", "linear") for n in options(g)]


def allowed(option, device: DeviceInfo) -> bool:
    needs = option.needs(device)
    return ((not needs.platforms or device.platform in needs.platforms)
            and (not needs.archs or device.arch in needs.archs))


def prepared(group: str, option, device: DeviceInfo):
    g = torch.Generator().manual_seed(0)
    if group == "mqa_kernel":
        return option.prepare(device=device)
    if group == "indexer":
        return option.prepare(head_dim=128, device=device)
    device = DeviceInfo(platform="cpu", arch=device.arch)      # weights: on the CPU
    if group == "o_proj":
        return option.prepare(OProjWeights(wo_a=torch.randn(256, 256, generator=g), groups=2), device=device,
                              dtype="bfloat16")
    return option.prepare(LinearWeight(values=torch.randn(256, 256, generator=g)), device=device, dtype="bfloat16")


@pytest.mark.parametrize("group,name", CASES)
def test_prepare_gives_none_or_a_frozen_dataclass(group, name):
    option = options(group)[name]
    devices = [d for d in DEVICES if allowed(option, d)]
    assert devices, f"{group}={name}: none of {[d.describe() for d in DEVICES]} is allowed"
    for device in devices:
        state = prepared(group, option, device)
        if state is None:
            continue
        what = f"{group}={name} on {device.describe()}: {type(state).__name__}"
        assert dataclasses.is_dataclass(state) and not isinstance(state, type), f"{what} is not a dataclass"
        assert type(state).__dataclass_params__.frozen, f"{what} is not frozen"
        assert not hasattr(state, "__dict__"), f"{what} has no slots"
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(state, dataclasses.fields(state)[0].name, None)
