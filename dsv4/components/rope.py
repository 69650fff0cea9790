"""RoPE of DSV4 (DSV4_SPEC §2.3): GPT-J interleaved pairs on the LAST 64 dims of a vector.

SWA-only layers use plain RoPE with `rope_theta`; compressed layers use YaRN with
`compress_rope_theta`. One table per layer serves q, KV, compressed KV, the indexer and the inverse
rotation of the output. Angles are computed in float64 from the positions asked for (no
[max_pos, 64] table: at 1M positions float32 angles lose several bits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dsv4.spec import ModelSpec

ROPE_DIM = 64


def rope_frequencies(spec: ModelSpec, ratio: int) -> list[float]:
    """The 32 pair frequencies of a layer with compress ratio `ratio` (1 = SWA-only)."""
    half = ROPE_DIM // 2
    if ratio <= 1:
        return [spec.rope_theta ** (-2 * i / ROPE_DIM) for i in range(half)]
    base = spec.compress_rope_theta
    ys = spec.rope_scaling
    orig, factor = ys.original_max_position_embeddings, ys.factor

    def corr_dim(rotations: float) -> float:
        return ROPE_DIM * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(corr_dim(ys.beta_fast)), 0)
    hi = min(math.ceil(corr_dim(ys.beta_slow)), ROPE_DIM - 1)
    if hi == lo:
        hi += 1e-3
    out = []
    for i in range(half):
        f = base ** (-2 * i / ROPE_DIM)
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out.append(f * (1 - ramp) + (f / factor) * ramp)
    return out


_FREQ_TENSORS: dict = {}


def _freq_tensor(freqs: tuple[float, ...], device):
    """The frequencies as a float64 tensor on `device`, made once (no host copy on later calls, so
    RoPE can be captured in a CUDA graph)."""
    import torch

    key = (freqs, str(device))
    if key not in _FREQ_TENSORS:
        _FREQ_TENSORS[key] = torch.tensor(freqs, dtype=torch.float64, device=device)
    return _FREQ_TENSORS[key]


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeRows:
    """cos, sin [T, 32] float32 of one RoPE table at T positions: what rotating T rows needs. A step
    plan makes them once per table and step (`StepPlan.rope_rows`); kernels take them as they are."""
    cos: Any
    sin: Any

    def rotate(self, x, *, inverse: bool = False):
        """Rotate x[..., -64:] (x is [T, ..., D]). Returns float32."""
        import torch

        c, s = self.cos, self.sin
        while c.dim() < x.dim():                     # broadcast over head dims
            c, s = c.unsqueeze(-2), s.unsqueeze(-2)
        if inverse:
            s = -s
        xf = x.float()
        pairs = xf[..., -ROPE_DIM:].unflatten(-1, (ROPE_DIM // 2, 2))
        ev, od = pairs[..., 0], pairs[..., 1]
        rot = torch.stack((ev * c - od * s, od * c + ev * s), -1).flatten(-2)
        return torch.cat((xf[..., :-ROPE_DIM], rot), -1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Rope:
    freqs: tuple[float, ...]     # 32 pair frequencies

    @classmethod
    def for_layer(cls, spec: ModelSpec, ratio: int) -> "Rope":
        return cls(freqs=tuple(rope_frequencies(spec, ratio)))

    def cos_sin(self, positions):
        """float32 cos, sin of shape [*positions.shape, 32], angles in float64."""
        import torch

        ang = positions.to(torch.float64)[..., None] * _freq_tensor(self.freqs, positions.device)
        return ang.cos().float(), ang.sin().float()

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
