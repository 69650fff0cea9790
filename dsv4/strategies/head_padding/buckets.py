"""head_padding=buckets_*: the q/out buffers hold the smallest bucket that fits the rank's heads (the
head counts a vendor kernel takes: FlashMLA 64/128, FlashInfer powers of two, aiter multiples of 16)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketHeadPadding:
    """Pad to the smallest bucket that holds the rank's heads: FlashMLA {64, 128}, FlashInfer {8..128}."""
    name: str
    buckets: tuple[int, ...]

    def __post_init__(self) -> None:
        b = tuple(sorted(int(x) for x in self.buckets))
        if not b or b[0] < 1:
            raise ValueError(f"head_padding={self.name}: buckets must be positive, got {self.buckets}")
        object.__setattr__(self, "buckets", b)

    def padded_heads(self, heads: int) -> int | None:
        return next((b for b in self.buckets if b >= heads), None)

    def supported(self) -> tuple[int, ...]:
        return self.buckets
