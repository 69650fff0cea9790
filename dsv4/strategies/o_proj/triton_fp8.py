"""o_proj=triton_fp8: the fp8 projection (fp8_common.py) with our Triton grouped e4m3 product
(dsv4/kernels/products/fp8_grouped_gemm.py; NVIDIA sm89+): the numerics of DeepGEMM's `fp8_einsum`, its sums
in another order up to 16 tokens (K split over programs, the dots transposed)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from dsv4.kernels import FP8_TRITON_ARCHS
from dsv4.strategies.o_proj.fp8_common import Fp8WoA, block_scaled_weights, fp8_needs
from dsv4.strategies.protocols import Needs, OProjWeights


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonFp8OProj:
    """The same fp8 projection with our Triton grouped product (dsv4/kernels/products/fp8_grouped_gemm.py), for
    NVIDIA GPUs with fp8 tensor cores (sm89+) and no DeepGEMM. Launch defaults from the H200 sweep
    (docs/notes/2026-12-04-fp8-products.md)."""
    name: str = "triton_fp8"
    error_budget: ClassVar[float] = 5e-2     # vs the oracle: e4m3 activations and weights
    block_m: int = 64         # tokens per program
    num_warps: int = 4
    num_stages: int = 4       # software-pipelining depth of the K loop

    def __post_init__(self) -> None:
        for key, allowed in (("block_m", (64, 128)), ("num_warps", (4, 8)), ("num_stages", (1, 2, 3, 4))):
            if getattr(self, key) not in allowed:
                raise ValueError(f"o_proj=triton_fp8: {key}={getattr(self, key)} is not one of {allowed}")

    def needs(self, device) -> Needs:
        # batch invariant: one launch shape (block_m rows, all of K) whatever the step's tokens (prepare keeps
        # no counters then, so the few-token launch, which splits K, is not taken)
        return replace(fp8_needs(archs=FP8_TRITON_ARCHS), batch_invariant=True)

    def prepare(self, weights: OProjWeights, *, device, dtype: str, batch_invariant: bool = False) -> Fp8WoA:
        """The weights in blocks, the device's facts the product's calls plan by (resolved once) and, unless
        batch_invariant, the few-token launch's arrival counters."""
        from dsv4.kernels.products.fp8_grouped_gemm import counters
        from dsv4.kernels.target import device_target

        blocks = block_scaled_weights(weights, device)
        G, N = blocks.weight.shape[:2]
        count = None if batch_invariant else counters(G, N, blocks.weight.device)
        return replace(blocks, target=device_target(device), count=count)

    def __call__(self, o, rot, *, prepared: Fp8WoA):
        from dsv4.kernels.products.fp8_grouped_gemm import grouped_fp8_gemm

        x, xs = prepared.prologue(o, rot, prepared.groups)
        z = grouped_fp8_gemm(x, xs, prepared.weight, prepared.scale, block_m=self.block_m, num_warps=self.num_warps,
                             num_stages=self.num_stages, target=prepared.target, count=prepared.count)
        return z.flatten(1)
