"""An engine's LoRA adapters: names registered for them (:meth:`LoRAMethods.add_lora`, as
vLLM's ``add_lora``), the hold each request takes on its adapter's slot, and counts per
adapter. The slots themselves belong to the model (:mod:`...models.lora.slots`)."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from ..errors import InvalidParameterError
from ..models.lora.files import read_adapter
from ..models.lora.slots import AdapterUse, ModelAdapters, adapters_of, resident_adapters


class EngineAdapters:
    """The adapter names of one engine and what its requests did with each adapter."""

    def __init__(self, model: Optional[Any], max_loras: int) -> None:
        self._model, self._max_loras = model, max_loras
        self._names: dict[str, Path] = {}
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()

    @property
    def slots(self) -> ModelAdapters:
        if self._model is None:
            raise RuntimeError("the engine is asleep: it has no model to hold adapters")  # (requests wake it first)
        return adapters_of(self._model, self._max_loras)

    def rebind(self, model: Optional[Any]) -> None:
        """Serve ``model`` (a wake's), or none (asleep): adapters become resident on it as
        requests use them; the names stay registered."""
        self._model = model

    def add(self, name: str, path: str | Path) -> None:
        """Register ``name`` for the adapter folder ``path`` (read and checked now)."""
        if not isinstance(name, str) or not name.strip():
            raise InvalidParameterError("lora_name", f"must be a non-empty string, got {name!r}")
        model = self._model
        if model is not None:  # (asleep: checked when a request wakes it)
            read_adapter(path, model)
        with self._lock:
            self._names[name] = Path(path).expanduser().resolve()

    def remove(self, name: str) -> bool:
        """Forget ``name``; whether it was registered (requests running with it finish)."""
        with self._lock:
            return self._names.pop(name, None) is not None

    def path_of(self, lora: str) -> tuple[str, Path]:
        """The display name and folder of a request's ``lora``: a registered name, else a folder."""
        with self._lock:
            path = self._names.get(lora)
        if path is not None:
            return lora, path
        folder = Path(lora).expanduser()
        if folder.is_dir():
            return str(folder), folder
        if "/" in lora or "\\" in lora:
            raise InvalidParameterError("lora", f"adapter {lora!r}: no such adapter folder")
        known = ", ".join(sorted(self._names)) or "none registered"
        raise InvalidParameterError("lora", f"unknown adapter {lora!r}: not a registered name ({known}) nor an adapter folder")

    def acquire(self, lora: Optional[str]) -> Optional[AdapterUse]:
        """A request's hold on its adapter's slot (made resident where it is not), counted
        under the adapter's name when released; None for the base model."""
        if lora is None:
            return None
        name, path = self.path_of(lora)
        use = self.slots.acquire(path)
        use.on_release = lambda tokens: self._count(name, tokens)
        return use

    def _count(self, name: str, tokens: int) -> None:
        with self._lock:
            self.requests[name] += 1
            self.tokens[name] += tokens

    def stats(self) -> dict[str, Any]:
        """Registered names, resident adapters (slot, rank, requests holding it) and counts per adapter."""
        with self._lock:
            names = {name: str(path) for name, path in sorted(self._names.items())}
            requests, tokens = dict(self.requests), dict(self.tokens)
        slots = resident_adapters(self._model) if self._model is not None else None
        return {"max_loras": self._max_loras, "registered": names, "resident": slots.resident() if slots else [],
                "loads": slots.loads if slots else 0, "evictions": slots.evictions if slots else 0,
                "finished_requests": requests, "generation_tokens": tokens}


class LoRAMethods:
    """The engine's adapter methods (mixed into :class:`.api.Engine`, which sets ``_adapters``)."""

    _adapters: EngineAdapters

    def add_lora(self, name: str, path: str | Path) -> None:
        """Register the mlx-lm adapter folder ``path`` (``adapters.safetensors`` +
        ``adapter_config.json``, as ``mlx_lm.lora`` writes) as ``name``, for
        ``SamplingParams(lora=name)``. Raises :class:`InvalidParameterError` where the folder
        is not an adapter of this model (missing files, other shapes, a DoRA or full fine-tune)."""
        self._adapters.add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Forget the adapter name ``name``; returns whether it was registered."""
        return self._adapters.remove(name)

    def list_loras(self) -> dict[str, Any]:
        """The registered adapter names, the adapters resident now and what each served."""
        return self._adapters.stats()
