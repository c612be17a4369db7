"""The batching engine: coordinator (callers' side), scheduler (policy), worker (MLX)."""

from .. import models as _models  # noqa: F401  (first: loads the BLAS before mlx, see models/__init__)
from .constraint import Constraint
from .coordinator import Engine, get_engine, shutdown_engines
from .embedding import EmbeddingResult
from .protocol import EngineLike
from .request import Completion, Delta, SamplingParams, TokenLogprob, Usage

__all__ = [
    "Completion",
    "Constraint",
    "Delta",
    "EmbeddingResult",
    "Engine",
    "EngineLike",
    "SamplingParams",
    "TokenLogprob",
    "Usage",
    "get_engine",
    "shutdown_engines",
]
