"""Token-sequence comparison shared by the scheduler and the prefix store (no MLX)."""

from __future__ import annotations

from typing import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    lo, hi = 0, min(len(a), len(b))
    if list(a[:hi]) == list(b[:hi]):
        return hi
    while lo < hi:  # a[:lo] == b[:lo], and the answer is at most hi
        mid = (lo + hi + 1) // 2
        if list(a[lo:mid]) == list(b[lo:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo
