"""fp8 CacheLayout options: DeepSeek-V4's fp8_ds_mla record and plain per-tensor-scaled e4m3 rows.

`fp8_ds_mla` is FlashMLA's "MODEL1" format (docs/numerics.md §3.2), byte for byte: per token 448 e4m3 NoPE
bytes (one power-of-two UE8M0 scale per 64 dims), 64 bf16 RoPE dims (128 B), 7 scale bytes and one
zero pad byte = 584 B. A page holds all its tokens' 576 data bytes first, then all their 8-byte scale
groups; the page stride is rounded up to a multiple of 576. Both layouts quantize the bf16-rounded
row, as vLLM's fused insert ops do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dsv4.formats.fp8 import E4M3_MAX, FNUZ_NAN, e4m3_over
from dsv4.formats.row_format import FP8_DS_MLA, RowFormat, RowKind
from dsv4.settings import at_least
from dsv4.sizes import round_up
from dsv4.strategies.cache_layout import kept_rows
from dsv4.strategies.protocols import Needs

DATA_BYTES, SCALE_BYTES, NOPE_BYTES, EXPONENTS = 576, 8, 448, 7     # the record (docs/numerics.md §3.2)


def _e4m3():
    import torch

    return torch.float8_e4m3fn


def record_offsets(pages, slots, block_size: int, data_bytes: int = DATA_BYTES, scale_bytes: int = SCALE_BYTES):
    """Byte offsets into `pages.view(-1)` ([num_blocks, page_bytes] uint8) of each slot's data bytes
    and scale bytes in the fp8_ds_mla page geometry -> ([..., 576], [..., 8]) int64."""
    import torch

    s = slots.long()
    base = (s // block_size) * pages.shape[1]
    t = s % block_size
    data = (base + t * data_bytes)[..., None] + torch.arange(data_bytes, device=s.device)
    scl = (base + block_size * data_bytes + t * scale_bytes)[..., None] + torch.arange(scale_bytes, device=s.device)
    return data, scl


def encode_records(rows, fp8, quant_max: float, *, nope_dim: int = NOPE_BYTES, tile: int = 64):
    """[N, nope_dim + rope dims] -> (data [N, nope_dim + 2·rope] uint8, scales [N, nope_dim/tile + 1] uint8),
    from the bf16-rounded rows: per `tile` NoPE dims scale = 2^ceil(log2(max(amax, 1e-4) / quant_max)) (its
    UE8M0 byte, then a zero pad byte), each NoPE byte the value over its scale in the torch dtype `fp8`
    (the record's flavour; FNUZ's NaN byte 0x80, which torch writes for -0, stored as 0x00), the RoPE
    dims as bf16 bytes."""
    import torch

    x = rows.bfloat16()
    nope = x[:, :nope_dim].float().unflatten(-1, (-1, tile))
    amax = nope.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    e = torch.ceil(torch.log2(amax / quant_max))
    q = (nope / torch.exp2(e)).clamp(-quant_max, quant_max).to(fp8).flatten(-2).view(torch.uint8)
    if fp8 == torch.float8_e4m3fnuz:
        q = torch.where(q == FNUZ_NAN, torch.zeros_like(q), q)
    data = torch.cat((q, x[:, nope_dim:].contiguous().view(torch.uint8)), 1)
    exp = (e.squeeze(-1) + 127).clamp(0, 255).to(torch.uint8)
    return data, torch.cat((exp, torch.zeros_like(exp[:, :1])), 1)


def decode_records(data, scales, fp8, *, nope_dim: int = NOPE_BYTES, tile: int = 64):
    """(data [..., 576], scales [..., 8]) uint8 -> [..., 512] float32: the NoPE bytes read as the torch
    dtype `fp8` (the record's flavour) times 2^(exponent byte - 127) per `tile` dims, the RoPE dims bf16."""
    import torch

    e = scales[..., : nope_dim // tile].float() - 127
    nope = data[..., :nope_dim].contiguous().view(fp8).float() * torch.exp2(e).repeat_interleave(tile, -1)
    rope = data[..., nope_dim:].contiguous().view(torch.bfloat16).float()
    return torch.cat((nope, rope), -1)


def write_records(layout, cache, slots, rows, *, block_size: int) -> None:
    """Pack rows with `layout.pack` into their slots (-1: skip) of fp8_ds_mla-geometry pages: on the CPU
    the kept rows only, on a GPU every row sync-free (`kept_rows`)."""
    import torch

    flat = cache.view(-1)
    if not cache.is_cuda:
        keep = (slots >= 0).nonzero().squeeze(-1)      # zero rows pack and write nothing
        data, scales = layout.pack(rows.index_select(0, keep))
        di, si = record_offsets(cache, slots.index_select(0, keep), block_size, data.shape[-1], scales.shape[-1])
        flat[di] = data
        flat[si] = scales
        return
    src, any_kept = kept_rows(slots)
    data, scales = layout.pack(rows.index_select(0, src))
    di, si = record_offsets(cache, slots.index_select(0, src).clamp(min=0), block_size, data.shape[-1],
                            scales.shape[-1])
    flat[di] = torch.where(any_kept, data, flat[di])
    flat[si] = torch.where(any_kept, scales, flat[si])


def read_records(layout, cache, slots, *, block_size: int, data_bytes: int = DATA_BYTES,
                 scale_bytes: int = SCALE_BYTES):
    """Rows at `slots` decoded with `layout.unpack` (a new tensor); zeros for -1."""
    di, si = record_offsets(cache, slots.clamp(min=0), block_size, data_bytes, scale_bytes)
    flat = cache.view(-1)
    return layout.unpack(flat[di], flat[si]).masked_fill_((slots < 0)[..., None], 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp8DsMlaLayout:
    """uint8 pages [num_blocks, page_bytes]; rows addressed at block*stride + t*576 (data) and
    block*stride + B*576 + t*8 (scales)."""
    name: str = "fp8_ds_mla"
    error_budget: ClassVar[float] = 1e-4     # vs the oracle: the oracle rounds rows as stored
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
        return Needs()

    def _check_dim(self, head_dim: int) -> None:
        if head_dim != self.nope_dim + self.rope_dim:
            raise ValueError(f"cache_layout={self.name} stores {self.nope_dim}+{self.rope_dim}-dim rows, "
                             f"not {head_dim} (the indexer's keys have their own layout)")

    def bytes_per_token(self, head_dim: int) -> int:
        self._check_dim(head_dim)
        return self.data_bytes + self.scale_bytes                # 584

    def page_bytes(self, block_size: int, head_dim: int) -> int:
        raw = block_size * self.bytes_per_token(head_dim)
        return round_up(raw, self.align)

    def allocate(self, *, num_blocks: int, block_size: int, head_dim: int, device: str):
        import torch

        return torch.zeros(num_blocks, self.page_bytes(block_size, head_dim), dtype=torch.uint8, device=device)

    # ---- packing ---------------------------------------------------------------------------------
    def pack(self, rows):
        """[N, 512] -> (data [N, 576] uint8, scales [N, 8] uint8), from the bf16-rounded rows."""
        return encode_records(rows, _e4m3(), E4M3_MAX, nope_dim=self.nope_dim, tile=self.tile)

    def unpack(self, data, scales):
        """(data [..., 576], scales [..., 8]) -> [..., 512] float32."""
        return decode_records(data, scales, _e4m3(), nope_dim=self.nope_dim, tile=self.tile)

    def write(self, cache, slots, rows, *, block_size: int) -> None:
        if cache.is_cuda and (self.nope_dim, self.rope_dim, self.tile) == (NOPE_BYTES, 64, 64):
            from dsv4.kernels.cache_write import write_fp8_ds_mla_kernel
            write_fp8_ds_mla_kernel(cache, slots, rows, block_size=block_size)
            return
        write_records(self, cache, slots, rows, block_size=block_size)

    def read(self, cache, slots, *, block_size: int):
        return read_records(self, cache, slots, block_size=block_size, data_bytes=self.data_bytes,
                            scale_bytes=self.scale_bytes)

    def kernel_store(self, cache, block_size: int):
        if not (cache.is_cuda and (self.nope_dim, self.rope_dim, self.tile) == (NOPE_BYTES, 64, 64)):
            return None
        from dsv4.kernels.cache_write import fp8_ds_mla_store
        return fp8_ds_mla_store(cache, block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp8PerTensorLayout:
    """e4m3 rows [num_blocks, B, 512] with one scale for the whole cache (FlashInfer sm100's fp8 path).

    A row is stored as e4m3(bf16(row) / kv_scale); an fp8 query as e4m3(q / q_scale). A kernel then
    takes bmm1_scale = softmax_scale · q_scale · kv_scale and bmm2_scale = kv_scale (vLLM fixes both
    scales at 1.0 for DSV4: the RMS-normed rows sit well inside e4m3's ±448).
    """
    name: str = "fp8_per_tensor"
    error_budget: ClassVar[float] = 1e-4     # vs the oracle: the oracle rounds rows as stored
    kv_scale: float = 1.0
    q_scale: float = 1.0

    def __post_init__(self) -> None:
        if not (self.kv_scale > 0 and self.q_scale > 0):
            raise ValueError(f"cache_layout={self.name}: kv_scale and q_scale must be > 0")

    @property
    def row_format(self) -> RowFormat:
        return RowFormat(kind=RowKind.FP8_PER_TENSOR, fp8="ocp", kv_scale=self.kv_scale, q_scale=self.q_scale)

    def needs(self, device) -> Needs:
        return Needs()

    def bytes_per_token(self, head_dim: int) -> int:
        return head_dim

    def page_bytes(self, block_size: int, head_dim: int) -> int:
        return block_size * head_dim

    def allocate(self, *, num_blocks: int, block_size: int, head_dim: int, device: str):
        import torch

        return torch.zeros(num_blocks, block_size, head_dim, dtype=_e4m3(), device=device)

    @staticmethod
    def quantize(x, scale: float):
        return e4m3_over(x, scale)

    def write(self, cache, slots, rows, *, block_size: int) -> None:
        import torch

        flat = cache.view(-1, cache.shape[-1])     # rows are quantized from their bf16 value, as vLLM's insert op does
        if not cache.is_cuda:
            keep = slots >= 0
            flat[slots[keep].long()] = self.quantize(rows[keep].bfloat16(), self.kv_scale)
            return
        src, any_kept = kept_rows(slots)
        tgt = slots.index_select(0, src).clamp(min=0).long()
        vals = self.quantize(rows.index_select(0, src).bfloat16(), self.kv_scale)
        flat[tgt] = torch.where(any_kept, vals.view(torch.uint8), flat[tgt].view(torch.uint8)).view(flat.dtype)

    def read(self, cache, slots, *, block_size: int):
        import torch

        rows = cache.view(-1, cache.shape[-1])[slots.clamp(min=0).long()].float() * self.kv_scale
        return torch.where((slots >= 0)[..., None], rows, torch.zeros((), device=rows.device))

    def kernel_store(self, cache, block_size: int):
        return None                                # rows go through `write`
