"""Register the LiteLLM provider when LiteLLM is imported, without importing it ourselves.

``import litellm`` takes seconds, so this package never imports it eagerly. If LiteLLM is
already imported, registration happens at once; otherwise an import hook runs it right
after ``litellm`` finishes importing.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from typing import Callable, Optional

logger = logging.getLogger(__name__)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Meta-path finder that runs a callback once ``litellm`` has been executed."""

    def __init__(self, callback: Callable[[], object]) -> None:
        self.callback = callback

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname != "litellm":
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
        finally:
            pass
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module
        callback = self.callback

        def exec_module(module):  # type: ignore[no-untyped-def]
            original(module)
            _safely(callback)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _safely(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:  # registration must never break the user's import of litellm
        logger.exception("could not register the mlx-parallm LiteLLM provider")


_hook: Optional[_AfterImport] = None


def install(callback: Callable[[], object]) -> None:
    """Run ``callback`` now if LiteLLM is imported, else right after it gets imported."""
    global _hook
    if "litellm" in sys.modules:
        _safely(callback)
        return
    if _hook is None:
        _hook = _AfterImport(callback)
        sys.meta_path.insert(0, _hook)
