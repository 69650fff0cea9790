"""How a sparse MQA call is planned, in plain Python (no Triton imported until the Hopper kernel's Gluon is
asked about): which kernel runs it (`variant`: the one-pass Hopper kernels, sparse_mqa_hopper.py and
sparse_mqa_hopper_few.py, or the portable two-pass one, sparse_mqa.py), the Hopper kernels' heads per
program and splits, and the two-pass kernel's launch shapes."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import NamedTuple

from dsv4.formats.row_format import BF16_ROWS, FP8_DS_MLA, FP8_DS_MLA_FNUZ
from dsv4.values.sizes import cdiv, next_pow2

VARIANTS = ("auto", "two_pass", "hopper")    # which kernel runs a call (plan_kernel)
READS = (BF16_ROWS, FP8_DS_MLA, FP8_DS_MLA_FNUZ)   # the rows the two-pass kernel decodes (the Hopper ones: OCP)
# what the one-pass Hopper kernel takes: the rule `hopper_unfit` applies per call and that
# mqa_kernel=triton_sparse variant=hopper declares in its needs()
HOPPER_ARCHS = frozenset({"sm90"})           # Hopper warpgroup MMAs
HOPPER_DTYPES = frozenset({"bfloat16"})      # query dtypes
HOPPER_HEAD_DIM = 512


class Launch(NamedTuple):
    block_n: int      # index columns per scores program (and per P·V step)
    block_h: int      # heads per program, both passes
    block_d: int      # output dims per P·V program
    num_warps_pv: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TwoPassLaunch:
    """The two-pass kernel's launch as a caller sets it (mqa_kernel=triton_sparse's fields); 0 = planned
    (`plan_launch`, or FIXED_LAUNCH under fixed_order)."""
    block_n: int = 0
    block_h: int = 0
    block_d: int = 0
    num_warps: int = 4          # the scores pass
    num_warps_pv: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class HopperLaunch:
    """The one-pass Hopper kernels' launch as a caller sets it; 0 and None = planned."""
    splits: int = 0              # programs per (token, head block): `hopper_splits` (fixed_order: FIXED_SPLITS)
    group: int = 0               # a run's tokens per program where the lists come with their runs: `hopper_group`
    inline: bool | None = None   # fixed_order: a token's runs merged inside its program (`fixed_inline`)


def plan_launch(tokens: int, heads: int, columns: int, processors: int) -> Launch:
    """Launch shapes from the step's size (the H200 sweep: docs/notes/2026-11-29-two-pass-kernel.md). When the
    scores pass at 128 columns x 64 heads per program gives at least half as many programs as processors:
    that (4 warps), and 128 output dims per P·V program. Otherwise (decode of a few requests) more, smaller
    programs, so that the step fills the GPU: 64 columns x 16 heads, 64 dims with 8 warps."""
    full = min(64, max(16, next_pow2(heads)))
    if 2 * tokens * cdiv(columns, 128) * cdiv(heads, full) >= processors:
        return Launch(128, full, 128, 4)
    return Launch(64, 16, 64, 8)


def hopper_heads(heads: int) -> int:
    """Heads per program of the one-pass Hopper kernels: 64 (sparse_mqa_hopper.py, the heads are its MMAs'
    M) above 32, else 8, 16 or 32 (sparse_mqa_hopper_few.py, the heads are the N of transposed MMAs, so a
    tensor-parallel rank's few heads are not padded to 64)."""
    return 64 if heads > 32 else max(8, next_pow2(heads))


# batch_invariant=true (Target.fixed_order): launches that give a token the same sums in any step. The
# two-pass kernel takes one launch shape; the Hopper kernel cuts every token's blocks into FIXED_SPLITS runs
# by its own lists' lengths (hopper_gluon.nblocks), always merged in split_combine's order (by its launch,
# or in a large step inside the token's program: fixed_inline), so that neither the step's size nor its
# width moves a run's bounds. 2 is the best single count on the H200 from 1 to 64 requests (1.5x the planned
# splits at one request, level at 64; merged inside, 1.3x at 128 and 1.4x at 256:
# docs/notes/2026-12-04-batch-invariance.md)
FIXED_LAUNCH = Launch(64, 16, 64, 8)
FIXED_SPLITS = 2
FIXED_WORKSPACE_BYTES = 1 << 28       # the split partials of one Hopper launch; longer steps go in token chunks


