"""mqa_kernel=triton_sparse: our Triton sparse MQA (dsv4/kernels/) for any GPU Triton runs on.

It reads the SWA and compressed caches in place -- fp8_ds_mla pages (OCP or FNUZ e4m3: the hardware
conversion where the GPU has one for the bytes, integer arithmetic elsewhere, so no fp8 hardware is
needed) or bf16 rows -- takes any number of heads (no padding), per-query lists with -1 padding and
lengths, and returns the log-sum-exp. Two kernels (`variant`):
- two_pass (sparse_mqa.py, every GPU): scores, then P·V by blocks of output dims; launch shapes left at
  0 are planned from the step's size;
- hopper (sparse_mqa_hopper.py, Gluon, NVIDIA sm90 and fp8_ds_mla pages): one pass, warp-specialized,
  rows read and decoded once into shared memory; programs of 64 heads, or of 8 to 32 for a rank's few
  heads (sparse_mqa_hopper_few.py, not padded to 64); a small step's programs split over list blocks;
- auto: hopper where it can run, two_pass elsewhere.
Prefill uses the same kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dsv4.formats.row_format import FP8_DS_MLA
from dsv4.kernels import TRITON_ARCHS
from dsv4.kernels.mqa.sparse_plan import HOPPER_ARCHS, HOPPER_DTYPES, HOPPER_HEAD_DIM, READS, VARIANTS, TwoPassLaunch
from dsv4.strategies.protocols import Needs
from dsv4.values.seam import SparseKV

if TYPE_CHECKING:
    from dsv4.kernels.target import Target


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonSparseMQA:
    name: str = "triton_sparse"
    error_budget: ClassVar[float] = 1e-2     # vs the oracle: bf16 probabilities in P·V
    block_n: int = 0          # index columns per scores program; 0 = planned (128, or 64 for small steps)
    block_h: int = 0          # heads per program; 0 = planned (up to 64, or 16 for small steps)
    block_d: int = 0          # output dims per P·V program; 0 = planned (128, or 64 for small steps)
    num_warps: int = 4        # scores pass
    num_warps_pv: int = 0     # P·V pass; 0 = planned (4, or 8 for small steps)
    variant: str = "auto"     # auto | two_pass | hopper (the launch fields above are two_pass's)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"mqa_kernel=triton_sparse: variant={self.variant!r} is not one of {VARIANTS}")
        for key, allowed in (("block_n", (0, 16, 32, 64, 128, 256)), ("block_h", (0, 16, 32, 64, 128)),
                             ("block_d", (0, 64, 128, 256)), ("num_warps", (1, 2, 4, 8, 16)),
                             ("num_warps_pv", (0, 1, 2, 4, 8, 16))):
            value = getattr(self, key)
            if value not in allowed:
                raise ValueError(f"mqa_kernel=triton_sparse: {key}={value} is not one of {allowed}"
                                 f"{'' if key == 'num_warps' else ' (0 = planned)'}")
            if value != (4 if key == "num_warps" else 0) and self.variant != "two_pass":
                raise ValueError(f"mqa_kernel=triton_sparse: {key}={value} sets the two-pass kernel's launch; "
                                 f"variant={self.variant} can run the one-pass Hopper kernel, which has no such "
                                 f"setting: add variant=two_pass")

    def needs(self, device) -> Needs:
        # batch_invariant=true: launches fixed whatever the step (kernels/mqa/sparse_plan.py FIXED_*)
        if self.variant == "hopper":
            return Needs(platforms=frozenset({"cuda"}), archs=HOPPER_ARCHS,
                         row_formats=frozenset({FP8_DS_MLA}), dtypes=HOPPER_DTYPES,
                         modules=(("triton", "triton>=3.6"),), fp8_formats=frozenset({"ocp"}),
                         model_values=(("head_dim", HOPPER_HEAD_DIM), ("qk_rope_head_dim", 64)),
                         fix="mqa_kernel.variant=auto", batch_invariant=True)
        return Needs(platforms=frozenset({"cuda", "rocm"}), archs=TRITON_ARCHS, row_formats=frozenset(READS),
                     dtypes=frozenset({"bfloat16"}), modules=(("triton", "triton"),),
                     fp8_formats=frozenset({"ocp", "fnuz"}),       # whichever the layout stores
                     model_values=(("head_dim", 512), ("qk_rope_head_dim", 64)), batch_invariant=True)

    def prepare(self, *, device, batch_invariant: bool = False) -> Target:
        """The device's facts the calls are planned by (arch, e4m3 in hardware, processors), resolved once;
        with batch_invariant, launches that do not follow the step (Target.fixed_order)."""
        from dsv4.kernels.target import target

        return target(platform=device.platform, arch=device.arch, torch_device=device.torch_device,
                      fixed_order=batch_invariant)

    def plan(self, *, tokens: int, layer_type: str, previous=None) -> None:
        return None

    @property
    def two_pass_launch(self) -> TwoPassLaunch:
        """The two-pass kernel's launch these fields set."""
        return TwoPassLaunch(block_n=self.block_n, block_h=self.block_h, block_d=self.block_d,
                             num_warps=self.num_warps, num_warps_pv=self.num_warps_pv)

    def __call__(self, q, kv: SparseKV, *, sink, scale: float, prepared=None, plan=None):
        from dsv4.kernels.mqa.sparse_mqa import sparse_mqa

        return sparse_mqa(q, kv, sink=sink, scale=scale, variant=self.variant, two_pass=self.two_pass_launch,
                          target=prepared)
