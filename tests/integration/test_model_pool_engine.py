"""Sleep, wake and the model pool on real engines (copies of the tiny random llama under
distinct names): sleep frees the model, wake answers as before, a request wakes a sleeping
engine, a request arriving during an unload waits for it and then wakes the engine, three
models share a budget that holds two."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from pathlib import Path
from typing import Any, Iterator

import pytest

from engine_helpers import run_clients
from mlx_parallm_provider import EngineConfig, PoolConfig, SamplingParams, doctor
from mlx_parallm_provider.engine import Engine, pool_stats, sleep
from mlx_parallm_provider.engine.pool import ModelPool, configure_pool, get_engine, shutdown_engines
from mlx_parallm_provider.errors import InvalidParameterError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = "the quick brown fox jumps over"
CONFIG = EngineConfig(kv_cache_memory_gb=0.01)


@pytest.fixture
def model_names(tiny_model_dir: Path, tmp_path: Path) -> list[str]:
    """Three names for the tiny model (links to its folder): three models to the registry."""
    names = []
    for name in ("chat", "coder", "embedder"):
        (tmp_path / name).symlink_to(tiny_model_dir, target_is_directory=True)
        names.append(str(tmp_path / name))
    return names


@pytest.fixture
def pool() -> Iterator[ModelPool]:
    pool = ModelPool(PoolConfig())
    yield pool
    for engine in pool.shutdown():
        engine.shutdown()


def test_sleep_frees_the_model_and_wake_answers_as_before(model_names: list[str], pool: ModelPool) -> None:
    engine = pool.get(model_names[0], CONFIG)
    before = engine.generate_sync(PROMPT, GREEDY).text
    memory = engine.memory_bytes()
    assert memory["weights"] > 0 and memory["kv"] > 0 and engine.stats()["state"] == "awake"
    model = weakref.ref(engine._loaded.model)
    engine.sleep()
    gc.collect()
    assert model() is None, "the model's weights outlived its sleep"
    assert engine.state == "asleep" and engine.memory_bytes() == {"weights": 0, "kv": 0}
    assert pool.stats()["bytes"] == 0
    engine.wake()
    assert engine.state == "awake" and pool.get(model_names[0]) is engine
    assert engine.generate_sync(PROMPT, GREEDY).text == before
    counts = pool.stats()["models"][model_names[0]]
    assert (counts["loads"], counts["sleeps"], counts["wakes"]) == (1, 1, 1)


def test_a_request_to_a_sleeping_engine_wakes_it(model_names: list[str], pool: ModelPool) -> None:
    engine = pool.get(model_names[0], CONFIG)
    before = engine.generate_sync(PROMPT, GREEDY).text
    engine.sleep()
    assert asyncio.run(engine.generate(PROMPT, GREEDY)).text == before
    engine.sleep()
    assert engine.generate_many_sync([PROMPT, PROMPT], GREEDY)[1].text == before
    engine.sleep()
    assert len(engine.embed_sync(["a text"]).embeddings) == 1
    assert engine.state == "awake" and pool.stats()["models"][model_names[0]]["wakes"] == 3


def test_a_request_arriving_during_an_unload_waits_then_wakes_the_engine(model_names: list[str], pool: ModelPool,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    engine = pool.get(model_names[0], CONFIG)
    before = engine.generate_sync(PROMPT, GREEDY).text
    gate, inside = threading.Event(), threading.Event()
    real_free = sleep.free_memory

    def slow_free() -> None:  # the unload, held at its end (the engine's core lock held)
        inside.set()
        gate.wait(10)
        real_free()

    monkeypatch.setattr(sleep, "free_memory", slow_free)
    sleeper = threading.Thread(target=engine.sleep)
    sleeper.start()
    assert inside.wait(10)
    answers: list[Any] = []
    arrival = threading.Thread(target=lambda: answers.append(engine.generate_sync(PROMPT, GREEDY).text))
    arrival.start()
    arrival.join(0.2)
    assert arrival.is_alive() and answers == [], "the request went ahead during the unload"
    gate.set()
    sleeper.join(10)
    arrival.join(30)
    assert answers == [before] and engine.state == "awake"
    counts = pool.stats()["models"][model_names[0]]
    assert (counts["sleeps"], counts["wakes"]) == (1, 1)


def test_three_models_in_a_budget_for_two_answer_every_request(model_names: list[str], pool: ModelPool) -> None:
    engines = [pool.get(name, CONFIG) for name in model_names[:2]]
    cost = pool.stats()["models"][model_names[0]]["bytes"]
    pool.configure(PoolConfig(memory_gb=2.5 * cost / 1024**3, load_wait_s=30))
    expected = engines[0].generate_sync(PROMPT, GREEDY).text  # (same weights under three names: the same answer)
    engines.append(pool.get(model_names[2], CONFIG))
    results: list[str] = []

    def client(offset: int) -> None:
        for i in range(6):
            results.append(engines[(i + offset) % 3].generate_sync(PROMPT, GREEDY).text)

    errors = run_clients(client, range(3), 120)
    stats = pool.stats()
    assert errors == [] and results == [expected] * 18
    assert stats["peak_bytes"] <= stats["budget_bytes"]
    assert sum(m["state"] == "awake" for m in stats["models"].values()) <= 2
    assert stats["sleeps"] >= 1 and stats["wakes"] >= 1


def test_an_engine_given_its_loaded_model_refuses_to_sleep(tiny_model: Any) -> None:
    engine = Engine("given", loaded=tiny_model)
    with pytest.raises(InvalidParameterError, match="could not load it again"):
        engine.sleep()
    assert engine.state == "awake"
    engine.shutdown()


def test_get_engine_goes_through_the_process_pool(model_names: list[str]) -> None:
    shutdown_engines()
    try:
        configure_pool(memory_gb=None)
        engine = get_engine(model_names[0], CONFIG)
        assert get_engine(model_names[0]) is engine
        from mlx_parallm_provider.engine import api

        assert api.get_engine is get_engine and api._engines[model_names[0]] is engine
        assert pool_stats()["models"][model_names[0]]["state"] == "awake"
        assert f"{model_names[0]} (awake, " in doctor.pool_report()["models loaded in this process"]
        assert _scrape(engine.model_name) == {"model_awake": 1.0, "model_loads_total": 1.0, "model_sleeps_total": 0.0}
        engine.sleep()
        assert pool_stats()["models"][model_names[0]]["state"] == "asleep" and get_engine(model_names[0]) is engine
        assert _scrape(engine.model_name) == {"model_awake": 0.0, "model_loads_total": 1.0, "model_sleeps_total": 1.0}
        assert f"{model_names[0]} (asleep, 0.0 MiB)" in doctor.pool_report()["models loaded in this process"]
    finally:
        shutdown_engines()
        configure_pool(PoolConfig())



def _scrape(model: str) -> dict[str, float]:
    """The pool's series of ``model`` from a fresh Prometheus registry."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from mlx_parallm_provider.engine.prometheus import EngineCollector

    registry = prometheus_client.CollectorRegistry()
    registry.register(EngineCollector(prefix=""))
    wanted = ("model_awake", "model_loads_total", "model_sleeps_total")
    return {sample.name: sample.value for family in registry.collect() for sample in family.samples
            if sample.name in wanted and sample.labels.get("model_name") == model}


