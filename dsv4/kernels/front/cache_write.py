"""Cache writers as Triton kernels: the bytes `Fp8DsMlaLayout.write` / `Fp8DsMlaFnuzLayout.write` and
`PlainRowLayout.write` store, and the indexer's key records (`Mxfp4KeyLayout`, `Fp8KeyLayout`) as the
compress kernel stores them, without the host sync of their torch path (slots of -1 are skipped in the
kernel, not selected on the host).

fp8_ds_mla record (dsv4/formats/fp8_ds_mla.py): the row rounded to bf16; per 64 NoPE dims the scale
2^e, e = ceil(log2(max(amax, 1e-4) / 448)), and the e4m3 bytes of x / 2^e; the 64 RoPE dims as bf16; 7
exponent bytes e + 127 and a zero byte. Exactness against torch:
- e comes from the IEEE bits of amax / 448 (division rounded to nearest, `div_rn`): the biased exponent,
  plus one unless the mantissa is 0. That is torch's ceil(log2(·)) wherever float32 log2 is not within
  half an ulp of an integer without being one; amax is a bf16 value (or the 1e-4 floor), for which
  amax / 448 = m/7 · 2^k is either a power of two or far from one.
- x / 2^e is x times the exact power of two 2^-e.
- the e4m3 byte is computed in integer arithmetic as torch's `fp8e4m3fn_from_fp32_value` does (round to
  nearest even, subnormals through the float adder), so no fp8 hardware is needed (A100, the CPU
  interpreter) and the bytes are torch's bit for bit.
FNUZ (cache_layout=fp8_ds_mla_fnuz): range ±224 instead of ±448 doubles the scale (e + 1) and halves x / 2^e,
and FNUZ's grid is OCP's halved, so its bytes are OCP's with negative zero (0x80, FNUZ's NaN) as 0x00.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

from dsv4.formats.row_format import RowCode
from dsv4.kernels.indexer.hadamard_fp4 import fp4_record
from dsv4.kernels.launch import CompileCase, as_i32, dependent_start, launch
from dsv4.kernels.target import gpu_launches_dependents, target_of
from dsv4.kernels.rounding import SOFT_ROUND, round_to, widen
from dsv4.values.sizes import cdiv, next_pow2

NOPE_DIMS, ROPE_DIMS = 448, 64
NOPE, TILE = tl.constexpr(NOPE_DIMS), tl.constexpr(64)                        # e4m3 dims, dims per scale
DATA_BYTES, SCALE_BYTES = tl.constexpr(576), tl.constexpr(8)                 # a record's two regions
# how a kernel that makes rows stores them itself (its KIND: the cache's RowFormat.code), as constexprs: rows
# handed back (no cache), plain rows, FP4 and fp8 key records; any other code, an fp8_ds_mla record
NO_CACHE, PLAIN_ROWS = tl.constexpr(RowCode.NONE.value), tl.constexpr(RowCode.PLAIN.value)
FP4_RECORD, FP8_KEY_RECORD = tl.constexpr(RowCode.MXFP4.value), tl.constexpr(RowCode.FP8_KEY.value)
FNUZ_RECORD = tl.constexpr(RowCode.FP8_DS_MLA_FNUZ.value)


@triton.jit
def e4m3_bits(y):
    """The OCP e4m3fn byte (uint8) of float32 y: torch's conversion (round to nearest even, finite
    overflow saturated to ±448, NaN to 0x7f with its sign)."""
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    mag = b & 0x7FFFFFFF
    # below 2^-6 (e4m3 subnormals): |y| + 2^14 rounds, in the float adder, to a multiple of 2^-9
    sub = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    nrm = (mag + ((7 - 127) << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    nrm = tl.where(nrm == 0x7F, 0x7E, nrm)
    r = tl.where(mag < (121 << 23), sub, nrm)
    r = tl.where(mag >= (1087 << 20), tl.where(mag > 0x7F800000, 0x7F, 0x7E), r)
    return (r | sign).to(tl.uint8)


@triton.jit
def pow2_e4m3(x, amax):
    """x float32 over its power-of-two fp8 scale 2^ceil(log2(max(amax, 1e-4) / 448)) (amax: |x|'s largest,
    broadcast against x), rounded to e4m3 -> (the bytes, the scale's biased float32 exponent e: the scale
    is 2^(e - 127)); x / scale is exact."""
    bits = tl.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32)).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)                          # 2^(127 - e)
    return e4m3_bits(tl.minimum(tl.maximum(x * inv, -448.0), 448.0)), e


@triton.jit
def fp8_heads(x, wv, w_scale):
    """Heads x [HP, D] float32 and their weights wv [HP] -> (each head's e4m3 bytes over its power-of-two
    scale, as `pow2_e4m3`; wv · w_scale · that scale [HP]): the fp8 indexers' queries and folded weights."""
    q8, e = pow2_e4m3(x, tl.max(tl.abs(x), 1)[:, None])
    return q8, (wv * w_scale) * (tl.max(e, 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_ds_mla_record(x, slot, u8_ptr, bf_ptr, w64_ptr, page_stride, BS: tl.constexpr, FNUZ: tl.constexpr,
                      SOFT: tl.constexpr):
    """Store x [8, 64] (the row's 7 NoPE tiles and its RoPE dims; float32 or bf16) as the fp8_ds_mla record
    of `slot` (in the pages, not checked here)."""
    tile = tl.arange(0, 8)
    dims = tile[:, None] * TILE + tl.arange(0, TILE)[None, :]
    xb = x if x.dtype == tl.bfloat16 else round_to(x, tl.bfloat16, SOFT)   # the record stores the bf16 row
    x = widen(xb, SOFT)
    amax = tl.maximum(tl.max(tl.abs(x), 1), 1e-4)
    bits = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)   # ceil(log2(amax / 448))
    # 2^-e, exact (e in [-22, 120] for finite rows); an infinite amax scales by 0 as x / inf does
    inv = tl.where(e < 127, ((127 - e) << 23).to(tl.float32, bitcast=True), 0.0)
    y = x * inv[:, None]
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -448.0), 448.0))
    q = e4m3_bits(y)
    if FNUZ:
        q = tl.where(q == 0x80, 0, q).to(tl.uint8)
        e = e + 1
    page = (slot // BS).to(tl.int64)
    t = slot % BS
    data = page * page_stride + t * DATA_BYTES
    nope = tile[:, None] < NOPE // TILE
    tl.store(u8_ptr + data + dims, q, mask=nope)
    tl.store(bf_ptr + (data + NOPE) // 2 + (dims - NOPE), xb, mask=~nope)
    exps = tl.minimum(tl.maximum(e + 127, 0), 255).to(tl.int64)
    word = tl.sum(tl.where(tile < NOPE // TILE, exps << (8 * tile).to(tl.int64), 0), 0)
    tl.store(w64_ptr + (page * page_stride + BS * DATA_BYTES + t * SCALE_BYTES) // 8, word)


@triton.jit
def fp8_key_record(x, slot, u8_ptr, page_stride, BS: tl.constexpr, N: tl.constexpr, SOFT: tl.constexpr):
    """Store row x [N] float32 as the fp8 key record of `slot` (dsv4/strategies/indexer/key_layouts.py): the
    bf16-rounded row's e4m3 bytes over its scale 2^ceil(log2(max(amax, 1e-4) / 448)) at page·page_stride
    + t·N, the scale's float32 bytes at page·page_stride + BS·N + 4t."""
    x = widen(round_to(x, tl.bfloat16, SOFT), SOFT)
    q, e = pow2_e4m3(x, tl.max(tl.abs(x), 0))
    page = (slot // BS).to(tl.int64)
    t = slot % BS
    base = page * page_stride
    tl.store(u8_ptr + base + t * N + tl.arange(0, N), q)
    b = tl.arange(0, 4)
    tl.store(u8_ptr + base + BS * N + t * 4 + b, (((e << 23) >> (8 * b)) & 0xFF).to(tl.uint8))


@triton.jit
def store_row(y, slot, ok, cache_ptr, cache_bf_ptr, cache_w64_ptr, page_stride, n_slots, D: tl.constexpr,
              BS: tl.constexpr, KIND: tl.constexpr, SOFT: tl.constexpr):
    """A row-making kernel's own store of its float32 row y [D] at `slot` of a cache (RowStore), when `ok`
    and the slot is in the cache: an fp8_ds_mla record (OCP or FNUZ bytes), a plain row in the cache's
    dtype, (FP4-simulated rows) an mxfp4 key record, or an fp8 key record."""
    if ok & (slot >= 0) & (slot < n_slots):
        if KIND == PLAIN_ROWS:
            dims = tl.arange(0, D)
            tl.store(cache_ptr + slot.to(tl.int64) * D + dims, round_to(y, cache_ptr.dtype.element_ty, SOFT))
        elif KIND == FP4_RECORD:
            fp4_record(y, slot, cache_ptr, page_stride, BS, D)
        elif KIND == FP8_KEY_RECORD:
            fp8_key_record(y, slot, cache_ptr, page_stride, BS, D, SOFT)
        else:
            fp8_ds_mla_record(tl.reshape(y, [8, TILE]), slot, cache_ptr, cache_bf_ptr, cache_w64_ptr, page_stride,
                              BS, KIND == FNUZ_RECORD, SOFT)


@triton.jit
def _fp8_ds_mla_kernel(rows_ptr, row_stride, slot_ptr, u8_ptr, bf_ptr, w64_ptr, page_stride, n_slots,
                       BS: tl.constexpr, FNUZ: tl.constexpr, SOFT: tl.constexpr, PDL: tl.constexpr = False):
    dependent_start(PDL)
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n)
    if (slot >= 0) & (slot < n_slots):
        dims = tl.arange(0, 8)[:, None] * TILE + tl.arange(0, TILE)[None, :]
        x = tl.load(rows_ptr + n.to(tl.int64) * row_stride + dims)
        fp8_ds_mla_record(x, slot, u8_ptr, bf_ptr, w64_ptr, page_stride, BS, FNUZ, SOFT)


def write_fp8_ds_mla_kernel(pages, slots, rows, *, block_size: int, fnuz: bool = False, num_warps: int = 2) -> None:
    """Store rows [N, 512] (float32 or bf16) as fp8_ds_mla records (FNUZ e4m3 bytes if `fnuz`) at `slots`
    [N] int32 (-1: skip) of pages [num_blocks, page_bytes] uint8: the bytes Fp8DsMlaLayout().write (or
    Fp8DsMlaFnuzLayout().write) writes. Sync-free; one program per row; a programmatic dependent where the GPU
    launches them (Target.pdl)."""
    import torch

    N = slots.shape[0]
    if rows.shape[-1] != NOPE_DIMS + ROPE_DIMS or pages.dtype != torch.uint8 or pages.dim() != 2:
        raise ValueError(f"write_fp8_ds_mla_kernel: rows {tuple(rows.shape)} / pages {tuple(pages.shape)} "
                         f"{pages.dtype} are not 512-dim rows and uint8 pages")
    if pages.shape[1] % 576 or pages.shape[1] < block_size * 584:
        raise ValueError(f"pages of {pages.shape[1]} bytes cannot hold {block_size} fp8_ds_mla records")
    if not N:
        return
    pages = pages if pages.is_contiguous() else pages.contiguous()
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    pdl = target_of(pages.device).pdl
    launch(_fp8_ds_mla_kernel, (N,), rows, rows.stride(0), as_i32(slots), pages, pages.view(torch.bfloat16),
           pages.view(torch.int64), pages.shape[1], pages.shape[0] * block_size, BS=block_size, FNUZ=fnuz,
           SOFT=SOFT_ROUND, PDL=pdl, launch_pdl=pdl, num_warps=num_warps)


@triton.jit
def _write_rows_kernel(rows_ptr, row_stride, slot_ptr, cache_ptr, n_slots, D, BLOCK: tl.constexpr, SOFT: tl.constexpr,
                       PDL: tl.constexpr = False):
    dependent_start(PDL)
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n)
    if (slot >= 0) & (slot < n_slots):
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < D
        x = tl.load(rows_ptr + n.to(tl.int64) * row_stride + cols, mask=m)
        dt = cache_ptr.dtype.element_ty
        if x.dtype != dt:
            x = round_to(widen(x, SOFT), dt, SOFT)
        tl.store(cache_ptr + slot.to(tl.int64) * D + cols, x, mask=m)


def write_rows_kernel(cache, slots, rows, *, num_warps: int = 4) -> None:
    """cache [num_blocks, B, D] float32 or bf16 (PlainRowLayout): row n, rounded to the cache's dtype, at
    flat slot slots[n] (-1: skip). Sync-free; a programmatic dependent where the GPU launches them (Target.pdl)."""
    N = slots.shape[0]
    D = cache.shape[-1]
    if rows.shape[-1] != D:
        raise ValueError(f"write_rows_kernel: rows of {rows.shape[-1]} dims for a cache of {D}")
    if not N:
        return
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    block = min(1024, next_pow2(D))
    pdl = target_of(cache.device).pdl
    launch(_write_rows_kernel, (N, cdiv(D, block)), rows, rows.stride(0), as_i32(slots), cache,
           cache.numel() // D, D, BLOCK=block, SOFT=SOFT_ROUND, PDL=pdl, launch_pdl=pdl, num_warps=num_warps)


@dataclass(frozen=True, slots=True)
class RowStore:
    """A cache as our row-making kernels (the SWA rows, the compressors' entries) store into it directly,
    with no row tensor in between: the kind of record and the views of its storage they write through.
    Made once per cache (PagedCache) by its layout's `access`."""
    kind: int                  # the cache's RowFormat.code (a RowCode)
    block_size: int
    data: Any                  # uint8 pages (fp8 and FP4 kinds) or the plain [pages, B, D] rows
    bf16: Any                  # fp8 kinds: the pages as bf16 (the RoPE dims); otherwise `data`
    words: Any                 # fp8 kinds: the pages as int64 (the exponent words); otherwise `data`
    page_stride: int           # fp8 and FP4 kinds: bytes per page; plain: 0
    num_slots: int
    dim: int                   # values per row

    def args(self) -> tuple:
        """The kernel arguments (cache_ptr, cache_bf_ptr, cache_w64_ptr, page_stride, n_slots)."""
        return self.data, self.bf16, self.words, self.page_stride, self.num_slots


def fp8_ds_mla_store(pages, block_size: int, *, fnuz: bool = False) -> RowStore:
    import torch

    code = RowCode.FP8_DS_MLA_FNUZ if fnuz else RowCode.FP8_DS_MLA
    return RowStore(kind=code.value, block_size=block_size, data=pages,
                    bf16=pages.view(torch.bfloat16), words=pages.view(torch.int64), page_stride=pages.shape[1],
                    num_slots=pages.shape[0] * block_size, dim=NOPE_DIMS + ROPE_DIMS)


def plain_rows_store(cache, block_size: int) -> RowStore:
    return RowStore(kind=RowCode.PLAIN.value, block_size=block_size, data=cache, bf16=cache, words=cache, page_stride=0,
                    num_slots=cache.numel() // cache.shape[-1], dim=cache.shape[-1])


def _key_records(kind: int, pages, block_size: int, dim: int) -> RowStore:
    """uint8 pages of indexer key records (one view: the kernels store bytes)."""
    return RowStore(kind=kind, block_size=block_size, data=pages, bf16=pages, words=pages,
                    page_stride=pages.shape[1], num_slots=pages.shape[0] * block_size, dim=dim)


def fp4_record_store(pages, block_size: int, dim: int) -> RowStore:
    return _key_records(RowCode.MXFP4.value, pages, block_size, dim)


def fp8_key_store(pages, block_size: int, dim: int) -> RowStore:
    return _key_records(RowCode.FP8_KEY.value, pages, block_size, dim)


def check_store(into, dim: int, *, fp4: bool = False) -> None:
    """Refuse a RowStore that cannot take rows of `dim` values (None: nothing to check), and an FP4 record
    store for rows that are not FP4-simulated (`fp4`: the kernel simulates FP4 on them first)."""
    if into is None:
        return
    if dim != into.dim:
        raise ValueError(f"a cache of {into.dim}-value rows ({RowCode(into.kind).name.lower()}) cannot store rows "
                         f"of {dim}")
    if into.kind == RowCode.MXFP4 and not fp4:
        raise ValueError("an mxfp4 key cache stores FP4-simulated rows only (the indexer's fp4 numerics)")


def row_outputs(who: str, into, faults, fault_row: int, T: int, D: int, device, *, fp4: bool = False):
    """What a row-making kernel writes, checked: into a RowStore `into` (nothing comes back), or rows
    [T, D] float32 and their slots [T] int32 for the cache's writer (`PagedCache.write`); and row `fault_row` of faults ([F, T]
    bool). -> (rows, store, the kernel's (out, store, cache_ptr, cache_bf_ptr, cache_w64_ptr, page_stride,
    n_slots) arguments, its KIND and BS constexprs); rows and store are None with `into`."""
    import torch

    if (faults.dim() != 2 or faults.shape[1] != T or faults.dtype != torch.bool or not faults.is_contiguous()
            or not 0 <= fault_row < faults.shape[0]):
        raise ValueError(f"{who}: faults must be a contiguous [F, {T}] bool tensor with row {fault_row}")
    check_store(into, D, fp4=fp4)
    if into is not None:                 # the out and store pointers are not written: any tensor will do
        return None, None, (faults, faults, *into.args()), into.kind, into.block_size
    rows = torch.empty(T, D, dtype=torch.float32, device=device)
    store = torch.empty(T, dtype=torch.int32, device=device)
    return rows, store, (rows, store, rows, rows, rows, 0, 0), RowCode.NONE.value, 1


# a row-making kernel's KIND with the types of the cache pointers it passes (cache_ptr, cache_bf_ptr,
# cache_w64_ptr), for the compile cases of the kernels that call `store_row`: rows handed back (float32),
# fp8_ds_mla records (OCP, FNUZ), plain bf16 rows, FP4 and fp8 key records
_RECORD_VIEWS = ("*u8", "*bf16", "*i64")
STORE_POINTERS = tuple((code.value, dict(zip(("cache_ptr", "cache_bf_ptr", "cache_w64_ptr"), views)))
                       for code, views in ((RowCode.NONE, ("*fp32",) * 3), (RowCode.FP8_DS_MLA, _RECORD_VIEWS),
                                           (RowCode.FP8_DS_MLA_FNUZ, _RECORD_VIEWS), (RowCode.PLAIN, ("*bf16",) * 3),
                                           (RowCode.MXFP4, ("*u8",) * 3), (RowCode.FP8_KEY, ("*u8",) * 3)))


def compile_cases(gpu) -> list[CompileCase]:
    """The cache writers as their wrappers launch them: fp8_ds_mla records from bf16 rows (OCP bytes on pages of
    64, FNUZ on pages of 3), plain float32 and bf16 rows; programmatic dependents where `gpu` launches them so."""
    pdl = gpu_launches_dependents(gpu)
    pages = {"rows_ptr": "*bf16", "slot_ptr": "*i32", "u8_ptr": "*u8", "bf_ptr": "*bf16", "w64_ptr": "*i64"}
    cases = [CompileCase(kernel=_fp8_ds_mla_kernel, constexprs=dict(BS=bs, FNUZ=fnuz, SOFT=False, PDL=pdl),
                         pointers=pages,
                         divisible=frozenset({"row_stride", "page_stride"}), num_warps=2)
             for bs, fnuz in ((64, False), (3, True))]
    return cases + [CompileCase(kernel=_write_rows_kernel, constexprs=dict(BLOCK=512, SOFT=False, PDL=pdl),
                                pointers={"rows_ptr": "*fp32", "slot_ptr": "*i32", "cache_ptr": name},
                                divisible=frozenset({"row_stride", "D"}))
                    for name in ("*fp32", "*bf16")]
