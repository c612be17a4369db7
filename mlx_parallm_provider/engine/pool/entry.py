"""What the model pool counts: a model's cost (measured, or estimated before it loads) and its
entry (state, bytes, counts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ...config import EngineConfig
from ...models import registry

COUNTS = ("loads", "wakes", "sleeps", "idle_sleeps", "waits", "overloads")
"""Per model: first loads, wakes, sleeps (evictions, idle sleeps and :meth:`.Engine.sleep`
calls), idle sleeps among them, loads that had to wait for room, and loads that gave up."""


def engine_cost(engine: Any) -> int:
    """An engine's cost in the pool: its weights' bytes plus its KV budget (the KV arrays
    allocated so far where it has none)."""
    memory = engine.memory_bytes()
    budget = engine.config.kv_cache_memory_bytes
    return memory["weights"] + (budget if budget is not None else memory["kv"])


def estimate_cost(model: str, config: EngineConfig) -> int:
    """A model's cost before it is loaded: its weight files' bytes plus its KV budget."""
    return registry.estimate_nbytes(model) + (config.kv_cache_memory_bytes or 0)


@dataclass
class Entry:
    """One model's place in the pool: its engine, state, bytes counted and counts."""

    name: str
    engine: Optional[Any] = None
    state: str = "loading"
    bytes: int = 0  # counted against the budget: a reservation while loading, the measured cost once awake
    measured: Optional[int] = None  # the last measured cost: the next wake's reservation
    last_used: float = 0.0
    draining: bool = False  # a load waits for it to become idle: new requests to it wait
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))


def mib(nbytes: float) -> str:
    return f"{nbytes / 1024**2:.1f} MiB"
