""":class:`ModelPool`: engines by model name under one memory budget
(:class:`~mlx_parallm_provider.config.PoolConfig`).

A model's cost is its weights' bytes (every array its modules hold) plus its KV pool
(``kv_cache_memory_gb`` where set, else the KV arrays allocated so far). Before a model loads
or wakes, its cost is reserved under the pool's lock (an estimate from its weight files the
first time, its measured cost after), so two loads at once cannot overshoot the budget; the
reservation is corrected to the measured cost once loaded. A load that does not fit puts
the least recently used idle model to sleep (:meth:`.Engine.sleep`), never one with a request
in flight: it waits for one to become idle up to ``load_wait_s``, then fails with
:class:`~mlx_parallm_provider.errors.EngineOverloadedError`. Meanwhile the least recently used
busy model drains: its new requests wait (:meth:`ModelPool.admit`) until it is asleep, so a
stream of requests to the loaded models cannot starve the load. With ``idle_unload_s``, a daemon
thread puts models idle that long to sleep. A request to a sleeping engine wakes it through
the pool (:mod:`.sleep`).

Each entry's state: ``loading`` (its cost reserved), ``awake``, ``unloading`` (still
counted) or ``asleep`` (nothing counted).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from ...config import EngineConfig, PoolConfig
from ...errors import EngineOverloadedError, InvalidParameterError, ModelLoadError
from ..api import Engine
from .entry import COUNTS, Entry, engine_cost, estimate_cost, mib

logger = logging.getLogger(__name__)

POLL_S = 0.05
"""How often a load waiting for an idle model looks again (requests end on the worker's thread)."""


class ModelPool:
    """Engines by model name, under one memory budget (see the module's docstring).

    Args:
        config: the budget and timings (default :class:`PoolConfig`'s, from the environment,
            read on first use).
        engine_factory: makes an engine (``Engine(model, config)``).
        estimate: a model's cost before loading (:func:`estimate_cost`).
        cost: an engine's measured cost (:func:`engine_cost`).
        engines: the dict of engines by name the pool fills (shared with older code).
    """

    def __init__(self, config: Optional[PoolConfig] = None, *, engine_factory: Callable[[str, EngineConfig], Any] = Engine,
                 estimate: Callable[[str, EngineConfig], int] = estimate_cost, cost: Callable[[Any], int] = engine_cost,
                 engines: Optional[dict[str, Any]] = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._factory, self._estimate, self._cost, self._clock = engine_factory, estimate, cost, clock
        self.engines: dict[str, Any] = engines if engines is not None else {}
        self._entries: dict[str, Entry] = {}
        self._cond = threading.Condition(threading.Lock())
        self._stop = threading.Event()
        self._sweeper: Optional[threading.Thread] = None
        self.peak_bytes = 0

    @property
    def config(self) -> PoolConfig:
        if self._config is None:
            self._config = PoolConfig()
        return self._config

    def configure(self, config: PoolConfig) -> None:
        """Replace the settings; models over a smaller budget are put to sleep (idle ones)."""
        with self._cond:
            self._config = config
            self._fit(None)
            self._start_sweeper()
            self._cond.notify_all()

    # -- engines -----------------------------------------------------------------------------

    def get(self, model: str = "default", config: Optional[EngineConfig] = None) -> Any:
        """The engine for ``model``, made and loaded on first use (room made first where the
        budget needs it). A later call's ``config`` must equal the first's."""
        with self._cond:
            self._start_sweeper()
            while True:
                engine = self.engines.get(model)
                if engine is not None:
                    if config is not None and config != engine.config:
                        raise InvalidParameterError("config", f"the engine for {model!r} already runs with another config; call shutdown_engines() first")
                    if model in self._entries:
                        self._entries[model].last_used = self._clock()
                    return engine
                if model not in self._entries:
                    break
                self._cond.wait()  # another thread is loading it
            entry = self._entries[model] = Entry(model)  # (loading: other callers for it wait)
        config = config or EngineConfig.from_env()
        try:
            nbytes = self._estimate(model, config)  # (outside the lock: naming a GGUF converts it)
            with self._cond:
                self._reserve(entry, nbytes)
            engine = self._factory(model, config)
        except BaseException:  # the entry goes, and its reservation with it
            with self._cond:
                del self._entries[model]
                self._cond.notify_all()
            raise
        engine._pool = self
        with self._cond:
            entry.engine = self.engines[model] = engine
            entry.counts["loads"] += 1
            self._settle(entry)
        return engine

    def wake(self, engine: Any) -> None:
        """Load a sleeping engine again (room made first where the budget needs it)."""
        entry = self._entry_of(engine)
        if entry is None:
            engine._reload()
            return
        with self._cond:
            self._wait_settled(entry)
            entry.last_used = self._clock()
            if entry.state == "awake" and engine.state == "awake":
                return
            entry.state = "loading"
            try:
                self._reserve(entry, entry.measured if entry.measured is not None else self._estimate(entry.name, engine.config))
            except BaseException:
                self._mark_asleep(entry)
                raise
        try:
            engine._reload()
        except BaseException:
            with self._cond:
                self._mark_asleep(entry)
            raise
        with self._cond:
            entry.counts["wakes"] += 1
            self._settle(entry)

    def _wait_settled(self, entry: Any) -> None:
        """(The lock held) until no load or unload of ``entry`` is under way."""
        while entry.state in ("loading", "unloading"):
            self._cond.wait()

    def sleep(self, engine: Any) -> None:
        """Put an engine to sleep (:meth:`.Engine.sleep`), its memory given back to the budget."""
        entry = self._entry_of(engine)
        if entry is None:
            engine._unload()
            return
        with self._cond:
            self._wait_settled(entry)
            if entry.state == "asleep":
                return
            self._put_to_sleep(entry, only_if_idle=False)

    def admit(self, engine: Any) -> None:
        """Before a request to ``engine`` is counted: while a load waits for it to become
        idle (it drains), wait (up to ``load_wait_s``) until it is asleep or no longer drained."""
        entry = self._entry_of(engine)
        if entry is None:
            return
        with self._cond:
            deadline = self._clock() + self.config.load_wait_s
            while entry.draining and entry.state == "awake" and self._clock() < deadline:
                self._cond.wait(POLL_S)

    def touch(self, engine: Any) -> None:
        """A request was submitted to ``engine``: it is the most recently used."""
        entry = self._entry_of(engine)
        if entry is not None:
            with self._cond:
                entry.last_used = self._clock()
                self._cond.notify_all()

    def shutdown(self) -> list[Any]:
        """Forget every engine (returned, for the caller to shut down) and stop the idle sweeper."""
        self._stop.set()
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None and sweeper is not threading.current_thread():
            sweeper.join(5.0)
        with self._cond:
            engines = list(self.engines.values())
            self.engines.clear()
            self._entries.clear()
            self.peak_bytes = 0
            self._stop = threading.Event()
            self._cond.notify_all()
        return engines

    def list_engines(self) -> list[Any]:
        """The pool's engines (awake or asleep), by name."""
        with self._cond:
            return [self.engines[name] for name in sorted(self.engines)]

    def stats(self) -> dict[str, Any]:
        """A plain dict: the budget, bytes counted now and at peak, and per model its state,
        bytes (weights, KV, counted) and :data:`COUNTS`."""
        with self._cond:
            self._remeasure()
            config = self.config
            models = {}
            for name, entry in sorted(self._entries.items()):
                memory = entry.engine.memory_bytes() if entry.engine is not None else {"weights": 0, "kv": 0}
                models[name] = {"state": entry.state, "bytes": entry.bytes, "weights_bytes": memory["weights"], "kv_bytes": memory["kv"],
                                "idle_s": round(self._clock() - entry.last_used, 3), **entry.counts}
            totals = {key: sum(m[key] for m in models.values()) for key in COUNTS}
            return {"budget_bytes": config.memory_bytes, "idle_unload_s": config.idle_unload_s, "load_wait_s": config.load_wait_s,
                    "bytes": self._accounted(), "peak_bytes": self.peak_bytes, "models": models, **totals}

    # -- internals (the condition's lock held) ---------------------------------------------------

    def _entry_of(self, engine: Any) -> Optional[Entry]:
        entry = self._entries.get(engine.model_name)
        return entry if entry is not None and entry.engine is engine else None

    def _accounted(self) -> int:
        return sum(entry.bytes for entry in self._entries.values())

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self._accounted())

    def _reserve(self, entry: Entry, nbytes: int) -> None:
        """Count ``nbytes`` for ``entry``, first putting idle models to sleep (least recently
        used first) or waiting for one while it does not fit."""
        budget = self.config.memory_bytes
        entry.bytes = 0
        if budget is not None and nbytes > budget:
            raise ModelLoadError(f"{entry.name}: needs about {mib(nbytes)} (weights + KV), more than the model pool's whole budget of "
                                 f"{mib(budget)} (memory_gb={self.config.memory_gb}); raise MLX_PARALLM_POOL_MEMORY_GB or lower kv_cache_memory_gb")
        deadline, waited, drained = None, False, None
        try:
            while budget is not None and self._accounted() + nbytes > budget:
                victim = self._victim(exclude=entry)
                if victim is not None:
                    self._put_to_sleep(victim)
                    continue
                if drained is None or drained.state != "awake":  # new arrivals to it wait: it becomes idle
                    if drained is not None:
                        drained.draining = False
                    drained = self._drain_candidate(exclude=entry)
                    if drained is not None:
                        drained.draining = True
                deadline = self._wait_for_room(entry, nbytes, deadline, waited)
                waited = True
        finally:
            if drained is not None:
                drained.draining = False
                self._cond.notify_all()
        entry.bytes = nbytes
        self._note_peak()

    def _wait_for_room(self, entry: Entry, nbytes: int, deadline: Optional[float], waited: bool) -> float:
        """Wait a little for a model to become idle (counted once a load); past ``load_wait_s``,
        :class:`EngineOverloadedError`. Returns the deadline."""
        budget = self.config.memory_bytes or 0
        now = self._clock()
        deadline = deadline if deadline is not None else now + self.config.load_wait_s
        if now >= deadline:
            entry.counts["overloads"] += 1
            busy = sorted(e.name for e in self._entries.values() if e.bytes and e is not entry)
            raise EngineOverloadedError(
                f"{entry.name}: needs {mib(nbytes)} of the model pool's {mib(budget)}, {mib(self._accounted())} held by models "
                f"with requests in flight or loading ({', '.join(busy)}) for {self.config.load_wait_s}s; retry later or raise memory_gb")
        if not waited:
            entry.counts["waits"] += 1
        self._cond.wait(min(POLL_S, deadline - now))
        return deadline

    def _drain_candidate(self, exclude: Entry) -> Optional[Entry]:
        """The least recently used awake model that can load again (busy: a load waits for it)."""
        awake = [e for e in self._entries.values() if e is not exclude and e.state == "awake" and e.engine is not None and e.engine._reloadable]
        return min(awake, key=lambda e: e.last_used, default=None)

    def _settle(self, entry: Entry) -> None:
        """``entry`` loaded: its measured cost counted instead of its reservation (idle models
        put to sleep where that is more than the budget holds)."""
        entry.state = "awake"
        entry.bytes = entry.measured = self._cost(entry.engine)
        entry.last_used = self._clock()
        self._fit(entry)
        self._note_peak()
        self._cond.notify_all()

    def _fit(self, keep: Optional[Entry]) -> None:
        budget = self.config.memory_bytes
        while budget is not None and self._accounted() > budget:
            victim = self._victim(exclude=keep)
            if victim is None:
                logger.warning("the model pool holds %s, over its budget of %s, and no other model is idle", mib(self._accounted()), mib(budget))
                return
            self._put_to_sleep(victim)

    def _victim(self, exclude: Optional[Entry]) -> Optional[Entry]:
        """The least recently used awake, idle model that can load again, or None."""
        idle = [e for e in self._entries.values() if e is not exclude and e.state == "awake" and e.engine is not None
                and e.engine._reloadable and e.engine.is_idle]
        return min(idle, key=lambda e: e.last_used, default=None)

    def _put_to_sleep(self, entry: Entry, only_if_idle: bool = True) -> bool:
        """Unload ``entry``'s engine with the lock released (arrivals for it wait on the
        engine's own lock, then wake it); False where it turned busy."""
        entry.state = "unloading"
        self._cond.release()
        try:
            slept = entry.engine._unload(only_if_idle=only_if_idle)
        except BaseException:
            self._cond.acquire()
            entry.state = "awake"
            self._cond.notify_all()
            raise
        self._cond.acquire()
        if slept:
            self._mark_asleep(entry)
            entry.counts["sleeps"] += 1
        else:
            entry.state, entry.last_used = "awake", self._clock()
            self._cond.notify_all()
        return slept

    def _mark_asleep(self, entry: Entry) -> None:
        entry.state, entry.bytes, entry.draining = "asleep", 0, False
        self._cond.notify_all()

    def _remeasure(self) -> None:
        """Awake models' costs measured again (a KV pool without a budget grows)."""
        for entry in self._entries.values():
            if entry.state == "awake" and entry.engine is not None:
                entry.bytes = entry.measured = self._cost(entry.engine)
        self._note_peak()

    # -- idle sleep ------------------------------------------------------------------------------

    def _start_sweeper(self) -> None:
        if self.config.idle_unload_s is None or (self._sweeper is not None and self._sweeper.is_alive()):
            return
        self._sweeper = threading.Thread(target=self._sweep_loop, args=(self._stop,), name="mlx-parallm-pool-idle", daemon=True)
        self._sweeper.start()

    def _sweep_loop(self, stop: threading.Event) -> None:
        while not stop.wait(min(1.0, (self.config.idle_unload_s or 4.0) / 4)):
            try:
                self.sweep_idle()
            except Exception:
                logger.exception("the model pool's idle sweep failed")

    def sweep_idle(self) -> list[str]:
        """Put to sleep the models idle for ``idle_unload_s`` (the sweeper thread calls this);
        returns their names."""
        limit = self.config.idle_unload_s
        slept: list[str] = []
        if limit is None:
            return slept
        with self._cond:
            now = self._clock()
            for entry in list(self._entries.values()):
                if entry.state != "awake" or entry.engine is None:
                    continue
                if not entry.engine.is_idle:
                    entry.last_used = now  # busy: idle time counts from its last request's end
                elif now - entry.last_used >= limit and entry.engine._reloadable and self._put_to_sleep(entry):
                    entry.counts["idle_sleeps"] += 1
                    slept.append(entry.name)
        return slept
