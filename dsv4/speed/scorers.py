"""mode=bench's indexer table: every indexer option this machine runs, on a decode step of 64 requests x 2
tokens (the model's index heads and dims, its top-k) at 8k, 64k and 128k contexts -- its keys as it stores
them, its scoring call and each top-k (`indexer.top_k`) -- each timed in a CUDA graph, with the bytes its
keys take.

Before an option is timed its scores are checked against the same call on bf16 rows of the values its keys
hold (our kernel: those of bf16 rows exactly, or float32-exact keys; a vendor's: its relative error, as it
sums in its own order), and its top-k sets against torch.topk's over its own scores.
"""
from __future__ import annotations

import torch

from dsv4.speed.cases import available_options
from dsv4.speed.timing import graph_time_us
from dsv4.values.seam import PagedCache
from dsv4.oracle import rel_err
from dsv4.reports.report import table
from dsv4.speed.rows import measurement, printed_rows
from dsv4.values.sizes import cdiv

NREQ, TOKENS, BS = 64, 2, 64
CONTEXTS = (8192, 65536, 131072)
PIECE = 1 << 18                 # keys written per call when filling a cache (bounded temporaries)
HEADERS = ["context", "indexer", "top-k", "key B/entry", "step plan µs", "scores µs", "scores + top-k µs",
           "rel err vs bf16 rows", "top-k == torch.topk"]


def decode_case(context: int, heads: int, dim: int, *, seed: int = 0):
    """64 requests x 2 tokens at `context`: random queries [T, Hi, Di], head weights [T, Hi], page tables
    (a permutation of the pages), the token's request and its visible entries, and the keys' float32 rows
    [pages, BS, Di]."""
    g = torch.Generator(device="cuda").manual_seed(seed + context)
    entries = context // 4 + 1
    P = cdiv(entries, BS)
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
    keys = PagedCache(name="indexer_keys", layout=layout, data=data, block_size=BS, head_dim=dim)
    for s0 in range(0, n, PIECE):
        slots = torch.arange(s0, min(n, s0 + PIECE), device=rows.device)
        keys.write(slots, flat[slots])
    return keys


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


def option_rows(ix, spec, context: int, top_ks=None) -> list[list]:
    """[context, option, top-k, key B/entry, step plan µs (made once per step for the step's ratio-4
    layers; 0: none), scores µs, scores + top-k µs, rel err vs bf16 rows, same top-k set], one row per
    top-k option of `top_ks` (default: the option's own)."""
    from dsv4.strategies import indexer_keys_layout
    from dsv4.strategies.indexer.common import triton_scores

    Hi, Di, K = spec.index_n_heads, spec.index_head_dim, spec.index_topk
    q, w, pages, req, counts, rows = decode_case(context, Hi, Di)
    q, rows = ix.numerics.apply(q), ix.numerics.apply(rows.view(-1, Di)).view(rows.shape)
    layout = indexer_keys_layout(ix, dtype="bfloat16", head_dim=Di)
    keys = stored_keys(layout, rows)
    del rows
    width = pages.shape[1] * BS
    scale = Di ** -0.5 * Hi ** -0.5

    def plan():
        return ix.plan(token_request=req, counts=counts, pages=pages, block_size=BS)

    ip = plan()                     # the step's, shared by its ratio-4 layers

    def scores():
        return ix.scores(q, w, keys, pages, req, counts, width=width, w_scale=scale, plan=ip)

    out = scores()
    ref = triton_scores(q, w, keys if keys.data.dtype != torch.uint8 else as_bf16_rows(keys), pages, req, counts,
                        width=width, w_scale=scale)
    vis = torch.arange(width, device="cuda")[None, :] < counts[:, None]
    out = out[:, :width]
    err = rel_err(out[vis], ref[vis])
    want = out.masked_fill(~vis, float("-inf")).topk(min(K, width), dim=-1).indices.sort(dim=-1).values
    del ref
    plan_us = graph_time_us(plan) if ip is not None else 0.0
    scores_us = graph_time_us(scores)
    rows = []
    for top_k in top_ks if top_ks is not None else (ix.top_k,):
        def step(select=top_k):
            return select(scores(), counts, pages, req, topk=K, block_size=BS)

        local, _, _ = step()
        same = torch.equal(local[:, :want.shape[1]].sort(dim=-1).values.long(), want)
        rows.append([context, ix.name, top_k.name, layout.bytes_per_token(Di), plan_us, scores_us,
                     graph_time_us(step), err, same])
    del keys, out
    torch.cuda.empty_cache()
    return rows


def top_ks_here(job) -> list:
    """The top-k options (configs/indexer/top_k/) check() accepts on this machine for the job's indexer."""
    from dsv4.checks.catalogue import options
    from dsv4.checks.compat import check
    from dsv4.values.device import local_platform

    return [top_k for top_k in options("indexer.top_k").values() if not [
        p for p in check(job.combo.with_choice("indexer.top_k", top_k), job.device, here=local_platform())
        if p.group == "indexer.top_k"]]


def scores_top_k(rows: list[list]) -> list[dict]:
    """The indexer table's rows (`option_rows`) as docs/benchmarks.md's scores + top-k table: per context and
    indexer option, its scores alone and the scores with each top-k option after them (ours, the default,
    and the others' as the peers'), the least of those in bold."""
    from dsv4.checks.catalogue import defaults

    ours = defaults()["indexer.top_k"]
    out: dict[tuple, dict] = {}
    for context, ix, top_k, _, _, scores_us, both_us, *_ in rows:
        line = out.setdefault((context, ix), {"scores": scores_us, "top-k": {}})
        line["top-k"][top_k] = both_us
    made = []
    for (context, ix), line in out.items():
        named = {f"scores + top-k, `top_k={k}`": (k, us) for k, us in line["top-k"].items()}
        made.append(measurement("indexer/scores_top_k", case={"context": f"{context // 1024}k", "indexer": ix},
                                ours={"scores": line["scores"]} | {c: us for c, (k, us) in named.items() if k == ours},
                                peers={c: us for c, (k, us) in named.items() if k != ours},
                                columns=["context", "indexer", "scores", *named], fastest=named))
    return made


def bench_indexer(job, options=None, top_ks=None, *, record=None) -> str:
    """The table (module docstring) for `options` (default: every option check() accepts here), each with
    every top-k option of `top_ks` (default: every one check() accepts here), with the job's model; `record`
    (dsv4/speed/rows.py) takes its rows, and them again as docs/benchmarks.md's scores + top-k table."""
    rows = []
    top_ks = top_ks if top_ks is not None else top_ks_here(job)
    for ix in options if options is not None else available_options(job, "indexer"):
        for context in CONTEXTS:
            rows += option_rows(ix, job.spec, context, top_ks)
    if record is not None:
        record(printed_rows("bench/indexer", HEADERS, rows, keys=3, unit=None) + scores_top_k(rows))
    return table(HEADERS, rows, left=(1, 2))
