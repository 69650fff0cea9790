"""The shipped options of each strategy group: the one reader of configs/<group>/*.yaml.

An option is its class and its YAML file. A group may nest one in an option's field (NESTED_GROUPS:
`indexer.top_k`, configs/indexer/top_k/*.yaml): the option's YAML and the command line name the nested
option (`indexer.top_k=flashinfer`), which is read here into its object. `check()` computes its fixes from
what ships here (a group's default in configs/config.yaml, a nested group's in that option's YAML, which
need nothing; the head padding that yields what a kernel takes), and `mode=info` and `mode=bench` list and
compose the options through `options` and the backend presets through `backend_presets`. Whatever needs a
group's default option takes it from here (`default_option`, `strategies`), never by naming its class.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from dsv4.values.errors import ConfigError
from dsv4.values.settings import option as parse_option



@functools.cache
def config_dir() -> Path:
    """The Hydra config tree's folder: the package `dsv4.configs`, which is the repository's top-level configs/
    mapped into the package (pyproject.toml), in a checkout installed with `pip install -e .` as in a wheel.
    Found without importing it: nothing here imports torch."""
    import importlib.util

    spec = importlib.util.find_spec("dsv4.configs")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the package dsv4.configs (the configs/ folder) is not importable: dsv4 runs installed; "
                          "fix: pip install -e . in the checkout (or pip install the wheel)")
    return Path(next(iter(spec.submodule_search_locations)))

GROUPS = ("mqa_kernel", "o_proj", "head_padding", "cache_layout", "indexer", "linear")
# groups whose option is a field of a group's option (`parent.field`), their YAMLs in configs/<parent>/<field>/
NESTED_GROUPS = ("indexer.top_k",)


def folder(group: str) -> Path:
    """The folder of a group's YAMLs (a nested group's inside its parent's)."""
    return config_dir().joinpath(*group.split("."))


def instantiate_group(node: Any, group: str = "strategy"):
    """One strategy from its YAML node, every field checked first (dsv4.values.settings.option); a field of a nested
    group (NESTED_GROUPS) takes the option it names, or the one its own node describes."""
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    for nested in NESTED_GROUPS:
        parent, _, key = nested.rpartition(".")
        if parent == group and isinstance(node.get(key), str):
            node[key] = option(nested, node[key])
        elif parent == group and isinstance(node.get(key), dict):
            node[key] = instantiate_group(node[key], nested)
    return parse_option(node, group)


@functools.cache
def options(group: str) -> dict[str, Any]:
    """The shipped options of `group` (or of a nested group), instantiated, by name (their YAML files'
    stems), in name order."""
    from omegaconf import OmegaConf

    paths = sorted(folder(group).glob("*.yaml"))
    if not paths:
        raise ConfigError(f"no shipped options for group {group!r} (one of {', '.join(GROUPS + NESTED_GROUPS)})")
    return {p.stem: instantiate_group(OmegaConf.load(p), group) for p in paths}


def option(group: str, name: str):
    """The shipped option `name` of `group`."""
    opts = options(group)
    if name not in opts:
        raise ConfigError(f"{group}={name} is not a shipped option (one of {', '.join(opts)})")
    return opts[name]


def null_group(overrides) -> str | None:
    """`model=null` (any config group set to null on the command line) or `=3` (no key): Hydra's composition
    fails on them with a traceback; here, before it, one line (with the group's options). None when no
    override does that."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    given = [o for o in overrides if isinstance(o, str) and "=" in o and not o.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(given)
    except HydraException:           # Hydra says what is wrong with these itself
        return None
    for o in parsed:
        group = o.key_or_group
        if not group:
            return f"{o.input_line}: no key before the '='; fix: KEY{o.input_line}, e.g. seed{o.input_line}"
        if o.is_delete() or o.is_sweep_override() or o.value() is not None or not (config_dir() / group).is_dir():
            continue
        names = ", ".join(sorted(p.stem for p in (config_dir() / group).glob("*.yaml")))
        fix = default_override(group) or f"drop {o.input_line}"
        return f"{o.input_line}: the config group {group} takes one of its options ({names}); fix: {fix}"
    return None


def default_override(key: str) -> str | None:
    """The override that gives a section of the config its default back: its group's option in
    configs/config.yaml's defaults list (the device's: the deployment's); None if it has none."""
    from omegaconf import OmegaConf

    group = "deployment" if key == "device" else key
    for entry in OmegaConf.to_container(OmegaConf.load(config_dir() / "config.yaml"))["defaults"]:
        if isinstance(entry, dict) and entry.get(group) is not None:
            return f"{group}={entry[group]}"
    return None


@functools.cache
def model_presets() -> dict[str, Any]:
    """The shipped model presets (configs/model/*.yaml) that build a ModelSpec, by name."""
    from omegaconf import OmegaConf

    from dsv4.values.spec import ModelSpec

    out = {}
    for p in sorted((config_dir() / "model").glob("*.yaml")):
        try:
            out[p.stem] = ModelSpec.from_config(OmegaConf.to_container(OmegaConf.load(p), resolve=True))
        except (ConfigError, TypeError, ValueError):     # a preset that does not build is no model
            continue
    return out


@functools.cache
def backend_presets() -> dict[str, dict[str, str]]:
    """The shipped backend presets (configs/backend/*.yaml), by name: the option each chooses per group."""
    from omegaconf import OmegaConf

    out = {}
    for p in sorted((config_dir() / "backend").glob("*.yaml")):
        chosen = {}
        for entry in OmegaConf.to_container(OmegaConf.load(p)).get("defaults", []):
            if isinstance(entry, dict) and len(entry) == 1:
                (key, name), = entry.items()
                group = key.removeprefix("override").strip(" /")
                if group in GROUPS:
                    chosen[group] = name
        out[p.stem] = chosen
    return out


@functools.cache
def defaults() -> dict[str, str]:
    """Each group's option in configs/config.yaml's defaults list, and each nested group's in the YAML of its
    parent's default (configs/indexer/exact.yaml: `top_k: triton`): the choice when nothing else is said."""
    from omegaconf import OmegaConf

    out = {}
    for entry in OmegaConf.to_container(OmegaConf.load(config_dir() / "config.yaml"))["defaults"]:
        if isinstance(entry, dict) and len(entry) == 1:
            (group, name), = entry.items()
            if group in GROUPS:
                out[group] = name
    for nested in NESTED_GROUPS:
        parent, _, key = nested.rpartition(".")
        out[nested] = OmegaConf.load(folder(parent) / f"{out[parent]}.yaml")[key]
    return out


def default_option(group: str):
    """The option of `group` (or of a nested group) chosen when nothing else is said: configs/config.yaml's."""
    return option(group, defaults()[group])


def strategies(**given):
    """An option of each group (a dsv4.strategies.Strategies): those `given` by group, each other group's (or
    one given as None) its default -- the one place a default option is taken, below the job's config."""
    from dsv4.strategies.choice import Strategies

    unknown = sorted(set(given) - set(GROUPS))
    if unknown:
        raise TypeError(f"strategies: {', '.join(unknown)} is no strategy group (one of {', '.join(GROUPS)})")
    return Strategies(**{g: default_option(g) if given.get(g) is None else given[g] for g in GROUPS})
