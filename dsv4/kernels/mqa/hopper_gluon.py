"""What the one-pass Hopper kernels (sparse_mqa_hopper.py: 64 heads per program; sparse_mqa_hopper_few.py:
8 to 32) share: the Gluon API they use, whose import is the test that this Triton can build them
(sparse_plan.gluon_error), the split of a token's list blocks over programs, a block's list entries,
loading Q and finishing the heads."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.language.core import _unwrap_if_constexpr
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,  # noqa: F401
                                                            warpgroup_mma_wait)

# Triton 3.6 (the H200's) calls the CTA barrier thread_barrier, 3.9 (CI's, for the compile check) barrier
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@builtin
def smem_view(desc, dtype, shape, layout, _semantic=None):
    """Shared memory `desc`'s bytes as another dtype, shape and layout (what Triton 3.6 calls
    `_reinterpret` and 3.9 `reinterpret`)."""
    return _semantic.memdesc_reinterpret(desc, _unwrap_if_constexpr(dtype), [_unwrap_if_constexpr(n) for n in shape],
                                         _unwrap_if_constexpr(layout))


LOG2E_C = gl.constexpr(1.4426950408889634)     # log2(e)
BN = gl.constexpr(64)                          # list rows per block


@gluon.jit
def list_len(len_ptr, w, mask=None):
    """A list's length as the kernels read it: clamped to [0, list width w], as the two-pass kernel and
    the reference do (0 where masked off)."""
    if mask is None:
        n = gl.load(len_ptr)
    else:
        n = gl.load(len_ptr, mask=mask, other=0)
    return gl.maximum(gl.minimum(n, w), 0)


@gluon.jit
def nblocks(t, sp, S, s_len, e_len, s_w, e_w):
    """The token's SWA list length, compressed list length and SWA blocks (a length is clamped to [0, list
    width], as the two-pass kernel and the reference read it), and the blocks [j0, j1) of split sp of S:
    the token's SWA then compressed blocks cut into S runs of equal length (the last ones may be empty)."""
    n_s = list_len(s_len + t, s_w)
    n_e = list_len(e_len + t, e_w)
    nb_s = gl.cdiv(n_s, BN)
    nblk = nb_s + gl.cdiv(n_e, BN)
    per = gl.cdiv(nblk, S)
    j0 = gl.minimum(sp * per, nblk)
    return n_s, n_e, nb_s, j0, gl.minimum(j0 + per, nblk)


@gluon.jit
def block_slots(j, j1, t, nb_s, n_s, n_e, s_idx, s_w, e_idx, e_w, rl: gl.constexpr):
    """List entries of block j of token t (its SWA blocks, then its compressed ones); -1 past the list
    and for j >= j1 (a look-ahead past the program's last block loads nothing)."""
    r = gl.arange(0, BN, layout=rl)
    if j < nb_s:
        c = j * BN + r
        slots = gl.load(s_idx + t.to(gl.int64) * s_w + c, mask=(c < n_s) & (j < j1), other=-1)
    else:
        c = (j - nb_s) * BN + r
        slots = gl.load(e_idx + t.to(gl.int64) * e_w + c, mask=(c < n_e) & (j < j1), other=-1)
    return slots


@gluon.jit
def load_q(q_ptr, q_smem, t, n, h0, H, NH: gl.constexpr, NQ: gl.constexpr, D: gl.constexpr, blk: gl.constexpr):
    """Into q_smem [NQ, D], 64 dims at a time: row i is head h0 + i % NH of token t + i // NH (NQ = NH: one
    token), zeros past H and past the program's n tokens."""
    i = gl.arange(0, NQ, layout=gl.SliceLayout(1, blk))
    hr = h0 + i % NH
    row = ((t + i // NH).to(gl.int64) * H + hr) * D
    ok = (i // NH < n) & (hr < H)
    for c in gl.static_range(D // 64):
        d = c * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, blk))
        qc = gl.load(q_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        q_smem.slice(64 * c, 64, dim=1).store(qc)
    fence_async_shared()
    cta_barrier()


@gluon.jit
def finish_heads(m_i, l_i, hs, t, ok, sp, T, H, sink_ptr, lse_ptr, ml_ptr, SPLIT: gl.constexpr):
    """The program's heads hs of tokens t (one, or one per head) after their last block, where ok, from the
    running max m_i and sum l_i (log2 domain):
    SPLIT, the split's (max, sum) stored for split_combine, which finishes them, and 1 returned; else the
    sink in the denominator, lse stored, and 1/denominator returned (a head with no valid row: 0, lse +inf)."""
    if SPLIT:
        part = ((sp * T + t).to(gl.int64) * H + hs) * 2
        gl.store(ml_ptr + part, m_i, mask=ok)
        gl.store(ml_ptr + part + 1, l_i, mask=ok)
        inv = gl.full(m_i.shape, 1.0, gl.float32, m_i.type.layout)
    else:
        has = l_i > 0
        m_fin = gl.where(has, m_i, 0.0)
        sink_l2 = gl.load(sink_ptr + hs, mask=hs < H, other=0.0) * LOG2E_C
        denom = gl.where(has, l_i + gl.exp2(sink_l2 - m_fin), 1.0)
        gl.store(lse_ptr + t.to(gl.int64) * H + hs,
                 gl.where(has, (m_fin + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("inf")),
                 mask=ok)
        inv = gl.where(has, 1.0 / denom, 0.0)
    return inv
