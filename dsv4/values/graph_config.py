"""The `graph:` settings of a run (CUDA-graph decode, dsv4/components/graphs.py) as a value. Pure Python:
`mode=check` reads it without importing torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4.values.errors import ConfigError
from dsv4.values.settings import at_least, parse

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphConfig:
    """`graph:` in the config. capture_sizes: token counts a step is padded to; max_context: the longest
    request a captured step holds (sizes the captured block tables)."""
    enabled: bool = False
    capture_sizes: tuple[int, ...] = at_least(1, DEFAULT_SIZES)
    max_context: int = at_least(1, 8192)

    def __post_init__(self) -> None:
        sizes = tuple(sorted({int(s) for s in self.capture_sizes}))
        if not sizes or sizes[0] < 1:
            raise ConfigError(f"graph.capture_sizes={list(self.capture_sizes)}: token counts must be >= 1")
        if self.max_context < 1:
            raise ConfigError(f"graph.max_context={self.max_context}: must be >= 1")
        object.__setattr__(self, "capture_sizes", sizes)

    @classmethod
    def from_config(cls, cfg: Any) -> "GraphConfig":
        return parse(cls, cfg, "graph")
