"""Every use of mlx-lm's private or unstable surface, in one place (issue 20).

Its tool parser inference is a private function, and one mlx-lm model's batch behaviour
needs a fix (:func:`fit_grouped_query_masks`). Each is a function here, so a change in mlx-lm
breaks one module and one test (``tests/unit/test_mlx_lm_compat.py``, pinned to the range
``pyproject.toml`` supports), not the engine at run time. (Since the rectangle KV layout
went, no mlx-lm cache's private fields are written anywhere.)"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx  # noqa: E402

from . import models as _models  # noqa: F401  (first: loads the BLAS before mlx, see models/__init__)

SUPPORTED = ((0, 32, 2), (0, 33, 0))
"""mlx-lm versions this module is written for: at least the first, below the second."""


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
    at any such batch). Per instance: the mlx-lm class and other models are untouched; a layer
    routed through its backend (:mod:`.models.backends.softcapped`) runs none of that code and
    is left as it is. Returns the number of layers changed."""
    from .models.backends.routing import routed_backend

    changed = 0
    for _, layer in model.named_modules() if hasattr(model, "named_modules") else ():
        cls = type(layer)
        if routed_backend(layer) is not None:
            continue
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
