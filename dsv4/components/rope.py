"""RoPE of DSV4 (docs/numerics.md §2.3): GPT-J interleaved pairs on the LAST 64 dims of a vector.

SWA-only layers use plain RoPE with `rope_theta`; compressed layers use YaRN with
`compress_rope_theta`. One table per layer serves q, KV, compressed KV, the indexer and the inverse
rotation of the output. The numbers are those of DeepSeek's published inference code
(`precompute_freqs_cis`), bit for bit: frequencies in float32, angle = float32 position × float32
frequency, cos/sin of that float32 angle via `torch.polar`. The model runs with these angles (off the
exact ones by up to half an ulp of p·f: ~3e-4 at 10k positions, ~2e-3 at 100k), so we use them too.
Rows are made at the positions asked for, not from a [max_pos, 64] table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dsv4.values.layer_types import by_ratio
from dsv4.values.seam import ROPE_DIM, RopeRows
from dsv4.values.spec import ModelSpec


def rope_frequencies(spec: ModelSpec, ratio: int) -> list[float]:
    """The 32 pair frequencies (float32 values) of a layer with compress ratio `ratio` (1 = SWA-only),
    computed with the published code's float32 torch ops, so they round as the model's do."""
    import torch

    half = ROPE_DIM // 2
    compressed = by_ratio(max(1, ratio)).compressed
    base = spec.compress_rope_theta if compressed else spec.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM))
    if compressed:
        ys = spec.rope_scaling
        orig = ys.original_max_position_embeddings

        def corr_dim(rotations: float) -> float:
            return ROPE_DIM * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo = max(math.floor(corr_dim(ys.beta_fast)), 0)
        hi = min(math.ceil(corr_dim(ys.beta_slow)), ROPE_DIM - 1)
        if hi == lo:
            hi += 0.001
        smooth = 1 - ((torch.arange(half, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        freqs = freqs / ys.factor * (1 - smooth) + freqs * smooth     # the published order of operations
    return freqs.tolist()


_FREQ_TENSORS: dict = {}


def _freq_tensor(freqs: tuple[float, ...], device):
    """The frequencies as a float32 tensor on `device`, made once (no host copy on later calls, so
    RoPE can be captured in a CUDA graph)."""
    import torch

    key = (freqs, str(device))
    if key not in _FREQ_TENSORS:
        _FREQ_TENSORS[key] = torch.tensor(freqs, dtype=torch.float32, device=device)
    return _FREQ_TENSORS[key]


@dataclass(frozen=True, slots=True, kw_only=True)
class Rope:
    freqs: tuple[float, ...]     # 32 pair frequencies, used as float32

    @classmethod
    def for_layer(cls, spec: ModelSpec, ratio: int) -> "Rope":
        return cls(freqs=tuple(rope_frequencies(spec, ratio)))

    def cos_sin(self, positions):
        """float32 cos, sin of shape [*positions.shape, 32]: torch.polar of the float32 angle, as the published
        table is made (torch.polar's cos/sin are not always torch.cos/torch.sin to the last bit)."""
        import torch

        ang = positions.to(torch.float32)[..., None] * _freq_tensor(self.freqs, positions.device)
        cis = torch.polar(torch.ones_like(ang), ang)
        return cis.real.contiguous(), cis.imag.contiguous()

    def at(self, positions) -> RopeRows:
        c, s = self.cos_sin(positions)
        return RopeRows(cos=c, sin=s)

    def cos_sin_cache(self, num_positions: int, device: str = "cpu"):
        """[num_positions, 64] float32 = [cos ‖ sin], the table vendor kernels take."""
        import torch

        c, s = self.cos_sin(torch.arange(num_positions, device=device))
        return torch.cat((c, s), -1)

    def apply(self, x, positions, *, inverse: bool = False):
        """Rotate x[..., -64:] at `positions` ([T]; x is [T, ..., D]). Returns float32."""
        return self.at(positions).rotate(x, inverse=inverse)
