"""The lightning indexer's numerics as typed values, as `RowFormat` is a cache row's: what its RoPE'd queries
and closed keys become before they are scored and stored (`IndexerNumerics`: the layer's kernels apply it,
the oracle recomputes it and a dump records its value), and the form its scoring kernel takes the queries
in on a GPU (`QueryFormat`). An indexer option states both; no code reads an option's name."""
from __future__ import annotations

import enum

from dsv4.formats.fp4 import fp4_sim


class IndexerNumerics(enum.Enum):
    """What the indexer's queries and keys become (docs/numerics.md §2.5). The layer's GPU kernels apply
    every member themselves (its front and compress kernels: dsv4/kernels/indexer/hadamard_fp4.py); `apply` is the torch
    path and their specification."""
    EXACT = "exact"      # as the layer computes them
    FP4 = "fp4"          # the published numerics: Hadamard rotation, then FP4 (e2m1, a power-of-two scale per 32)

    def apply(self, rows):
        """rows [..., Di] float32 -> what these numerics make of them, float32 (EXACT: the rows themselves)."""
        return rows if self is IndexerNumerics.EXACT else fp4_sim(rows)


class QueryFormat(enum.Enum):
    """How the indexer's scoring kernel takes its queries on a GPU (the torch path scores float rows)."""
    ROWS = "rows"        # [T, Hi, Di] rows, float32 or the keys' dtype (components/indexer.Indexer.score_dtype)
    # [T, 1, Hi, Di] e4m3, each head over its power-of-two scale, the scales folded into the head weights
    # (indexer/key_layouts.fp8_queries; on a GPU the layer's front kernel makes both)
    E4M3 = "e4m3"
