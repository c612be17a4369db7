"""Token-sequence comparison for prefix sharing: common prefixes, and whether a waiting prompt
waits for an in-flight prefill of the prefix it shares (no MLX)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence


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


def waits_for_sharer(request: Any, cached: int, sharers: Sequence[Any], min_shared_tokens: int,
                     capacity_tokens: Optional[int] = None, reusable: Callable[[int, int], int] = lambda n, _: n) -> bool:
    """Whether ``request`` should wait for an in-flight prefill of a prompt it shares
    a long prefix with (at least ``min_shared_tokens`` more than its ``cached`` tokens, or its
    whole prompt), instead of computing that prefix again alongside it. A sharer whose new
    tokens are more than the prefix store holds (``capacity_tokens``) is not waited for.
    ``reusable(shared, sharer's length)``: how much of the shared prefix the cache will hold
    (:meth:`.manager.KVCacheManager.reusable`)."""
    for sharer in sharers:
        if sharer.cache_namespace != request.cache_namespace:
            continue  # (another adapter's blocks: never shared)
        new_tokens = sharer.prompt_len - sharer.num_cached
        if capacity_tokens is not None and new_tokens > capacity_tokens:
            continue  # the store could not keep it
        shared = reusable(min(common_prefix_len(sharer.prompt_ids, request.prompt_ids), request.prompt_len - 1),
                          len(sharer.computed_ids))
        gain = shared - cached
        if gain >= min_shared_tokens or (gain > 0 and shared == request.prompt_len - 1):
            return True
    return False
