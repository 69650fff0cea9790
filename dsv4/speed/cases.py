"""The benches' inputs: fresh random data, fp8_ds_mla pools far larger than L2 with slot lists random over
them (FLOPs and bytes, docs/numerics.md §2.7: per query row 2·H·N·(512+512) FLOPs and N·584 bytes of KV, N
the valid SWA + compressed entries, plus q and out), and the options this machine can time."""
from __future__ import annotations

from typing import Any

import torch

from dsv4.checks.catalogue import options
from dsv4.values.seam import PagedCache
from dsv4.strategies import Fp8DsMlaLayout, OProjWeights, SparseKV

POOL_BLOCKS = 4096                                          # 262,144 rows x 584 B = 153 MB per cache
SERVING_STEP = (64, 2, 8192)     # requests, tokens per request (MTP), context: a serving decode step per rank
DECODE_CASES = [("h64 128+512", 64, 64, 512, b, sq) for b, sq in ((1, 1), (64, 2), (128, 1), (128, 2))] + [
    ("h128 128+1024", 128, 64, 1024, 128, 2), ("h64 128 SWA only", 64, None, 0, 128, 1)]
# a small step, and tensor-parallel ranks' head counts: DSV4-Flash's 64 heads at TP8 and TP4, DSV4-Pro's
# 128 at TP4 (kernels that take only some head counts run padded, as the head_padding policy pads them)
SMALL_CASES = [("h64 128+512", 64, 64, 512, 16, 1), ("h8 128+512", 8, 64, 512, 128, 2),
               ("h16 128+512", 16, 64, 512, 128, 2), ("h32 128+1024", 32, 64, 1024, 128, 2)]

def random_pages(name: str, blocks: int, block_size: int, g, layout=None) -> PagedCache:
    """A PagedCache on g's device (fp8_ds_mla unless `layout` says otherwise) with a random row in every
    slot, written in scrambled order."""
    lay, dev = layout or Fp8DsMlaLayout(), g.device
    c = PagedCache(name=name, layout=lay, block_size=block_size, head_dim=512,
                   data=lay.allocate(num_blocks=blocks, block_size=block_size, head_dim=512, device=dev))
    n = blocks * block_size
    c.write(torch.randperm(n, generator=g, device=dev).int(), torch.randn(n, 512, generator=g, device=dev))
    return c


def sparse_case(T: int, H: int, *, extra_block, extra_w: int, seed: int, swa_w: int = 128, swa_blocks: int = 16,
                extra_blocks: int = 64, full: bool = False, q_std: float = 1.0, layout=None, device: str = "cuda"):
    """q [T, H, 512] bf16, a SparseKV over random pages, sinks. Slot lists are random over the pools,
    -1 padded past random lengths (or full, for benchmarks that count every entry)."""
    g = torch.Generator(device=device).manual_seed(seed)
    swa = random_pages("swa", swa_blocks, 64, g, layout)

    def lists(width, slots):
        idx = torch.randint(0, slots, (T, width), generator=g, device=device)
        lens = torch.full((T,), width, device=device) if full else \
            torch.randint(1 if width == swa_w else 0, width + 1, (T,), generator=g, device=device)
        cols = torch.arange(width, device=device)[None]
        return torch.where(cols < lens[:, None], idx, -1).int(), lens.int()

    si, sl = lists(swa_w, swa.num_slots)
    kw: dict[str, Any] = dict(swa=swa, swa_indices=si, swa_lens=sl)
    if extra_w:
        ext = random_pages("compressed", extra_blocks, extra_block, g, layout)
        ei, el = lists(extra_w, ext.num_slots)
        kw |= dict(extra=ext, extra_indices=ei, extra_lens=el)
    q = (torch.randn(T, H, 512, generator=g, device=device) * q_std).bfloat16()   # logits ~ N(0, q_std²)
    return q, SparseKV(**kw), torch.randn(H, generator=g, device=device)


