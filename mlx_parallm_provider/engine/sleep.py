"""Sleep and wake of an :class:`~.api.Engine`: its weights and KV freed while the engine object
stays (vLLM's sleep mode, which only CUDA has there), loaded again on demand.

:meth:`SleepMethods.sleep` stops the worker (its KV arrays go with it), drops the model (the
engine's reference and the registry's cache entry), and returns MLX's cached buffers;
:meth:`~SleepMethods.wake` loads the model again through the registry (a GGUF's conversion
is cached on disk), prepares it as the engine's constructor does and warms it with a one-token
generation. A request to a sleeping engine wakes it. An engine of the process's model pool
(:mod:`.pool`) sleeps and wakes through the pool, so its memory budget holds.

Races: a request being submitted holds :meth:`~SleepMethods._submission`, which counts it
(the engine is not idle, so the pool does not put it to sleep) and wakes the engine first
(before that, while a load waits for this engine to drain, it waits: :meth:`.ModelPool.admit`). An
unload holds the engine's core lock throughout, so a request arriving meanwhile waits for the
unload to finish, then wakes the engine.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from typing import Any, Iterator, Optional

from .. import mlx_lm_compat
from ..errors import InvalidParameterError
from ..models import backends, registry
from ..models.backend import release_load_transients
from ..models.registry import LoadedModel
from .kv.budget import check_kv_settings, kv_bytes_per_token
from .kv.support import ensure_servable, settings_for
from .request import SamplingParams

logger = logging.getLogger(__name__)


class SleepMethods:
    """Sleep, wake and memory of :class:`~.api.Engine` (which this is mixed into; it provides
    ``config``, ``model_name``, ``tokenizer``, the core lock and the core)."""

    _loaded: Optional[LoadedModel]
    _pool: Any = None  # the ModelPool that made this engine, or None
    _reloadable: bool = True
    _submitting: int = 0
    _weight_bytes: Optional[int] = None
    _waking_thread: Optional[int] = None  # the thread warming the engine up after a wake

    # -- public -----------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``"awake"`` (weights loaded) or ``"asleep"`` (:meth:`sleep`: weights and KV freed)."""
        return "awake" if self._loaded is not None else "asleep"

    @property
    def is_idle(self) -> bool:
        """No request in flight: none being submitted, queued or running (a racy read; the
        pool confirms it under the core lock before an unload)."""
        engine: Any = self
        core = engine._core
        return self._submitting == 0 and (core is None or core.idle)

    def sleep(self) -> None:
        """Free the model's weights and KV memory, keeping this engine (the same object
        :func:`~mlx_parallm_provider.get_engine` returns); the next request, or :meth:`wake`,
        loads it again. Call it while idle: requests in flight fail with
        :class:`~mlx_parallm_provider.errors.EngineDeadError`, as at shutdown. An engine made
        with a ``loaded`` model cannot load it again, so it refuses
        (:class:`~mlx_parallm_provider.errors.InvalidParameterError`)."""
        if self._pool is not None:
            self._pool.sleep(self)  # type: ignore[attr-defined]
        else:
            self._unload()

    def wake(self) -> None:
        """Load the model again after :meth:`sleep` and warm it (one generated token); nothing
        when awake. Through the pool where the engine has one (which may put the least
        recently used idle model to sleep to make room)."""
        if self._pool is not None:
            self._pool.wake(self)  # type: ignore[attr-defined]
        else:
            self._reload()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held now: ``weights`` (every array the model's modules hold, each once) and
        ``kv`` (the KV block pool's arrays, a hybrid model's recurrent states and those kept for its
        prefix cache); 0 each while asleep."""
        engine: Any = self
        loaded, core = self._loaded, engine._core
        if loaded is not None and self._weight_bytes is None:
            self._weight_bytes = _weights_nbytes(loaded.model)
        weights = self._weight_bytes if loaded is not None else 0
        return {"weights": weights or 0, "kv": core.memory.nbytes if core is not None else 0}

    # -- internals --------------------------------------------------------------------------

    def _adopt(self, loaded: LoadedModel) -> None:
        """Make ``loaded`` the model served: its backend ensured, checked servable, its
        masks fitted, the KV settings checked against it (at construction and each wake)."""
        engine: Any = self
        backends.ensure(loaded.model, engine.config.device)  # a model passed in unprepared gets one too
        ensure_servable(loaded.model, engine.model_name)
        engine.config = settings_for(loaded.model, engine.config)  # a hybrid model's settings
        mlx_lm_compat.fit_grouped_query_masks(loaded.model)
        check_kv_settings(loaded.model, loaded.config, engine.config)
        engine._kv_bytes_per_token = kv_bytes_per_token(loaded.model, loaded.config, engine.config.kv_cache_dtype)
        self._weight_bytes = None
        self._loaded = loaded
        engine._adapters.rebind(loaded.model)  # (adapters are made resident again on use)

    def _idle_locked(self) -> bool:
        """:attr:`is_idle`, with the core lock held (so no submission can start meanwhile)."""
        return self.is_idle

    def _unload(self, only_if_idle: bool = False) -> bool:
        """Stop the worker and drop the model (the core lock held throughout, so arrivals wait
        for the end); False where ``only_if_idle`` and a request is in flight."""
        engine: Any = self
        if not self._reloadable:
            raise InvalidParameterError("sleep", f"the engine for {engine.model_name!r} was given its loaded model, so it could not "
                                                 "load it again; make it with Engine(name) or get_engine(name) to sleep it")
        with engine._core_lock:
            if self._loaded is None:
                return True
            if only_if_idle and not self._idle_locked():
                return False
            core, engine._core = engine._core, None
            loaded, self._loaded = self._loaded, None
            engine._adapters.rebind(None)  # (the adapters' slots live in the model's layers)
            self._weight_bytes = None
            if core is not None:
                core.stop()
            registry.forget(loaded)
            del core, loaded
            free_memory()
        logger.info("%s: asleep (weights and KV freed)", engine.model_name)
        return True

    def _reload(self) -> None:
        """Load the model again (nothing when awake) and warm it."""
        engine: Any = self
        with engine._core_lock:
            if self._loaded is not None:
                return
            self._adopt(registry.load(engine.model_name, dequantize=engine.config.dequantize, device=engine.config.device))
        self._waking_thread = threading.get_ident()
        try:
            self._warm()
        finally:
            self._waking_thread = None
        logger.info("%s: awake", engine.model_name)

    def _warm(self) -> None:
        """One generated token, so the first request after a wake finds the worker started
        and the model's kernels ready; a failure is logged (the next request reports it)."""
        engine: Any = self
        bos = getattr(engine.tokenizer, "bos_token_id", None)
        try:
            engine.generate_sync([bos if isinstance(bos, int) else 0], SamplingParams(max_tokens=1))
        except Exception:
            logger.exception("%s: warming after wake failed", engine.model_name)

    @contextlib.contextmanager
    def _submission(self) -> Iterator[None]:
        """Held while a request is submitted: the engine counts as busy (the pool does not put
        it to sleep) and is awake (woken where asleep; an unload in progress is waited for)."""
        engine: Any = self
        if self._pool is not None and threading.get_ident() != self._waking_thread:  # (a wake's warm-up is let through)
            self._pool.admit(self)  # while a load waits for this engine to become idle, new requests wait
        with engine._core_lock:  # (an unload holds it: arrivals wait for its end)
            self._submitting += 1
        try:
            while self._loaded is None:
                self.wake()
            yield
        finally:
            with engine._core_lock:
                self._submitting -= 1
            if self._pool is not None:
                self._pool.touch(self)


def free_memory() -> None:
    """Collect cycles still holding arrays, return MLX's cached buffers, then the C heap's free
    pages (glibc keeps them otherwise) to the system."""
    gc.collect()
    release_load_transients()


def _weights_nbytes(model: Any) -> int:
    """:func:`.registry.module_nbytes`, 0 for an object that is not an MLX module (a test's fake)."""
    try:
        return registry.module_nbytes(model) if callable(getattr(model, "modules", None)) else 0
    except Exception:  # pragma: no cover (an odd module: counted as nothing rather than failing stats)
        logger.debug("could not measure the weights of %s", type(model).__name__, exc_info=True)
        return 0
