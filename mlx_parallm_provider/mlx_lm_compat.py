"""Every use of mlx-lm's private state, in one place (issue 20).

mlx-lm's batch caches keep their write position and row lengths in private fields
(``_idx``, ``_lengths``) that the rectangle layout's prefix reuse has to set, and its tool
parser inference is a private function. Each access is a function here, so a change in
mlx-lm breaks one module and one test (``tests/unit/test_mlx_lm_compat.py``, pinned to the
range ``pyproject.toml`` supports), not the engine at run time. So is the one fix of an
mlx-lm model's batch behaviour (:func:`fit_grouped_query_masks`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx

SUPPORTED = ((0, 32, 2), (0, 33, 0))
"""mlx-lm versions this module is written for: at least the first, below the second."""


def write_index(cache: Any) -> int:
    """Where a (batch or rotating) KV cache writes its next token along the tokens axis."""
    return cache._idx


def set_prefilled(cache: Any, n: int) -> None:
    """Make a fresh single-row ``RotatingKVCache`` whose keys / values were just assigned
    look as if it had prefilled those ``n`` tokens itself."""
    cache.offset = cache._idx = n


def drop_leading_columns(cache: Any, cut: int) -> None:
    """Move a ``BatchKVCache``'s write position back after its first ``cut`` columns (all
    padding) were sliced off its keys and values."""
    cache._idx -= cut


def filter_rotating_lengths(cache: Any, keep: Sequence[int]) -> None:
    """``BatchRotatingKVCache.filter`` leaves the rows' prompt lengths (used by its
    prefill mask) unfiltered; keep those of the rows ``keep``."""
    lengths: Optional[mx.array] = getattr(cache, "_lengths", None)
    if lengths is not None:
        cache._lengths = lengths[mx.array(list(keep))]


GROUPED_SCORE_MODULES = frozenset({"mlx_lm.models.gemma2"})
"""mlx-lm model modules whose attention computes its own grouped-query scores as
``(B, kv_heads, repeats, L, S)`` and adds the mask unchanged, which fits a single row's
``(L, S)`` mask but not a batch cache's ``(B, 1, L, S)`` one."""

_FITTED: dict[type, type] = {}  # an mlx-lm attention class -> its subclass that fits masks


def _fitted_class(cls: type) -> type:
    if cls not in _FITTED:

        def __call__(self: Any, x: mx.array, mask: Optional[Any] = None, cache: Optional[Any] = None) -> mx.array:
            if isinstance(mask, mx.array) and mask.ndim == 4:
                mask = mx.expand_dims(mask, 2)  # (B, 1, L, S) -> (B, 1, 1, L, S): one for every repeat
            return cls.__call__(self, x, mask, cache)

        _FITTED[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__qualname__": cls.__qualname__})
    return _FITTED[cls]


def fit_grouped_query_masks(model: Any) -> int:
    """Give ``model``'s attention layers of the :data:`GROUPED_SCORE_MODULES` that group
    query heads (``repeats > 1``) a subclass that adds the repeats' axis to a batch mask, so
    batches of rows of different lengths run (mlx-lm 0.32's gemma2 raises a broadcast error
    at any such batch). Per instance: the mlx-lm class and other models are untouched.
    Returns the number of layers changed."""
    changed = 0
    for _, layer in model.named_modules() if hasattr(model, "named_modules") else ():
        cls = type(layer)
        if cls.__module__ in GROUPED_SCORE_MODULES and cls.__name__ == "Attention" and getattr(layer, "repeats", 1) > 1:
            layer.__class__ = _fitted_class(cls)
            changed += 1
    return changed


def infer_tool_parser(tokenizer: Any) -> Optional[str]:
    """The name of the tool-call parser mlx-lm would pick for ``tokenizer``'s chat template
    (a module of ``mlx_lm.tool_parsers``), or None when it picks none or cannot tell."""
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser

        return _infer_tool_parser(tokenizer)
    except Exception:
        return None
