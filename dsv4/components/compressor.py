"""The KV compressor (docs/numerics.md §2.4): ratio 4 with overlapping windows (CSA), ratio 128 plain (HCA),
batched over every request of a step.

Every token contributes a candidate `a` and gate logits `s + ape[p mod R]` (float32, coff·D wide each,
coff = 2 at ratio 4). The entry j that closes at position jR+R-1 pools, per channel, a softmax over its
rows: for R=128 the block's 128 tokens; for R=4 the previous block's first halves and the current
block's second halves (absent before position 0: value 0, logit -inf). Then RMSNorm and RoPE at jR, the
pooled value and the norm's output rounded to the layer's activation dtype as the published code rounds
them (`kv = self.norm(kv.to(dtype))`; its RMSNorm returns that dtype).

A step (`compress_all`), over all tokens of all requests, is made of two batched operations:
- `write_state`: the (a, s + ape) rows a later step will read (a request's last coff·R positions) go
  to the state pages at the plan's `state[R].write_slots`;
- `close`: each token that closes an entry pools its rows -- this step's from the step's own
  projection, earlier ones from the state pages -- and returns the entry (written through the cache
  layout by the layer).
The state pages are written only at slots of this step's new positions, so a refused or failed step
leaves every row an earlier step wrote untouched. The torch code of the two operations here (`entries`,
`compress_all`) is the CPU path and the reference; on a GPU the layer's Triton ops (dsv4/components/layer_ops.py,
chosen once when the layer is built) run the step as one Triton kernel that also stores the closed entries
into their cache (`launch_compress`, dsv4/kernels/front/compress.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4.components.front import stored_badly
from dsv4.components.norms import rms_norm
from dsv4.formats.indexer_numerics import IndexerNumerics
from dsv4.values.layer_types import by_ratio


class Compressor:
    def __init__(self, *, wkv, wgate, ape, norm, ratio: int, head_dim: int, eps: float, dtype=None) -> None:
        """`dtype`: the layer's activation dtype (float32 if None), which the pooled entry and its norm are
        rounded to, as the published code rounds them."""
        import torch

        self.ratio, self.dim, self.eps = ratio, head_dim, eps
        self.coff = by_ratio(ratio).coff
        self.wkv, self.wgate, self.ape, self.norm = wkv.float(), wgate.float(), ape.float(), norm.float()
        self.dtype = dtype if dtype is not None else torch.float32

    @property
    def width(self) -> int:
        """Width of a token's candidate (and of its gate logits): coff·D."""
        return self.coff * self.dim

    def weights(self):
        """[2·width, hidden]: wkv then wgate, the rows of the layer's score projection for this compressor."""
        import torch

        return torch.cat((self.wkv, self.wgate))

    def entries(self, scores, plan, state, rot, faults, fault_row: int):
        """The step: `write_state`, then `close` -> (rows [T, D] float32 as `close` gives them, store [T]
        int32: the slot each token's closed entry is stored at, -1 where it closes none or its entry is
        not stored), with faults[fault_row] ([F, T] bool) set where a closed entry is not stored."""
        import torch

        self.write_state(scores, plan, state)
        rows, bad = self.close(scores, plan, state, rot)
        faults[fault_row] = bad
        return rows, torch.where(bad, -1, plan.entries[self.ratio].close_slots)

    def write_state(self, scores, plan, state) -> None:
        """scores [T, 2·width] float32 ([a | s], no APE yet) -> the kept rows into `state` (CompressorState)."""
        import torch

        rows = plan.state[self.ratio]
        keep = rows.write_slots >= 0
        a, s = scores[keep].split(self.width, 1)
        vals = torch.cat((a, s + self.ape[plan.positions[keep].long() % self.ratio]), 1)
        state.data[rows.write_slots[keep].long()] = vals

    def close(self, scores, plan, state, rot):
        """The entries closed in this step: (rows [T, D] float32 -- the entry closed by each token, zero
        where it closes none --, bad [T] bool: a closed entry not stored, `front.stored_badly`). `rot` is the
        layer's RoPE at each entry's first position (plan.rope_rows(rope, shift=ratio))."""
        import torch

        ents = plan.entries[self.ratio]
        R, D, T = self.ratio, self.dim, scores.shape[0]
        out = torch.zeros(T, D, dtype=torch.float32, device=scores.device)
        bad = torch.zeros(T, dtype=torch.bool, device=scores.device)
        tok = (ents.close_slots >= 0).nonzero().squeeze(-1)          # the CPU path may look at the data
        if not len(tok):
            return out, bad
        pos = plan.positions[tok].long()
        first = pos + 1 - R                                           # jR: the entry's first position
        span = torch.arange(-(self.coff - 1) * R, R, device=scores.device)
        q = first[:, None] + span[None, :]                            # [m, coff·R] positions pooled
        a, s = self._rows(scores, plan, state, tok, q)
        if self.coff == 2:                                            # overlapping: the previous block's first halves
            a = torch.cat((a[:, :R, :D], a[:, R:, D:]), 1)
            s = torch.cat((s[:, :R, :D], s[:, R:, D:]), 1)
        v = (a * torch.softmax(s, dim=1)).sum(1)
        sub = type(rot)(cos=rot.cos[tok], sin=rot.sin[tok])
        dt = self.dtype                                               # the published kv.to(dtype), norm in it
        out[tok] = sub.rotate(rms_norm(v.to(dt), self.norm, self.eps).to(dt))
        bad[tok] = stored_badly(out[tok])
        return out, bad

    def _rows(self, scores, plan, state, tok, q):
        """(a, s) [m, n, width] at positions q [m, n] of each closing token's request: this step's rows
        from `scores` (+ APE), earlier ones from the state pages; positions before 0: a = 0, s = -inf."""
        import torch

        step0 = plan.step_start[tok].long()[:, None]
        pos = plan.positions[tok].long()[:, None]
        here = q >= step0
        t_q = (tok[:, None] + (q - pos)).clamp(min=0)                 # the token at position q, if in the step
        a_s, s_s = scores[t_q.clamp(max=scores.shape[0] - 1)].split(self.width, -1)
        s_s = s_s + self.ape[q.clamp(min=0) % self.ratio]
        table = plan.state[self.ratio].table
        slots = table.slots(plan.token_request[tok], torch.where(q >= 0, q, torch.full_like(q, -1)).int())
        st = state.data[slots.clamp(min=0).long()]
        a_h, s_h = st.split(self.width, -1)
        a = torch.where(here[..., None], a_s, a_h)
        s = torch.where(here[..., None], s_s, s_h)
        absent = (q < 0)[..., None]
        return a.masked_fill(absent, 0.0), s.masked_fill(absent, float("-inf"))