def fixed_inline(tokens: int, heads: int, splits: int, processors: int) -> bool:
    """Under FIXED_SPLITS, whether the 64-head programs take a token's runs in turn and merge them themselves
    (sparse_mqa_hopper's `inline`, the same sums): where the runs spread over programs would not all run at
    once. The H200, a ratio-4 layer: 48 against 57 µs at 128 tokens, 100 against 112 at 256; at 64 tokens,
    spread, 28 against 44 (docs/notes/2026-12-04-batch-invariance.md)."""
    return hopper_heads(heads) == 64 and splits > 1 and tokens * cdiv(heads, 64) * splits > processors


RUN_GROUP = 2       # tokens of a run per program where hopper_group groups them


def hopper_group(tokens: int, heads: int, columns: int, processors: int) -> int:
    """Tokens of a run (StepPlan.runs) per program of the one-pass Hopper kernel, given the runs: 2 at 8
    heads where the step's groups of two still fill the GPU unsplit, so that a request's two MTP tokens
    read their shared window rows once; else 1: 16 heads x 2 tokens are 32 columns, whose state spills, and
    groups split over list blocks pay more for the merge than the union saves
    (docs/notes/2026-12-03-mtp-token-groups.md)."""
    if hopper_heads(heads) != 8 or hopper_splits(tokens, heads, columns, processors, group=RUN_GROUP) != 1:
        return 1
    return RUN_GROUP


def hopper_splits(tokens: int, heads: int, columns: int, processors: int, group: int = 1) -> int:
    """How many programs the Hopper kernel makes of each (token, head block): 1 once the step has as many
    of them as SMs; below, as many as bring it to about one per SM, each at least one block of 64 rows, so
    that a small step fills the GPU (docs/notes/2026-12-02-hopper-splits.md). `group` tokens per program
    (hopper_group) count as one."""
    programs = cdiv(tokens, group) * cdiv(heads, hopper_heads(heads))
    if programs >= processors:
        return 1
    return max(1, min(cdiv(columns, 64), processors // max(programs, 1)))


GLUON_MIN_TRITON = (3, 6)        # the Gluon API the Hopper kernel is written in (3.6 runs it, 3.9 compiles it)


@functools.lru_cache(maxsize=None)
def gluon_error() -> str:
    """Why the one-pass Hopper kernel cannot be built with this Triton ('' if it can)."""
    import triton

    version = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    if version < GLUON_MIN_TRITON:
        return f"it needs Triton >= {'.'.join(map(str, GLUON_MIN_TRITON))}'s Gluon, this is {triton.__version__}"
    try:
        import dsv4.kernels.mqa.hopper_gluon  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means: not available, with the reason
        return f"Triton {triton.__version__} has no usable Gluon ({type(e).__name__}: {e})"
    return ""


def hopper_unfit(*, arch: str, layouts: tuple[int, int], head_dim: int, native: bool, dtype: str) -> str:
    """Why the one-pass Hopper kernel cannot run this call ('' if it can); `layouts`: the two pools' row
    codes (RowFormat.code)."""
    if arch not in HOPPER_ARCHS:
        return f"it runs on NVIDIA {'/'.join(sorted(HOPPER_ARCHS))} (Hopper warpgroup MMAs) only, not {arch}"
    if dtype not in HOPPER_DTYPES:
        return f"it takes {'/'.join(sorted(HOPPER_DTYPES))} queries, not {dtype}"
    if layouts != (FP8_DS_MLA.code, FP8_DS_MLA.code):
        return "it reads fp8_ds_mla pages (OCP e4m3) only"
    if head_dim != HOPPER_HEAD_DIM:
        return f"it is built for head_dim {HOPPER_HEAD_DIM}, not {head_dim}"
    if not native:
        return "it decodes e4m3 with the hardware conversion (native_fp8=False asks for the integer decoding)"
    return gluon_error()


def plan_kernel(variant: str, *, arch: str, layouts: tuple[int, int], head_dim: int, native: bool,
                dtype: str) -> str:
    """'hopper' or 'two_pass' for a call. auto: Hopper wherever it can run (split over list blocks where
    the step is small, `hopper_splits`); an explicit 'hopper' that cannot run is an error."""
    if variant not in VARIANTS:
        raise ValueError(f"mqa_kernel=triton_sparse: variant={variant!r} is not one of {VARIANTS}")
    if variant == "two_pass":
        return variant
    why = hopper_unfit(arch=arch, layouts=layouts, head_dim=head_dim, native=native, dtype=dtype)
    if variant == "hopper":
        if why:
            raise ValueError(f"mqa_kernel=triton_sparse variant=hopper: {why}; set mqa_kernel.variant=auto or "
                             f"two_pass")
        return variant
    return "two_pass" if why else "hopper"
