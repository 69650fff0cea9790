"""Sparse MQA with attention sink in Triton, reading the paged cache in place (mqa_kernel=triton_sparse).

One program per (query token, block of heads, split of the index columns). It walks the token's SWA
list, then its compressed-cache list, BLOCK_N slots at a time: gathers the named rows, decodes them
to bf16 in registers, and runs an online softmax (log2 domain) with tensor-core dots for Q·Kᵀ and
P·V (V = K). With one split the program finishes the softmax itself, sink in the denominator;
otherwise it writes its unnormalized partial (acc, max, sum) and `_combine` merges the splits.

Row decoding (DSV4_SPEC §3.2): on GPUs that convert OCP e4m3 in hardware (NVIDIA sm89+) the bytes go
through that conversion; everywhere else (FNUZ bytes, A100, AMD) it is integer arithmetic, which needs
no fp8 hardware: an e4m3 byte's 7 magnitude bits shifted left by 7, with its sign moved to bit 15, are
an fp16 whose value is the e4m3 value times 2^-8 (OCP, bias 7) or 2^-7 (FNUZ, bias 8), subnormals
included; that factor goes into the tile's power-of-two scale 2^(E-127). Either way the value is a
4-bit mantissa times a power of two, so its bf16 rounding is exact.

Under TRITON_INTERPRET=1 (CPU tests) the dots take the same bf16-rounded operands widened to float32:
the interpreter's bf16 `tl.dot` returns garbage (Triton 3.6-3.9 with NumPy 2), its float32 one is exact.
"""
from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# how a cache's rows are stored (its layout's kv_row_dtype): bf16 rows, fp8_ds_mla records with OCP or
# FNUZ e4m3 NoPE bytes
LAYOUT_CODES = {"bfloat16": 0, "fp8_ds_mla": 1, "fp8_ds_mla_fnuz": 2}


