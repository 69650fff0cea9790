"""Host integer arithmetic for sizes: pages, launch grids, padded widths (Triton's `cdiv` and
`next_power_of_2` are constexpr functions, several µs a call outside a kernel)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host integers."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """The least multiple of b that is >= a."""
    return cdiv(a, b) * b


def next_pow2(n: int) -> int:
    """The least power of two >= n for n >= 1 (0 for n = 0), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
