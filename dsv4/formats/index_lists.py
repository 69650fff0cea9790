"""The index lists an MQA call reads (SparseKV: per token, global slots into the SWA and the compressed
pools, -1 padded, with lengths), and the rules every kernel adapter applies to them: which entries are
valid, valid ones first, padded columns, the distinct rows a gathering kernel decodes once."""
from __future__ import annotations


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


def distinct_rows(kv, ids, *, width: int, lead: int = 0, read=None):
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


def attended(kv):
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
