"""Every setting of a run, validated once before anything runs: typed values from the composed config.

A section of the config is read into a frozen dataclass by `parse(cls, node, key)`, which takes the
field types and the ranges declared in the fields' metadata (`at_least`, `above`, `one_of`) and refuses,
in one line that names the key, the value and what is allowed: a value of the wrong type (no silent
truncation: `tp_size=2.5` is refused, not run as 2), one out of range, and an unknown key (with the
closest known one). Strategy options are read the same way from their class (`option`), so their
fields are checked before any strategy is built. Pure Python: `mode=check` imports no torch.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import MISSING, dataclass, field
from typing import Any, Mapping

from dsv4.values.errors import ConfigError

_HINTS: dict[type, dict[str, Any]] = {}


def at_least(n: float, default: Any = MISSING) -> Any:
    """A numeric field (or each element of a tuple field) >= n."""
    return field(default=default, metadata={"min": n})


def above(n: float, default: Any = MISSING) -> Any:
    """A numeric field > n."""
    return field(default=default, metadata={"gt": n})


def one_of(options: tuple, default: Any = MISSING) -> Any:
    """A field whose value is one of `options`."""
    return field(default=default, metadata={"choices": tuple(options)})


def unknown_key(key: str, name: str, known) -> ConfigError:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean {_join(key, close[0])}?)" if close else ""
    return ConfigError(f"{_join(key, name)}: unknown setting{hint}; known: {', '.join(sorted(known))}")


def check_keys(node: Mapping[str, Any], known, key: str) -> None:
    for name in node:
        if name not in known:
            raise unknown_key(key, str(name), known)


def parse(cls, node: Mapping[str, Any] | None, key: str, *, skip: tuple[str, ...] = ()):
    """cls(**node), each field checked against its type and metadata; keys in `skip` are read elsewhere."""
    if node is not None and not isinstance(node, Mapping):
        raise ConfigError(f"{key}={_show(node)}: expected a group of settings")
    node = dict(node or {})
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    check_keys(node, names | set(skip), key)
    kw = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        k = _join(key, f.name)
        if f.name not in node:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"{k}: missing")
            continue
        kw[f.name] = _value(k, node[f.name], hints[f.name], f.metadata)
    return cls(**kw)


def _hints(cls) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _show(value: Any) -> str:
    """A value as it would be typed on the command line."""
    if isinstance(value, str) and value and not any(c.isspace() for c in value):
        return value
    return "null" if value is None else repr(value)


def _describe(tp, meta, *, plural: bool = False) -> str:
    if "choices" in meta:
        return "one of " + ", ".join(str(c) for c in meta["choices"])
    names = {int: ("a whole number", "whole numbers"), float: ("a finite number", "finite numbers"),
             bool: ("true or false",) * 2,
             str: ("a string", "strings")}
    base = names.get(tp, (str(tp),) * 2)[plural]
    if "min" in meta:
        base += f" >= {meta['min']}"
    if "gt" in meta:
        base += f" > {meta['gt']}"
    return base


def _value(key: str, value: Any, tp, meta: Mapping[str, Any]) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _value(key, value, args[0], meta)
    if origin is tuple:
        elem = typing.get_args(tp)[0]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={_show(value)}: expected a list of {_describe(elem, meta, plural=True)}, e.g. [1, 2]")
        return tuple(_value(f"{key}[{i}]", v, elem, meta) for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}={_show(value)}: expected a group of settings")
        return parse(tp, value, key)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)                  # a name or path the command line parsed as a number (dump_dir=2024)
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str)}.get(tp, lambda v: True)
    if not ok(value) or ("choices" in meta and value not in meta["choices"]) \
            or ("min" in meta and value < meta["min"]) or ("gt" in meta and not value > meta["gt"]):
        raise ConfigError(f"{key}={_show(value)}: expected {_describe(tp, meta)}")
    return float(value) if tp is float else value


def resolved(cfg: Any) -> Any:
    """The composed config with every interpolation resolved in place; one that cannot be (`seed=${oops}`, a
    resolver that fails) is refused in one line that names the key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        key = _unresolvable(cfg, OmegaConf.to_container(cfg, resolve=False)) or "the config"
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}; fix: {key}=<a value>") from None
    return cfg


