"""The compressor's step as one Triton kernel (dsv4.components.compressor.Compressor is the torch
specification) -- a ratio-4 layer's two compressors, its own and its indexer's, in one launch
(`compress_kernels`) -- for every token of the step, in one program per compressor,

- the (a, s + APE) row a later step reads goes to the state pages (the plan's `state[R].write_slots`);
- if the token closes an entry: the softmax-pooled entry (rows of this step from the step's scores plus
  APE, earlier ones from the state pages), rounded to the activation dtype, RMSNorm with the compressor's
  weight, rounded again, RoPE at the entry's first position -- a float32 row, the slot to store it at (-1
  if it is not all finite) and its fault flag.

The two parts touch different rows: a step writes state rows only at its own new positions, and pooling
reads this step's positions from the scores, never from the state pages, so one pass does both. A
closing program holds the entry's D channels and walks its coff·R pooled rows RB at a time, twice: the
per-channel maximum of the logits, then the sum of exp(s − max) and of a·exp(s − max) (torch's softmax
takes the same maximum; only the summation order differs). RMSNorm uses an IEEE square root and division.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

from dsv4.formats.row_format import RowCode
from dsv4.kernels.launch import CompileCase, as_dense, as_f32, as_i32, dependent_start, launch, rows_dense
from dsv4.kernels.target import gpu_launches_dependents, target_of
from dsv4.values.layer_types import LAYER_TYPES
from dsv4.values.sizes import next_pow2
from dsv4.kernels.front.cache_write import NO_CACHE, STORE_POINTERS, row_outputs, store_row
from dsv4.kernels.indexer.hadamard_fp4 import FP4_MAX_DIM, fp4_sim
from dsv4.kernels.front.layer_front import ROPE, ROPE_DIM, _rotate
from dsv4.kernels.rounding import BF16_INF_FROM, SOFT_ROUND, TL_DTYPES, round_to, widen

RATIOS = {t.ratio: t.coff for t in LAYER_TYPES if t.compressed}      # ratio -> coff (dsv4/values/layer_types.py)
ROWS_PER_CHUNK = 8


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
def _compress_rows(t, sc_ptr, sc_stride, ape_ptr, norm_ptr, cos_ptr, sin_ptr, pos_ptr, start_ptr, req_ptr, keep_ptr,
                   close_ptr, pages_ptr, P, st_ptr, n_state, out_ptr, store_ptr, faults_ptr, fault_row, T, eps,
                   cache_ptr, cache_bf_ptr, cache_w64_ptr, page_stride, n_slots, R: tl.constexpr, D: tl.constexpr,
                   COFF: tl.constexpr, SB: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr,
                   BS: tl.constexpr, SOFT: tl.constexpr, FP4: tl.constexpr, DTYPE: tl.constexpr):
    """One compressor's step for token t; FP4: its entries then take the indexer's published numerics
    (dsv4/kernels/indexer/hadamard_fp4.py), as the indexer's keys. The pooled value and the norm's output are rounded to
    DTYPE (the activation dtype)."""
    dims = tl.arange(0, D)
    W: tl.constexpr = COFF * D
    pos = tl.load(pos_ptr + t)
    keep = tl.load(keep_ptr + t)                               # the state row a later step reads
    if (keep >= 0) & (keep < n_state):
        for c0 in tl.static_range(0, 2 * W, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < 2 * W
            v = tl.load(sc_ptr + t.to(tl.int64) * sc_stride + cols, mask=m)
            gate = (cols >= W) & m
            ape = tl.load(ape_ptr + (pos % R) * W + (cols - W), mask=gate, other=0.0)
            tl.store(st_ptr + keep.to(tl.int64) * 2 * W + cols, tl.where(gate, v + ape, v), mask=m)
    close = tl.load(close_ptr + t)
    if close >= 0:
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
        v = widen(round_to(tl.div_rn(acc, l), DTYPE, SOFT), SOFT)
        ev, od = tl.split(tl.reshape(v, [D // 2, 2]))
        ms = (tl.sum(ev * ev, 0) + tl.sum(od * od, 0)) / D
        r = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
        w_ev, w_od = tl.split(tl.reshape(tl.load(norm_ptr + dims), [D // 2, 2]))
        ev = widen(round_to(ev * r * w_ev, DTYPE, SOFT), SOFT)
        od = widen(round_to(od * r * w_od, DTYPE, SOFT), SOFT)
        ev, od = _rotate(ev, od, cos_ptr + t * (ROPE // 2), sin_ptr + t * (ROPE // 2), D)
        y = tl.reshape(tl.join(ev, od), [D])
        finite = (y.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) < BF16_INF_FROM     # finite once rounded to bf16
        bad = tl.min(finite.to(tl.int32), 0) == 0
        if FP4:                       # after the check, as the torch path (its max would drop a NaN)
            y = tl.reshape(fp4_sim(tl.reshape(y, [1, D]), 1, D, SOFT), [D])
        if KIND == NO_CACHE:                                   # the entry and its slot, for the layout's write
            tl.store(out_ptr + t.to(tl.int64) * D + dims, y)
            tl.store(store_ptr + t, tl.where(bad, -1, close))
        else:                                                  # stored here (RowStore)
            store_row(y, close, ~bad, cache_ptr, cache_bf_ptr, cache_w64_ptr, page_stride, n_slots, D, BS, KIND, SOFT)
        tl.store(faults_ptr + fault_row * T + t, bad)
    else:
        if KIND == NO_CACHE:
            tl.store(out_ptr + t.to(tl.int64) * D + dims, tl.zeros([D], tl.float32))
            tl.store(store_ptr + t, -1)
        tl.store(faults_ptr + fault_row * T + t, False)


@triton.jit(do_not_specialize=["T"])     # step sizes: one variant for all
def _compress_kernel(cos_ptr, sin_ptr, pos_ptr, start_ptr, req_ptr, keep_ptr, close_ptr, pages_ptr, P, faults_ptr, T,
                     eps, sc_ptr, sc_stride, ape_ptr, norm_ptr, st_ptr, n_state, out_ptr, store_ptr, fault_row,
                     cache_ptr, cache_bf_ptr, cache_w64_ptr, page_stride, n_slots,
                     sc2_ptr, sc2_stride, ape2_ptr, norm2_ptr, st2_ptr, n_state2, out2_ptr, store2_ptr, fault_row2,
                     cache2_ptr, cache2_bf_ptr, cache2_w64_ptr, page_stride2, n_slots2,
                     R: tl.constexpr, COFF: tl.constexpr, SB: tl.constexpr, RB: tl.constexpr, SOFT: tl.constexpr,
                     D: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr, BS: tl.constexpr,
                     D2: tl.constexpr, BLOCK2: tl.constexpr, KIND2: tl.constexpr, BS2: tl.constexpr,
                     FP4: tl.constexpr, FP4_2: tl.constexpr, JOBS: tl.constexpr, DTYPE: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Programs 0..T-1: the first compressor's step per token; with JOBS == 2 the next T: the second's."""
    dependent_start(PDL)
    pid = tl.program_id(0)
    if pid < T:
        _compress_rows(pid, sc_ptr, sc_stride, ape_ptr, norm_ptr, cos_ptr, sin_ptr, pos_ptr, start_ptr, req_ptr,
                       keep_ptr, close_ptr, pages_ptr, P, st_ptr, n_state, out_ptr, store_ptr, faults_ptr, fault_row,
                       T, eps, cache_ptr, cache_bf_ptr, cache_w64_ptr, page_stride, n_slots, R, D, COFF, SB, RB,
                       BLOCK, KIND, BS, SOFT, FP4, DTYPE)
    elif JOBS == 2:
        _compress_rows(pid - T, sc2_ptr, sc2_stride, ape2_ptr, norm2_ptr, cos_ptr, sin_ptr, pos_ptr, start_ptr,
                       req_ptr, keep_ptr, close_ptr, pages_ptr, P, st2_ptr, n_state2, out2_ptr, store2_ptr,
                       faults_ptr, fault_row2, T, eps, cache2_ptr, cache2_bf_ptr, cache2_w64_ptr, page_stride2,
                       n_slots2, R, D2, COFF, SB, RB, BLOCK2, KIND2, BS2, SOFT, FP4_2, DTYPE)


