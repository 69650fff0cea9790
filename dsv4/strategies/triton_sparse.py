"""mqa_kernel=triton_sparse: our Triton sparse MQA (dsv4/kernels/sparse_mqa.py) for any GPU Triton runs on.

It reads the SWA and compressed caches in place -- fp8_ds_mla pages (OCP or FNUZ e4m3: the hardware
conversion where the GPU has one for the bytes, integer arithmetic elsewhere, so no fp8 hardware is
needed) or bf16 rows -- takes any number of heads (no
padding), per-query lists with -1 padding and lengths, splits the index columns across programs
when there are few queries, and returns the log-sum-exp. Prefill uses the same kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsv4.strategies.protocols import Needs, SparseKV

# bf16 tensor-core dots: NVIDIA Ampere and newer, AMD CDNA2 and newer
TRITON_ARCHS = frozenset({"sm80", "sm86", "sm87", "sm89", "sm90", "sm100", "sm103", "sm110", "sm120", "sm121",
                          "gfx90a", "gfx942", "gfx950"})
READS = frozenset({"bf16", "fp8_ds_mla", "fp8_ds_mla_fnuz"})


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonSparseMQA:
    name: str = "triton_sparse"
    block_n: int = 64         # index entries (rows) per step of a program
    block_h: int = 0          # heads per program; 0 = 64, or 16 when there are too few programs for the GPU
    num_warps: int = 8
    num_stages: int = 1
    splits: int = 0           # splits of the index columns; 0 = planned from the shapes and the GPU

    def needs(self, device) -> Needs:
        return Needs(platforms=frozenset({"cuda", "rocm"}), archs=TRITON_ARCHS, cache_layouts=READS,
                     dtypes=frozenset({"bfloat16"}), modules=(("triton", "triton"),),
                     fp8_formats=frozenset({"ocp", "fnuz"}),       # whichever the layout stores
                     model_values=(("head_dim", 512), ("qk_rope_head_dim", 64)))

    def prepare(self, *, device) -> None:
        return None

    def __call__(self, q, kv: SparseKV, *, sink, scale: float, prepared=None):
        from dsv4.kernels.sparse_mqa import pool_args, sparse_mqa

        extra = {}
        if kv.extra is not None:
            extra = dict(extra=pool_args(kv.extra), extra_idx=kv.extra_indices, extra_len=kv.extra_lens)
        return sparse_mqa(q, sink, scale, pool_args(kv.swa), kv.swa_indices, kv.swa_lens, **extra,
                          block_n=self.block_n, block_h=self.block_h, num_warps=self.num_warps,
                          num_stages=self.num_stages, splits=self.splits or None)