@triton.jit
def _rows(u8, bf, slots, ok, block_size, page_stride, LAYOUT: tl.constexpr, D: tl.constexpr,
          NATIVE: tl.constexpr):
    """The rows at `slots` [BN] as bf16 [BN, D] (zeros where not `ok`). NATIVE: OCP e4m3 bytes through
    the hardware conversion (sm89+); otherwise the integer decoding above."""
    d = tl.arange(0, D)
    if LAYOUT == 0:
        return tl.load(bf + slots.to(tl.int64)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    NOPE: tl.constexpr = D - 64
    slot = tl.where(ok, slots, 0).to(tl.int64)
    page = slot // block_size
    t = slot - page * block_size
    base = page * page_stride + t * (NOPE + 128)                  # 576 data bytes per row
    scl = page * page_stride + block_size * (NOPE + 128) + t * 8  # then 8 scale bytes per row
    nope = (d < NOPE)[None, :] & ok[:, None]
    byte = tl.load(u8 + base[:, None] + d[None, :], mask=nope, other=0)
    if NATIVE and LAYOUT == 1:
        fix: tl.constexpr = 0
        value = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        fix: tl.constexpr = 8 if LAYOUT == 1 else 7               # the fp16 view's 2^-8 / 2^-7
        b16 = byte.to(tl.uint16)
        value = (((b16 & 0x7F) << 7) | ((b16 & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    # a row's 8 scale bytes loaded once, made powers of two, each widened over its 64 dims (the 8th, a
    # zero pad, over RoPE)
    e8 = tl.load(u8 + scl[:, None] + tl.arange(0, 8)[None, :], mask=ok[:, None], other=0).to(tl.int32)
    s8 = ((e8 + fix) << 23).to(tl.float32, bitcast=True)
    scale = tl.reshape(tl.broadcast_to(s8[:, :, None], [s8.shape[0], 8, 64]), [s8.shape[0], D])
    rope = tl.load(bf + ((base + NOPE) // 2)[:, None] + (d - NOPE)[None, :],
                   mask=(d >= NOPE)[None, :] & ok[:, None], other=0.0)
    return tl.where((d < NOPE)[None, :], value * scale, rope.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _attend(q, m, l, acc, idx_ptr, lo, hi, num_slots, u8, bf, block_size, page_stride, qk_scale,
            LAYOUT: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr,
            NATIVE: tl.constexpr):
    """Online softmax over index columns [lo, hi) of one token's list."""
    for c in range(lo, hi, BN):
        cols = c + tl.arange(0, BN)
        slots = tl.load(idx_ptr + cols, mask=cols < hi, other=-1)
        ok = (cols < hi) & (slots >= 0) & (slots < num_slots)
        k = _rows(u8, bf, slots, ok, block_size, page_stride, LAYOUT, D, NATIVE).to(DOT)
        s = tl.dot(q, tl.trans(k)) * qk_scale                    # log2 domain
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16).to(DOT), k)
        m = m_new
    return m, l, acc


@triton.jit
def _finish(acc, m, l, sink_l2, out_ptrs, lse_ptrs, hmask):
    """Sink in the denominator; a head with no valid row gets 0 and lse = +inf."""
    has = l > 0
    m_use = tl.where(has, m, 0.0)
    denom = tl.where(has, l + tl.exp2(sink_l2 - m_use), 1.0)
    out = tl.where(has[:, None], acc / denom[:, None], 0.0)
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=hmask[:, None])
    tl.store(lse_ptrs, tl.where(has, (m_use + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453,
                                float("inf")), mask=hmask)


@triton.jit
def _sparse_mqa_kernel(q_ptr, sink_ptr, out_ptr, lse_ptr, po_ptr, pml_ptr,
                       s_u8, s_bf, s_idx, s_len, s_w, s_bs, s_stride, s_slots,
                       e_u8, e_bf, e_idx, e_len, e_w, e_bs, e_stride, e_slots,
                       H, chunk, qk_scale, n_splits,
                       S_LAYOUT: tl.constexpr, E_LAYOUT: tl.constexpr, HAS_EXTRA: tl.constexpr, SPLIT: tl.constexpr,
                       BH: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr,
                       NATIVE: tl.constexpr):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    split = tl.program_id(2)
    hmask = heads < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (t.to(tl.int64) * H + heads)[:, None] * D + d[None, :], mask=hmask[:, None],
                other=0.0).to(tl.bfloat16).to(DOT)
    m = tl.full([BH], float("-inf"), tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    c0 = split * chunk
    c1 = c0 + chunk
    n_swa = tl.minimum(tl.load(s_len + t), s_w)
    m, l, acc = _attend(q, m, l, acc, s_idx + t.to(tl.int64) * s_w, c0, tl.minimum(c1, n_swa), s_slots,
                        s_u8, s_bf, s_bs, s_stride, qk_scale, S_LAYOUT, BN, D, DOT, NATIVE)
    if HAS_EXTRA:
        n_ext = tl.minimum(tl.load(e_len + t), e_w)
        m, l, acc = _attend(q, m, l, acc, e_idx + t.to(tl.int64) * e_w, tl.maximum(c0 - s_w, 0),
                            tl.minimum(c1 - s_w, n_ext), e_slots, e_u8, e_bf, e_bs, e_stride, qk_scale,
                            E_LAYOUT, BN, D, DOT, NATIVE)
    if not SPLIT:
        sink_l2 = tl.load(sink_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634
        row = t.to(tl.int64) * H + heads
        _finish(acc, m, l, sink_l2, out_ptr + row[:, None] * D + d[None, :], lse_ptr + row, hmask)
    else:
        prow = (t.to(tl.int64) * n_splits + split) * H + heads
        tl.store(po_ptr + prow[:, None] * D + d[None, :], acc, mask=hmask[:, None])
        tl.store(pml_ptr + prow * 2, m, mask=hmask)
        tl.store(pml_ptr + prow * 2 + 1, l, mask=hmask)


@triton.jit
def _combine(po_ptr, pml_ptr, sink_ptr, out_ptr, lse_ptr, H, n_splits, BH: tl.constexpr, D: tl.constexpr):
    """Merge the splits' partials of one token and block of heads."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    d = tl.arange(0, D)
    M = tl.full([BH], float("-inf"), tl.float32)
    for s in range(0, n_splits):
        M = tl.maximum(M, tl.load(pml_ptr + ((t.to(tl.int64) * n_splits + s) * H + heads) * 2, mask=hmask,
                                  other=float("-inf")))
    M_use = tl.where(M == float("-inf"), 0.0, M)
    L = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    for s in range(0, n_splits):
        prow = (t.to(tl.int64) * n_splits + s) * H + heads
        w = tl.exp2(tl.load(pml_ptr + prow * 2, mask=hmask, other=float("-inf")) - M_use)
        L += w * tl.load(pml_ptr + prow * 2 + 1, mask=hmask, other=0.0)
        acc += w[:, None] * tl.load(po_ptr + prow[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0)
    sink_l2 = tl.load(sink_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634
    row = t.to(tl.int64) * H + heads
    _finish(acc, M, L, sink_l2, out_ptr + row[:, None] * D + d[None, :], lse_ptr + row, hmask)


@functools.lru_cache(maxsize=None)
def native_e4m3(device) -> bool:
    """Whether `device` converts OCP e4m3 in hardware (NVIDIA sm89 and newer; not ROCm's FNUZ-only gfx942)."""
    import torch

    if device.type != "cuda" or getattr(torch.version, "hip", None):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.lru_cache(maxsize=None)
def _processors(device) -> int:
    import torch

    if device.type == "cpu":
        return 4                                  # the interpreter: any small number exercises splitting
    return torch.cuda.get_device_properties(device).multi_processor_count


def pool_args(cache) -> tuple:
    """(layout code, uint8 view, bf16 view, block_size, page stride in bytes, num_slots) of a PagedCache."""
    import torch

    row = cache.layout.kv_row_dtype
    if row not in LAYOUT_CODES:
        raise ValueError(f"mqa_kernel=triton_sparse reads {', '.join(LAYOUT_CODES)} rows, not {row} "
                         f"(cache {cache.name}); check() refuses this combination")
    code, data = LAYOUT_CODES[row], cache.data
    if code == 0:
        return code, data, data, cache.block_size, 0, cache.num_slots
    return code, data, data.view(torch.bfloat16), cache.block_size, data.stride(0), cache.num_slots


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_columns(columns: int, splits: int, block_n: int) -> tuple[int, int]:
    """(splits, columns per split) for about `splits` splits of whole blocks of rows."""
    chunk = max(1, _cdiv(_cdiv(columns, max(1, splits)), block_n)) * block_n
    return max(1, _cdiv(columns, chunk)), chunk


def head_block(tokens: int, heads: int, processors: int) -> int:
    """Heads per program: up to 64 (one pass over a token's rows serves them all); 16 when that leaves
    processors idle (each program then holds a quarter of the accumulator and spills less)."""
    full = min(64, max(16, triton.next_power_of_2(heads)))
    return full if tokens * _cdiv(heads, full) >= processors else 16


def plan_splits(tokens: int, head_blocks: int, columns: int, block_n: int, processors: int) -> tuple[int, int]:
    """Split the index columns when tokens x head blocks alone leave processors idle: aim at ~2 programs
    per processor, each walking at least 2 blocks of rows."""
    want = _cdiv(2 * processors, max(tokens * head_blocks, 1))
    return split_columns(columns, min(want, _cdiv(columns, 2 * block_n)), block_n)


def sparse_mqa(q, sink, scale: float, swa: tuple, swa_idx, swa_len, extra: tuple | None = None, extra_idx=None,
               extra_len=None, *, block_n: int = 64, block_h: int = 0,
               num_warps: int = 8, num_stages: int = 1, splits: int | None = None, native_fp8: bool | None = None):
    """q [T, H, D] -> (out [T, H, D] in q's dtype, lse [T, H] float32, natural log, sink excluded).

    `swa`/`extra` are `pool_args(...)`; index lists [T, W] int32 with -1 padding and lengths [T].
    `native_fp8`: decode OCP e4m3 with the hardware conversion; None = where the GPU has it (NVIDIA sm89+)."""
    import torch

    T, H, D = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    procs = _processors(q.device)
    BH = block_h or head_block(T, H, procs)
    hb = _cdiv(H, BH)
    sw = swa_idx.shape[1]
    ew = extra_idx.shape[1] if extra is not None else 0
    n_split, chunk = (plan_splits(T, hb, sw + ew, block_n, procs) if splits is None
                      else split_columns(sw + ew, splits, block_n))
    po = torch.empty(T * n_split * H * D if n_split > 1 else 1, dtype=torch.float32, device=q.device)
    pml = torch.empty(T * n_split * H * 2 if n_split > 1 else 1, dtype=torch.float32, device=q.device)
    sink = sink.float().contiguous()
    s_idx, s_len = swa_idx.int().contiguous(), swa_len.int().contiguous()
    e, e_idx, e_len = (extra, extra_idx.int().contiguous(), extra_len.int().contiguous()) if extra is not None \
        else (swa, s_idx, s_len)                   # no extra cache: never read (HAS_EXTRA=False)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    _sparse_mqa_kernel[(T, hb, n_split)](
        q, sink, out, lse, po, pml, *swa[1:3], s_idx, s_len, sw, *swa[3:], *e[1:3], e_idx, e_len, ew, *e[3:],
        H, chunk, scale * LOG2E, n_split,
        S_LAYOUT=swa[0], E_LAYOUT=e[0], HAS_EXTRA=extra is not None, SPLIT=n_split > 1, BH=BH, BN=block_n, D=D,
        NATIVE=native_e4m3(q.device) if native_fp8 is None else native_fp8,
        DOT=tl.float32 if interpret else tl.bfloat16, num_warps=num_warps, num_stages=num_stages)
    if n_split > 1:
        _combine[(T, hb)](po, pml, sink, out, lse, H, n_split, BH=BH, D=D, num_warps=4)
    return out, lse
