"""Activation dtypes are plain strings in YAML (OmegaConf has no torch types); torch types here."""
from __future__ import annotations

ACTIVATION_DTYPES = ("float32", "bfloat16")


def torch_dtype(name: str):
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in table:
        from dsv4.values.errors import ConfigError
        raise ConfigError(f"dtype={name!r}: expected one of {', '.join(table)}")
    return table[name]
