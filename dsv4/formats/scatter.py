"""Sync-free scatters of rows into pages, for writes a CUDA graph captures."""
from __future__ import annotations


def kept_rows(slots):
    """For a scatter that must not read how many rows are kept (a GPU step): the row each of `slots`
    takes its slot and values from -- itself if kept (slot >= 0), else the first kept row, so a
    skipped row writes that row's bytes again --, and whether any row is kept (if none, a caller writes
    back what its target already holds). -> (src [N] int64, any_kept 0-d bool)."""
    import torch

    keep = slots >= 0
    first = keep.to(torch.int8).argmax()
    src = torch.where(keep, torch.arange(slots.shape[0], device=slots.device), first)
    return src, keep.any()
