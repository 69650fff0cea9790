"""What the indexer's record layouts (mxfp4's FP4 records, the fp8 options' fp8 records) share: a key is
`data_bytes` of values and `scale_bytes` of scales, and a page of B keys holds its B value rows first,
then its B scale rows (the fp8_ds_mla page geometry: `write_records`, `read_records`). Each layout class
takes these as its methods; its own are the format (`pack`, `unpack`) and its kernel store."""
from __future__ import annotations

from dsv4.strategies.fp8_layouts import read_records, write_records
from dsv4.strategies.protocols import Needs


def needs(self, device) -> Needs:
    return Needs()


def bytes_per_token(self, head_dim: int) -> int:
    if head_dim != self.head_dim:
        raise ValueError(f"{self.name} keys of {self.head_dim} dims cannot hold rows of {head_dim}")
    return self.data_bytes + self.scale_bytes


def page_bytes(self, block_size: int, head_dim: int) -> int:
    return block_size * self.bytes_per_token(head_dim)


def allocate(self, *, num_blocks: int, block_size: int, head_dim: int, device: str):
    import torch

    return torch.zeros(num_blocks, self.page_bytes(block_size, head_dim), dtype=torch.uint8, device=device)


def read(self, cache, slots, *, block_size: int):
    return read_records(self, cache, slots, block_size=block_size, data_bytes=self.data_bytes,
                        scale_bytes=self.scale_bytes)


write = write_records          # (layout, cache, slots, rows, *, block_size)
