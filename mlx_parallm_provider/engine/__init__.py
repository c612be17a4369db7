"""The batching engine: the API callers use (:mod:`.api`), the step loop (:mod:`.core`: scheduler, runner, KV manager)."""

from .. import models as _models  # noqa: F401  (first: loads the BLAS before mlx, see models/__init__)
from .api import Engine
from .embed.request import EmbeddingResult
from .grammar.constraint import Constraint
from .pool import configure_pool, get_engine, pool_stats, shutdown_engines
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
    "configure_pool",
    "get_engine",
    "pool_stats",
    "shutdown_engines",
]
