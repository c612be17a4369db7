"""mlx-parallm-provider: many concurrent LLM calls, one batched MLX decode loop.

Public API::

    from mlx_parallm_provider import get_engine, SamplingParams, EngineConfig
    engine = get_engine("default")
    out = await engine.generate(prompt, SamplingParams(max_tokens=64))

Importing this package does no work beyond registering the ``mlx-parallm`` LiteLLM provider,
now if LiteLLM is already imported, else as soon as it is (by importing
:mod:`.integrations.litellm`, which registers itself). ``mlx``, ``mlx-lm`` and the engine are
imported on first use of an engine name below (:data:`_ENGINE_NAMES`); the optimized BLAS for
MLX's CPU backend is loaded then, before mlx (see :mod:`.models.backend`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _import_hook
from .config import DeviceConfig, EngineConfig, PoolConfig
from .errors import (
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

if TYPE_CHECKING:
    from .engine import (
        Completion,
        Constraint,
        Delta,
        EmbeddingResult,
        Engine,
        EngineLike,
        SamplingParams,
        TokenLogprob,
        Usage,
        configure_pool,
        get_engine,
        pool_stats,
        shutdown_engines,
    )

_ENGINE_NAMES = frozenset({
    "Completion", "Constraint", "Delta", "EmbeddingResult", "Engine", "EngineLike", "SamplingParams", "TokenLogprob",
    "Usage", "configure_pool", "get_engine", "pool_stats", "shutdown_engines",
})
"""Names of :mod:`.engine` this package exports, imported on first access (they import mlx)."""

__version__ = "0.5.0"


def _load_litellm_adapter() -> Any:
    # Importing the adapter registers the provider. While the adapter is itself importing
    # LiteLLM this returns the half-loaded module, which registers when it finishes.
    return importlib.import_module(f"{__name__}.integrations.litellm")


def register() -> None:
    """Register the ``mlx-parallm`` provider with LiteLLM again (idempotent; imports
    LiteLLM), e.g. after ``litellm.custom_provider_map`` was replaced."""
    _load_litellm_adapter().register()


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        value = getattr(importlib.import_module(f"{__name__}.engine"), name)
        globals()[name] = value
        return value
    # The LiteLLM handler is built on first access: importing LiteLLM takes seconds.
    if name == "litellm_handler":
        from .integrations.litellm import litellm_handler

        return litellm_handler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _preload_blas() -> None:
    from .models.device import preload_blas

    preload_blas()


_import_hook.after_import("litellm", _load_litellm_adapter)
_import_hook.before_import("mlx", _preload_blas)

__all__ = [
    "Completion",
    "Constraint",
    "ContextWindowExceededError",
    "Delta",
    "DeviceConfig",
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
    "PoolConfig",
    "RequestFailedError",
    "RequestTimeoutError",
    "SamplingParams",
    "TokenLogprob",
    "UnsupportedModelError",
    "Usage",
    "__version__",
    "configure_pool",
    "get_engine",
    "litellm_handler",
    "pool_stats",
    "register",
    "shutdown_engines",
]