def runs_case(tokens: list[int], context: list[int], H: int, *, extra: str | None, extra_w: int = 512,
              extra_block: int = 64, pool_blocks: int = POOL_BLOCKS, seed: int = 0, padding: int = 0,
              device: str = "cuda"):
    """A step of requests with `tokens[i]` new tokens each (MTP) at length `context[i]` after the step (and
    `padding` rows), its lists as StepPlan builds them from random page tables: SWA windows, which a
    request's tokens share but for one row each, and `extra`: None, "topk" (random full lists per token,
    as a ratio-4 layer's indexer gives) or "nested" (a ratio-128 layer's every visible entry, each token's
    a prefix of the next one's). -> (q [T, H, 512] bf16, SparseKV with the step's runs, sinks)."""
    from dsv4.components.plan import PageTable, StepPlan
    from dsv4.values.sizes import cdiv

    g = torch.Generator(device=device).manual_seed(seed)
    b, T = len(tokens), sum(tokens) + padding
    qs = torch.tensor([0] + tokens, device=device).cumsum(0).int()

    def table(block: int, rows: int) -> PageTable:
        return PageTable(block_size=block, pages=torch.randint(0, pool_blocks, (b, cdiv(rows, block)), generator=g,
                                                               device=device, dtype=torch.int32))

    entries = {128: table(extra_block, max(context) // 128 + 1)} if extra == "nested" else {}
    plan = StepPlan.build(query_start=qs, seq_lens=torch.tensor(context, device=device).int(),
                          swa=table(64, max(context)), window=128, entries=entries, num_tokens=T)
    kw: dict[str, Any] = dict(swa=random_pages("swa", pool_blocks, 64, g), swa_indices=plan.swa.indices,
                              swa_lens=plan.swa.lens, runs=plan.runs)
    if extra is not None:
        ext = random_pages("compressed", pool_blocks, extra_block, g)
        if extra == "nested":
            ents = plan.entries[128]
            kw |= dict(extra_indices=ents.visible, extra_lens=ents.counts, extra_nested=True)
        else:
            kw |= dict(extra_indices=torch.randint(0, ext.num_slots, (T, extra_w), generator=g, device=device,
                                                   dtype=torch.int32),
                       extra_lens=torch.where(plan.real, extra_w, 0).int())
        kw["extra"] = ext
    q = torch.randn(T, H, 512, generator=g, device=device).bfloat16()
    return q, SparseKV(**kw), torch.randn(H, generator=g, device=device)


def pad_heads(q, sink, heads: int):
    """q [T, H, D] and sink [H] with zero heads appended up to `heads`."""
    T, H, D = q.shape
    qp = q.new_zeros(T, heads, D)
    qp[:, :H] = q
    sp = sink.new_zeros(heads)
    sp[:H] = sink
    return qp, sp


def oproj_case(T: int, G: int, seed: int = 0, hpg: int = 8, o_lora: int = 1024):
    g = torch.Generator().manual_seed(seed)
    w = OProjWeights(wo_a=torch.randn(G * o_lora, hpg * 512, generator=g) * (hpg * 512) ** -0.5, groups=G)
    o = torch.randn(T, G * hpg, 512, generator=g).cuda().bfloat16()
    pos = torch.randint(0, 100_000, (T,), generator=g).cuda()
    return w, o, pos


def available_options(job, group: str) -> list:
    """Every option of `group` that check() accepts on this machine with the job's other choices,
    except for the cache layout, which is fp8_ds_mla for every kernel (the one all of them read)."""
    from dataclasses import replace

    from dsv4.checks.compat import check
    from dsv4.values.device import local_platform

    out = []
    for strat in options(group).values():
        chosen = replace(job.combo.strategies, **{group: strat}, cache_layout=Fp8DsMlaLayout())
        combo = replace(job.combo, strategies=chosen, dtype="bfloat16")
        probs = [p for p in check(combo, job.device, here=local_platform()) if p.group in (group, "dtype")]
        if not probs:
            out.append(strat)
    return out
