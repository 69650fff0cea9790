"""Torch arithmetic whose order does not depend on the step (batch_invariant=true on the torch path).

A product's kernel, and so the order of its sums, is chosen by its shape: a row's result can change with the
number of rows beside it, and a reduction over a token's keys changes with the width the step pads them to.
Here products run on tiles of a fixed number of rows, and reductions over keys on blocks of a fixed width,
added in order (a padding block adds exact zeros). docs/notes/2026-12-04-batch-invariance.md measures why.
"""
from __future__ import annotations

ROW_TILE = 32       # rows per product call
# rows per library product call on a GPU, where a call costs about the same from 1 row to this many (cuBLAS
# on the H200, DSV4-Flash's float tail: 6-10 µs up to 128 rows, 9-11 at 256): a decode step of up to 128
# requests is one call
GPU_ROW_TILE = 128
KEY_BLOCK = 64      # keys per reduction block


def asked(batch_invariant: bool) -> dict:
    """The keywords an option's prepare() gets for batch_invariant: only where it is asked for, so that an
    option that cannot give it (check() refuses it then) need not take the keyword."""
    return {"batch_invariant": True} if batch_invariant else {}


def refuse_unable(options, device) -> None:
    """batch_invariant=true with options (strategies) that cannot give it on `device` (a DeviceInfo): one
    ValueError naming them and why, before any is prepared (check() reports the same with a fix)."""
    cannot = []
    for option in options:
        needs = option.needs(device)
        if not needs.batch_invariant:
            cannot.append(f"{option.name} ({needs.variance})")
    if cannot:
        raise ValueError(f"batch_invariant=true: {', '.join(cannot)} cannot give it on {device.describe()}")


def in_row_tiles(fn, x, tile: int = ROW_TILE):
    """fn over x's rows in calls of exactly `tile` rows (the last tile zero-padded): row i of the result is
    fn's value for row i alone, whatever the other rows. `fn` maps rows to rows (a product, an einsum)."""
    import torch

    T = x.shape[0]
    if T == 0:
        return fn(x)
    x = x.contiguous()
    rem = T % tile                   # whole tiles are views of x; only the last, partial one is copied, padded
    tiles = [x[i:i + tile] for i in range(0, T - rem, tile)]
    if rem:
        tiles.append(torch.cat((x[T - rem:], x.new_zeros(tile - rem, *x.shape[1:]))))
    if len(tiles) == 1:
        return fn(tiles[0])[:T]
    return torch.cat([fn(t) for t in tiles])[:T]


def pad_keys(t, dim: int, block: int = KEY_BLOCK, value=0):
    """t padded along `dim` to a whole number of `block`s with `value`."""
    import torch

    n = t.shape[dim]
    pad = (-n) % block
    if not pad:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat((t, torch.full(shape, value, dtype=t.dtype, device=t.device)), dim)


def stable_top(scores, k: int):
    """(values, indices) of the k largest of each row, the lower index first among equal values: the same
    selection whatever the row's padding (torch.topk leaves the order of ties to its kernel)."""
    import torch

    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]
