"""indexer=fp4_sim: the numerics of DeepSeek's published inference code for V4 (`inference/model.py`,
`Indexer.forward` and `Compressor.forward` with `rotate=True`; `inference/kernel.py`, `fp4_act_quant`),
which the indexer was trained with (QAT): after RoPE, each 128-dim query head and each compressed key is
taken in bf16, rotated by the orthonormal Hadamard transform (Sylvester order, scale dim^-1/2, float32
butterflies, one rounding to bf16), then quantized and dequantized to FP4 -- e2m1 values (grid ±{0, 0.5,
1, 1.5, 2, 3, 4, 6}, round to nearest, ties to even) with one power-of-two scale per block of 32,
2^ceil(log2(amax / 6)) with amax clamped at 6·2^-126 --, in bf16 (dsv4/formats/fp4.py). The keys are
stored as these values. The rotation is orthogonal, so q·k changes only by the quantization. The
published code also rounds the head weights and the scores to bf16; here both stay float32 (summed by our
scoring kernel)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dsv4.formats.indexer_numerics import IndexerNumerics, QueryFormat
from dsv4.strategies.indexer.common import FP4_NEEDS, check_top_k, triton_scores
from dsv4.strategies.indexer.top_k.triton import TritonTopK
from dsv4.strategies.protocols import Needs, TopKStrategy


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp4SimIndexer:
    name: str = "fp4_sim"
    top_k: TopKStrategy = field(default_factory=TritonTopK)     # how its scores become lists on a GPU
    error_budget: ClassVar[float] = 0.0       # the oracle applies the same numerics
    numerics: ClassVar[IndexerNumerics] = IndexerNumerics.FP4
    query_format: ClassVar[QueryFormat] = QueryFormat.ROWS

    def __post_init__(self) -> None:
        check_top_k(self)

    def needs(self, device) -> Needs:
        return FP4_NEEDS

    def prepare(self, *, head_dim: int, device, batch_invariant: bool = False):
        from dsv4.kernels.target import device_target

        return device_target(device, fixed_order=batch_invariant)

    def key_layout(self, *, dtype: str, head_dim: int) -> None:
        """None: the FP4-simulated keys stored as plain rows in the activation dtype (bf16 values)."""
        return None

    def plan(self, *, token_request, counts, pages, block_size: int) -> None:
        return None

    def scores(self, q, w, keys, pages, token_request, counts, *, width: int, w_scale: float, plan=None,
               prepared=None):
        return triton_scores(q, w, keys, pages, token_request, counts, width=width, w_scale=w_scale,
                             prepared=prepared)
