"""The lightning indexer's scores as one Triton kernel (dsv4.components.indexer.Indexer.scores is the torch
specification): out[t, j] = Σ_h w[t,h] · ReLU(q[t,h] · k_j) for the entries j < counts[t] of token t's
request, −inf for j >= counts[t].

A program takes TG consecutive tokens and NBLK blocks of BN entries. Consecutive tokens nearly always
belong to one request (decode: a request's 2 tokens; prefill: one request), so their TG·Hi query rows are
one operand, loaded once, and each block of BN keys is gathered once through the request's page table
for all of them: one tensor-core product keys [BN, Di] x queriesᵀ [Di, TG·Hi] per block, then ReLU, the
head weights and the sum over heads (keys as the M operand: the sum runs along the accumulator's rows,
within warps). A group whose tokens span two requests (rare: a request with an odd number of tokens)
makes one product per token, each with its own request's keys. Blocks at or past the group's largest
count load nothing and compute nothing; they only write −inf.

Precision follows the keys' dtype (the indexer option's `key_layout`). bf16 keys, and FP4 records
(decoded to their bf16 values as they are read): the queries are rounded to bf16 and scored by one bf16
product accumulated in float32, as the published code scores its bf16 cache. fp8 records: e4m3 queries,
each head over its power-of-two scale (`key_layouts.fp8_queries`), times the records' e4m3 bytes as they
are stored -- one e4m3 tensor-core product, at twice bf16's rate, where Triton has e4m3 (NVIDIA sm89+),
else both decoded to their bf16 values (exact) -- then each key's scale on its head sum. For
FP4-simulated queries and keys both operands hold the values exactly and the products are exact; on the
H200 the e4m3 product's sums equalled the bf16 product's bit for bit (docs/notes/2026-12-02-indexer-scores.md).
float32 keys: the scores feed a top-k that is compared with a float32 oracle, so the products must be
float32-accurate.
INPUT_PRECISION["cuda"] = "tf32x3" splits each float32 operand into a tf32 head and a tf32 tail and sums three
tensor-core products (error ~2^-21 relative, about float32's); plain "tf32" (10-bit mantissas) would reorder
near-ties of the top-k, and "ieee" runs on the CUDA cores, far slower. The split is done here rather than by
tl.dot's "tf32x3" so that the queries are split once per program, not once per block, the two small products
accumulated before the large one, as Triton orders them (the tensor cores' float32 accumulation drops low bits of
small addends to a large sum). The measurements: docs/notes/2026-12-02-indexer-scores.md. AMD's Triton
has no tf32x3; "bf16x6" (three bf16 pieces per operand, six products) is its float32-accurate
tensor-core product. Under TRITON_INTERPRET=1 the products are NumPy's float32 matmuls; its dot of bf16
operands multiplies their uint16 bits, so there bf16 operands are widened to float32 first (the products of
bf16 values are exact in float32: the same scores).
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from dsv4.formats.row_format import FP8_KEYS, MXFP4_KEYS, RowCode
from dsv4.kernels.launch import CompileCase, as_dense, as_i32, dependent_start, launch, rows_dense
from dsv4.kernels.target import E4M3_SM, Target, arch_at_least, gpu_launches_dependents, target_of
from dsv4.values.sizes import cdiv, next_pow2

INPUT_PRECISION = {"cuda": "tf32x3", "hip": "bf16x6"}        # per Triton backend, see above
RECORDS = (MXFP4_KEYS, FP8_KEYS)          # uint8 key pages: RECORD is the layout's row_format.code
# the row codes the kernel branches on: plain float32 or bf16 keys, fp8 records (the other: FP4 records)
PLAIN, FP8_RECORD = tl.constexpr(RowCode.PLAIN.value), tl.constexpr(RowCode.FP8_KEY.value)
TOKENS_PER_PROGRAM = 2          # TG: a decode request's two tokens (MTP) share each key block


@dataclass(frozen=True, slots=True)
class Launch:
    block_n: int                # BN: entries per block
    blocks: int                 # NBLK: blocks per program
    num_warps: int
    stages: int                 # software-pipelining depth of the one-request loop


# H200, 64 heads of 128 dims, by the keys' dtype and the step's size (bench/tune_indexer.py; decode: 64
# requests x 2 tokens at 8k and 64k contexts; prefill: 8k tokens of one request, 2k entries, float32 keys)
LAUNCH = {("float32", "decode"): Launch(128, 8, 8, 3), ("bfloat16", "decode"): Launch(128, 4, 4, 2),
          ("float32", "prefill"): Launch(128, 16, 8, 1), ("bfloat16", "prefill"): Launch(128, 16, 8, 1)}
PREFILL_TOKENS = 1024           # steps of at least this many tokens take the prefill shape


def pipelined(target: Target) -> bool:
    """Whether the planned pipelined shapes fit: sm90+ (their shared memory); not below, nor on AMD."""
    return arch_at_least(target.arch, 90)


@triton.jit
def _e4m3_operand(byte, PREC: tl.constexpr):
    """e4m3 bytes as the product's operand: e4m3 for "fp8"; else their values (exact in bf16), decoded by
    integer arithmetic (GPUs without e4m3 in Triton: sm80, AMD)."""
    if PREC == "fp8":
        return byte.to(tl.float8e4nv, bitcast=True)
    else:
        b = byte.to(tl.uint16)
        # e4m3 as float16 bits (sign, then exponent and mantissa shifted in): the value times 2^-8
        v = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        return _operand(v, PREC)


@triton.jit
def _operand(x, PREC: tl.constexpr):
    """Values as the product's operand dtype: bf16 for "bf16", float32 for "bf16_widened" (the interpreter's
    dot of bf16 operands multiplies their bits); others as they are."""
    if PREC == "bf16":
        return x.to(tl.bfloat16)
    elif PREC == "bf16_widened":
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def _key_scores(q_hi, q_lo, wv, k_ptr, pages_ptr, req, P, n_slots, cols, limit, DI, BS: tl.constexpr,
                TG: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, PREC: tl.constexpr, RECORD: tl.constexpr):
    """Σ_h w·ReLU(q·k) -> [BN, TG] for the entries `cols` of request `req`, their keys 0 at or past `limit`,
    without a page (as the torch path reads them: zero rows) and for dims past DI. RECORD (the keys' row
    code) PLAIN: rows in the keys' dtype; MXFP4: FP4 records, decoded to bf16 (exactly, for FP4-simulated
    keys); FP8_KEY: fp8 records (both: dsv4/strategies/indexer/key_layouts.py), their e4m3 bytes the operand of
    an e4m3 product
    (PREC "fp8") or decoded, their scale applied to the head sums (s·Σ_h w·ReLU(x) = Σ_h w·ReLU(s·x) for a
    power of two s > 0, exactly)."""
    BN: tl.constexpr = cols.shape[0]
    logical = cols // BS
    ok = (cols < limit) & (logical < P)
    page = tl.load(pages_ptr + req * P + logical, mask=ok, other=-1)
    t = cols % BS
    slot = page.to(tl.int64) * BS + t
    ok = ok & (page >= 0) & (slot < n_slots)
    d = tl.arange(0, DP)
    m = ok[:, None] & (d < DI)[None, :]
    if RECORD == PLAIN:
        keys = tl.load(k_ptr + slot[:, None] * DI + d[None, :], mask=m, other=0.0)
        return _head_sum(_dot(_operand(keys, PREC), q_hi, q_lo, PREC), wv, TG, HP, BN)
    elif RECORD == FP8_RECORD:
        # page p: its keys' DI e4m3 bytes each, then their float32 scales (4 bytes each, little-endian)
        base = page.to(tl.int64) * (BS * (DI + 4))
        byte = tl.load(k_ptr + (base + t * DI)[:, None] + d[None, :], mask=m, other=0)
        sb = tl.load(k_ptr + (base + BS * DI + t * 4)[:, None] + tl.arange(0, 4)[None, :], mask=ok[:, None],
                     other=0).to(tl.int32)
        scale = tl.sum(sb << (8 * tl.arange(0, 4))[None, :], 1).to(tl.float32, bitcast=True)
        keys = _e4m3_operand(byte, PREC)
        return _head_sum(_dot(keys, q_hi, q_lo, PREC), wv, TG, HP, BN) * scale[:, None]
    else:
        # page p: its keys' codes (DI/2 bytes each, the even dim in the low nibble), then their scale bytes
        # (one per 32 dims, 2^(e - 127))
        base = page.to(tl.int64) * (BS * (DI // 2 + DI // 32))
        dh = tl.arange(0, DP // 2)
        byte = tl.load(k_ptr + (base + t * (DI // 2))[:, None] + dh[None, :],
                       mask=ok[:, None] & (dh < DI // 2)[None, :], other=0)          # each byte loaded once
        ds = tl.arange(0, DP // 32)
        e = tl.load(k_ptr + (base + BS * (DI // 2) + t * (DI // 32))[:, None] + ds[None, :],
                    mask=ok[:, None] & (ds < DI // 32)[None, :], other=0)
        code = tl.reshape(tl.join(byte & 15, byte >> 4), [BN, DP]).to(tl.int32)    # dims 2j, 2j + 1
        ei = tl.reshape(tl.broadcast_to(e.to(tl.int32)[:, :, None], [BN, DP // 32, 32]), [BN, DP])
        i = (code & 7).to(tl.float32)
        mag = tl.where(i < 4, 0.5 * i, tl.where(i < 7, i - 2, 6.0))         # 0, .5, 1, 1.5, 2, 3, 4, 6
        keys = tl.where((code & 8) != 0, -mag, mag) * (ei << 23).to(tl.float32, bitcast=True)
        return _head_sum(_dot(_operand(keys, PREC), q_hi, q_lo, PREC), wv, TG, HP, BN)


@triton.jit
def _tf32_split(x):
    """x = hi + lo, both tf32-valued (rounded to nearest: the tensor cores truncate the low 13 bits)."""
    hi = ((x.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
    lo = x - hi
    return hi, ((lo.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _dot(k, q_hi, q_lo, PREC: tl.constexpr):
    """k [BN, DP] · qᵀ -> [BN, TG·HP] float32, from the queries [TG·HP, DP] (split into tf32 hi + lo for
    tf32x3, else q_hi alone) in the operand dtype of PREC."""
    if PREC == "tf32x3":
        k_hi, k_lo = _tf32_split(k)
        s = tl.dot(k_lo, tl.trans(q_hi), input_precision="tf32")
        s = tl.dot(k_hi, tl.trans(q_lo), s, input_precision="tf32")
        s = tl.dot(k_hi, tl.trans(q_hi), s, input_precision="tf32")
    elif PREC == "bf16" or PREC == "bf16_widened" or PREC == "fp8":
        s = tl.dot(k, tl.trans(q_hi))
    else:
        s = tl.dot(k, tl.trans(q_hi), input_precision=PREC)
    return s


@triton.jit
def _head_sum(s, wv, TG: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr):
    """Σ_h w·ReLU(s) -> [BN, TG] from the products s [BN, TG·HP]; NaN stays NaN (torch's relu)."""
    s = tl.where(s < 0, 0.0, s) * wv[None, :]
    return tl.sum(tl.reshape(s, [BN, TG, HP]), 2)


@triton.jit
def _block(q_hi, q_lo, wv, k_ptr, pages_ptr, P, n_slots, cols, i, req, cnt, r_lo, cmax, DI, BS: tl.constexpr,
           TG: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
           SAME: tl.constexpr, RECORD: tl.constexpr):
    """Scores [BN, TG] of entries `cols` for the group's tokens (−inf where not visible); SAME: they are
    all of request r_lo."""
    if SAME:
        logits = _key_scores(q_hi, q_lo, wv, k_ptr, pages_ptr, r_lo, P, n_slots, cols, cmax, DI, BS, TG, HP, DP,
                             PREC, RECORD)
    else:
        logits = tl.zeros([BN, TG], tl.float32)
        for u in tl.static_range(TG):
            r_u = tl.sum(tl.where(i == u, req, 0), 0)
            c_u = tl.sum(tl.where(i == u, cnt, 0), 0)
            s = _key_scores(q_hi, q_lo, wv, k_ptr, pages_ptr, r_u, P, n_slots, cols, c_u, DI, BS, TG, HP, DP, PREC,
                            RECORD)
            logits = tl.where((i == u)[None, :], s, logits)
    return tl.where(cols[:, None] < cnt[None, :], logits, float("-inf"))


@triton.jit(do_not_specialize=["T"])     # step sizes: one variant for all
def _indexer_kernel(q_ptr, w_ptr, w_stride, w_scale, k_ptr, pages_ptr, req_ptr, cnt_ptr, out_ptr, T, H, DI, P, width,
                    n_slots,
                    BS: tl.constexpr, TG: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr,
                    NBLK: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr, RECORD: tl.constexpr,
                    Q_E4M3: tl.constexpr, PDL: tl.constexpr = False):
    dependent_start(PDL)
    g = tl.program_id(0)
    j0 = tl.program_id(1) * (NBLK * BN)
    i = tl.arange(0, TG)
    tok = g * TG + i
    cnt = tl.load(cnt_ptr + tok, mask=tok < T, other=0)
    req = tl.load(req_ptr + tok, mask=tok < T, other=0).to(tl.int64)
    live = cnt > 0
    cmax = tl.max(cnt, 0)
    r_lo = tl.min(tl.where(live, req, 1 << 62), 0)
    same = r_lo == tl.max(tl.where(live, req, -1), 0)        # every token that sees an entry: one request
    # query rows of the group's tokens: row m is token m // HP, head m % HP
    m = tl.arange(0, TG * HP)
    mt = g * TG + m // HP
    mh = m % HP
    mok = (mt < T) & (mh < H)
    d = tl.arange(0, DP)
    q = tl.load(q_ptr + (mt.to(tl.int64) * H + mh)[:, None] * DI + d[None, :], mask=mok[:, None] & (d < DI)[None, :],
                other=0)
    if Q_E4M3:                  # e4m3 bytes: the fp8 product's operand, or their values decoded once here
        q = _e4m3_operand(q, PREC)
    else:
        q = _operand(q, PREC)
    if PREC == "tf32x3":
        q_hi, q_lo = _tf32_split(q)
    else:
        q_hi, q_lo = q, q
    wv = tl.load(w_ptr + mt.to(tl.int64) * w_stride + mh, mask=mok, other=0.0) * w_scale
    out_cols = out_ptr + tok.to(tl.int64)[None, :] * width
    keep = (tok < T)[None, :]
    if STAGES > 1:
        # a branch-free loop over the blocks holding a visible entry, software-pipelined (sm90+: the
        # buffers need its shared memory); then −inf for the rest
        nb = tl.minimum(tl.cdiv(cmax - j0, BN), NBLK)
        if same:
            for b in tl.range(0, nb, num_stages=STAGES):
                cols = j0 + b * BN + tl.arange(0, BN)
                vals = _block(q_hi, q_lo, wv, k_ptr, pages_ptr, P, n_slots, cols, i, req, cnt, r_lo, cmax, DI, BS, TG,
                              HP, DP, BN, PREC, True, RECORD)
                tl.store(out_cols + cols[:, None], vals, mask=keep & (cols < width)[:, None])
        else:
            for b in range(0, nb):
                cols = j0 + b * BN + tl.arange(0, BN)
                vals = _block(q_hi, q_lo, wv, k_ptr, pages_ptr, P, n_slots, cols, i, req, cnt, r_lo, cmax, DI, BS, TG,
                              HP, DP, BN, PREC, False, RECORD)
                tl.store(out_cols + cols[:, None], vals, mask=keep & (cols < width)[:, None])
        for b in range(tl.maximum(nb, 0), NBLK):
            cols = j0 + b * BN + tl.arange(0, BN)
            tl.store(out_cols + cols[:, None], tl.full([BN, TG], float("-inf"), tl.float32),
                     mask=keep & (cols < width)[:, None])
    else:
        for b in range(NBLK):
            cols = j0 + b * BN + tl.arange(0, BN)
            if j0 + b * BN < cmax:
                if same:
                    vals = _block(q_hi, q_lo, wv, k_ptr, pages_ptr, P, n_slots, cols, i, req, cnt, r_lo, cmax, DI, BS,
                                  TG, HP, DP, BN, PREC, True, RECORD)
                else:
                    vals = _block(q_hi, q_lo, wv, k_ptr, pages_ptr, P, n_slots, cols, i, req, cnt, r_lo, cmax, DI, BS,
                                  TG, HP, DP, BN, PREC, False, RECORD)
            else:
                vals = tl.full([BN, TG], float("-inf"), tl.float32)
            tl.store(out_cols + cols[:, None], vals, mask=keep & (cols < width)[:, None])


def indexer_logits(q, w, keys, pages, token_request, counts, *, width: int, w_scale: float = 1.0, block_n: int = 0,
                   blocks_per_program: int = 0, num_warps: int = 0, stages: int = 0, target: Target | None = None):
    """[T, width] float32 indexer scores: q [T, Hi, Di] (float32, or already in the keys' dtype; or e4m3,
    [T, Hi, Di] or [T, 1, Hi, Di], each head over its scale as `key_layouts.fp8_queries` makes it, for fp8
    records), w [T, Hi] float32 head weights (rows may be strided) times `w_scale`, `keys` a PagedCache of
    float32 or bf16 rows ([num_blocks, bs, Di] data), of FP4 records (uint8 [num_blocks, bs·(Di/2 +
    Di/32)]) or of fp8 records (uint8 [num_blocks, bs·(Di + 4)]), pages [B, P] int32 (the entries table),
    token_request [T] int64, counts [T] int32. Entries j < counts[t] score Σ_h w·ReLU(q·k_j) (0 where the
    entry has no page: the torch path reads a zero key), the rest −inf. Records are scored by their exact
    values (the module docstring: bf16 queries against FP4 records, bf16 or e4m3 ones against fp8 records).
    Sync-free; grid (T / TOKENS_PER_PROGRAM, width / (block_n · blocks_per_program)); launch shapes left at
    0 are the H200's best for the keys' dtype and the step's size (LAUNCH); a programmatic dependent where the
    GPU launches them (Target.pdl). `target`: the device's facts as the strategy prepared them (default:
    `target.target_of` q's device)."""
    import torch

    e4m3 = q.dtype == torch.float8_e4m3fn
    if e4m3 and q.dim() == 4:
        q = q.flatten(1, 2)
    T, H, DI = q.shape
    data = keys.data
    rows = keys.layout.row_format
    record = rows.code if data.dtype == torch.uint8 and rows in RECORDS else RowCode.PLAIN.value
    if data.dtype == torch.uint8:
        per_key = DI // 2 + DI // 32 if record == RowCode.MXFP4 else DI + 4
        if record == RowCode.PLAIN or DI % 64 or data.dim() != 2 or data.shape[1] != keys.block_size * per_key:
            raise ValueError(f"indexer_logits: key pages {tuple(data.shape)} ({keys.layout.row_format.label}) do not "
                             f"hold {keys.block_size} FP4 or fp8 records of {DI} dims (a multiple of 64)")
    elif data.dtype not in (torch.float32, torch.bfloat16) or data.shape[-1] != DI:
        raise ValueError(f"indexer_logits reads float32 or bf16 keys of {DI} dims or FP4 or fp8 records, not "
                         f"{data.dtype} [{data.shape[-1]}]")
    if e4m3 and record != RowCode.FP8_KEY:
        raise ValueError(f"indexer_logits: e4m3 queries are scored against fp8 records, not "
                         f"{keys.layout.row_format.label} keys")
    key_dtype = torch.bfloat16 if record != RowCode.PLAIN else data.dtype    # the dtype the queries are rounded to
    out = torch.empty(T, width, dtype=torch.float32, device=q.device)
    if not T or not width:
        return out
    tgt = target or target_of(q.device)
    # fixed_order (batch_invariant=true): the decode shape for every step, one token a program, so that a token's
    # scores do not depend on the step's size or on the token beside it
    tg = 1 if tgt.fixed_order else TOKENS_PER_PROGRAM
    size = "prefill" if T >= PREFILL_TOKENS and not tgt.fixed_order else "decode"
    plan = LAUNCH[str(key_dtype).removeprefix("torch."), size]
    block_n, blocks_per_program = block_n or plan.block_n, blocks_per_program or plan.blocks
    num_warps = num_warps or plan.num_warps
    stages = stages or (plan.stages if pipelined(tgt) else 1)
    hp = max(next_pow2(H), 16 // tg)         # a dot needs >= 16 rows
    dp = max(next_pow2(DI), 16)
    pages = as_i32(pages)
    w = rows_dense(w if w.dtype == torch.float32 else w.float())
    if e4m3 and not tgt.interpret and tgt.native_e4m3:     # e4m3 operands to the tensor cores as they are
        precision = "fp8"
    elif key_dtype == torch.bfloat16:
        precision = "bf16_widened" if tgt.interpret else "bf16"
    else:
        precision = INPUT_PRECISION["hip" if tgt.arch == "rocm" else "cuda"]
    if not e4m3 and q.dtype != key_dtype:
        q = q.to(key_dtype)
    grid = (cdiv(T, tg), cdiv(width, block_n * blocks_per_program))
    launch(_indexer_kernel, grid, as_dense(q.view(torch.uint8) if e4m3 else q), w, w.stride(0), w_scale,
           data, pages, as_dense(token_request), as_i32(counts), out, T, H, DI, pages.shape[1], width,
           keys.num_slots, BS=keys.block_size, TG=tg, HP=hp, DP=dp, BN=block_n, NBLK=blocks_per_program,
           PREC=precision, STAGES=stages, RECORD=record, Q_E4M3=e4m3, PDL=tgt.pdl, launch_pdl=tgt.pdl,
           num_warps=num_warps, num_stages=1)
    return out


def compile_cases(gpu) -> list[CompileCase]:
    """The scoring kernel as indexer_logits launches it on `gpu` (Triton's GPUTarget), 64 heads of 128 dims on
    pages of 64 entries: the planned decode and prefill shapes over plain rows (float32 keys at the backend's
    float32-accurate product), and bf16's over FP4 records (bf16 queries) and fp8 records (e4m3 queries: an
    e4m3 product where the target has one, else decoded to bf16); pipelined stages on sm90+, and launched as
    programmatic dependents where the GPU launches them so."""
    nvidia = gpu.backend == "cuda"
    fp8 = "fp8" if nvidia and gpu.arch >= E4M3_SM else "bf16"
    shapes = [(dtype, plan, RowCode.PLAIN.value, INPUT_PRECISION[gpu.backend] if dtype == "float32" else "bf16")
              for (dtype, _size), plan in LAUNCH.items()]
    shapes += [(rows.label, plan, rows.code, "bf16" if rows is MXFP4_KEYS else fp8)
               for (dtype, _size), plan in LAUNCH.items() if dtype == "bfloat16" for rows in RECORDS]
    cases = []
    for dtype, plan, record, prec in shapes:
        e4m3 = dtype == FP8_KEYS.label
        name = {"float32": "*fp32"}.get(dtype, "*u8" if e4m3 else "*bf16")
        cases.append(CompileCase(
            kernel=_indexer_kernel, constexprs=dict(BS=64, TG=TOKENS_PER_PROGRAM, HP=64, DP=128, BN=plan.block_n,
                                                    NBLK=plan.blocks, PREC=prec, RECORD=record, Q_E4M3=e4m3,
                                                    STAGES=plan.stages if nvidia and gpu.arch >= 90 else 1,
                                                    PDL=gpu_launches_dependents(gpu)),
            pointers={"q_ptr": name, "w_ptr": "*fp32", "k_ptr": "*u8" if record != RowCode.PLAIN else name,
                      "pages_ptr": "*i32", "req_ptr": "*i64", "cnt_ptr": "*i32", "out_ptr": "*fp32"},
            floats=frozenset({"w_scale"}), divisible=frozenset({"H", "DI", "width", "w_stride"}),
            num_warps=plan.num_warps))
    return cases
