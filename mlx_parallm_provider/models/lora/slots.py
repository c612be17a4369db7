"""The adapters resident on one model: slots in its :class:`.MultiLoRALinear` layers, held
by the requests using them.

At most ``max_loras`` adapters are resident at once (slots 1..max_loras; slot 0 is the base
model). A request takes a slot for its life (:meth:`ModelAdapters.acquire`, then
:meth:`AdapterUse.release`); an adapter no request holds stays resident until its slot is
wanted for another (least recently used first). When every slot is held by running requests
a new adapter is refused with :class:`EngineOverloadedError` (retry later, or raise
``max_loras``). One model's slots are shared by every engine serving that model object.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ...errors import EngineOverloadedError
from .files import CONFIG_FILE, WEIGHTS_FILE, AdapterFiles, linear_dims, read_adapter
from .layers import MultiLoRALinear, base_linear

_ATTRIBUTE = "_parallm_adapters"


@dataclass
class _Resident:
    files: AdapterFiles
    slot: int
    stamp: tuple[int, ...]
    users: int = 0
    last_used: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class AdapterUse:
    """One request's hold on a resident adapter: its ``slot``, ``scale`` and ``uid`` (the
    name its KV blocks are cached under). :meth:`release` (idempotent) gives the hold back
    (with the tokens the request generated, for its engine's counts)."""

    slot: int
    scale: float
    uid: str
    path: Path
    _release: Callable[["AdapterUse"], None]
    released: bool = False
    on_release: Optional[Callable[[int], None]] = None
    """Called once with the tokens the request generated, at :meth:`release`."""

    def release(self, tokens: int = 0) -> None:
        if not self.released:
            self.released = True
            self._release(self)
            if self.on_release is not None:
                self.on_release(tokens)


def _stamp(path: Path) -> tuple[int, ...]:
    """The adapter folder's files' sizes and modification times (a changed file is reread)."""
    out: list[int] = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            stat = (path / name).stat()
        except OSError:
            return ()
        out += [stat.st_size, stat.st_mtime_ns]
    return tuple(out)


class ModelAdapters:
    """The adapter slots of one model (see the module's docstring); one a model, made by
    :func:`adapters_of` (a second would wrap the layers the first keeps its adapters in)."""

    def __init__(self, model: Any, max_loras: int) -> None:
        self.model, self.max_loras = model, max_loras
        self._lock = threading.Lock()
        self._resident: dict[Path, _Resident] = {}
        self._wrapped: dict[str, MultiLoRALinear] = {}
        self.loads = 0
        self.evictions = 0

    def acquire(self, path: str | Path) -> AdapterUse:
        """A hold on the adapter at ``path``, made resident first where it is not (read,
        checked against the model: :func:`.read_adapter`'s errors)."""
        key = Path(path).expanduser().resolve()
        stamp = _stamp(key)
        with self._lock:
            resident = self._resident.get(key)
            if resident is not None and resident.stamp != stamp and resident.users == 0:
                self._evict(key)
                resident = None
            if resident is None:
                files = read_adapter(key, self.model)
                resident = self._make_resident(key, files, stamp)
            resident.users += 1
            resident.last_used = time.monotonic()
            return AdapterUse(resident.slot, resident.files.scale, resident.files.uid, key, self._release)

    def resident(self) -> list[dict[str, Any]]:
        """The resident adapters: path, slot, rank, requests holding it, bytes."""
        with self._lock:
            return [{"path": str(p), "slot": r.slot, "rank": r.files.rank, "requests": r.users, "bytes": r.files.nbytes}
                    for p, r in sorted(self._resident.items(), key=lambda item: item[1].slot)]

    def _release(self, use: AdapterUse) -> None:
        with self._lock:
            resident = self._resident.get(use.path)
            if resident is not None and resident.slot == use.slot:
                resident.users -= 1
                resident.last_used = time.monotonic()

    def _make_resident(self, key: Path, files: AdapterFiles, stamp: tuple[int, ...]) -> _Resident:
        taken = {r.slot for r in self._resident.values()}
        free = [s for s in range(1, self.max_loras + 1) if s not in taken]
        if not free:
            idle = [(r.last_used, p) for p, r in self._resident.items() if r.users == 0]
            if not idle:
                raise EngineOverloadedError(
                    f"all {self.max_loras} LoRA adapter slots hold adapters of running requests; retry later or raise EngineConfig.max_loras")
            victim = min(idle)[1]
            free = [self._resident[victim].slot]
            self._evict(victim)
        slot = free[0]
        unwrapped = [name for name in files.pairs if name not in self._wrapped]
        modules = dict(self.model.named_modules()) if unwrapped else {}  # (one walk of the model for all of them)
        for name in unwrapped:
            self._wrap(name, modules)
        rank = max([files.rank, *(layer.rank for layer in self._wrapped.values())])
        for name, layer in self._wrapped.items():
            layer.set_slot(slot, files.pairs.get(name), slot + 1, rank)
        self.loads += 1
        resident = self._resident[key] = _Resident(files, slot, stamp)
        return resident

    def _evict(self, key: Path) -> None:
        resident = self._resident.pop(key)
        for layer in self._wrapped.values():
            layer.set_slot(resident.slot, None, resident.slot + 1, layer.rank)
        self.evictions += 1

    def _wrap(self, name: str, modules: dict[str, Any]) -> None:
        """Put a :class:`MultiLoRALinear` in place of the linear layer at ``name`` (``modules``:
        the model's, by name)."""
        parent_name, _, leaf = name.rpartition(".")
        parent = modules[parent_name]
        linear = base_linear(getattr(parent, leaf))
        slots = max((layer.slots for layer in self._wrapped.values()), default=1)
        wrapper = MultiLoRALinear(linear, *linear_dims(linear))
        if slots > 1:
            wrapper.set_slot(slots - 1, None, slots, 1)
        setattr(parent, leaf, wrapper)
        self._wrapped[name] = wrapper
        block = self.model.layers[int(name.split(".layers.", 1)[1].split(".", 1)[0])]
        object.__setattr__(block, "_parallm_lora", True)


_made_lock = threading.Lock()


def adapters_of(model: Any, max_loras: int = 8) -> ModelAdapters:
    """``model``'s :class:`ModelAdapters`, made on first use (with ``max_loras`` slots)."""
    with _made_lock:
        adapters: Optional[ModelAdapters] = getattr(model, _ATTRIBUTE, None)
        if adapters is None:
            adapters = ModelAdapters(model, max_loras)
            object.__setattr__(model, _ATTRIBUTE, adapters)
        return adapters


def resident_adapters(model: Any) -> Optional[ModelAdapters]:
    """``model``'s :class:`ModelAdapters`, or None where no adapter was ever used on it."""
    return getattr(model, _ATTRIBUTE, None)
