"""The paged KV pool of one layer on one rank: SWA cache, compressed cache, indexer key cache.

Each cache is pages of `block_size` rows in a `CacheLayout`, handed out by its own allocator; a
request owns a block table per cache (logical page -> physical page, -1 once freed). Slot ids follow
vLLM: `slot = table[idx // block_size] * block_size + idx % block_size`, idx being the raw position
(SWA) or the compressed entry index (compressed caches). SWA pages wholly behind the window are
freed when a step commits, so SWA memory per request is bounded by the window.

Steps are two-phase: `reserve` takes pages for the new tokens (or raises before taking any),
`commit` makes the new length and compressor states current, `rollback` undoes a reservation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from dsv4.errors import InvalidRequest


class BlockAllocator:
    """A free list of page ids."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"internal: took {n} pages with {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        return out

    def give(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


@dataclass(slots=True, kw_only=True)
class PagedCache:
    """One cache: storage in a layout, its page size and allocator."""
    name: str
    layout: Any                 # CacheLayout
    data: Any                   # layout.allocate(...)
    block_size: int
    head_dim: int
    allocator: BlockAllocator

    def write(self, slots, rows, *, where: Callable[[int], str] | None = None) -> None:
        """Store rows at global slots (-1: skip). Refuses slot ids outside the pool and non-finite
        rows before writing anything: a NaN must never be packed into a shared page (with fp8
        layouts it would also poison the scale of its whole 64-dim block). `where(i)` names row i."""
        import torch

        outside = (slots < -1) | (slots >= self.num_slots)
        # layouts that store the bf16 value: no overflow to inf either (a non-finite row stays so in bf16)
        stored = rows if self.layout.kv_row_dtype == "float32" else rows.bfloat16()
        bad = (slots >= 0) & ~torch.isfinite(stored).all(-1)
        any_outside, any_bad = torch.stack((outside.any(), bad.any())).tolist()     # one device sync
        if any_outside:
            raise InvalidRequest(f"{self.name} cache: slot ids {slots[outside][:5].tolist()} are outside the pool "
                                 f"[0, {self.num_slots}) (-1 = skip); nothing was written")
        if any_bad:
            i = int(torch.nonzero(bad)[0])
            raise InvalidRequest(f"non-finite {self.name} row ({where(i) if where else f'row {i}'}): refused "
                                 f"before packing it into the cache; nothing of this step was kept")
        self.layout.write(self.data, slots, rows, block_size=self.block_size)

    def read(self, slots):
        return self.layout.read(self.data, slots, block_size=self.block_size)

    @property
    def num_slots(self) -> int:
        return self.allocator.num_blocks * self.block_size

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes(self.block_size, self.head_dim)


@dataclass(slots=True)
class RequestKV:
    seq_len: int = 0
    tables: dict[str, list[int]] = field(default_factory=dict)    # cache name -> physical pages
    states: dict[str, Any] = field(default_factory=dict)          # compressor name -> state


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """The tokens of one request in a step: batch rows [offset, offset+count), positions from start."""
    rid: Hashable
    start: int
    offset: int
    count: int

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.count)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMeta:
    segments: tuple[Segment, ...]
    positions: Any              # [T] int64
    segment_of_token: Any       # [T] int64, index into segments
    scratch: dict = field(default_factory=dict)    # per-step plans of kernels (see SparseKV.scratch)


class LayerKV:
    """The caches of one layer (one rank) and every request's tables in them."""

    def __init__(self, *, ratio: int, window: int, swa: PagedCache, compressed: PagedCache | None = None,
                 indexer: PagedCache | None = None) -> None:
        self.ratio, self.window = ratio, window
        self.caches = {c.name: c for c in (swa, compressed, indexer) if c is not None}
        self.requests: dict[Hashable, RequestKV] = {}

    # ---- requests ------------------------------------------------------------------------
    def add(self, rid: Hashable) -> None:
        self.requests[rid] = RequestKV(tables={n: [] for n in self.caches})

    def release(self, rid: Hashable) -> None:
        req = self.requests.pop(rid)
        for name, table in req.tables.items():
            self.caches[name].allocator.give([b for b in table if b >= 0])

    # ---- two-phase step ------------------------------------------------------------------
    def _entries_after(self, name: str, new_len: int) -> int:
        """How many rows of cache `name` a request of `new_len` tokens has written."""
        return new_len if name == "swa" else new_len // self.ratio

    def pages_needed(self, rid: Hashable, new_tokens: int) -> dict[str, int]:
        req = self.requests[rid]
        out = {}
        for name, cache in self.caches.items():
            rows = self._entries_after(name, req.seq_len + new_tokens)
            out[name] = max(0, -(-rows // cache.block_size) - len(req.tables[name]))
        return out

    def reserve(self, counts: dict[Hashable, int]) -> dict[Hashable, dict[str, int]]:
        """Take the pages `counts` (rid -> new tokens) need, or raise InvalidRequest taking none."""
        need = {rid: self.pages_needed(rid, n) for rid, n in counts.items()}
        for name, cache in self.caches.items():
            total = sum(n[name] for n in need.values())
            if total > cache.allocator.num_free:
                big = {rid: n[name] + self._live_pages(rid, name) for rid, n in need.items()
                       if n[name] + self._live_pages(rid, name) > cache.allocator.num_blocks}
                who = ("; ".join(f"request {rid!r} needs {k} pages" for rid, k in big.items())
                       + " of the " + name + " cache, more than the whole pool" if big
                       else f"the step needs {total} new pages of the {name} cache")
                knob = "swa_blocks" if name == "swa" else "compressed_blocks"
                raise InvalidRequest(
                    f"KV pool full: {who} ({cache.allocator.num_free} of {cache.allocator.num_blocks} pages of "
                    f"{cache.block_size} rows free); raise workload.kv_pool.{knob} or shorten the request "
                    f"(a prefill chunk's SWA pages are held until the step ends). Nothing was written.")
        for rid, n in need.items():
            for name, k in n.items():
                self.requests[rid].tables[name].extend(self.caches[name].allocator.take(k))
        return need

    def rollback(self, taken: dict[Hashable, dict[str, int]]) -> None:
        for rid, n in taken.items():
            for name, k in n.items():
                if k:
                    table = self.requests[rid].tables[name]
                    self.caches[name].allocator.give(table[-k:])
                    del table[-k:]

    def commit(self, rid: Hashable, new_len: int, states: dict[str, Any]) -> None:
        req = self.requests[rid]
        req.seq_len = new_len
        req.states.update(states)
        swa = self.caches["swa"]
        first_needed = max(0, new_len - self.window + 1)      # lowest position a future query reads
        table = req.tables["swa"]
        for b in range(min(len(table), first_needed // swa.block_size)):
            if table[b] >= 0:
                swa.allocator.give([table[b]])
                table[b] = -1

    def _live_pages(self, rid: Hashable, name: str) -> int:
        return sum(1 for b in self.requests[rid].tables[name] if b >= 0)

    # ---- addressing ----------------------------------------------------------------------
    def _token_tables(self, name: str, meta: StepMeta):
        """Each token's block table [T, width] (-1 padded), built once per step and cache: the tables
        do not change between reserve and commit, and a layer addresses its SWA cache twice."""
        import torch

        key = ("block_tables", id(self), name)
        if key not in meta.scratch:
            tables = [self.requests[s.rid].tables[name] for s in meta.segments]
            width = max(1, max(len(t) for t in tables))
            padded = [t + [-1] * (width - len(t)) for t in tables]      # one host-to-device copy
            tab = torch.tensor(padded, dtype=torch.int64, device=meta.positions.device)
            meta.scratch[key] = tab[meta.segment_of_token]
        return meta.scratch[key]

    def global_slots(self, name: str, meta: StepMeta, local):
        """Global slot ids for per-token local row indices `local` [T, N] (-1 stays -1)."""
        import torch

        bs = self.caches[name].block_size
        tab = self._token_tables(name, meta)
        logical = local.clamp(min=0) // bs
        page = tab.gather(1, logical.clamp(max=tab.shape[1] - 1))
        page = torch.where(logical < tab.shape[1], page, torch.full_like(page, -1))   # past the table: no page
        slots = page * bs + local.clamp(min=0) % bs
        ok = (local >= 0) & (page >= 0)
        if bool(((local >= 0) & (page < 0)).any()):
            raise RuntimeError(f"internal: {name} row without a page (freed or never reserved)")
        return torch.where(ok, slots, torch.full_like(slots, -1)).to(torch.int32)

    def swa_write_slots(self, meta: StepMeta):
        return self.global_slots("swa", meta, meta.positions[:, None])[:, 0]

    def swa_indices(self, meta: StepMeta):
        """Per token the window's positions max(0, p-W+1)..p as global SWA slots, and the count."""
        import torch

        p = meta.positions
        lo = (p - self.window + 1).clamp(min=0)
        local = lo[:, None] + torch.arange(self.window, device=p.device)[None, :]
        local = torch.where(local <= p[:, None], local, torch.full_like(local, -1))
        lens = torch.minimum(p + 1, torch.full_like(p, self.window)).to(torch.int32)
        return self.global_slots("swa", meta, local), lens

    def request_rows(self, name: str, rid: Hashable, count: int):
        """Global slots of rows 0..count-1 of one request's cache `name` (for reading them back)."""
        import torch

        cache = self.caches[name]
        bs, dev = cache.block_size, cache.data.device
        table = self.requests[rid].tables[name]
        pages = -(-count // bs)
        if pages > len(table) or any(b < 0 for b in table[:pages]):
            raise RuntimeError(f"internal: rows 0..{count - 1} of {name} are not all in live pages")
        idx = torch.arange(count, device=dev)
        return (torch.tensor(table[:pages] or [0], dtype=torch.int64, device=dev)[idx // bs] * bs + idx % bs).to(torch.int32)

    # ---- accounting ----------------------------------------------------------------------
    def bytes_in_use(self) -> int:
        return sum(c.page_bytes * (c.allocator.num_blocks - c.allocator.num_free) for c in self.caches.values())
