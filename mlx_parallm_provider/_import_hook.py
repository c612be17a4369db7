"""The package's one import hook: work deferred to another module's first import.

* ``litellm``: importing it takes seconds, so this package never imports it eagerly; the
  ``mlx-parallm`` provider is registered right after ``litellm`` finishes importing (at once
  if it already has).
* ``mlx``: MLX binds its BLAS when it first loads, so the fast CPU BLAS is loaded just before
  (:func:`.models.device.preload_blas`), whichever of ``mlx`` or this package the program
  imports first: importing the package does no work itself. If ``mlx`` was imported before
  this package, the CPU kernels call the BLAS privately instead (see
  :mod:`.models.private_blas`).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from typing import Callable, Optional

logger = logging.getLogger(__name__)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Meta-path finder that runs callbacks before and after named top-level modules import."""

    def __init__(self) -> None:
        self.before: dict[str, Callable[[], object]] = {}
        self.after: dict[str, Callable[[], object]] = {}

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        before, after = self.before.pop(fullname, None), self.after.pop(fullname, None)
        if not self.before and not self.after and self in sys.meta_path:
            sys.meta_path.remove(self)
        if before is not None:
            _safely(before)
        if after is None:
            return None  # the other finders import it as usual
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            original(module)
            _safely(after)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _safely(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:  # the hook must never break the user's import
        logger.exception("mlx-parallm's import hook failed")


_hook: Optional[_ImportHook] = None


def _installed() -> _ImportHook:
    global _hook
    if _hook is None:
        _hook = _ImportHook()
    if _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
    return _hook


def after_import(name: str, callback: Callable[[], object]) -> None:
    """Run ``callback`` now if module ``name`` is imported, else right after it gets imported."""
    if name in sys.modules:
        _safely(callback)
    else:
        _installed().after[name] = callback


def before_import(name: str, callback: Callable[[], object]) -> None:
    """Run ``callback`` right before module ``name`` first imports (never, if it already has)."""
    if name not in sys.modules:
        _installed().before[name] = callback
