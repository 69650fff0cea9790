"""What the one-pass Hopper kernels (sparse_mqa_hopper.py: 64 heads per program; sparse_mqa_hopper_few.py:
8 to 32) share: the Gluon API they use, whose import is the test that this Triton can build them
(sparse_plan.gluon_error), and the split of a token's list blocks over programs."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,  # noqa: F401
                                                            warpgroup_mma_wait)

# Triton 3.6 (the H200's) calls the CTA barrier thread_barrier, 3.9 (CI's, for the compile check) barrier
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

LOG2E_C = gl.constexpr(1.4426950408889634)     # log2(e)
BN = gl.constexpr(64)                          # list rows per block


@gluon.jit
def nblocks(t, sp, S, s_len, e_len, s_w, e_w):
    """The token's SWA list length, compressed list length and SWA blocks (a length is clamped to [0, list
    width], as the two-pass kernel and the reference read it), and the blocks [j0, j1) of split sp of S:
    the token's SWA then compressed blocks cut into S runs of equal length (the last ones may be empty)."""
    n_s = gl.maximum(gl.minimum(gl.load(s_len + t), s_w), 0)
    n_e = gl.maximum(gl.minimum(gl.load(e_len + t), e_w), 0)
    nb_s = gl.cdiv(n_s, BN)
    nblk = nb_s + gl.cdiv(n_e, BN)
    per = gl.cdiv(nblk, S)
    j0 = gl.minimum(sp * per, nblk)
    return n_s, n_e, nb_s, j0, gl.minimum(j0 + per, nblk)