@dataclass(frozen=True, slots=True)
class CompressPart:
    """One compressor's share of a layer's compress step: its scores, state rows, faults row and cache; for
    the indexer's compressor the indexer's numerics, which its keys take before they are stored."""
    compressor: Compressor
    scores: Any
    state: Any
    fault_row: int
    cache: Any
    numerics: IndexerNumerics | None = None

    @property
    def fp4(self) -> bool:
        """Whether its entries take the published FP4 numerics (which the compress kernel applies)."""
        return self.numerics is IndexerNumerics.FP4

    @property
    def kernel_stores(self) -> bool:
        """Whether the compress kernel can store its entries: a cache with a kernel store (the kernel applies
        every IndexerNumerics)."""
        return self.cache.store is not None

    def stored(self, rows):
        """Its closed entries as its cache stores them: its numerics applied (none: the rows themselves)."""
        return rows if self.numerics is None else self.numerics.apply(rows)


def compress_all(parts, plan, rot, faults) -> None:
    """Compressors of one ratio over the same step (CompressPart; a ratio-4 layer's and its indexer's), their
    closed entries stored into their caches: each through `entries`, its numerics and its cache's writer
    (the torch code; the Triton ops launch the compress kernel instead)."""
    for p in parts:
        rows, store = p.compressor.entries(p.scores, plan, p.state, rot, faults, p.fault_row)
        p.cache.write(store, p.stored(rows))


def launch_compress(parts, plan, rot, faults) -> list:
    """dsv4/kernels/front/compress.py's kernel, one launch for parts (compressor, scores, state, fault_row,
    RowStore or None, FP4 numerics) -> per part None (stored into its RowStore) or (rows, store) for its
    cache's writer, as `Compressor.entries` gives them."""
    from dsv4.kernels.front.compress import CompressJob, compress_kernels

    first, block = parts[0][0], parts[0][2].block_size
    ratio = first.ratio
    if any(c.ratio != ratio or st.block_size != block or c.eps != first.eps or c.dtype != first.dtype
           for c, _, st, *_ in parts):
        raise ValueError("compressors launched together must share their ratio, state block size, eps and dtype")
    rows = plan.state[ratio]
    jobs = tuple(CompressJob(scores=sc, ape=c.ape, norm=c.norm, state=st.data, head_dim=c.dim, fault_row=row,
                             into=into, fp4=fp4) for c, sc, st, row, into, fp4 in parts)
    return compress_kernels(jobs, rot.cos, rot.sin, plan.positions, plan.step_start, plan.token_request,
                            rows.write_slots, plan.entries[ratio].close_slots, rows.table.pages, faults, ratio=ratio,
                            state_block=block, eps=first.eps, dtype=first.dtype)
