"""dsv4: the DeepSeek-V4 sparse-MLA attention layer, composed from injected strategies.

The public API (README, "Using the layer from Python"): `compose` a validated job from the command line's
overrides (and, optionally, a model spec, a device or strategy objects of your own), then `build_layer`,
`build_pool` or `build_engine` from it. Names resolve on first use, so `import dsv4` imports neither torch
nor Hydra; compose() and validate() never import torch.
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__all__ = [
    "ConfigError", "DSV4Attention", "DeviceInfo", "Engine", "IncompatibleCombination", "InvalidRequest", "Job",
    "KVPool", "LayerCaches", "ModelSpec", "PageTable", "PoolConfig", "Problem", "StepPlan", "TypePlan",
    "build_engine",
    "build_layer", "build_pool", "compose", "detect", "random_layer_weights", "validate",
]
_HOMES = {       # where each public name lives; imported on first use
    "dsv4.api": ("compose", "validate", "build_layer", "build_pool", "build_engine"),
    "dsv4.app.job": ("Job",),
    "dsv4.values.spec": ("ModelSpec",),
    "dsv4.values.device": ("DeviceInfo", "detect"),
    "dsv4.values.errors": ("Problem", "ConfigError", "IncompatibleCombination", "InvalidRequest"),
    "dsv4.components.attention": ("DSV4Attention",),
    "dsv4.components.kv_pool": ("KVPool", "LayerCaches", "PoolConfig"),
    "dsv4.components.plan": ("PageTable", "StepPlan", "TypePlan"),
    "dsv4.components.engine": ("Engine",),
    "dsv4.components.weights": ("random_layer_weights",),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'dsv4' has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from dsv4.api import build_engine, build_layer, build_pool, compose, validate
    from dsv4.app.job import Job
    from dsv4.components.attention import DSV4Attention
    from dsv4.components.engine import Engine
    from dsv4.components.kv_pool import KVPool, LayerCaches, PoolConfig
    from dsv4.components.plan import PageTable, StepPlan, TypePlan
    from dsv4.components.weights import random_layer_weights
    from dsv4.values.device import DeviceInfo, detect
    from dsv4.values.errors import ConfigError, IncompatibleCombination, InvalidRequest, Problem
    from dsv4.values.spec import ModelSpec
