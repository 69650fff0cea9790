"""cache_layout=bf16 and cache_layout=float32: rows stored as they are, [pages, block_size, head_dim].

Storage is always a tensor with one leading page dimension; writes and `read` address rows by global slot id
(`page * block_size + offset`, -1 = skip), so a byte-packed layout (fp8_ds_mla, 584 B/token with
page-level regions) fits the same Protocol as these plain rows. On a GPU, writes never read a value on the
host (a layer's step is captured in CUDA graphs): our Triton writer (dsv4/kernels/front/cache_write.py),
chosen once per cache (`access`). The indexer's plain keys are rows of this layout too
(dsv4/strategies/indexer/common.py)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from dsv4.formats.row_format import RowFormat, plain_rows
from dsv4.strategies.cache_layout.common import BF16_ROWS_ROUNDING_BUDGET
from dsv4.strategies.protocols import CacheAccess, Needs


_ROW_DTYPES = {"float32": 4, "bfloat16": 2}
_ROUNDING_BUDGETS = {"float32": 0.0, "bfloat16": BF16_ROWS_ROUNDING_BUDGET}    # vs exact float32 rows


def scatter_kept_rows(cache, slots, rows) -> None:
    """The host's writer: the kept rows (slots >= 0) at their slots of [pages, block_size, dim] rows."""
    flat = cache.view(-1, cache.shape[-1])
    keep = slots >= 0
    flat[slots[keep].long()] = rows[keep].to(flat.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlainRowLayout:
    """Rows stored as-is in `dtype` ([pages, block_size, head_dim]); reading rounds nothing further."""
    name: str
    error_budget: ClassVar[float] = 1e-4     # vs the oracle, which rounds rows as stored: summation order
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in _ROW_DTYPES:
            raise ValueError(f"cache_layout={self.name}: dtype must be one of {sorted(_ROW_DTYPES)}, got {self.dtype!r}")

    @property
    def rounding_budget(self) -> float:
        return _ROUNDING_BUDGETS[self.dtype]

    @property
    def row_format(self) -> RowFormat:
        return plain_rows(self.dtype)

    def needs(self, device) -> Needs:
        return Needs(batch_invariant=True)       # each row rounded by itself

    def bytes_per_token(self, head_dim: int) -> int:
        return head_dim * _ROW_DTYPES[self.dtype]

    def page_bytes(self, block_size: int, head_dim: int) -> int:
        return block_size * self.bytes_per_token(head_dim)

    def allocate(self, *, num_blocks: int, block_size: int, head_dim: int, device: str):
        import torch

        from dsv4.values.dtypes import torch_dtype
        return torch.zeros(num_blocks, block_size, head_dim, dtype=torch_dtype(self.dtype), device=device)

    def access(self, cache, *, block_size: int, gpu: bool) -> CacheAccess:
        """On a GPU our Triton writer and the kernels' store; on the host torch's scatter of the kept rows."""
        if not gpu:
            return CacheAccess(write=partial(scatter_kept_rows, cache))
        from dsv4.kernels.front.cache_write import plain_rows_store, write_rows_kernel
        return CacheAccess(write=partial(write_rows_kernel, cache), store=plain_rows_store(cache, block_size))

    def read(self, cache, slots, *, block_size: int):
        import torch

        flat = cache.view(-1, cache.shape[-1])
        rows = flat[slots.clamp(min=0).long()].float()
        return torch.where((slots >= 0)[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