@dataclass(frozen=True, slots=True, kw_only=True)
class CompressJob:
    """One compressor's part of a compress launch: its scores [T, 2·coff·head_dim] float32 ([a | s], no
    APE; rows may be strided), ape [ratio, coff·head_dim], norm [head_dim], its state rows [S,
    2·coff·head_dim] float32 (written in place), the faults row it sets and where its entries go (`into`, a
    RowStore, or None: returned), and whether its entries take the indexer's FP4 numerics (`fp4`)."""
    scores: Any
    ape: Any
    norm: Any
    state: Any
    head_dim: int
    fault_row: int
    into: Any = None
    fp4: bool = False


def compress_kernel(scores, ape, norm, cos, sin, positions, step_start, token_request, keep_slots, close_slots,
                    state_pages, state, faults, fault_row: int, *, ratio: int, head_dim: int, state_block: int,
                    eps: float, into=None, dtype=None, num_warps: int = 4):
    """The compressor's step: `Compressor.write_state` then `Compressor.close`, in one launch. Each closed
    entry is stored into `into` (a cache's RowStore) at its slot from `close_slots`, unless it is not all
    finite; without `into` -> (rows [T, head_dim] float32, the entry each token closes, zero where it
    closes none; store [T] int32: its slot, -1 where it closes none or the entry is refused) for the
    cache's writer. faults[fault_row] is set where a closed entry is refused.

    scores, ape, norm, state as CompressJob's; cos/sin [T, 32] at each entry's first position,
    positions/step_start/keep_slots/close_slots [T] int32, token_request [T] int64, state_pages [B, P] int32
    (the state table, rows of `state_block`), faults [F, T] bool; `dtype` the activation dtype (float32 if
    None). Sync-free; one program per token, a programmatic dependent where the GPU launches them
    (Target.pdl)."""
    job = CompressJob(scores=scores, ape=ape, norm=norm, state=state, head_dim=head_dim, fault_row=fault_row,
                      into=into)
    return compress_kernels((job,), cos, sin, positions, step_start, token_request, keep_slots, close_slots,
                            state_pages, faults, ratio=ratio, state_block=state_block, eps=eps, dtype=dtype,
                            num_warps=num_warps)[0]


