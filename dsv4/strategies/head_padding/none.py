"""head_padding=none: the q/out buffers hold exactly the rank's heads."""
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
