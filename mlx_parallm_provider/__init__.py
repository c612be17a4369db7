"""mlx-parallm-provider: many concurrent LLM calls, one batched MLX decode loop.

Importing this package loads an optimized BLAS for MLX's CPU backend when one is present
(it must happen before ``mlx`` is imported; see :mod:`.models.backend`).
"""

from __future__ import annotations

from .models.backend import preload_blas as _preload_blas

_preload_blas()

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
from .engine.request import Completion, Delta, SamplingParams, Usage  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Completion",
    "ContextWindowExceededError",
    "Delta",
    "EngineDeadError",
    "EngineOverloadedError",
    "InvalidParameterError",
    "MLXParallmError",
    "ModelLoadError",
    "ModelNotFoundError",
    "RequestTimeoutError",
    "SamplingParams",
    "UnsupportedModelError",
    "Usage",
    "__version__",
]
