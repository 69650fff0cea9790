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
from typing import Any, ClassVar

from dsv4.strategies.fp8_layouts import read_records, write_records
from dsv4.strategies.indexer import FP4_BLOCK, FP4_NEEDS, fp4_decode, fp4_encode, fp4_sim, triton_scores
from dsv4.strategies.protocols import Needs


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
    def kv_row_dtype(self) -> str:
        return "mxfp4"

    @property
    def data_bytes(self) -> int:
        return self.head_dim // 2

    @property
    def scale_bytes(self) -> int:
        return self.head_dim // self.block

    def needs(self, device) -> Needs:
        return Needs()

    def bytes_per_token(self, head_dim: int) -> int:
        if head_dim != self.head_dim:
            raise ValueError(f"mxfp4 keys of {self.head_dim} dims cannot hold rows of {head_dim}")
        return self.data_bytes + self.scale_bytes

    def page_bytes(self, block_size: int, head_dim: int) -> int:
        return block_size * self.bytes_per_token(head_dim)

    def allocate(self, *, num_blocks: int, block_size: int, head_dim: int, device: str):
        import torch

        return torch.zeros(num_blocks, self.page_bytes(block_size, head_dim), dtype=torch.uint8, device=device)

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

    def write(self, cache, slots, rows, *, block_size: int) -> None:
        write_records(self, cache, slots, rows, block_size=block_size)

    def read(self, cache, slots, *, block_size: int):
        return read_records(self, cache, slots, block_size=block_size, data_bytes=self.data_bytes,
                            scale_bytes=self.scale_bytes)

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
    error_budget: ClassVar[float] = 0.0       # the oracle applies the same numerics
    transforms: ClassVar[bool] = True
    fp4: ClassVar[bool] = True
    oracle_numerics: ClassVar[str] = "fp4"

    scores = staticmethod(triton_scores)

    def needs(self, device) -> Needs:
        return Needs(**FP4_NEEDS)

    def prepare(self, *, head_dim: int, device) -> Any:
        return None

    def key_layout(self, *, dtype: str, head_dim: int):
        return Mxfp4KeyLayout(head_dim=head_dim)

    def queries(self, q, prepared=None):
        return fp4_sim(q)

    def keys(self, rows, prepared=None):
        return fp4_sim(rows)
