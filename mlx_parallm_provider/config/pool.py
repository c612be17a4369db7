""":class:`PoolConfig`: the process's model pool, each field's default from its variable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from .._validation import Limit
from .settings import CheckedSettings, Setting, parse_number, setting_field

POOL_SETTINGS: dict[str, Setting] = {
    "memory_gb": Setting(Limit("number", 0.0, optional=True, positive=True, hint="None: no budget"), "MLX_PARALLM_POOL_MEMORY_GB",
                         None, parse_number),
    "idle_unload_s": Setting(Limit("number", 0.0, optional=True, positive=True, hint="None: never"), "MLX_PARALLM_POOL_IDLE_UNLOAD_S",
                             None, parse_number),
    "load_wait_s": Setting(Limit("number", 0.0, 3600.0), "MLX_PARALLM_POOL_LOAD_WAIT_S", 30.0, parse_number),
}
""":class:`PoolConfig`'s fields: limits, variables, built-in defaults."""


def _field(name: str) -> Any:
    return setting_field(POOL_SETTINGS, name)


@dataclass(frozen=True)
class PoolConfig(CheckedSettings):
    """The process's model pool: every engine :func:`~mlx_parallm_provider.get_engine` makes
    (one per model name) shares one memory budget. Per process: set it with
    :func:`~mlx_parallm_provider.configure_pool` or the variables below (read when the pool is
    first used); the defaults keep every model loaded for the life of the process.

    Attributes:
        memory_gb: the budget for every pooled model's weights and KV pool together (a
            model's weights: every array its modules hold; its KV: ``kv_cache_memory_gb``
            where set, else the KV arrays allocated so far). Loading or waking a model that
            does not fit puts the least recently used idle model to sleep first (never one
            with requests in flight); a model larger than the whole budget is refused with
            :class:`~mlx_parallm_provider.errors.ModelLoadError`. None: no budget.
        idle_unload_s: a model without requests for this long is put to sleep (weights and
            KV freed, the engine kept; the next request wakes it). None: never.
        load_wait_s: how long a load waits for a busy model to become idle so it can be put to
            sleep; past it the load fails with
            :class:`~mlx_parallm_provider.errors.EngineOverloadedError`.
    """

    _SETTINGS: ClassVar[dict[str, Setting]] = POOL_SETTINGS
    memory_gb: Optional[float] = _field("memory_gb")
    idle_unload_s: Optional[float] = _field("idle_unload_s")
    load_wait_s: float = _field("load_wait_s")

    @property
    def memory_bytes(self) -> Optional[int]:
        """The budget in bytes, or None."""
        return None if self.memory_gb is None else int(self.memory_gb * 1024**3)
