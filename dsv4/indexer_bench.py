"""mode=bench's indexer table: every indexer option this machine runs, on a decode step of 64 requests x 2
tokens (the model's index heads and dims, its top-k) at 8k, 64k and 128k contexts -- its keys as it stores
them, its scoring call and our top-k -- each timed in a CUDA graph, with the bytes its keys take.

Before an option is timed its scores are checked against the same call on bf16 rows of the values its keys
hold (our kernel: those of bf16 rows exactly, or float32-exact keys; a vendor's: its relative error, as it
sums in its own order), and its top-k sets against torch.topk's over its own scores.
"""
from __future__ import annotations

import torch

from dsv4.bench import available_options, graph_time_us
from dsv4.components.kv_pool import PagedCache
from dsv4.kernels.topk_lists import topk_lists
from dsv4.reference import rel_err
from dsv4.report import table

NREQ, TOKENS, BS = 64, 2, 64
CONTEXTS = (8192, 65536, 131072)
PIECE = 1 << 18                 # keys written per call when filling a cache (bounded temporaries)


def decode_case(context: int, heads: int, dim: int, *, seed: int = 0):
    """64 requests x 2 tokens at `context`: random queries [T, Hi, Di], head weights [T, Hi], page tables
    (a permutation of the pages), the token's request and its visible entries, and the keys' float32 rows
    [pages, BS, Di]."""
    g = torch.Generator(device="cuda").manual_seed(seed + context)
    entries = context // 4 + 1
    P = -(-entries // BS)
    pages = torch.randperm(NREQ * P, device="cuda", generator=g).view(NREQ, P).int()
    keys = torch.randn(NREQ * P, BS, dim, device="cuda", generator=g)
    req = torch.arange(NREQ, device="cuda").repeat_interleave(TOKENS)
    pos = context + torch.arange(TOKENS, device="cuda").repeat(NREQ)
    counts = ((pos + 1) // 4).int()
    q = torch.randn(NREQ * TOKENS, heads, dim, device="cuda", generator=g)
    w = torch.randn(NREQ * TOKENS, heads, device="cuda", generator=g)
    return q, w, pages, req, counts, keys


def stored_keys(layout, rows):
    """Float32 rows [pages, BS, Di] written through `layout` into a PagedCache, piece by piece."""
    n, dim = rows.shape[0] * BS, rows.shape[-1]
    data = layout.allocate(num_blocks=rows.shape[0], block_size=BS, head_dim=dim, device=rows.device)
    flat = rows.view(n, dim)
    for s0 in range(0, n, PIECE):
        slots = torch.arange(s0, min(n, s0 + PIECE), device=rows.device)
        layout.write(data, slots, flat[slots], block_size=BS)
    return PagedCache(name="indexer_keys", layout=layout, data=data, block_size=BS, head_dim=dim)


def as_bf16_rows(keys):
    """A PagedCache of bf16 rows of the values `keys` hold (the reference of records)."""
    from dsv4.strategies import PlainRowLayout

    n, dim, dev = keys.num_slots, keys.head_dim, keys.data.device
    rows = torch.empty(n, dim, dtype=torch.bfloat16, device=dev)
    for s0 in range(0, n, PIECE):
        slots = torch.arange(s0, min(n, s0 + PIECE), device=dev)
        rows[slots] = keys.read(slots).bfloat16()
    return PagedCache(name="indexer_keys", layout=PlainRowLayout(name="bf16", dtype="bfloat16"),
                      data=rows.view(-1, BS, dim), block_size=BS, head_dim=dim)


def option_rows(ix, spec, context: int) -> list:
    """[context, option, key B/entry, step plan µs (made once per step for the step's ratio-4 layers; 0:
    none), scores µs, scores + top-k µs, rel err vs bf16 rows, same top-k set]."""
    from dsv4.strategies.indexer import triton_scores

    Hi, Di, K = spec.index_n_heads, spec.index_head_dim, spec.index_topk
    q, w, pages, req, counts, rows = decode_case(context, Hi, Di)
    if ix.transforms:
        q, rows = ix.queries(q), ix.keys(rows.view(-1, Di)).view(rows.shape)
    layout = ix.key_layout(dtype="bfloat16", head_dim=Di)
    keys = stored_keys(layout, rows)
    del rows
    width = pages.shape[1] * BS
    scale = Di ** -0.5 * Hi ** -0.5

    def plan():
        return ix.plan(token_request=req, counts=counts, pages=pages, block_size=BS)

    ip = plan()                     # the step's, shared by its ratio-4 layers

    def scores():
        return ix.scores(q, w, keys, pages, req, counts, width=width, w_scale=scale, plan=ip)

    def step():
        return topk_lists(scores(), counts, pages, req, topk=K, block_size=BS)

    out = scores()
    ref = triton_scores(q, w, keys if keys.data.dtype != torch.uint8 else as_bf16_rows(keys), pages, req, counts,
                        width=width, w_scale=scale)
    vis = torch.arange(width, device="cuda")[None, :] < counts[:, None]
    out = out[:, :width]
    err = rel_err(out[vis], ref[vis])
    local, _, _ = step()
    want = out.masked_fill(~vis, float("-inf")).topk(min(K, width), dim=-1).indices.sort(dim=-1).values
    same = torch.equal(local[:, :want.shape[1]].sort(dim=-1).values.long(), want)
    plan_us = graph_time_us(plan) if ip is not None else 0.0
    row = [context, ix.name, layout.bytes_per_token(Di), plan_us, graph_time_us(scores), graph_time_us(step), err,
           same]
    del keys, out, ref
    torch.cuda.empty_cache()
    return row


def bench_indexer(job, options=None) -> str:
    """The table (module docstring) for `options` (default: every option check() accepts here), with the
    job's model."""
    rows = []
    for ix in options if options is not None else available_options(job, "indexer"):
        for context in CONTEXTS:
            rows.append(option_rows(ix, job.spec, context))
    return table(["context", "indexer", "key B/entry", "step plan µs", "scores µs", "scores + top-k µs",
                  "rel err vs bf16 rows", "top-k == torch.topk"], rows, left=(1,))
