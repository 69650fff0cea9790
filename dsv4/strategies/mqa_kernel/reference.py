"""mqa_kernel=reference: the sparse MQA call in torch, on any device: the rows each query attends to,
read through the cache layout, a softmax with the sink in its denominator (docs/numerics.md §2.7)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.formats.index_lists import valid_entries
from dsv4.settings import at_least
from dsv4.strategies.protocols import Needs
from dsv4.seam import SparseKV


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


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferenceMQA:
    """Torch sparse MQA on any device: reads rows through the cache layout, computes in float32.

    Queries are processed `chunk` at a time so the gathered rows stay bounded in memory.
    """
    name: str = "reference"
    error_budget: ClassVar[float] = 0.0     # vs the oracle: float32 math over the rows as stored
    chunk: int = at_least(1, 64)      # cached rows per step of the reference loop

    def needs(self, device) -> Needs:
        return Needs()

    def prepare(self, *, device) -> None:
        return None

    def plan(self, *, tokens: int, layer_type: str, previous=None) -> None:
        return None

    def __call__(self, q, kv: SparseKV, *, sink, scale: float, prepared=None, plan=None):
        import torch

        outs, lses = [], []
        for t0 in range(0, q.shape[0], self.chunk):
            sl = slice(t0, t0 + self.chunk)
            rows, valid = _gather(kv.swa, kv.swa_indices[sl], kv.swa_lens[sl])
            if kv.extra is not None:
                er, ev = _gather(kv.extra, kv.extra_indices[sl], kv.extra_lens[sl])
                rows, valid = torch.cat((rows, er), 1), torch.cat((valid, ev), 1)
            o, lse = sparse_mqa_with_sink(q[sl], rows, valid, sink, scale)
            outs.append(o.to(q.dtype))
            lses.append(lse)
        if not outs:
            return q.new_zeros(q.shape), q.new_zeros(q.shape[:2], dtype=torch.float32)
        return torch.cat(outs), torch.cat(lses)
