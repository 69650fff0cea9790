"""The indexer's record layouts (CacheLayouts of its keys): mxfp4's packed FP4 records and the fp8
options' fp8 records. A key is `data_bytes` of values and `scale_bytes` of scales, and a page of B keys
holds its B value rows first, then its B scale rows (the fp8_ds_mla page geometry: `records_writer`,
`read_records`). Each layout's own are its format (`pack`, `unpack`) and its kernel store.

- fp8 records (`Fp8KeyLayout`; indexer=deepgemm_fp8 and triton_fp8): one key of Di dims is Di e4m3 bytes
  and one float32 scale (132 B for the 128-dim keys of DSV4): the bf16-rounded key divided by its scale
  2^ceil(log2(max(amax, 1e-4) / 448)) -- a power of two, as the fp8_ds_mla records' --, rounded to e4m3.
  Its pages are DeepGEMM's paged fp8 indexer cache ([num_blocks, B, 1, Di + 4] as `fp8_paged_mqa_logits`
  reads it, B = 64 on sm90). The keys being FP4-simulated (e2m1 values times a power of two per 32 dims),
  the power-of-two scale keeps them exactly wherever a block's scale is within 2^-13 of the key's largest
  -- every key the model makes in practice.
- FP4 records (`Mxfp4KeyLayout`; indexer=mxfp4): one key of Di dims is Di/2 bytes of e2m1 codes -- two
  per byte, the even dim in the low nibble -- and Di/32 UE8M0 scale bytes, one per block of 32 dims (68 B
  for the 128-dim keys of DSV4, against 256 B of bf16 keys): key t of page p at p·B·68 + t·64, its scales
  at p·B·68 + B·64 + t·4. The values are exactly the FP4-simulated keys `fp4_sim` stores as bf16 rows.

On a GPU the layer's compress kernel writes both records (dsv4/kernels/indexer/hadamard_fp4.py, cache_write.py) and our
Triton scoring kernel (dsv4/kernels/indexer/indexer_logits.py) decodes them as it reads them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.formats.fp4 import FP4_BLOCK, fp4_decode, fp4_encode, pow2_ceil
from dsv4.formats.fp8 import E4M3_MAX
from dsv4.formats.fp8_ds_mla import read_records, records_writer
from dsv4.formats.row_format import FP8_KEYS, MXFP4_KEYS, RowFormat
from dsv4.strategies.protocols import CacheAccess, Needs


def _needs(self, device) -> Needs:
    return Needs()


def _bytes_per_token(self, head_dim: int) -> int:
    if head_dim != self.head_dim:
        raise ValueError(f"{self.name} keys of {self.head_dim} dims cannot hold rows of {head_dim}")
    return self.data_bytes + self.scale_bytes


def _page_bytes(self, block_size: int, head_dim: int) -> int:
    return block_size * self.bytes_per_token(head_dim)


def _allocate(self, *, num_blocks: int, block_size: int, head_dim: int, device: str):
    import torch

    return torch.zeros(num_blocks, self.page_bytes(block_size, head_dim), dtype=torch.uint8, device=device)


def _read(self, cache, slots, *, block_size: int):
    return read_records(self, cache, slots, block_size=block_size, data_bytes=self.data_bytes,
                        scale_bytes=self.scale_bytes)


AMAX_MIN = 1e-4                 # the smallest amax a scale is taken from (a zero key: scale 2^-22)


def pow2_e4m3(x):
    """x float32 [..., Di] -> (x over its power-of-two fp8 scale, rounded to e4m3, and that scale [..., 1]
    float32: 2^ceil(log2(max(amax, 1e-4) / 448)) over the last dim; x / scale is exact)."""
    import torch

    s = pow2_ceil(x.abs().amax(-1, keepdim=True).clamp_min(AMAX_MIN) / E4M3_MAX)
    return (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp8KeyLayout:
    """uint8 pages [num_blocks, B·(Di + 4)] of fp8 key records (the module docstring)."""
    name: str = "fp8"
    error_budget: ClassVar[float] = 0.0      # the values of FP4-simulated keys, exactly
    rounding_budget: ClassVar[float] = 0.0   # nothing past the indexer's numerics, which grade its keys
    head_dim: int = 128

    @property
    def row_format(self) -> RowFormat:
        return FP8_KEYS

    @property
    def data_bytes(self) -> int:
        return self.head_dim

    @property
    def scale_bytes(self) -> int:
        return 4

    # the record layouts' shared methods (above)
    needs, bytes_per_token, page_bytes = _needs, _bytes_per_token, _page_bytes
    allocate, read = _allocate, _read

    def pack(self, rows):
        """[N, Di] -> (e4m3 bytes [N, Di] uint8, the float32 scales' bytes [N, 4] uint8), from the
        bf16-rounded rows."""
        import torch

        q, s = pow2_e4m3(rows.bfloat16().float())
        return q.view(torch.uint8), s.flatten().contiguous().view(torch.uint8).view(*s.shape[:-1], 4)

    def unpack(self, data, scales):
        """(data [..., Di], scales [..., 4]) -> [..., Di] float32."""
        import torch

        return data.contiguous().view(torch.float8_e4m3fn).float() * scales.contiguous().view(torch.float32)

    def access(self, cache, *, block_size: int, gpu: bool) -> CacheAccess:
        """Keys written as records by torch (sync-free on a GPU), where the compress kernel also stores them
        (dsv4/kernels/front/cache_write.py)."""
        store = None
        if gpu:
            from dsv4.kernels.front.cache_write import fp8_key_store
            store = fp8_key_store(cache, block_size, self.head_dim)
        return CacheAccess(write=records_writer(self, cache, block_size=block_size, gpu=gpu), store=store)


def fp8_queries(q, w, w_scale: float):
    """q [T, Hi, Di] (FP4-simulated values) and head weights w [T, Hi] -> (q in e4m3 [T, 1, Hi, Di], each
    head divided by its power-of-two scale; the weights times w_scale and that scale [T, Hi] float32). The
    specification of the GPU's one launch (dsv4/kernels/indexer/fp8_queries.py)."""
    q8, s = pow2_e4m3(q.float())
    return q8.unsqueeze(1), (w.float() * w_scale) * s.squeeze(-1)


def e4m3_queries(q, w, w_scale: float):
    """(q8, wq) as `fp8_queries` makes them (one launch: dsv4/kernels/indexer/fp8_queries.py), or q and w as they
    are where q is already e4m3 (the layer's front kernel made both, w_scale folded in)."""
    import torch

    from dsv4.kernels.indexer.fp8_queries import fp8_queries_kernel

    return (q, w) if q.dtype == torch.float8_e4m3fn else fp8_queries_kernel(q, w, w_scale)


@dataclass(frozen=True, slots=True, kw_only=True)
class Mxfp4KeyLayout:
    """uint8 pages [num_blocks, B·(Di/2 + Di/32)] of FP4 key records (the module docstring)."""
    name: str = "mxfp4"
    error_budget: ClassVar[float] = 0.0      # the values of fp4_sim's keys, exactly
    rounding_budget: ClassVar[float] = 0.0   # nothing past the indexer's numerics, which grade its keys
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

    # the record layouts' shared methods (above)
    needs, bytes_per_token, page_bytes = _needs, _bytes_per_token, _page_bytes
    allocate, read = _allocate, _read

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

    def access(self, cache, *, block_size: int, gpu: bool) -> CacheAccess:
        """Keys written as records by torch (sync-free on a GPU), where the compress kernel also stores
        FP4-simulated keys as these records (dsv4/kernels/indexer/hadamard_fp4.py)."""
        store = None
        if gpu:
            from dsv4.kernels.front.cache_write import fp4_record_store
            store = fp4_record_store(cache, block_size, self.head_dim)
        return CacheAccess(write=records_writer(self, cache, block_size=block_size, gpu=gpu), store=store)
