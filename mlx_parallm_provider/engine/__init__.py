"""The batching engine: the API callers use (:mod:`.api`), the step loop (:mod:`.core`: scheduler, runner, KV manager)."""

from .. import models as _models  # noqa: F401  (first: loads the BLAS before mlx, see models/__init__)
from . import api, pool
from .api import Engine
from .embed.request import EmbeddingResult
from .grammar.constraint import Constraint
from .pool import configure_pool, get_engine, pool_stats, shutdown_engines
from .protocol import EngineLike
from .request import Completion, Delta, SamplingParams, TokenLogprob, Usage

# Their home was engine.api before the model pool took them: still reachable there.
api.get_engine, api.shutdown_engines, api._engines, api._engines_lock = get_engine, shutdown_engines, pool._engines, pool._engines_lock  # type: ignore[attr-defined]

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
