"""The compressor's two batched operations as Triton kernels (dsv4.components.compressor.Compressor is the
torch specification):

- `write_state_kernel`: the (a, s + APE) rows a later step reads, into the state pages;
- `close_kernel`: for each token that closes an entry, the softmax-pooled entry (rows of this step from
  the step's scores plus APE, earlier ones from the state pages), RMSNorm with the compressor's weight,
  RoPE at the entry's first position; float32 rows and a flag for entries that are not all finite.

One program per token (the grid depends on T only; tokens that close nothing write a zero row). A
closing program holds the entry's D channels and walks its coff·R pooled rows RB at a time, twice: the
per-channel maximum of the logits, then the sum of exp(s − max) and of a·exp(s − max) (torch's softmax
takes the same maximum; only the summation order differs). RMSNorm uses an IEEE square root and division.
"""
from __future__ import annotations

import triton
import triton.language as tl

# float32 bit patterns from here up (|x| >= 3.3961e38, inf, NaN) are not finite once rounded to bf16: the rows
# dsv4.components.front.stored_badly refuses to store
BF16_INF_FROM: tl.constexpr = tl.constexpr(0x7F7F8000)

from dsv4.kernels.layer_front import ROPE, ROPE_DIM, _rotate

RATIOS = {4: 2, 128: 1}            # ratio -> coff (ratio 4 pools two overlapping windows)
ROWS_PER_CHUNK = 8


@triton.jit
def _write_state_kernel(sc_ptr, sc_stride, ape_ptr, pos_ptr, slot_ptr, st_ptr, n_state, W,
                        R: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + t)
    if (slot >= 0) & (slot < n_state):
        m = cols < 2 * W
        v = tl.load(sc_ptr + t.to(tl.int64) * sc_stride + cols, mask=m)
        p = tl.load(pos_ptr + t)
        gate = (cols >= W) & m
        ape = tl.load(ape_ptr + (p % R) * W + (cols - W), mask=gate, other=0.0)
        tl.store(st_ptr + slot.to(tl.int64) * 2 * W + cols, tl.where(gate, v + ape, v), mask=m)