def compress_kernels(jobs, cos, sin, positions, step_start, token_request, keep_slots, close_slots, state_pages,
                     faults, *, ratio: int, state_block: int, eps: float, dtype=None, num_warps: int = 4) -> list:
    """`compress_kernel` for one or two compressors of one ratio over the same step (a ratio-4 layer's and
    its indexer's), in one launch: what each returns, in the order of `jobs`."""
    if ratio not in RATIOS:
        raise ValueError(f"compress_kernel: ratio {ratio} is not one of {sorted(RATIOS)}")
    if not 1 <= len(jobs) <= 2:
        raise ValueError(f"compress_kernels: one or two compressors a launch, not {len(jobs)}")
    if len({job.fault_row for job in jobs}) != len(jobs):
        raise ValueError("compress_kernels: the compressors of one launch need faults rows of their own")
    coff = RATIOS[ratio]
    T = jobs[0].scores.shape[0]
    parts, results = [], []
    for job in jobs:
        D = job.head_dim
        if (D < ROPE_DIM or D & (D - 1) or job.scores.shape != (T, 2 * coff * D)
                or job.state.shape[-1] != 2 * coff * D):
            raise ValueError(f"compress_kernel: scores {tuple(job.scores.shape)} / state {tuple(job.state.shape)} do "
                             f"not hold ratio-{ratio} rows of head_dim {D} (a power of two >= {ROPE_DIM}) for {T} "
                             f"tokens")
        if tuple(job.ape.shape) != (ratio, coff * D):
            raise ValueError(f"compress_kernel: ape {tuple(job.ape.shape)} is not [{ratio}, {coff * D}]")
        if job.fp4 and D > FP4_MAX_DIM:
            raise ValueError(f"compress_kernel: FP4 numerics on rows of {D} dims (a power of two, 32 to "
                             f"{FP4_MAX_DIM})")
        rows, store, (out, st, *cache), kind, bs = row_outputs("compress_kernel", job.into, faults, job.fault_row, T,
                                                              D, job.scores.device, fp4=job.fp4)
        results.append(None if job.into is not None else (rows, store))
        sc = rows_dense(job.scores)
        parts.append(((sc, sc.stride(0), as_f32(job.ape), as_f32(job.norm), job.state, job.state.shape[0], out, st,
                       job.fault_row, *cache), (D, min(1024, next_pow2(2 * coff * D)), kind, bs, job.fp4)))
    if T:
        pages = as_i32(state_pages)
        (args, const), (args2, const2) = parts[0], parts[-1]       # one job: the second's arguments unused
        pdl = target_of(faults.device).pdl
        launch(_compress_kernel, (len(jobs) * T,), as_f32(cos), as_f32(sin), as_i32(positions), as_i32(step_start),
               as_dense(token_request), as_i32(keep_slots), as_i32(close_slots), pages, pages.shape[1], faults, T, eps,
               *args, *args2, R=ratio, COFF=coff, SB=state_block, RB=ROWS_PER_CHUNK, SOFT=SOFT_ROUND,
               D=const[0], BLOCK=const[1], KIND=const[2], BS=const[3], D2=const2[0], BLOCK2=const2[1],
               KIND2=const2[2], BS2=const2[3], FP4=const[4], FP4_2=const2[4], JOBS=len(jobs),
               DTYPE=TL_DTYPES[str(dtype)] if dtype is not None else tl.float32, PDL=pdl, launch_pdl=pdl,
               num_warps=num_warps)
    return results


