"""Routing many mlx-parallm replicas behind LiteLLM's Router: prefix-aware, load-bounded.

:class:`PrefixAwareRouting` (a LiteLLM custom routing strategy; ``prefix_aware_routing`` is
the instance a proxy config names), :class:`HashRing` / :func:`choose` (consistent hashing
with bounded loads, no LiteLLM) and :func:`prefix_key` (what requests sharing a prefix share).
"""

from .hashring import Choice, HashRing, choose, hash64
from .prefix_key import prefix_key

__all__ = ["Choice", "HashRing", "PrefixAwareRouting", "choose", "hash64", "prefix_aware_routing", "prefix_key"]


def __getattr__(name: str):
    # The strategy imports LiteLLM (seconds): only when asked for.
    if name in ("PrefixAwareRouting", "prefix_aware_routing"):
        from . import strategy

        return getattr(strategy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
