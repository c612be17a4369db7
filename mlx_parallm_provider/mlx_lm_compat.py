"""Every use of mlx-lm's private state, in one place (issue 20).

mlx-lm's batch caches keep their write position and row lengths in private fields
(``_idx``, ``_lengths``) that the rectangle layout's prefix reuse has to set, and its tool
parser inference is a private function. Each access is a function here, so a change in
mlx-lm breaks one module and one test (``tests/unit/test_mlx_lm_compat.py``, pinned to the
range ``pyproject.toml`` supports), not the engine at run time.
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


def infer_tool_parser(tokenizer: Any) -> Optional[str]:
    """The name of the tool-call parser mlx-lm would pick for ``tokenizer``'s chat template
    (a module of ``mlx_lm.tool_parsers``), or None when it picks none or cannot tell."""
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser

        return _infer_tool_parser(tokenizer)
    except Exception:
        return None