def _job_case(n: str, dim: int, coff: int, kind: int, cache: dict) -> tuple[dict, dict]:
    """One compressor's constexprs and pointer types in the compress kernel (n: '' for the first, '2')."""
    ptrs = {f"{k}{n}_ptr": "*fp32" for k in ("sc", "ape", "norm", "st", "out")}
    ptrs |= {f"store{n}_ptr": "*i32", **{k.replace("cache", f"cache{n}"): v for k, v in cache.items()}}
    return {f"D{n}": dim, f"BLOCK{n}": min(1024, 2 * coff * dim), f"KIND{n}": kind, f"BS{n}": 64}, ptrs


def compile_cases(gpu) -> list[CompileCase]:
    """The compress kernel as compress_kernels launches it (a programmatic dependent where `gpu` launches them so):
    ratios 4 (head_dim 512 and the indexer's 128) and 128; entries handed back, stored as fp8_ds_mla records
    (OCP, FNUZ) or plain rows, the indexer's keys also as mxfp4 and fp8 records (FP4 numerics); one compressor a
    launch, or a layer's and its indexer's; bf16 activations (the first case also float32)."""
    stores = dict(STORE_POINTERS)
    main = [(k.value, stores[k]) for k in (RowCode.NONE, RowCode.FP8_DS_MLA, RowCode.FP8_DS_MLA_FNUZ)]
    # the indexer's keys: plain rows (exact or fp4_sim numerics), mxfp4 or fp8 records (FP4 numerics)
    plain = [(k.value, stores[k]) for k in (RowCode.NONE, RowCode.PLAIN)]
    keys = [(k, c, False) for k, c in plain] + [(k, c, True) for k, c in plain[1:]]
    keys += [(k.value, stores[k], True) for k in (RowCode.MXFP4, RowCode.FP8_KEY)]
    pairs = [((4, 512, k, c, False), None) for k, c in main[:2]]
    pairs += [((4, 128, k, c, fp4), None) for k, c, fp4 in keys]
    pairs += [((128, 512, k, c, False), None) for k, c in main]
    pairs += [((4, 512, k, c, False), (128, k2, c2, fp4)) for k, c in main[1:2] for k2, c2, fp4 in keys]
    common = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i32", "start_ptr": "*i32", "req_ptr": "*i64",
              "keep_ptr": "*i32", "close_ptr": "*i32", "pages_ptr": "*i32", "faults_ptr": "*i1"}
    cases, pdl = [], gpu_launches_dependents(gpu)
    for i, ((ratio, dim, kind, cache, fp4), second) in enumerate(pairs):
        coff = RATIOS[ratio]
        const, ptrs = _job_case("", dim, coff, kind, cache)
        dim2, kind2, cache2, fp4_2 = (dim, kind, cache, fp4) if second is None else second
        const2, ptrs2 = _job_case("2", dim2, coff, kind2, cache2)
        for dt in (tl.bfloat16, tl.float32) if i == 0 else (tl.bfloat16,):
            cases.append(CompileCase(kernel=_compress_kernel, constexprs=dict(
                R=ratio, COFF=coff, SB=64, RB=ROWS_PER_CHUNK, SOFT=False, JOBS=1 if second is None else 2, FP4=fp4,
                FP4_2=fp4_2, DTYPE=dt, PDL=pdl, **const, **const2), pointers={**common, **ptrs, **ptrs2},
                floats=frozenset({"eps"}), divisible=frozenset({"sc_stride", "sc2_stride"})))
    return cases
