"""The strategies of one layer, an option per group: what the builders take and what `check()` judges.

No option is imported here (nor outside dsv4/strategies/ but by the catalogue and the benchmarks of
dsv4/speed/, which time named kernels): each comes from its caller -- a configured job, the catalogue's
defaults (configs/config.yaml, `catalogue.strategies`) or objects of the caller's own -- so that a default is
written in one place only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import get_type_hints

from dsv4.strategies.protocols import (CacheLayout, HeadPaddingPolicy, IndexerStrategy, LinearStrategy,
                                       MQAKernelStrategy, OProjStrategy)


@dataclass(frozen=True, slots=True, kw_only=True)
class Strategies:
    """One option of each group (catalogue.GROUPS, in its order), each satisfying its group's Protocol; none
    has a default here, so no option class is named below the catalogue."""
    mqa_kernel: MQAKernelStrategy
    o_proj: OProjStrategy
    head_padding: HeadPaddingPolicy
    cache_layout: CacheLayout
    indexer: IndexerStrategy
    linear: LinearStrategy


@functools.cache
def protocols() -> dict[str, type]:
    """Each group's Protocol, by group: the type of its field of Strategies."""
    hints = get_type_hints(Strategies)
    return {f.name: hints[f.name] for f in fields(Strategies)}
