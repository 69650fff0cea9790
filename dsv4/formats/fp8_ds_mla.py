"""The fp8_ds_mla record (docs/numerics.md §3.2), byte for byte FlashMLA's "MODEL1" format: per token 448
e4m3 NoPE bytes (one power-of-two UE8M0 scale per 64 dims), 64 bf16 RoPE dims (128 B), 7 scale bytes and
one zero pad byte = 584 B. A page holds all its tokens' 576 data bytes first, then all their 8-byte scale
groups; the page stride is rounded up to a multiple of 576. Its two cache layouts (OCP and FNUZ e4m3 bytes)
and the indexer's key records share this page geometry; the readers of the pages (FlashMLA's view, the
flavour converters) share the record. Rows are quantized from their bf16 rounding, as vLLM's fused insert
ops do."""
from __future__ import annotations

from functools import partial

from dsv4.formats.fp8 import FNUZ_NAN
from dsv4.formats.scatter import kept_rows
from dsv4.values.sizes import round_up

DATA_BYTES, SCALE_BYTES, NOPE_BYTES, EXPONENTS = 576, 8, 448, 7     # the record (docs/numerics.md §3.2)

ROPE_DIMS = 64            # bf16 RoPE dims after the NoPE bytes
ALIGN = DATA_BYTES        # page strides are multiples of this (vLLM's KV-spec alignment)


def check_row_dim(name: str, head_dim: int, nope_dim: int = NOPE_BYTES, rope_dim: int = ROPE_DIMS) -> None:
    """Refuse rows that are not `nope_dim` + `rope_dim` wide in the layout `name`."""
    if head_dim != nope_dim + rope_dim:
        raise ValueError(f"cache_layout={name} stores {nope_dim}+{rope_dim}-dim rows, not {head_dim} (the "
                         "indexer's keys have their own layout)")


def page_bytes(block_size: int, record_bytes: int = DATA_BYTES + SCALE_BYTES, align: int = ALIGN) -> int:
    """Bytes of a page of `block_size` records: its stride, rounded up to a multiple of `align`."""
    return round_up(block_size * record_bytes, align)


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


def write_kept_records(layout, cache, slots, rows, *, block_size: int) -> None:
    """Pack the kept rows (slots >= 0) with `layout.pack` into their slots of fp8_ds_mla-geometry pages:
    the host's writer (it reads how many rows are kept)."""
    keep = (slots >= 0).nonzero().squeeze(-1)      # zero rows pack and write nothing
    data, scales = layout.pack(rows.index_select(0, keep))
    di, si = record_offsets(cache, slots.index_select(0, keep), block_size, data.shape[-1], scales.shape[-1])
    flat = cache.view(-1)
    flat[di] = data
    flat[si] = scales


def write_records_sync_free(layout, cache, slots, rows, *, block_size: int) -> None:
    """`write_kept_records`' bytes, packing every row and reading nothing on the host (`kept_rows`): a
    GPU's writer, whose writes a captured step replays."""
    import torch

    flat = cache.view(-1)
    src, any_kept = kept_rows(slots)
    data, scales = layout.pack(rows.index_select(0, src))
    di, si = record_offsets(cache, slots.index_select(0, src).clamp(min=0), block_size, data.shape[-1],
                            scales.shape[-1])
    flat[di] = torch.where(any_kept, data, flat[di])
    flat[si] = torch.where(any_kept, scales, flat[si])


def records_writer(layout, cache, *, block_size: int, gpu: bool):
    """The writer (slots, rows) -> None of `layout`'s records into `cache`, for its device: on a GPU the
    sync-free one, on the host the kept rows alone."""
    return partial(write_records_sync_free if gpu else write_kept_records, layout, cache, block_size=block_size)


def read_records(layout, cache, slots, *, block_size: int, data_bytes: int = DATA_BYTES,
                 scale_bytes: int = SCALE_BYTES):
    """Rows at `slots` decoded with `layout.unpack` (a new tensor); zeros for -1."""
    di, si = record_offsets(cache, slots.clamp(min=0), block_size, data_bytes, scale_bytes)
    flat = cache.view(-1)
    return layout.unpack(flat[di], flat[si]).masked_fill_((slots < 0)[..., None], 0)


FNUZ_QUANT_MAX = 224.0    # what a block's amax maps to (vLLM's FNUZ fp8 range; = OCP 448 / 2)


def fp8_ds_mla_pages(cache):
    """The [num_blocks, B, 1, 584] view FlashMLA reads of a PagedCache in the fp8_ds_mla layout:
    row t of page b at b*page_bytes + t*584 (the page stride keeps our 576-aligned padding)."""
    B, data = cache.block_size, cache.data
    return data.as_strided((data.shape[0], B, 1, 584), (data.stride(0), 584, 584, 1))


# ---- converting whole caches between the two flavours ---------------------------------------------
def _regions(pages, block_size: int):
    """Masks over one page's bytes: (NoPE e4m3 bytes, UE8M0 exponent bytes)."""
    import torch

    n = pages.shape[1]
    if n < block_size * (DATA_BYTES + SCALE_BYTES):
        raise ValueError(f"pages of {n} bytes cannot hold {block_size} fp8_ds_mla tokens")
    i = torch.arange(n, device=pages.device)
    in_data = i < block_size * DATA_BYTES
    nope = in_data & (i % DATA_BYTES < NOPE_BYTES)
    j = i - block_size * DATA_BYTES
    exps = (j >= 0) & (j < block_size * SCALE_BYTES) & (j % SCALE_BYTES < EXPONENTS)
    return nope, exps


def ocp_to_fnuz_pages(pages, block_size: int):
    """fp8_ds_mla pages -> fp8_ds_mla_fnuz pages holding the same values (a new tensor).

    Each e4m3 byte keeps its bit pattern (worth half as FNUZ) except OCP's negative zero 0x80, which
    becomes 0x00; each written exponent byte goes up by one (twice the scale). Exponent byte 0 marks a
    slot never written (a written one is >= 105, the 1e-4 amax floor) and stays 0; RoPE dims and
    padding are copied."""
    import torch

    nope, exps = _regions(pages, block_size)
    out = pages.clone()
    b = out[:, nope]
    out[:, nope] = torch.where(b == FNUZ_NAN, torch.zeros_like(b), b)
    e = out[:, exps]
    if bool((e == 255).any()):
        raise ValueError("an OCP scale exponent of 255 has no FNUZ counterpart")
    out[:, exps] = torch.where(e > 0, e + 1, e)
    return out


def fnuz_to_ocp_pages(pages, block_size: int):
    """fp8_ds_mla_fnuz pages -> fp8_ds_mla pages holding the same values (a new tensor): the inverse
    of `ocp_to_fnuz_pages`. Refuses bytes with no OCP counterpart at the same scale: 0x80 (NaN) and
    ±240 (0x7f / 0xff), which this layout's quantizer (range ±224) never writes."""
    import torch

    nope, exps = _regions(pages, block_size)
    b = pages[:, nope]
    bad = (b == FNUZ_NAN) | (b == 0x7F) | (b == 0xFF)
    if bool(bad.any()):
        raise ValueError(f"FNUZ bytes {sorted(set(b[bad].tolist()))} (NaN / ±240) have no OCP counterpart")
    out = pages.clone()
    e = out[:, exps]
    out[:, exps] = torch.where(e > 0, e - 1, e)
    return out
