"""mqa_kernel=reference: the sparse MQA call in torch, on any device: the rows each query attends to,
read through the cache layout, a softmax with the sink in its denominator (docs/numerics.md §2.7)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.values.fixed_order import KEY_BLOCK, pad_keys
from dsv4.formats.index_lists import valid_entries
from dsv4.values.settings import at_least
from dsv4.strategies.protocols import Needs
from dsv4.values.seam import SparseKV


def _gather(cache, indices, lens):
    """Rows named by `indices` (float32, zero for invalid ones) and which of them count."""
    import torch

    valid = valid_entries(indices, lens, cache.num_slots)
    return cache.read(torch.where(valid, indices, torch.full_like(indices, -1))), valid


def sparse_mqa_with_sink(q, rows, valid, sink, scale: float):
    """docs/numerics.md §2.7 in float32. q [T,H,D], rows [T,N,D], valid [T,N] -> out [T,H,D] f32, lse [T,H].

    The sink adds mass only to the denominator; a query with no valid row gets 0 (lse = +inf).
    """
    import torch

    s = torch.einsum("thd,tnd->thn", q.float(), rows) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m0 = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m0)
    l = p.sum(-1, keepdim=True)
    denom = l + torch.exp(sink.float()[None, :, None] - m0)
    out = torch.einsum("thn,tnd->thd", p, rows) / denom
    has = l > 0
    out = torch.where(has, out, torch.zeros_like(out))
    lse = torch.where(has, m0 + torch.log(l), torch.full_like(m0, float("inf"))).squeeze(-1)
    return out, lse


def sparse_mqa_in_blocks(q, parts, sink, scale: float, block: int = KEY_BLOCK):
    """sparse_mqa_with_sink in an order independent of the step: each part's rows (the SWA rows, then the
    compressed ones: [(rows [T,N,D], valid [T,N])]) scored and summed in blocks of `block` keys, the blocks
    added in order. A token's rows sit at the same places whatever the step pads them to, and a padding
    block adds exact zeros, so its result does not depend on the other tokens of the step."""
    import torch

    blocks = []
    for rows, valid in parts:
        rows, valid = pad_keys(rows, 1, block), pad_keys(valid, 1, block, value=False)
        blocks += [(rows[:, i:i + block], valid[:, i:i + block]) for i in range(0, rows.shape[1], block)]
    qf = q.float()
    scores = [(torch.einsum("thd,tnd->thn", qf, r) * scale).masked_fill(~v[:, None, :], float("-inf"))
              for r, v in blocks]
    m = torch.stack([s.amax(-1) for s in scores]).amax(0)[..., None] if scores else \
        torch.full((*q.shape[:2], 1), float("-inf"), device=q.device)
    m0 = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    l = torch.zeros_like(m0)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s, (r, _) in zip(scores, blocks):
        p = torch.exp(s - m0)
        l = l + p.sum(-1, keepdim=True)
        acc = acc + torch.einsum("thn,tnd->thd", p, r)
    denom = l + torch.exp(sink.float()[None, :, None] - m0)
    has = l > 0
    out = torch.where(has, acc / denom, torch.zeros_like(acc))
    lse = torch.where(has, m0 + torch.log(l), torch.full_like(m0, float("inf"))).squeeze(-1)
    return out, lse


@dataclass(frozen=True, slots=True)
class InvariantOrder:
    """What batch_invariant=true asks of this option: keys reduced in blocks of `block`, in order."""
    block: int = KEY_BLOCK


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferenceMQA:
    """Torch sparse MQA on any device: reads rows through the cache layout, computes in float32.

    Queries are processed `chunk` at a time so the gathered rows stay bounded in memory.
    """
    name: str = "reference"
    error_budget: ClassVar[float] = 0.0     # vs the oracle: float32 math over the rows as stored
    chunk: int = at_least(1, 64)      # cached rows per step of the reference loop

    def needs(self, device) -> Needs:
        return Needs(batch_invariant=device.platform == "cpu", variance="shown on the CPU only")

    def prepare(self, *, device, batch_invariant: bool = False) -> InvariantOrder | None:
        return InvariantOrder() if batch_invariant else None

    def plan(self, *, tokens: int, layer_type: str, previous=None) -> None:
        return None

    def __call__(self, q, kv: SparseKV, *, sink, scale: float, prepared=None, plan=None):
        import torch

        outs, lses = [], []
        for t0 in range(0, q.shape[0], self.chunk):
            sl = slice(t0, t0 + self.chunk)
            parts = [_gather(kv.swa, kv.swa_indices[sl], kv.swa_lens[sl])]
            if kv.extra is not None:
                parts.append(_gather(kv.extra, kv.extra_indices[sl], kv.extra_lens[sl]))
            if isinstance(prepared, InvariantOrder):
                o, lse = sparse_mqa_in_blocks(q[sl], parts, sink, scale, prepared.block)
            else:
                rows, valid = (torch.cat(t, 1) for t in zip(*parts)) if len(parts) > 1 else parts[0]
                o, lse = sparse_mqa_with_sink(q[sl], rows, valid, sink, scale)
            outs.append(o.to(q.dtype))
            lses.append(lse)
        if not outs:
            return q.new_zeros(q.shape), q.new_zeros(q.shape[:2], dtype=torch.float32)
        return torch.cat(outs), torch.cat(lses)
