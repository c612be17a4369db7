"""mlx-parallm-provider: many concurrent LLM calls, one batched MLX decode loop.

Public API::

    from mlx_parallm_provider import get_engine, SamplingParams, EngineConfig
    engine = get_engine("default")
    out = await engine.generate(prompt, SamplingParams(max_tokens=64))

Importing this package loads an optimized BLAS for MLX's CPU backend when one is present
(it must happen before ``mlx`` is imported; see :mod:`.models.backend`), and registers the
``mlx-parallm`` LiteLLM provider, now if LiteLLM is already imported, else as soon as it is
(by importing :mod:`.integrations.litellm`, which registers itself).
"""

from __future__ import annotations

import importlib
from typing import Any

from .models.backend import preload_blas as _preload_blas

_preload_blas()

from . import _litellm_hook  # noqa: E402
from .config import EngineConfig  # noqa: E402
from .engine import (  # noqa: E402
    Constraint,
    Completion,
    Delta,
    EmbeddingResult,
    Engine,
    EngineLike,
    SamplingParams,
    TokenLogprob,
    Usage,
    get_engine,
    shutdown_engines,
)
from .errors import (  # noqa: E402
    BackendError,
    ContextWindowExceededError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidParameterError,
    MLXParallmError,
    ModelLoadError,
    ModelNotFoundError,
    RequestFailedError,
    RequestTimeoutError,
    UnsupportedModelError,
)

__version__ = "0.1.0"


def _load_litellm_adapter() -> Any:
    # Importing the adapter registers the provider. While the adapter is itself importing
    # LiteLLM this returns the half-loaded module, which registers when it finishes.
    return importlib.import_module(f"{__name__}.integrations.litellm")


def register() -> None:
    """Register the ``mlx-parallm`` provider with LiteLLM again (idempotent; imports
    LiteLLM), e.g. after ``litellm.custom_provider_map`` was replaced."""
    _load_litellm_adapter().register()


def __getattr__(name: str) -> Any:
    # The LiteLLM handler is built on first access: importing LiteLLM takes seconds.
    if name == "litellm_handler":
        from .integrations.litellm import litellm_handler

        return litellm_handler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_litellm_hook.install(_load_litellm_adapter)

__all__ = [
    "Completion",
    "Constraint",
    "ContextWindowExceededError",
    "Delta",
    "EmbeddingResult",
    "Engine",
    "EngineConfig",
    "EngineLike",
    "BackendError",
    "EngineDeadError",
    "EngineOverloadedError",
    "InvalidParameterError",
    "MLXParallmError",
    "ModelLoadError",
    "ModelNotFoundError",
    "RequestFailedError",
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
