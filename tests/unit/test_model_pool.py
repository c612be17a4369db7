"""The model pool's policy over fake engines: the budget holds under racing loads, the least
recently used idle model is put to sleep, a busy one never is (the loader waits, then gets
EngineOverloadedError), a model larger than the budget is refused, idle models sleep."""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Optional

import pytest

from engine_helpers import run_clients
from mlx_parallm_provider import EngineConfig, PoolConfig
from mlx_parallm_provider.engine.pool import ModelPool
from mlx_parallm_provider.errors import EngineOverloadedError, InvalidParameterError, ModelLoadError

GIB = 1024**3
MODEL = GIB // 10  # every fake model's bytes: 0.1 GiB


class Resident:
    """What the fakes really hold, recorded at each load and unload: the bytes resident and
    their peak (the budget must hold for these, not only for the pool's books)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes = self.peak = 0
        self.events: list[tuple[str, str]] = []

    def add(self, name: str, nbytes: int, what: str) -> None:
        with self.lock:
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
            self.events.append((what, name))


class FakeEngine:
    """What the pool uses of an engine: memory, idleness, unload (only if idle) and reload;
    a request is :meth:`begin` .. :meth:`end` (counted busy under the engine's lock, as
    ``Engine._submission`` counts it)."""

    def __init__(self, name: str, config: EngineConfig, resident: Resident, load_s: float = 0.0) -> None:
        self.model_name, self.config, self.resident, self.load_s = name, config, resident, load_s
        self._pool: Any = None
        self._reloadable = True
        self.lock = threading.Lock()
        self.busy = 0
        self.loaded = False
        self.unload_gate: Optional[threading.Event] = None
        self._load("load")

    def _load(self, what: str) -> None:
        self.resident.add(self.model_name, MODEL, what)
        time.sleep(self.load_s)  # (a slow load: others race meanwhile)
        self.loaded = True

    @property
    def state(self) -> str:
        return "awake" if self.loaded else "asleep"

    @property
    def is_idle(self) -> bool:
        return self.busy == 0

    def memory_bytes(self) -> dict[str, int]:
        return {"weights": MODEL if self.loaded else 0, "kv": 0}

    def _unload(self, only_if_idle: bool = False) -> bool:
        with self.lock:
            if only_if_idle and self.busy:
                return False
            if self.unload_gate is not None:
                self.unload_gate.wait(5)
            self.loaded = False
            self.resident.add(self.model_name, -MODEL, "unload")
            return True

    def _reload(self) -> None:
        self._load("wake")

    def begin(self) -> None:
        self._pool.admit(self)
        with self.lock:
            self.busy += 1
        while not self.loaded:
            self._pool.wake(self)

    def end(self) -> None:
        with self.lock:
            self.busy -= 1
        self._pool.touch(self)

    def shutdown(self) -> None:
        pass


def make_pool(resident: Resident, budget_models: Optional[float] = 2.5, load_s: float = 0.0, **config: Any) -> ModelPool:
    memory_gb = None if budget_models is None else budget_models * MODEL / GIB
    return ModelPool(PoolConfig(memory_gb=memory_gb, **config), engine_factory=lambda name, cfg: FakeEngine(name, cfg, resident, load_s),
                     estimate=lambda name, cfg: MODEL, cost=lambda engine: MODEL if engine.loaded else 0)


def test_racing_loads_and_requests_never_hold_more_than_the_budget() -> None:
    resident = Resident()
    pool = make_pool(resident, load_s=0.002, load_wait_s=30)
    names = [f"model-{i}" for i in range(5)]
    books: list[int] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(25):
            engine = pool.get(rng.choice(names))
            engine.begin()
            books.append(pool.stats()["bytes"])
            time.sleep(rng.random() * 0.002)
            engine.end()

    errors = run_clients(client, range(8))
    stats = pool.stats()
    assert errors == []
    budget = stats["budget_bytes"]
    assert resident.peak <= budget, f"{resident.peak / MODEL} models resident at once, the budget holds 2.5"
    assert stats["peak_bytes"] <= budget and max(books) <= budget
    assert stats["loads"] == 5 and stats["sleeps"] >= 3 and stats["wakes"] >= 1
    assert stats["sleeps"] == stats["loads"] + stats["wakes"] - sum(m["state"] == "awake" for m in stats["models"].values())


def test_the_least_recently_used_idle_model_sleeps_first() -> None:
    pool = make_pool(Resident())
    a, b = pool.get("a"), pool.get("b")
    a.begin()
    a.end()  # a is now the most recently used
    c = pool.get("c")
    assert (a.state, b.state, c.state) == ("awake", "asleep", "awake")
    b.begin()  # b wakes: c was loaded after a was used, so a sleeps
    b.end()
    assert (a.state, b.state, c.state) == ("asleep", "awake", "awake")
    models = pool.stats()["models"]
    assert models["b"]["sleeps"] == 1 and models["b"]["wakes"] == 1 and models["a"]["sleeps"] == 1


def test_a_busy_model_is_never_put_to_sleep_the_loader_waits_then_gives_up() -> None:
    pool = make_pool(Resident(), load_wait_s=0.2)
    a, b = pool.get("a"), pool.get("b")
    a.begin()
    b.begin()
    with pytest.raises(EngineOverloadedError, match="requests in flight"):
        pool.get("c")
    assert (a.state, b.state) == ("awake", "awake")
    stats = pool.stats()
    assert "c" not in stats["models"] and stats["models"]["a"]["sleeps"] == 0
    # Once one becomes idle while a load waits, the load goes ahead.
    pool.configure(PoolConfig(memory_gb=2.5 * MODEL / GIB, load_wait_s=30))
    threading.Timer(0.1, a.end).start()
    c = pool.get("c")
    assert (a.state, b.state, c.state) == ("asleep", "awake", "awake")
    assert pool.stats()["models"]["c"]["waits"] == 1


def test_a_load_is_not_starved_by_a_stream_of_requests_to_the_busy_models() -> None:
    """Overlapping requests keep a and b busy; c's load drains the least recently used of them
    (its new requests wait) instead of waiting for a moment when one happens to be idle."""
    pool = make_pool(Resident(), load_wait_s=20)
    a, b = pool.get("a"), pool.get("b")
    stop = threading.Event()

    def stream(engine: FakeEngine) -> None:
        while not stop.is_set():
            engine.begin()
            time.sleep(0.01)
            engine.end()

    streams = [threading.Thread(target=stream, args=(engine,)) for engine in (a, a, b, b)]
    for thread in streams:
        thread.start()
    try:
        c = pool.get("c")
        assert c.state == "awake"
    finally:
        stop.set()
        for thread in streams:
            thread.join()
    stats = pool.stats()
    assert stats["overloads"] == 0 and stats["models"]["c"]["waits"] == 1 and stats["peak_bytes"] <= stats["budget_bytes"]


def test_a_model_larger_than_the_whole_budget_is_refused_naming_the_sizes() -> None:
    pool = make_pool(Resident(), budget_models=0.5)
    with pytest.raises(ModelLoadError, match=r"needs about 102\.4 MiB .* whole budget of 51\.2 MiB"):
        pool.get("big")
    assert pool.stats()["models"] == {}


def test_a_second_config_for_a_loaded_model_is_refused() -> None:
    pool = make_pool(Resident(), budget_models=None)
    pool.get("a", EngineConfig(max_num_seqs=4))
    assert pool.get("a") is pool.get("a", EngineConfig(max_num_seqs=4))
    with pytest.raises(InvalidParameterError, match="another config"):
        pool.get("a", EngineConfig(max_num_seqs=8))


def test_concurrent_gets_of_one_model_load_it_once() -> None:
    resident = Resident()
    pool = make_pool(resident, budget_models=None, load_s=0.05)
    engines: list[Any] = []
    threads = [threading.Thread(target=lambda: engines.append(pool.get("a"))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(e) for e in engines}) == 1 and resident.events == [("load", "a")]


def test_models_idle_past_the_limit_sleep() -> None:
    now = [0.0]
    resident = Resident()
    pool = ModelPool(PoolConfig(idle_unload_s=10.0), engine_factory=lambda name, cfg: FakeEngine(name, cfg, resident),
                     estimate=lambda name, cfg: MODEL, cost=lambda e: MODEL if e.loaded else 0, clock=lambda: now[0])
    a, b = pool.get("a"), pool.get("b")
    now[0] = 6.0
    b.begin()
    now[0] = 12.0
    assert pool.sweep_idle() == ["a"]  # b is busy: its idle time starts when its request ends
    b.end()
    now[0] = 21.0
    assert pool.sweep_idle() == []
    now[0] = 22.5
    assert pool.sweep_idle() == ["b"]
    stats = pool.stats()
    assert (a.state, b.state) == ("asleep", "asleep") and stats["idle_sleeps"] == 2 and stats["bytes"] == 0
    pool.shutdown()


def test_the_idle_sweeper_thread_puts_models_to_sleep_and_stops_at_shutdown() -> None:
    pool = make_pool(Resident(), budget_models=None, idle_unload_s=0.05)
    a = pool.get("a")
    deadline = time.monotonic() + 10
    while a.state == "awake" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.state == "asleep"
    sweeper = pool._sweeper
    assert sweeper is not None and sweeper.daemon
    pool.shutdown()
    assert not sweeper.is_alive() and pool.list_engines() == []


def test_an_arrival_during_an_unload_waits_for_it_then_wakes_the_model() -> None:
    pool = make_pool(Resident())
    a = pool.get("a")
    a.unload_gate = threading.Event()
    sleeper = threading.Thread(target=pool.sleep, args=(a,))
    sleeper.start()
    time.sleep(0.05)  # the unload is inside its gate now
    arrived = threading.Thread(target=a.begin)
    arrived.start()
    arrived.join(0.1)
    assert arrived.is_alive(), "the arrival went ahead during the unload"
    a.unload_gate.set()
    sleeper.join(5)
    arrived.join(5)
    assert not arrived.is_alive() and a.state == "awake"
    models = pool.stats()["models"]
    assert models["a"]["sleeps"] == 1 and models["a"]["wakes"] == 1
    a.end()
