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

from dataclasses import dataclass
from typing import ClassVar

from dsv4.strategies.indexer.common import (fp4_keys, fp4_needs, fp4_queries, no_plan, triton_prepare, plain_keys,
                                           triton_scores)
from dsv4.strategies.indexer.top_k import DEFAULT_TOP_K, check_top_k


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp4SimIndexer:
    name: str = "fp4_sim"
    top_k: str = DEFAULT_TOP_K                # how the scores become lists on a GPU (top_k.TOP_K)
    __post_init__ = check_top_k
    error_budget: ClassVar[float] = 0.0       # the oracle applies the same numerics
    transforms: ClassVar[bool] = True
    fp4: ClassVar[bool] = True                # which the layer's kernels apply themselves on a GPU
    oracle_numerics: ClassVar[str] = "fp4"
    fp8_queries: ClassVar[bool] = False

    scores, prepare, plan, key_layout = staticmethod(triton_scores), triton_prepare, no_plan, plain_keys
    queries, keys, needs = fp4_queries, fp4_keys, fp4_needs