def test_a_private_engine_sleeps_and_wakes_without_a_pool(model_names: list[str]) -> None:
    engine = Engine(model_names[1], CONFIG)
    try:
        before = engine.generate_sync(PROMPT, GREEDY).text
        engine.sleep()
        assert engine.state == "asleep" and engine._pool is None
        assert engine.generate_sync(PROMPT, GREEDY).text == before and engine.state == "awake"
    finally:
        engine.shutdown()


def test_the_benchmarks_sleep_and_wake_step_on_the_tiny_model(model_names: list[str]) -> None:
    from mlx_parallm_provider.bench import model_pool as bench

    shutdown_engines()
    try:
        result = bench._sleep_and_wake(model_names[2])
    finally:
        shutdown_engines()
    assert result["cost"] == result["memory"]["weights"] + int(bench.KV_GB * 1024**3)
    assert [(c["counted_freed"], c["same_answer"]) for c in result["cycles"]] == [(result["cost"], True)] * 2


def test_an_engine_with_adapters_frees_them_asleep_and_a_request_through_one_wakes_it(model_names: list[str], tmp_path: Path) -> None:
    from lora_helpers import write_random_adapter

    adapter = write_random_adapter(tmp_path / "adapter", Path(model_names[2]), seed=4)
    engine = Engine(model_names[2], CONFIG)
    try:
        engine.add_lora("writer", adapter)
        with_adapter = SamplingParams(max_tokens=8, ignore_eos=True, lora="writer")
        before = engine.generate_sync(PROMPT, with_adapter).text
        assert engine.list_loras()["resident"] and before != engine.generate_sync(PROMPT, GREEDY).text
        model = weakref.ref(engine._loaded.model)
        engine.sleep()
        gc.collect()
        assert model() is None, "the adapters kept the model alive asleep"
        assert engine.list_loras()["resident"] == [] and "writer" in engine.list_loras()["registered"]
        assert engine.generate_sync(PROMPT, with_adapter).text == before and engine.state == "awake"
    finally:
        engine.shutdown()


def test_doctor_lists_the_adapters_of_the_process_models(model_names: list[str], tmp_path: Path) -> None:
    from lora_helpers import write_random_adapter
    from mlx_parallm_provider import doctor, get_engine, shutdown_engines

    adapter = write_random_adapter(tmp_path / "adapter", Path(model_names[0]), seed=6)
    try:
        engine = get_engine(model_names[0], CONFIG)
        assert doctor.pool_report()["LoRA adapters in this process"] == "none"
        engine.add_lora("support", adapter)
        engine.generate_sync(PROMPT, SamplingParams(max_tokens=2, lora="support"))
        line = doctor.pool_report()["LoRA adapters in this process"]
        assert line.startswith(f"{model_names[0]}: support; {adapter.resolve()} (slot 1, rank 8) of max_loras=8"), line
    finally:
        shutdown_engines()
