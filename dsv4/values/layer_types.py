"""DeepSeek-V4's layer types, one row each (docs/numerics.md §1.1, §2.4): what a layer's compress ratio means
for its caches, its compressor and what a token attends to. Every place that asks "what does ratio R do"
reads this table, so a new ratio is one row. Pure Python, below every other module (the kernels read it too).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LayerType:
    ratio: int          # the compress ratio (1: no compressor, the sliding window only)
    name: str           # its name in tables, step plans and result rows
    coff: int           # windows a compressed entry pools: 2 where consecutive windows overlap (CSA), else 1; 0: none
    indexed: bool       # a token reads the indexer's top-k of the compressed entries, not every visible one

    @property
    def compressed(self) -> bool:
        """Whether the layer has a compressor (and a compressed cache)."""
        return self.ratio > 1

    @property
    def reach(self) -> int:
        """Positions back from a closing one that its compressor reads (its windows: coff x ratio)."""
        return self.coff * self.ratio


LAYER_TYPES: tuple[LayerType, ...] = (
    LayerType(ratio=1, name="swa", coff=0, indexed=False),
    LayerType(ratio=4, name="c4a", coff=2, indexed=True),
    LayerType(ratio=128, name="c128a", coff=1, indexed=False),
)
RATIOS = tuple(t.ratio for t in LAYER_TYPES)
INDEXED = next(t for t in LAYER_TYPES if t.indexed)        # the layer type whose tokens the indexer serves


def by_ratio(ratio: int) -> LayerType:
    """The layer type of compress ratio `ratio` (1 for a layer without a compressor)."""
    for t in LAYER_TYPES:
        if t.ratio == ratio:
            return t
    raise ValueError(f"compress ratio {ratio}: the layer types are those of ratios {', '.join(map(str, RATIOS))}")

