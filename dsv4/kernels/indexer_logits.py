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

Precision: the scores feed a top-k that is compared with a float32 oracle, so the products must be
float32-accurate. INPUT_PRECISION["cuda"] = "tf32x3" splits each float32 operand into a tf32 head and a
tf32 tail and sums three tensor-core products (error ~2^-21 relative, about float32's); plain "tf32"
(10-bit mantissas: 7.7e-4 from a float64 oracle on the H200) would reorder near-ties of the top-k, and
"ieee" runs on the CUDA cores (30x slower there). The split is done here rather than by tl.dot's
"tf32x3" so that the queries are split once per program, not once per block (H200, the shapes below:
decode 144 -> 139 us, 8k prefill 2.9 -> 2.5 ms; both 3.5e-7 from the float64 oracle), the two small
products accumulated before the large one, as Triton orders them (the tensor cores' float32
accumulation drops low bits of small addends to a large sum: 1.4e-6 the other way round). AMD's Triton
has no tf32x3; "bf16x6" (three bf16 pieces per operand, six products) is its float32-accurate
tensor-core product. Under TRITON_INTERPRET=1 the products are NumPy's float32 matmuls.
"""
from __future__ import annotations

import triton
import triton.language as tl

INPUT_PRECISION = {"cuda": "tf32x3", "hip": "bf16x6"}        # per Triton backend, see above
TOKENS_PER_PROGRAM = 2          # TG: a decode request's two tokens (MTP) share each key block
# H200, 64 heads of 128 dims (decode: 64 requests x 2 tokens, ~2k of 16k entries visible; prefill: 8k tokens of
# one request, 2k entries): 128 entries x 8 blocks, 8 warps was the fastest decode shape, 16 blocks for prefill
BLOCK_N, NUM_WARPS = 128, 8
BLOCKS_PER_PROGRAM = {"decode": 8, "prefill": 16}
PREFILL_TOKENS = 1024           # steps of at least this many tokens take the prefill shape


@triton.jit
def _keys(k_ptr, pages_ptr, req, P, n_slots, cols, limit, DI, BS: tl.constexpr, DP: tl.constexpr):
    """Keys [BN, DP] float32 of entries `cols` of request `req`: 0 for entries at or past `limit`, without
    a page (as the torch path reads them: zero rows) and for dims past DI."""
    logical = cols // BS
    ok = (cols < limit) & (logical < P)
    page = tl.load(pages_ptr + req * P + logical, mask=ok, other=-1)
    slot = page.to(tl.int64) * BS + cols % BS
    ok = ok & (page >= 0) & (slot < n_slots)
    d = tl.arange(0, DP)
    return tl.load(k_ptr + slot[:, None] * DI + d[None, :], mask=ok[:, None] & (d < DI)[None, :], other=0.0)


@triton.jit
def _tf32_split(x):
    """x = hi + lo, both tf32-valued (rounded to nearest: the tensor cores truncate the low 13 bits)."""
    hi = ((x.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
    lo = x - hi
    return hi, ((lo.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _head_sum(q_hi, q_lo, k, wv, TG: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    """Σ_h w·ReLU(q·k) -> [BN, TG], from keys k [BN, DP] and queries [TG·HP, DP] (split into tf32 hi + lo
    for tf32x3, else q_hi alone); NaN stays NaN (torch's relu)."""
    if PREC == "tf32x3":
        k_hi, k_lo = _tf32_split(k)
        s = tl.dot(k_lo, tl.trans(q_hi), input_precision="tf32")
        s = tl.dot(k_hi, tl.trans(q_lo), s, input_precision="tf32")
        s = tl.dot(k_hi, tl.trans(q_hi), s, input_precision="tf32")
    else:
        s = tl.dot(k, tl.trans(q_hi), input_precision=PREC)
    s = tl.where(s < 0, 0.0, s) * wv[None, :]
    return tl.sum(tl.reshape(s, [BN, TG, HP]), 2)


@triton.jit
def _indexer_kernel(q_ptr, w_ptr, k_ptr, pages_ptr, req_ptr, cnt_ptr, out_ptr, T, H, DI, P, width, n_slots,
                    BS: tl.constexpr, TG: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr,
                    NBLK: tl.constexpr, PREC: tl.constexpr):
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
                other=0.0)
    if PREC == "tf32x3":
        q_hi, q_lo = _tf32_split(q)
    else:
        q_hi, q_lo = q, q
    wv = tl.load(w_ptr + mt.to(tl.int64) * H + mh, mask=mok, other=0.0)
    out_cols = out_ptr + tok.to(tl.int64)[None, :] * width
    for b in range(NBLK):
        cols = j0 + b * BN + tl.arange(0, BN)
        if j0 + b * BN < cmax:
            if same:
                logits = _head_sum(q_hi, q_lo, _keys(k_ptr, pages_ptr, r_lo, P, n_slots, cols, cmax, DI, BS, DP), wv,
                                   TG, HP, BN, PREC)
            else:
                logits = tl.zeros([BN, TG], tl.float32)
                for u in tl.static_range(TG):
                    r_u = tl.sum(tl.where(i == u, req, 0), 0)
                    c_u = tl.sum(tl.where(i == u, cnt, 0), 0)
                    k = _keys(k_ptr, pages_ptr, r_u, P, n_slots, cols, c_u, DI, BS, DP)
                    logits = tl.where((i == u)[None, :], _head_sum(q_hi, q_lo, k, wv, TG, HP, BN, PREC), logits)
            vals = tl.where(cols[:, None] < cnt[None, :], logits, float("-inf"))
        else:
            vals = tl.full([BN, TG], float("-inf"), tl.float32)
        tl.store(out_cols + cols[:, None], vals, mask=(tok < T)[None, :] & (cols < width)[:, None])


def indexer_logits(q, w, keys, pages, token_request, counts, *, width: int, exact: bool = True, block_n: int = 0,
                   blocks_per_program: int = 0, num_warps: int = 0, num_stages: int = 1):
    """[T, width] float32 indexer scores: q [T, Hi, Di] float32, w [T, Hi] float32 (already scaled), `keys`
    a PagedCache of float32 rows ([num_blocks, bs, Di] data, `.block_size`), pages [B, P] int32 (the
    entries table), token_request [T] int64, counts [T] int32. Entries j < counts[t] score
    Σ_h w·ReLU(q·k_j) (0 where the entry has no page: the torch path reads a zero key), the rest −inf.
    Sync-free; grid (T / TOKENS_PER_PROGRAM, width / (block_n · blocks_per_program)); launch shapes left
    at 0 are the H200's best for the step's size (module constants). exact=False: one tf32 product on NVIDIA
    (relative error ~1e-3, a third of tf32x3's work), for queries that carry bf16 activations' rounding anyway."""
    import torch

    T, H, DI = q.shape
    data = keys.data
    if data.dtype != torch.float32 or data.shape[-1] != DI:
        raise ValueError(f"indexer_logits reads float32 keys of {DI} dims, not {data.dtype} [{data.shape[-1]}]")
    out = torch.empty(T, width, dtype=torch.float32, device=q.device)
    if not T or not width:
        return out
    tg = TOKENS_PER_PROGRAM
    block_n = block_n or BLOCK_N
    blocks_per_program = blocks_per_program or BLOCKS_PER_PROGRAM["prefill" if T >= PREFILL_TOKENS else "decode"]
    num_warps = num_warps or NUM_WARPS
    hp = max(triton.next_power_of_2(H), 16 // tg)         # a dot needs >= 16 rows
    dp = max(triton.next_power_of_2(DI), 16)
    pages = pages.int().contiguous()
    precision = INPUT_PRECISION["hip" if torch.version.hip else "cuda"] if exact or torch.version.hip else "tf32"
    grid = (triton.cdiv(T, tg), triton.cdiv(width, block_n * blocks_per_program))
    _indexer_kernel[grid](q.float().contiguous(), w.float().contiguous(), data, pages, token_request.contiguous(),
                          counts.int().contiguous(), out, T, H, DI, pages.shape[1], width,
                          data.numel() // DI, BS=keys.block_size, TG=tg, HP=hp, DP=dp, BN=block_n,
                          NBLK=blocks_per_program, PREC=precision, num_warps=num_warps, num_stages=num_stages)
    return out
