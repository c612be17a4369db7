"""The process's model pool: every engine :func:`get_engine` makes, one per model name, under
one memory budget (:class:`~mlx_parallm_provider.config.PoolConfig`; :class:`.ModelPool` says how).
"""

from __future__ import annotations

import atexit
from typing import Any, Optional

from ...config import EngineConfig, PoolConfig
from ..api import Engine, _live_engines
from ..exit_guard import shut_down_at_exit
from .entry import engine_cost, estimate_cost
from .model_pool import ModelPool

__all__ = ["ModelPool", "configure_pool", "engine_cost", "estimate_cost", "get_engine", "pool_stats", "shutdown_engines"]

_engines: dict[str, Engine] = {}
_pool = ModelPool(engines=_engines)
_engines_lock = _pool._cond


def get_engine(model: str = "default", config: Optional[EngineConfig] = None) -> Engine:
    """The process-wide engine for ``model`` (created and loaded on first use).

    Every front door (LiteLLM, LangChain, direct calls, any thread or event loop) that asks
    for the same model name shares this engine, so their requests batch together. The
    first call's ``config`` configures it; later calls may omit it. Engines live in the
    process's model pool (:func:`configure_pool`): under a memory budget a model may be put
    to sleep, and its next request wakes it.
    """
    return _pool.get(model, config)


def configure_pool(config: Optional[PoolConfig] = None, **fields: Any) -> PoolConfig:
    """Set the process's model pool: a :class:`PoolConfig`, or its fields
    (``memory_gb``, ``idle_unload_s``, ``load_wait_s``; the rest from the environment).
    Returns the config in force."""
    config = config if config is not None else PoolConfig(**fields)
    _pool.configure(config)
    return config


def pool_stats() -> dict[str, Any]:
    """The process's model pool: budget, bytes counted now and at peak, and per model its
    state, bytes and counts (loads, wakes, sleeps, idle sleeps, waits, overloads)."""
    return _pool.stats()


def shutdown_engines() -> None:
    """Stop every engine's worker (also run at interpreter exit)."""
    _pool.shutdown()
    for engine in list(_live_engines):
        engine.shutdown()


atexit.register(shut_down_at_exit, shutdown_engines)
