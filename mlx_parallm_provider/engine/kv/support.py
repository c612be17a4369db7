"""Whether a model can run on paged KV, and which of its layers keep a recurrent state
instead: the one place in :mod:`.kv` that looks at mlx-lm's cache classes."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional

from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from ...errors import InvalidParameterError, UnsupportedModelError

logger = logging.getLogger(__name__)


def unsupported_reason(model: Any) -> Optional[str]:
    """Why ``model`` cannot run on paged KV (so cannot be served), or None if it can. A model
    whose attention is not routed through its backend (a module computing it itself that
    :mod:`...models.backends.routing` does not know) gets every row's blocks gathered per layer
    (:class:`.paged_cache.PagedBatch`'s ``gathered``), as mlx-lm's batch cache gives them.
    Hybrid models (attention layers beside state-space or linear-attention ones: LFM2,
    Qwen3.5, Granite 4.0-H, Nemotron-H) are served, their recurrent layers' state held per
    request (:mod:`.states`)."""
    if not hasattr(model, "layers"):
        return "the model has no layers list"
    windows = layer_windows(model)
    if windows is None:
        return (f"{type(model).__module__} has layers whose cache is neither a KV cache nor a recurrent state "
                "(chunked or kept-first-tokens attention, cache lists): only attention KV caches and hybrid models' "
                "recurrent states are served")
    if not windows:
        return (f"{type(model).__module__} has no attention layer (a state-space model): only models with attention "
                "layers, hybrid ones included, are served")
    return None


def ensure_servable(model: Any, name: str) -> None:
    """Raise :class:`~mlx_parallm_provider.errors.UnsupportedModelError` (at load, not at the
    first request) if ``model`` cannot be served, saying why."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise UnsupportedModelError(f"model {name!r} cannot be served: {reason}")


def _caches(model: Any) -> Optional[list[Any]]:
    make_cache = getattr(model, "make_cache", None)
    return make_cache() if make_cache is not None else None


def layer_windows(model: Any) -> Optional[list[Optional[int]]]:
    """Each attention layer's sliding window (None: it attends to every token), in layer
    order, as the caches ``model.make_cache()`` builds say (a ``RotatingKVCache`` that keeps
    no first tokens is a window of its size); a recurrent layer (:func:`recurrent_layers`)
    has none and is left out; None if some layer's cache is none of these kinds."""
    caches = _caches(model)
    if caches is None:
        return [None] * len(model.layers)
    windows: list[Optional[int]] = []
    for cache in caches:
        if type(cache) is KVCache:
            windows.append(None)
        elif type(cache) is RotatingKVCache and cache.keep == 0:
            windows.append(cache.max_size)
        elif not isinstance(cache, ArraysCache):
            return None
    return windows


def recurrent_layers(model: Any) -> dict[int, int]:
    """The layers whose cache is a recurrent state (mlx-lm's ``ArraysCache``: a state-space
    or linear-attention layer's convolution and scan states), each with how many arrays its
    state is; empty for a model of attention layers only."""
    return {layer: len(cache.cache) for layer, cache in enumerate(_caches(model) or []) if isinstance(cache, ArraysCache)}


PADDED_STATE_MODULES = frozenset({"lfm2", "lfm2_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe", "granitemoehybrid", "nemotron_h",
                                  "plamo2", "kimi_linear"})
"""mlx-lm model modules whose recurrent layers take a right-padded batch (``ArraysCache.lengths``:
each row's state is the one at its own last token). Others' prompts are prefilled a row at a
time (a batch's rows each as long as the pass)."""


def pads_states(model: Any) -> bool:
    """Whether ``model``'s recurrent layers can prefill rows of different lengths in one pass
    (:data:`PADDED_STATE_MODULES`)."""
    return type(model).__module__.rpartition(".")[2] in PADDED_STATE_MODULES


STATE_OFF = ("async_scheduling", "grammar_fast_forward")
"""Settings a model with recurrent layers runs without: a recurrent state is one per request
at its last token, so it cannot be rewound over tokens a step computed ahead or verified and
then dropped. (Prefix caching stays: prompts' states are kept at checkpoints, :mod:`.states`.)"""


def settings_for(model: Any, config: Any) -> Any:
    """``config`` (an :class:`~...config.EngineConfig`) as ``model`` can run it: for a model
    with recurrent layers, :data:`STATE_OFF` turned off (logged) and ``speculative`` /
    ``kv_disk_path`` refused (:class:`~...errors.InvalidParameterError`), as vLLM does for such
    models; else ``config`` itself."""
    if not recurrent_layers(model):
        return config
    for name, why in (("speculative", "a draft the model rejects cannot be taken back out of a recurrent state"),
                      ("kv_disk_path", "the disk tier stores KV blocks, not the recurrent states a cached prefix also needs")):
        if getattr(config, name) is not None:
            raise InvalidParameterError(name, f"not available for a model with state-space or linear-attention layers: {why}")
    off = {name: False for name in STATE_OFF if getattr(config, name)}
    if off:
        logger.info("%s has recurrent (state-space or linear-attention) layers: %s off", type(model).__module__, ", ".join(off))
    return replace(config, **off) if off else config


def with_max_kv_size(windows: list[Optional[int]], max_kv_size: Optional[int]) -> list[Optional[int]]:
    """Each layer's window once ``max_kv_size`` bounds every layer to that many recent tokens
    (as mlx-lm's batch rotating cache keeps them: none of the first tokens)."""
    if max_kv_size is None:
        return windows
    return [max_kv_size if w is None else min(w, max_kv_size) for w in windows]
