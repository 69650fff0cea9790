"""cache_layout=fp8_ds_mla: DeepSeek-V4's fp8 record, byte for byte FlashMLA's "MODEL1" format
(docs/numerics.md §3.2; the record and its pages: dsv4/formats/fp8_ds_mla.py), OCP e4m3 NoPE bytes. On a
GPU rows are written by our Triton writer or, inside the layer, stored by its kernels (a RowStore): chosen
once per cache (`access`)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from dsv4.formats.fp8 import E4M3_MAX, e4m3_dtype
from dsv4.formats.fp8_ds_mla import (NOPE_BYTES, check_row_dim, decode_records, encode_records, page_bytes,
                                     read_records, records_writer)
from dsv4.formats.row_format import FP8_DS_MLA, RowFormat
from dsv4.values.settings import at_least
from dsv4.strategies.cache_layout.common import FP8_ROWS_ROUNDING_BUDGET
from dsv4.strategies.protocols import CacheAccess, Needs


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp8DsMlaLayout:
    """uint8 pages [num_blocks, page_bytes]; rows addressed at block*stride + t*576 (data) and
    block*stride + B*576 + t*8 (scales)."""
    name: str = "fp8_ds_mla"
    error_budget: ClassVar[float] = 1e-4     # vs the oracle: the oracle rounds rows as stored
    rounding_budget: ClassVar[float] = FP8_ROWS_ROUNDING_BUDGET     # vs exact float32 rows (common.py)
    nope_dim: int = at_least(1, 448)
    rope_dim: int = at_least(1, 64)
    tile: int = at_least(1, 64)          # NoPE dims per UE8M0 scale
    align: int = at_least(1, 576)        # page strides are multiples of this (vLLM's KV-spec alignment)

    @property
    def row_format(self) -> RowFormat:
        return FP8_DS_MLA

    @property
    def data_bytes(self) -> int:
        return self.nope_dim + 2 * self.rope_dim                 # 576

    @property
    def scale_bytes(self) -> int:
        return self.nope_dim // self.tile + 1                    # 7 exponents + 1 zero pad = 8

    def needs(self, device) -> Needs:
        return Needs(batch_invariant=True)       # each row rounded by itself

    def bytes_per_token(self, head_dim: int) -> int:
        check_row_dim(self.name, head_dim, self.nope_dim, self.rope_dim)
        return self.data_bytes + self.scale_bytes                # 584

    def page_bytes(self, block_size: int, head_dim: int) -> int:
        return page_bytes(block_size, self.bytes_per_token(head_dim), self.align)

    def allocate(self, *, num_blocks: int, block_size: int, head_dim: int, device: str):
        import torch

        return torch.zeros(num_blocks, self.page_bytes(block_size, head_dim), dtype=torch.uint8, device=device)

    # ---- packing ---------------------------------------------------------------------------------
    def pack(self, rows):
        """[N, 512] -> (data [N, 576] uint8, scales [N, 8] uint8), from the bf16-rounded rows."""
        return encode_records(rows, e4m3_dtype(), E4M3_MAX, nope_dim=self.nope_dim, tile=self.tile)

    def unpack(self, data, scales):
        """(data [..., 576], scales [..., 8]) -> [..., 512] float32."""
        return decode_records(data, scales, e4m3_dtype(), nope_dim=self.nope_dim, tile=self.tile)

    def read(self, cache, slots, *, block_size: int):
        return read_records(self, cache, slots, block_size=block_size, data_bytes=self.data_bytes,
                            scale_bytes=self.scale_bytes)

    def access(self, cache, *, block_size: int, gpu: bool) -> CacheAccess:
        """On a GPU our Triton writer and the kernels' store (the record as DSV4 has it: 448 + 64 dims, tiles
        of 64), else torch's packing (sync-free on a GPU)."""
        if not (gpu and (self.nope_dim, self.rope_dim, self.tile) == (NOPE_BYTES, 64, 64)):
            return CacheAccess(write=records_writer(self, cache, block_size=block_size, gpu=gpu))
        from dsv4.kernels.front.cache_write import fp8_ds_mla_store, write_fp8_ds_mla_kernel
        return CacheAccess(write=partial(write_fp8_ds_mla_kernel, cache, block_size=block_size),
                           store=fp8_ds_mla_store(cache, block_size))