def _unresolvable(cfg: Any, node: Any, key: str = "") -> str | None:
    """The first key under `key` whose value does not resolve (found by selecting each value alone)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(node, (dict, list)):
        for k, v in node.items() if isinstance(node, dict) else enumerate(node):
            bad = _unresolvable(cfg, v, f"{key}[{k}]" if isinstance(node, list) else _join(key, str(k)))
            if bad is not None:
                return bad
        return None
    try:
        OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except OmegaConfBaseException:
        return key
    return None


def section(cfg: Mapping[str, Any], key: str, *, needed: bool = True, fix: str | None = None) -> dict[str, Any] | None:
    """The section `key` of the composed config as plain values. A section the job needs that the command line
    removed (`~model`; `fix`: the override that gives it back), and any section set to null or to a single value
    (`parallel=null`), is refused in one line; a section it can do without that is absent is None (its
    defaults)."""
    if key not in cfg:
        if not needed:
            return None
        raise ConfigError(f"{key}: missing (a ~ on the command line removed it); the job needs it, fix: "
                          f"{f'{fix} (or drop that ~)' if fix else 'drop that ~'}")
    node = cfg[key]
    if hasattr(node, "_get_node"):                      # an OmegaConf node
        from omegaconf import OmegaConf

        node = OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, Mapping):
        raise ConfigError(f"{key}={_show(node)}: expected a group of settings; fix: leave {key} out")
    return dict(node)


# ---- the run's own settings ------------------------------------------------------------------------
MODES = ("run", "check", "info", "bench", "summarize")
WEIGHTS = ("random", "checkpoint")
# top-level keys that other sections own: the strategy groups, the model and device (their own parsers),
# graph, parallel and workload (theirs), summary (dsv4.reports.summary_metrics, read when a sweep is summarized)
SECTIONS = ("model", "device", "mqa_kernel", "o_proj", "head_padding", "cache_layout", "indexer", "linear", "graph",
            "parallel",
            "workload", "summary")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSettings:
    path: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSettings:
    """The top level of the config (configs/config.yaml), less the sections parsed by their owners."""
    mode: str = one_of(MODES, "run")
    seed: int = at_least(0, 0)
    tp_size: int = at_least(1, 1)
    dtype: str = one_of(("float32", "bfloat16"), "float32")
    dump_dir: str | None = None
    dump_overwrite: bool = False         # dump_dir may already hold files (then replaced); else it is refused
    weights: str = one_of(WEIGHTS, "random")
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    sweep_dir: str | None = None         # mode=summarize: +sweep_dir=PATH
    bench_rows: str | None = None        # mode=bench: +bench_rows=PATH, the folder its stamped rows go to
    overlap: bool = True                 # on a GPU, the compressors on a side stream beside the query path
    batch_invariant: bool = False        # a request's results bit for bit independent of the rest of its steps

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "RunSettings":
        s = parse(cls, {k: v for k, v in cfg.items() if k != "hydra"}, "", skip=SECTIONS)
        if s.weights == "checkpoint" and not s.checkpoint.path:
            raise ConfigError("weights=checkpoint needs the checkpoint folder: checkpoint.path=DIR (config.json and "
                              "the safetensors index)")
        if s.weights == "checkpoint" and not os.path.isdir(os.path.expanduser(s.checkpoint.path)):
            what = "not a folder" if os.path.exists(os.path.expanduser(s.checkpoint.path)) else "no such folder"
            raise ConfigError(f"checkpoint.path={s.checkpoint.path}: {what}; fix: checkpoint.path=DIR, the folder "
                              f"that holds config.json and the safetensors index")
        return s


def option(node: Mapping[str, Any], group: str):
    """A strategy from its YAML node (`_target_` and its fields), every field checked by `parse`."""
    import importlib

    node = dict(node)
    target = node.pop("_target_", None)
    node.pop("_convert_", None)
    if not isinstance(target, str) or "." not in target:
        raise ConfigError(f"{group}: no _target_ naming the option's class")
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except ImportError as e:
        raise ConfigError(f"{group}._target_={target}: cannot import {module} ({e})") from None
    if cls is None or not dataclasses.is_dataclass(cls):
        raise ConfigError(f"{group}: _target_={target} is not a strategy class")
    try:
        return parse(cls, node, group)
    except (TypeError, ValueError) as e:        # a class's own __post_init__ check
        if isinstance(e, ConfigError):
            raise
        msg = str(e)
        raise ConfigError(msg if msg.startswith(f"{group}=") else f"{group}={node.get('name', '?')}: {msg}") from None
