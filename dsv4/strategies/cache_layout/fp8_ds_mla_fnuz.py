"""cache_layout=fp8_ds_mla_fnuz: the fp8_ds_mla record (docs/numerics.md §3.2) with FNUZ e4m3 bytes.

MI300X (gfx942) computes fp8 only as float8_e4m3fnuz -- aiter's `dtypes.fp8` there -- so a gfx942
kernel that decodes cache bytes natively needs them in that flavour (§3.2; aiter on ROCm: §4.5).
Same 584 bytes per token and the same pages as fp8_ds_mla: all tokens' 576 data bytes (448 e4m3 NoPE
bytes, 64 bf16 RoPE dims), then all tokens' 8 scale bytes (7 UE8M0 exponents + a zero byte), page
stride a multiple of 576. Only the e4m3 flavour of the NoPE bytes differs: FNUZ has bias 8 (OCP: 7),
a largest finite value of 240, no infinities and no negative zero -- byte 0x80 is its only NaN, so it
is never written (a negative zero is stored as 0x00).

Quantization follows vLLM's FNUZ writer, whose fp8 range on FNUZ platforms is ±224 = 448 / 2: per 64
NoPE dims, scale = 2^ceil(log2(max(amax, 1e-4) / 224)), byte = e4m3fnuz(x / scale). FNUZ's grid is
OCP's halved (one more bias step), so these are exactly fp8_ds_mla's values: the same e4m3 bit
patterns (a negative zero written as 0x00) with every UE8M0 scale byte one higher. The page
converters at the end are therefore lossless both ways.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from dsv4.formats.fp8_ds_mla import (DATA_BYTES, FNUZ_QUANT_MAX, SCALE_BYTES, check_row_dim, decode_records,
                                     encode_records, page_bytes, read_records, records_writer)
from dsv4.formats.row_format import FP8_DS_MLA_FNUZ, RowFormat
from dsv4.strategies.cache_layout.common import FP8_ROWS_ROUNDING_BUDGET
from dsv4.strategies.protocols import CacheAccess, Needs


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp8DsMlaFnuzLayout:
    """uint8 pages [num_blocks, page_bytes], addressed like fp8_ds_mla; NoPE bytes in e4m3fnuz."""
    name: str = "fp8_ds_mla_fnuz"
    error_budget: ClassVar[float] = 1e-4     # vs the oracle: the oracle rounds rows as stored
    rounding_budget: ClassVar[float] = FP8_ROWS_ROUNDING_BUDGET     # vs exact float32 rows (common.py)

    @property
    def row_format(self) -> RowFormat:
        return FP8_DS_MLA_FNUZ

    def needs(self, device) -> Needs:
        return Needs(batch_invariant=True)       # each row rounded by itself

    # the record's geometry is fp8_ds_mla's: same 584 bytes, same pages, same 576-aligned stride
    def bytes_per_token(self, head_dim: int) -> int:
        check_row_dim(self.name, head_dim)
        return DATA_BYTES + SCALE_BYTES

    def page_bytes(self, block_size: int, head_dim: int) -> int:
        return page_bytes(block_size, self.bytes_per_token(head_dim))

    def allocate(self, *, num_blocks: int, block_size: int, head_dim: int, device: str):
        import torch

        return torch.zeros(num_blocks, self.page_bytes(block_size, head_dim), dtype=torch.uint8, device=device)

    # ---- packing ---------------------------------------------------------------------------------
    def pack(self, rows):
        """[N, 512] -> (data [N, 576] uint8, scales [N, 8] uint8), from the bf16-rounded rows."""
        import torch

        return encode_records(rows, torch.float8_e4m3fnuz, FNUZ_QUANT_MAX)

    def unpack(self, data, scales):
        """(data [..., 576], scales [..., 8]) -> [..., 512] float32."""
        import torch

        return decode_records(data, scales, torch.float8_e4m3fnuz)

    def read(self, cache, slots, *, block_size: int):
        return read_records(self, cache, slots, block_size=block_size)

    def access(self, cache, *, block_size: int, gpu: bool) -> CacheAccess:
        """On a GPU our Triton writer and the kernels' store, in FNUZ bytes; on the host torch's packing."""
        if not gpu:
            return CacheAccess(write=records_writer(self, cache, block_size=block_size, gpu=False))
        from dsv4.kernels.front.cache_write import fp8_ds_mla_store, write_fp8_ds_mla_kernel
        return CacheAccess(write=partial(write_fp8_ds_mla_kernel, cache, block_size=block_size, fnuz=True),
                           store=fp8_ds_mla_store(cache, block_size, fnuz=True))
