"""MQAKernelStrategy options shipped with the core: the torch reference."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.settings import at_least
from dsv4.strategies.protocols import Needs, SparseKV


def valid_entries(indices, lens, num_slots: int):
    """[T, W] bool: which entries of a SparseKV list count -- the slot is in the pool (-1 or beyond it
    is padding) and the column is below the length. The reference kernel and the flashinfer and aiter
    adapters read lists by this rule; our Triton kernel applies the same one in-kernel."""
    import torch

    cols = torch.arange(indices.shape[1], device=indices.device)[None, :]
    return (indices >= 0) & (indices < num_slots) & (cols < lens[:, None].to(indices.device))


def pad_columns(idx, width: int):
    """idx [T, W] with -1 columns appended up to `width` >= W, contiguous (itself where it already is)."""
    import torch

    if idx.shape[1] == width:
        return idx if idx.is_contiguous() else idx.contiguous()
    return torch.cat((idx, idx.new_full((idx.shape[0], width - idx.shape[1]), -1)), 1).contiguous()


def distinct_rows(kv: SparseKV, ids, *, width: int, lead: int = 0, read=None):
    """The rows that ids [T, W] (`attended`'s, -1 padded) name, each decoded once into a bf16 buffer, and
    each entry's row in it: -> (buffer [lead + N, width] bf16: `lead` zero rows, then the N distinct rows,
    their head_dim values then zeros; local [T, W] int32, -1 kept). `read(cache, slots)` decodes a pool's
    rows (the cache's own `read` if None). The gather paths of kernels that read a bf16 workspace
    (FlashMLA's prefill, aiter); torch.unique sizes the buffer, so it synchronizes with the host."""
    import torch

    read = read or (lambda cache, slots: cache.read(slots))
    S, D = kv.swa.num_slots, kv.swa.head_dim
    used, inv = torch.unique(ids[ids >= 0], return_inverse=True)
    buf = torch.zeros(lead + len(used), width, dtype=torch.bfloat16, device=ids.device)
    from_swa = used < S
    if bool(from_swa.any()):
        buf[lead:][from_swa, :D] = read(kv.swa, used[from_swa].int()).bfloat16()
    if bool((~from_swa).any()):
        buf[lead:][~from_swa, :D] = read(kv.extra, (used[~from_swa] - S).int()).bfloat16()
    local = torch.full_like(ids, -1, dtype=torch.int32)
    local[ids >= 0] = (inv + lead).to(torch.int32)
    return buf, local


def _valid_first(ids, ok):
    """ids [T, W] with the entries where `ok` first, in their order, then -1."""
    import torch

    order = torch.argsort((~ok).to(torch.int8), dim=1, stable=True)
    return torch.where(ok, ids, -1).gather(1, order)


def compact(indices, lens, num_slots: int):
    """The entries a SparseKV list means (`valid_entries`), first and in their order, then -1; and how
    many there are. -> (indices [T, W] int32, counts [T] int32)."""
    import torch

    valid = valid_entries(indices, lens, num_slots)
    return _valid_first(indices, valid).to(torch.int32), valid.sum(1).to(torch.int32)


def attended(kv: SparseKV):
    """The rows each query attends to, as ids over both pools (SWA slot s -> s, compressed slot s ->
    swa.num_slots + s), in SparseKV order (SWA list, then compressed list), valid ones first, -1 after
    them: an entry counts if its slot is in its pool and its column is below the length (as ReferenceMQA
    reads it). The aiter adapter and FlashMLA's prefill gather read lists through it. -> (ids [T, W]
    int64, counts [T] int64)."""
    import torch

    S = kv.swa.num_slots
    ok, ids = valid_entries(kv.swa_indices, kv.swa_lens, S), kv.swa_indices.long()
    if kv.extra is not None:
        ok = torch.cat((ok, valid_entries(kv.extra_indices, kv.extra_lens, kv.extra.num_slots)), 1)
        ids = torch.cat((ids, kv.extra_indices.long() + S), 1)
    return _valid_first(ids, ok), ok.sum(1)


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
