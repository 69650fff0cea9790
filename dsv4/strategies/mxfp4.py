"""indexer=mxfp4: the published FP4 numerics (`fp4_sim`), the keys stored as packed FP4 records.

One key of Di dims is Di/2 bytes of e2m1 codes -- two per byte, the even dim in the low nibble -- and
Di/32 UE8M0 scale bytes, one per block of 32 dims (68 B for the 128-dim keys of DSV4, against 256 B of
bf16 keys). A page of B keys holds its B code rows first, then its B scale rows (the page arrangement of
DeepGEMM's paged fp8 and fp4 indexer keys and of our fp8_ds_mla pages): key t of page p at
p·B·68 + t·64, its scales at p·B·68 + B·64 + t·4. The values are exactly the FP4-simulated keys
`fp4_sim` stores as bf16 rows, so the two options score and select the same entries. On a GPU the layer's
compress kernel writes the records (dsv4/kernels/fp4.py) and our Triton scoring kernel
(dsv4/kernels/indexer_logits.py) decodes them as it reads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.formats.row_format import MXFP4_KEYS, RowFormat
from dsv4.strategies import key_records
from dsv4.strategies.indexer import (
    FP4_BLOCK,
    fp4_decode,
    fp4_encode,
    fp4_keys,
    fp4_needs,
    fp4_queries,
    no_plan,
    no_prepare,
    triton_scores,
)
from dsv4.strategies.top_k import DEFAULT_TOP_K, check_top_k


@dataclass(frozen=True, slots=True, kw_only=True)
class Mxfp4KeyLayout:
    """uint8 pages [num_blocks, B·(Di/2 + Di/32)] of FP4 key records (the module docstring)."""
    name: str = "mxfp4"
    error_budget: ClassVar[float] = 0.0      # the values of fp4_sim's keys, exactly
    head_dim: int = 128
    block: int = FP4_BLOCK                   # dims per scale

    def __post_init__(self) -> None:
        if self.head_dim % (2 * self.block) or self.head_dim <= 0:
            raise ValueError(f"mxfp4 keys: head_dim {self.head_dim} is not a multiple of {2 * self.block}")

    @property
    def row_format(self) -> RowFormat:
        return MXFP4_KEYS

    @property
    def data_bytes(self) -> int:
        return self.head_dim // 2

    @property
    def scale_bytes(self) -> int:
        return self.head_dim // self.block

    # the record layouts' shared methods (dsv4/strategies/key_records.py)
    needs, bytes_per_token, page_bytes = key_records.needs, key_records.bytes_per_token, key_records.page_bytes
    allocate, write, read = key_records.allocate, key_records.write, key_records.read

    def pack(self, rows):
        """[N, Di] -> (codes [N, Di/2] uint8, scales [N, Di/32] uint8): rows FP4-quantized as fp4_sim does
        (already FP4-simulated rows come back unchanged in value)."""
        codes, exps = fp4_encode(rows, self.block)
        return codes[..., 0::2] | (codes[..., 1::2] << 4), exps

    def unpack(self, data, scales):
        """(codes [..., Di/2], scales [..., Di/32]) -> [..., Di] float32."""
        import torch

        codes = torch.stack((data & 15, data >> 4), -1).flatten(-2)
        return fp4_decode(codes, scales, self.block)

    def kernel_store(self, cache, block_size: int):
        """On a GPU, the compress kernel stores FP4-simulated keys as these records (dsv4/kernels/fp4.py)."""
        if not cache.is_cuda:
            return None
        from dsv4.kernels.cache_write import fp4_record_store
        return fp4_record_store(cache, block_size, self.head_dim)


@dataclass(frozen=True, slots=True, kw_only=True)
class Mxfp4Indexer:
    """fp4_sim's queries and keys; keys stored as Mxfp4KeyLayout records."""
    name: str = "mxfp4"
    top_k: str = DEFAULT_TOP_K                # how the scores become lists on a GPU (top_k.TOP_K)
    __post_init__ = check_top_k
    error_budget: ClassVar[float] = 0.0       # the oracle applies the same numerics
    transforms: ClassVar[bool] = True
    fp4: ClassVar[bool] = True
    oracle_numerics: ClassVar[str] = "fp4"
    fp8_queries: ClassVar[bool] = False

    scores, prepare, plan = staticmethod(triton_scores), no_prepare, no_plan
    queries, keys, needs = fp4_queries, fp4_keys, fp4_needs

    def key_layout(self, *, dtype: str, head_dim: int):
        return Mxfp4KeyLayout(head_dim=head_dim)

