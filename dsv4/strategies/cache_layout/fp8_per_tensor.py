"""cache_layout=fp8_per_tensor: e4m3 rows with one scale for the whole cache, FlashInfer sm100's fp8
rows (docs/numerics.md §3.3). Its RowFormat carries `kv_scale` and `q_scale`, which a kernel reading
these rows takes its query and its bmm scales from (dsv4/formats/fp8.py)."""
from __future__ import annotations

import math

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from dsv4.formats.fp8 import E4M3_MAX, E4M3_MIN_SUBNORMAL, e4m3_dtype, e4m3_over
from dsv4.formats.row_format import RowFormat, RowKind
from dsv4.formats.scatter import kept_rows
from dsv4.strategies.cache_layout.common import FP8_ROWS_ROUNDING_BUDGET
from dsv4.strategies.protocols import CacheAccess, Needs, SettingRange

# Cached rows are RMS-normed (kv_norm, the compressors' norm) and queries too (per head): their values are
# ~1 times the norm's weight. Over a scale below 1/448 a typical value passes e4m3's largest and saturates;
# over one above 2^9 it falls to e4m3's smallest step, 2^-9, or to 0 (measured on dsv4_tiny's random
# weights: the output's error against float32 rows is 0.5 at 1/448 and 0.4 at 512, 1 from 4096 up; 3.5e-2,
# e4m3's own, from 0.1 to 16).
TYPICAL_VALUE = 1.0


def _scale_range(setting: str, what: str) -> SettingRange:
    """The scales over which a typical value of `what` (RMS-normed) lands inside e4m3's range."""
    low, high = TYPICAL_VALUE / E4M3_MAX, TYPICAL_VALUE / E4M3_MIN_SUBNORMAL
    values = f"{what} are RMS-normed (values ~{TYPICAL_VALUE:g})"
    return SettingRange(setting=setting, low=low, high=high,
                        below=f"{values}: divided by a scale below {low:.3g} they pass e4m3's largest value "
                              f"({E4M3_MAX:g}) and are stored as +-{E4M3_MAX:g}*{setting}",
                        above=f"{values}: divided by a scale above {high:g} they fall to e4m3's smallest step "
                              f"(2^{math.log2(E4M3_MIN_SUBNORMAL):.0f}) or to 0")


SCALE_RANGES = (_scale_range("kv_scale", "cached rows"), _scale_range("q_scale", "queries"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp8PerTensorLayout:
    """e4m3 rows [num_blocks, B, 512] with one scale for the whole cache (FlashInfer sm100's fp8 path).

    A row is stored as e4m3(bf16(row) / kv_scale); an fp8 query as e4m3(q / q_scale). A kernel then
    takes bmm1_scale = softmax_scale · q_scale · kv_scale and bmm2_scale = kv_scale (vLLM fixes both
    scales at 1.0 for DSV4: the RMS-normed rows sit well inside e4m3's ±448).
    """
    name: str = "fp8_per_tensor"
    error_budget: ClassVar[float] = 1e-4     # vs the oracle: the oracle rounds rows as stored
    rounding_budget: ClassVar[float] = FP8_ROWS_ROUNDING_BUDGET     # vs exact float32 rows (common.py)
    kv_scale: float = 1.0
    q_scale: float = 1.0

    def __post_init__(self) -> None:
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (self.kv_scale, self.q_scale)):
            raise ValueError(f"cache_layout={self.name}: kv_scale and q_scale must be finite numbers > 0 "
                             f"(got {self.kv_scale}, {self.q_scale})")

    @property
    def row_format(self) -> RowFormat:
        return RowFormat(kind=RowKind.FP8_PER_TENSOR, fp8="ocp", kv_scale=self.kv_scale, q_scale=self.q_scale)

    def needs(self, device) -> Needs:
        return Needs(batch_invariant=True, setting_ranges=SCALE_RANGES)       # each row rounded by itself

    def bytes_per_token(self, head_dim: int) -> int:
        return head_dim

    def page_bytes(self, block_size: int, head_dim: int) -> int:
        return block_size * head_dim

    def allocate(self, *, num_blocks: int, block_size: int, head_dim: int, device: str):
        import torch

        return torch.zeros(num_blocks, block_size, head_dim, dtype=e4m3_dtype(), device=device)

    @staticmethod
    def quantize(x, scale: float):
        return e4m3_over(x, scale)

    def scatter(self, cache, slots, rows) -> None:
        """Rows quantized from their bf16 value, as vLLM's insert op does, at their slots (-1: skip): one
        scatter on every device that never reads how many rows are kept (`kept_rows`), so that a GPU step's
        writes can be captured; the bytes are those of the kept rows alone."""
        import torch

        if not slots.shape[0]:
            return
        flat = cache.view(-1, cache.shape[-1])
        src, any_kept = kept_rows(slots)
        tgt = slots.index_select(0, src).clamp(min=0).long()
        vals = self.quantize(rows.index_select(0, src).bfloat16(), self.kv_scale)
        flat[tgt] = torch.where(any_kept, vals.view(torch.uint8), flat[tgt].view(torch.uint8)).view(flat.dtype)

    def read(self, cache, slots, *, block_size: int):
        import torch

        rows = cache.view(-1, cache.shape[-1])[slots.clamp(min=0).long()].float() * self.kv_scale
        return torch.where((slots >= 0)[..., None], rows, torch.zeros((), device=rows.device))

    def access(self, cache, *, block_size: int, gpu: bool) -> CacheAccess:
        """One writer on every device (`scatter`); the kernels have no store for these rows."""
        return CacheAccess(write=partial(self.scatter, cache))
