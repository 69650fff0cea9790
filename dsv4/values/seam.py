"""The values that cross the seam between the layer's components and its strategies: what a sparse-MQA call
attends to (SparseKV), a layer's paged cache (PagedCache), which of a step's tokens run together (QueryRuns)
and a step's RoPE rows (RopeRows). Below both dsv4/components/ and dsv4/strategies/, so that neither imports
the other for them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

ROPE_DIM = 64           # RoPE acts on the last 64 dims of a row (docs/numerics.md §2.3)


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeRows:
    """cos, sin [T, 32] float32 of one RoPE table at T positions: what rotating T rows needs. A step
    plan makes them once per table and step (`StepPlan.rope_rows`); kernels take them as they are."""
    cos: Any
    sin: Any

    def rotate(self, x, *, inverse: bool = False):
        """Rotate x[..., -64:] (x is [T, ..., D]). Returns float32."""
        import torch

        c, s = self.cos, self.sin
        while c.dim() < x.dim():                     # broadcast over head dims
            c, s = c.unsqueeze(-2), s.unsqueeze(-2)
        if inverse:
            s = -s
        xf = x.float()
        pairs = xf[..., -ROPE_DIM:].unflatten(-1, (ROPE_DIM // 2, 2))
        ev, od = pairs[..., 0], pairs[..., 1]
        rot = torch.stack((ev * c - od * s, od * c + ev * s), -1).flatten(-2)
        return torch.cat((xf[..., :-ROPE_DIM], rot), -1)


@dataclass(frozen=True, slots=True, kw_only=True)
class QueryRuns:
    """Which of the step's tokens are consecutive positions of one request (a decode step's MTP tokens, a
    prefill chunk): a kernel may read the rows such tokens share once for several of them (SparseKV.runs).
    By the plan's construction their SWA lists are windows, each the one before shifted by a position,
    and a dense ratio's lists prefixes of the run's last one."""
    tokens: Any             # [T, 2] int32: the token's index in its run, and the run's tokens from it on
    _groups: dict = field(default_factory=dict)

    def groups(self, size: int):
        """[T, 2] int32: row p < the number of groups: the first token of group p and how many tokens it
        has, the runs cut into groups of up to `size` tokens in order; (0, 0) past them. Made once per
        step and size: a captured step makes RUN_GROUPS' in its plan's graph (graphs.py), so that every
        layer's graph reads what the plan's replay wrote."""
        import torch

        if size not in self._groups:
            off, left = self.tokens[:, 0], self.tokens[:, 1]
            first = off % size == 0
            T = off.shape[0]
            rows = torch.where(first, torch.cumsum(first, 0, dtype=torch.int32) - 1, T).long()
            out = torch.zeros(T + 1, 2, dtype=torch.int32, device=off.device)
            out.scatter_(0, rows[:, None].expand(T, 2),
                         torch.stack((torch.arange(T, dtype=torch.int32, device=off.device), left.clamp(max=size)), 1))
            self._groups[size] = out[:T]
        return self._groups[size]


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedCache:
    """One cache of one layer: storage in a layout, on a page group's pages (slot = page·B + offset)."""
    name: str
    layout: Any                 # CacheLayout
    data: Any                   # layout.allocate(...): one leading page dimension
    block_size: int
    head_dim: int
    # how rows get into `data` (the layout's CacheAccess): chosen once, here, where the cache's device is known
    access: Any = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "access", self.layout.access(self.data, block_size=self.block_size,
                                                              gpu=self.data.is_cuda))

    @property
    def store(self):
        """How our row-making kernels store into `data` directly (a RowStore), None where they cannot."""
        return self.access.store

    def write(self, slots, rows) -> None:
        """Store rows at global slots (-1: skip), through the layout's writer for this cache."""
        self.access.write(slots, rows)

    def read(self, slots):
        return self.layout.read(self.data, slots, block_size=self.block_size)

    @property
    def num_slots(self) -> int:
        return self.data.shape[0] * self.block_size

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes(self.block_size, self.head_dim)


@dataclass(frozen=True, slots=True, kw_only=True)
class SparseKV:
    """What one sparse-MQA call attends to: per query, rows of the SWA cache and of the extra
    (compressed) cache, named by global slot ids (-1 = padding) with per-query lengths. An id past its
    pool is padding too for the reference, our Triton kernels and the aiter and FlashInfer adapters
    (`formats.index_lists.valid_entries`); FlashMLA's decode kernel reads the ids as given, so lists made outside
    this package keep them in their pools.

    This is the two-pool form of FlashMLA's decode API (docs/numerics.md §4.2, §5.5); kernels that want
    another shape (one combined table, CSR) build it from these.

    `runs` (StepPlan.runs) says which queries are consecutive positions of one request (a decode step's
    MTP tokens): their SWA lists are then windows that overlap, and a kernel may read the rows they
    share once (mqa_kernel=triton_sparse does, at 8 heads). `extra_nested`: the extra lists of a
    run are prefixes of its last query's list (a dense ratio's every visible entry), not top-k lists.
    Kernels that take each query alone ignore both.
    """
    swa: PagedCache
    swa_indices: Tensor            # [T, W] int32 global slots into `swa`
    swa_lens: Tensor               # [T] int32
    extra: PagedCache | None = None
    extra_indices: Tensor | None = None   # [T, K] int32 global slots into `extra`
    extra_lens: Tensor | None = None      # [T] int32
    layer_type: str = "swa"               # swa | c4a | c128a: calls of one type in one step share shapes
    runs: QueryRuns | None = None         # StepPlan.runs
    extra_nested: bool = False