def write_state_kernel(scores, ape, positions, slots, state, *, ratio: int, num_warps: int = 4) -> None:
    """state[slots[t]] = [a_t | s_t + ape[positions[t] % ratio]] for every token t with slots[t] >= 0.

    scores [T, 2W] float32 ([a | s]; rows may be strided, a column slice of the score projection), ape
    [ratio, W] float32, positions/slots [T] int32, state [S, 2W] float32 (written in place). Sync-free."""
    T, W2 = scores.shape
    if W2 % 2 or state.shape[-1] != W2 or tuple(ape.shape) != (ratio, W2 // 2):
        raise ValueError(f"write_state_kernel: scores {tuple(scores.shape)}, ape {tuple(ape.shape)} and state "
                         f"{tuple(state.shape)} do not fit ratio {ratio}")
    if not T:
        return
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    block = min(1024, triton.next_power_of_2(W2))
    _write_state_kernel[(T, triton.cdiv(W2, block))](scores, scores.stride(0), ape.float().contiguous(),
                                                    positions.int().contiguous(), slots.int().contiguous(),
                                                    state, state.shape[0], W2 // 2, R=ratio, BLOCK=block,
                                                    num_warps=num_warps)


@triton.jit
def _pooled_rows(row0, t, pos, first, step0, req, sc_ptr, sc_stride, ape_ptr, pages_ptr, P, st_ptr, n_state, T,
                 R: tl.constexpr, D: tl.constexpr, COFF: tl.constexpr, SB: tl.constexpr, RB: tl.constexpr):
    """(a, s) [RB, D] of pooled rows row0..row0+RB-1 of the entry: row i is position
    first − (COFF−1)·R + i; at ratio 4 rows < R take the first half of their position's width-2D row (the
    previous block), the others the second half. A position in this step (>= step0) reads the step's
    scores row of its token plus APE; an earlier one the state row of its slot (slot −1, no page, reads
    row 0 as the torch path does); a position before 0 is absent (a = 0, s = −inf)."""
    W: tl.constexpr = COFF * D
    i = row0 + tl.arange(0, RB)
    q = first - (COFF - 1) * R + i
    qc = tl.maximum(q, 0)
    col = ((i >= R).to(tl.int32) * D)[:, None] + tl.arange(0, D)[None, :]     # ratio 128: i < R, half 0
    here = q >= step0
    past = (q >= 0) & ~here
    tq = tl.minimum(tl.maximum(t + (q - pos), 0), T - 1).to(tl.int64)       # the token at position q
    logical = qc // SB
    page = tl.load(pages_ptr + req * P + logical, mask=past & (logical < P), other=-1)
    slot = tl.where(page >= 0, page.to(tl.int64) * SB + qc % SB, 0)
    past = past & (slot < n_state)
    src = (tq * sc_stride)[:, None] + col
    a = tl.load(sc_ptr + src, mask=here[:, None], other=0.0)
    s = tl.load(sc_ptr + src + W, mask=here[:, None], other=0.0)
    s = s + tl.load(ape_ptr + (qc % R)[:, None] * W + col, mask=here[:, None], other=0.0)
    srow = (slot * 2 * W)[:, None] + col
    a = tl.where(here[:, None], a, tl.load(st_ptr + srow, mask=past[:, None], other=0.0))
    s = tl.where(here[:, None], s, tl.load(st_ptr + srow + W, mask=past[:, None], other=0.0))
    absent = (q < 0)[:, None]
    return tl.where(absent, 0.0, a), tl.where(absent, float("-inf"), s)


@triton.jit
def _close_kernel(sc_ptr, sc_stride, ape_ptr, norm_ptr, cos_ptr, sin_ptr, pos_ptr, start_ptr, req_ptr, close_ptr,
                  pages_ptr, P, st_ptr, n_state, out_ptr, bad_ptr, T, eps,
                  R: tl.constexpr, D: tl.constexpr, COFF: tl.constexpr, SB: tl.constexpr, RB: tl.constexpr):
    t = tl.program_id(0)
    dims = tl.arange(0, D)
    if tl.load(close_ptr + t) >= 0:
        pos = tl.load(pos_ptr + t)
        first = pos + 1 - R                                   # jR: the entry's first position
        step0 = tl.load(start_ptr + t)
        req = tl.load(req_ptr + t).to(tl.int64)
        rows = (t, pos, first, step0, req, sc_ptr, sc_stride, ape_ptr, pages_ptr, P, st_ptr, n_state, T)
        m = tl.full([D], float("-inf"), tl.float32)
        for r0 in range(0, COFF * R, RB):
            _, s = _pooled_rows(r0, *rows, R, D, COFF, SB, RB)
            m = tl.maximum(m, tl.max(s, 0))
        l = tl.zeros([D], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for r0 in range(0, COFF * R, RB):
            a, s = _pooled_rows(r0, *rows, R, D, COFF, SB, RB)
            e = tl.exp(s - m[None, :])
            l += tl.sum(e, 0)
            acc += tl.sum(a * e, 0)
        v = tl.div_rn(acc, l)
        ev, od = tl.split(tl.reshape(v, [D // 2, 2]))
        ms = (tl.sum(ev * ev, 0) + tl.sum(od * od, 0)) / D
        r = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
        w_ev, w_od = tl.split(tl.reshape(tl.load(norm_ptr + dims), [D // 2, 2]))
        ev, od = _rotate(ev * r * w_ev, od * r * w_od, cos_ptr + t * (ROPE // 2), sin_ptr + t * (ROPE // 2), D)
        y = tl.reshape(tl.join(ev, od), [D])
        tl.store(out_ptr + t.to(tl.int64) * D + dims, y)
        finite = (y.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) < BF16_INF_FROM     # finite once rounded to bf16
        tl.store(bad_ptr + t, tl.min(finite.to(tl.int32), 0) == 0)
    else:
        tl.store(out_ptr + t.to(tl.int64) * D + dims, tl.zeros([D], tl.float32))
        tl.store(bad_ptr + t, False)


def close_kernel(scores, ape, norm, cos, sin, positions, step_start, token_request, close_slots, state_pages, state,
                 *, ratio: int, head_dim: int, state_block: int, eps: float, num_warps: int = 4):
    """The entries closed in this step -> (rows [T, head_dim] float32, zero where a token closes none;
    bad [T] bool: a closed entry that is not all finite), as `Compressor.close` computes them.

    scores [T, 2·coff·head_dim] float32 ([a | s], no APE; rows may be strided), ape [ratio, coff·head_dim],
    norm [head_dim], cos/sin [T, 32] at each entry's first position, positions/step_start/close_slots [T]
    int32, token_request [T] int64, state_pages [B, P] int32 (the state table, rows of `state_block`), state
    [S, 2·coff·head_dim] float32. Sync-free; one program per token."""
    import torch

    if ratio not in RATIOS:
        raise ValueError(f"close_kernel: ratio {ratio} is not one of {sorted(RATIOS)}")
    coff, D = RATIOS[ratio], head_dim
    T = scores.shape[0]
    if D < ROPE_DIM or D & (D - 1) or scores.shape[1] != 2 * coff * D or state.shape[-1] != 2 * coff * D:
        raise ValueError(f"close_kernel: scores {tuple(scores.shape)} / state {tuple(state.shape)} do not hold "
                         f"ratio-{ratio} rows of head_dim {D} (a power of two >= {ROPE_DIM})")
    rows = torch.empty(T, D, dtype=torch.float32, device=scores.device)
    bad = torch.empty(T, dtype=torch.bool, device=scores.device)
    if not T:
        return rows, bad
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    pages = state_pages.int().contiguous()
    _close_kernel[(T,)](scores, scores.stride(0), ape.float().contiguous(), norm.float().contiguous(),
                        cos.float().contiguous(), sin.float().contiguous(), positions.int().contiguous(),
                        step_start.int().contiguous(), token_request.contiguous(), close_slots.int().contiguous(),
                        pages, pages.shape[1], state, state.shape[0], rows, bad, T, eps, R=ratio, D=D, COFF=coff,
                        SB=state_block, RB=ROWS_PER_CHUNK, num_warps=num_warps)
    return rows, bad
