"""HeadPaddingPolicy options: the head count q/out buffers are allocated at."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class NoHeadPadding:
    """Allocate exactly the rank's heads (reference, Triton, ROCm)."""
    name: str = "none"

    def padded_heads(self, heads: int) -> int | None:
        return heads

    def supported(self) -> tuple[int, ...]:
        return ()


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
