"""mlx-parallm-provider: many concurrent LLM calls, one batched MLX decode loop.

Public API::

    from mlx_parallm_provider import get_engine, SamplingParams, EngineConfig
    engine = get_engine("default")
    out = await engine.generate(prompt, SamplingParams(max_tokens=64))

Importing this package loads an optimized BLAS for MLX's CPU backend when one is present
(it must happen before ``mlx`` is imported; see :mod:`.models.backend`), and registers the
``mlx-parallm`` LiteLLM provider, now if LiteLLM is already imported, else as soon as it is.
"""

from __future__ import annotations

import sys
from typing import Any

from .models.backend import preload_blas as _preload_blas

_preload_blas()

from . import _litellm_hook  # noqa: E402
from .config import EngineConfig  # noqa: E402
from .engine import Completion, Delta, Engine, SamplingParams, TokenLogprob, Usage, get_engine, shutdown_engines  # noqa: E402
from .errors import (  # noqa: E402
    ContextWindowExceededError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidParameterError,
    MLXParallmError,
    ModelLoadError,
    ModelNotFoundError,
    RequestTimeoutError,
    UnsupportedModelError,
)

__version__ = "0.1.0"


def register() -> None:
    """Register the ``mlx-parallm`` provider with LiteLLM (idempotent; imports LiteLLM)."""
    adapter = sys.modules.get(f"{__name__}.integrations.litellm")
    if adapter is not None and not hasattr(adapter, "register"):
        return  # the adapter itself is importing LiteLLM; it registers once it is loaded
    from .integrations.litellm import register as _register

    _register()


def __getattr__(name: str) -> Any:
    # The LiteLLM handler is built on first access: importing LiteLLM takes seconds.
    if name == "litellm_handler":
        from .integrations.litellm import litellm_handler

        return litellm_handler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_litellm_hook.install(register)

__all__ = [
    "Completion",
    "ContextWindowExceededError",
    "Delta",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineOverloadedError",
    "InvalidParameterError",
    "MLXParallmError",
    "ModelLoadError",
    "ModelNotFoundError",
    "RequestTimeoutError",
    "SamplingParams",
    "TokenLogprob",
    "UnsupportedModelError",
    "Usage",
    "__version__",
    "get_engine",
    "litellm_handler",
    "register",
    "shutdown_engines",
]
