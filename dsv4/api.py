"""The Python API for engine authors: a validated job, then a layer, its pool or an Engine built from it.

A job is what `dsv4 OVERRIDES` would run, as values: composed from the packaged configs by the same
`make_job` as the command line, optionally with a model spec, a device or strategy objects of the caller's
own in place of the configured ones. Every builder first checks the job for this machine (`check()`, with
the Python packages looked for here), so a combination that cannot run raises IncompatibleCombination,
naming each problem and its fix, before anything is allocated. compose() and validate() never import torch.
"""
from __future__ import annotations

import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from dsv4.checks.catalogue import GROUPS, null_group
from dsv4.app.job import Job, make_job, problems_for, raise_if
from dsv4.values.device import DeviceInfo
from dsv4.values.errors import ConfigError
from dsv4.checks.no_effect import inert_settings
from dsv4.values.settings import resolved
from dsv4.values.spec import ModelSpec

if TYPE_CHECKING:
    from dsv4.components.attention import DSV4Attention
    from dsv4.components.kv_pool import PoolConfig
    from dsv4.components.engine import Engine
    from dsv4.components.kv_pool import KVPool


def compose(overrides: Sequence[str] = (), *, spec: ModelSpec | None = None, device: DeviceInfo | None = None,
            mqa_kernel: Any = None, o_proj: Any = None, head_padding: Any = None, cache_layout: Any = None,
            indexer: Any = None, linear: Any = None, running: bool = True) -> Job:
    """The validated job of `dsv4 *overrides` (e.g. `["model=dsv4_tiny", "backend=triton", "tp_size=2"]`).

    `spec`, `device` and the six strategies, when given, replace what the overrides chose (objects of the
    caller's own: a model that has no preset, a strategy that has no YAML). `running`: check that the job can
    run on this machine (False: only that the combination fits its deployment's device, as `mode=check`).
    Raises ConfigError for an unknown option or a bad value, IncompatibleCombination for a combination that
    cannot run."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    from dsv4.app.cli import group_choices

    listed = None if isinstance(overrides, str) else list(overrides)     # read once: an iterator is spent
    if listed is None or not all(isinstance(o, str) for o in listed):
        raise TypeError(f"overrides: a list of 'key=value' strings, got {overrides!r}")
    overrides = listed
    if spec is not None and not isinstance(spec, ModelSpec):
        raise TypeError(f"spec: a dsv4.values.spec.ModelSpec, got {type(spec).__name__}")
    if device is not None and not isinstance(device, DeviceInfo):
        raise TypeError(f"device: a dsv4.values.device.DeviceInfo, got {type(device).__name__}")
    given = {g: s for g, s in zip(GROUPS, (mqa_kernel, o_proj, head_padding, cache_layout, indexer, linear))
             if s is not None}
    for group, strat in given.items():
        _check_strategy(group, strat)
    null = null_group(overrides)                  # Hydra's composition fails on it with a traceback
    if null:
        raise ConfigError(null)
    outer = GlobalHydra.instance().hydra          # a Hydra app of the caller's keeps its own state
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="dsv4.configs", version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(str(e)) from None
    finally:
        GlobalHydra.instance().hydra = outer
    choices = group_choices(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    job = make_job(resolved(cfg), choices=choices)
    if spec is not None:
        spec.validate()
        job = replace(job, spec=spec, combo=replace(job.combo, spec=spec), choices=job.choices | {"model": spec.name})
    if device is not None:
        job = replace(job, device=device)
    if given:
        job = replace(job, combo=replace(job.combo, strategies=replace(job.combo.strategies, **given)),
                      choices=job.choices | {g: getattr(s, "name", type(s).__name__) for g, s in given.items()})
    for line in inert_settings(job, overrides):
        warnings.warn(line, stacklevel=2)
    return validate(job, running=running)


def validate(job: Job, *, running: bool = True) -> Job:
    """`job` if `check()` finds no problem with it (on this machine, unless `running=False`); otherwise
    IncompatibleCombination, whose message lists every problem with its fix."""
    if not isinstance(job, Job):
        raise TypeError(f"job: what dsv4.api.compose() returns (a dsv4.app.job.Job), got {type(job).__name__}")
    raise_if(job, problems_for(job, running=running))
    return job


def build_layer(job: Job, layer: int, *, weights: Mapping[str, Any] | None = None, rank: int = 0) -> DSV4Attention:
    """Decoder layer `layer`'s attention for tensor-parallel rank `rank` of the job: `weights` are the whole
    layer's, under dsv4's names (`dsv4.components.weights`; each rank takes its shard), or the job's
    (`weights=random`, seeded by `seed`, or `weights=checkpoint`). Its caches: `build_pool(job, [layer])`."""
    from dsv4.components.builders import build_layer as build

    validate(job)
    _check_int("layer", layer)
    job.spec.compress_ratio(layer)                # an unknown layer is a ConfigError before any weight is made
    _check_int("rank", rank)
    if not 0 <= rank < job.combo.tp_size:
        raise ConfigError(f"rank={rank}: expected 0..{job.combo.tp_size - 1} (tp_size={job.combo.tp_size})")
    full, fp8 = _weights(job, [layer], None if weights is None else {layer: weights})
    return build(spec=job.spec, layer=layer, weights=full[layer], rank=rank, tp_size=job.combo.tp_size,
                 strategies=job.combo.strategies, device=job.device, dtype=job.combo.dtype, fp8=fp8.get(layer),
                 overlap=job.run.overlap, batch_invariant=job.combo.batch_invariant)


def build_pool(job: Job, layers: Sequence[int] | None = None, *, pool: PoolConfig | None = None) -> KVPool:
    """One rank's KV pool for `layers` (default: the workload's, one layer of each type): the page groups,
    block tables and each layer's caches (`.layers[l]`, what `DSV4Attention` reads and writes). `pool`: page
    sizes and counts (default: the job's `workload.kv_pool`)."""
    from dsv4.components.builders import build_pool as build

    job = _with_pool(job, pool)
    validate(job)
    layers = _layers(job, layers)
    return build(spec=job.spec, layers=list(layers), layout=job.combo.cache_layout, pool=job.pool,
                 device=job.device, dtype=job.combo.dtype, indexer=job.combo.indexer)


def build_engine(job: Job, *, layers: Sequence[int] | None = None, weights: Mapping[int, Mapping[str, Any]] | None = None,
                 pool: PoolConfig | None = None) -> Engine:
    """An Engine over `layers` (default: those of `weights`, else the workload's) with every tensor-parallel
    rank of the job in this process (their outputs summed): requests, validated steps, rollback; with
    `graph.enabled=true`, CUDA-graph decode. `weights`: {layer: its whole weights}, default the job's."""
    from dsv4.app.runner import job_engine

    job = _with_pool(job, pool)
    validate(job)
    if weights is not None and not isinstance(weights, Mapping):
        raise TypeError(f"weights: a mapping {{layer: {{name: tensor}}}}, got {type(weights).__name__}")
    if layers is None and weights is not None:
        layers = list(weights)
    layers = _layers(job, layers)
    full, fp8 = _weights(job, layers, weights)
    return job_engine(job, {l: full[l] for l in layers}, job.pool, fp8)


# ---- the job's defaults ---------------------------------------------------------------------------------
def _layers(job: Job, layers: Sequence[int] | None) -> tuple[int, ...]:
    if layers is None:
        return tuple(job.workload.layer_indices(job.spec))
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(f"layers: a list of decoder layer indices, got {type(layers).__name__}")
    if not layers:
        raise ValueError("layers: an empty list; give at least one decoder layer index (or None: the job's)")
    for l in layers:
        _check_int("layers", l)
        job.spec.compress_ratio(l)                # ConfigError naming the model's layer count
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers: {list(layers)} names a layer twice")
    return tuple(layers)


def _with_pool(job: Job, pool: PoolConfig | Mapping[str, Any] | None) -> Job:
    """The job with the given pool sizes (a PoolConfig, or a mapping of its fields checked as the config's
    are; None: its own), so that `validate` judges the pool that will be built."""
    from dataclasses import replace

    from dsv4.components.kv_pool import PoolConfig

    if pool is None:
        return job
    if isinstance(pool, Mapping):
        pool = PoolConfig.from_config(dict(pool))
    elif not isinstance(pool, PoolConfig):
        raise TypeError(f"pool: a dsv4.components.kv_pool.PoolConfig or a mapping of its fields, got "
                        f"{type(pool).__name__}")
    return replace(job, pool=pool)


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: an int, got {type(value).__name__} {value!r}")


def _check_strategy(group: str, strat: Any) -> None:
    """A strategy object given for `group` satisfies the group's Protocol (its field's type in
    dsv4.strategies.Strategies); a name is an override's job."""
    from dsv4.strategies.choice import protocols

    proto = protocols()[group]
    if strat is None or isinstance(strat, proto):
        return
    if isinstance(strat, str):
        raise TypeError(f"{group}={strat!r}: a strategy object; to choose a shipped option by name, pass the "
                        f"override: compose(['{group}={strat}'])")
    raise TypeError(f"{group}: {type(strat).__name__} does not satisfy {proto.__name__} "
                    f"(dsv4/strategies/protocols.py)")


def _weights(job: Job, layers: Sequence[int], given: Mapping[int, Mapping[str, Any]] | None):
    """(float weights per layer, the linears stored as fp8 blocks per layer): the caller's (float values:
    fp8 options quantize them at build), or the job's source."""
    from dsv4.components.checkpoint import load_or_random

    if given is None:
        return load_or_random(job, list(layers), job.run.seed)
    missing = [l for l in layers if l not in given]
    if missing:
        raise ConfigError(f"weights: no weights for layers {missing} (given: {sorted(given)})")
    for l in layers:
        check_weights(job.spec, l, given[l])
    return {l: dict(given[l]) for l in layers}, {}


def check_weights(spec, layer: int, weights: Mapping[str, Any]) -> None:
    """A caller's weights for `layer`, judged before anything is built, as the checkpoint loader judges a
    checkpoint's: every tensor the layer reads and no other, each a floating-point tensor of its shape with
    only finite values (a NaN would give NaN or all-zero outputs without a word)."""
    import torch

    from dsv4.components.weights import weight_shapes

    if not isinstance(weights, Mapping):
        raise TypeError(f"weights[{layer}]: a mapping of tensor names to tensors, got {type(weights).__name__}")
    want = weight_shapes(spec, spec.compress_ratio(layer))
    missing, extra = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    if missing or extra:
        raise ConfigError(f"weights[{layer}]: " + "; ".join(
            ([f"missing {missing}"] if missing else []) + ([f"not read by this layer: {extra}"] if extra else []))
            + " (names: dsv4.components.weights.weight_shapes)")
    for name, shape in want.items():
        t = weights[name]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"weights[{layer}][{name!r}]: a floating-point tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if tuple(t.shape) != tuple(shape):
            raise ConfigError(f"weights[{layer}][{name!r}]: shape {tuple(t.shape)}, expected {tuple(shape)} "
                              f"for model={spec.name}")
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise ConfigError(f"weights[{layer}][{name!r}]: {bad} non-finite value(s)")
