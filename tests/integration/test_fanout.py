"""Engine.generate_many / generate_many_sync on the tiny model: order, ``seed + i``,
per-request errors, sibling cancellation, waves larger than the queue, and the
thread-count / batch-size figures of the front doors' fan-out."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import litellm
import pytest

import mlx_parallm_provider
from engine_helpers import ScriptedModel
from mlx_parallm_provider import Engine, EngineLike, SamplingParams, get_engine, shutdown_engines
from mlx_parallm_provider.errors import ContextWindowExceededError, EngineOverloadedError, InvalidParameterError
from mlx_parallm_provider.langchain import ChatMLXParallm
from mlx_parallm_provider.models.registry import LoadedModel

WORDS = "the quick brown fox jumps over a lazy dog while seven curious cats watch from the old wall".split()
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
LONG = " ".join(WORDS * 40)  # more than the tiny model's 512-token context


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[i % 9 : i % 9 + 4]) + f" #{i}" for i in range(n)]


def wait_until(condition: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)


class ThreadPeak:
    """Samples ``threading.active_count()`` while a block runs (the sampler excluded)."""

    def __init__(self) -> None:
        self.baseline = threading.active_count()
        self.peak = self.baseline
        self._done = threading.Event()

    @property
    def added(self) -> int:
        """Threads that existed at some moment of the block beyond those before it."""
        return self.peak - self.baseline

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, threading.active_count() - 1)


@contextmanager
def thread_peak() -> Iterator[ThreadPeak]:
    peak = ThreadPeak()
    sampler = threading.Thread(target=peak._sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        peak._done.set()
        sampler.join()


# --------------------------------------------------------------------------- the engine API


def test_the_engine_is_engine_like(make_engine: Callable[..., Engine]) -> None:
    assert isinstance(make_engine(), EngineLike)


def test_results_come_prompt_by_prompt_and_choice_i_samples_with_seed_plus_i(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    texts = prompts(2)
    many = engine.generate_many_sync(texts, SAMPLED, n=3)
    alone = [engine.generate_sync(p, SamplingParams(**{**_fields(SAMPLED), "seed": 5 + i})) for p in texts for i in range(3)]
    assert [c.text for c in many] == [c.text for c in alone]
    assert len({c.text for c in many[:3]}) == 3  # the choices differ
    assert [c.text for c in asyncio.run(engine.generate_many(texts, SAMPLED, n=3))] == [c.text for c in many]


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in params.__slots__}  # type: ignore[attr-defined]


def test_return_exceptions_fails_only_the_bad_request(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    results = engine.generate_many_sync(["a b c", "", "d e f"], SAMPLED, return_exceptions=True)
    assert isinstance(results[1], InvalidParameterError) and results[1].field == "prompt"
    # The same neighbours without the bad request (a batch of two either way: answered alone, a
    # row's seeded draw could differ by the rounding of another batch size, not by the failure).
    clean = engine.generate_many_sync(["a b c", "d e f"], SAMPLED)
    assert [r.text for r in (results[0], results[2])] == [c.text for c in clean]
    results = asyncio.run(engine.generate_many(["a b c", LONG], SAMPLED, return_exceptions=True))
    assert results[0].text == engine.generate_sync("a b c", SAMPLED).text
    assert isinstance(results[1], ContextWindowExceededError)


def test_a_failure_cancels_the_siblings(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    long_answers = SamplingParams(max_tokens=400, ignore_eos=True)
    with pytest.raises(ContextWindowExceededError):
        engine.generate_many_sync([*prompts(3), LONG], long_answers)
    wait_until(lambda: engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0, "the siblings to be dropped")
    assert engine.stats()["generated_tokens"] < 3 * 400  # they were cancelled, not run to the end


def test_a_call_larger_than_the_queue_runs_in_waves(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_queue=4, max_num_seqs=8)
    texts = prompts(10)
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    many = engine.generate_many_sync(texts, greedy, n=2)
    assert [c.text for c in many] == [engine.generate_sync(p, greedy).text for p in texts for _ in range(2)]
    assert len(asyncio.run(engine.generate_many(texts, greedy, n=2))) == 20


def test_a_call_running_in_waves_leaves_room_for_other_callers(make_engine: Callable[..., Engine], tiny_model: LoadedModel) -> None:
    scripted = ScriptedModel(tiny_model.model, [100, 101, 102], vocab_size=49152)
    scripted.gate = threading.Event()
    engine = make_engine(scripted, max_num_seqs=4, max_queue=8, batch_window_ms=0)
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)

    async def main() -> tuple[list[Any], Any]:
        first = asyncio.ensure_future(engine.generate("first", greedy))
        await asyncio.sleep(0.05)  # the worker is now blocked inside the first forward
        big = asyncio.ensure_future(engine.generate_many(prompts(20), greedy))
        await asyncio.sleep(0.05)
        assert engine.stats()["waiting"] == 6  # 8 - a quarter
        other = asyncio.ensure_future(engine.generate("another caller", greedy))
        await asyncio.sleep(0.01)
        scripted.gate.set()
        await first
        return await big, await other

    many, other = asyncio.run(main())
    assert len(many) == 20 and other.usage.completion_tokens == 2


def test_a_full_queue_fails_the_call_before_anything_is_queued(make_engine: Callable[..., Engine], tiny_model: LoadedModel) -> None:
    scripted = ScriptedModel(tiny_model.model, [100, 101, 102], vocab_size=49152)
    scripted.gate = threading.Event()
    engine = make_engine(scripted, max_num_seqs=1, max_num_batched_tokens=64, max_queue=2, batch_window_ms=0)
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)

    async def main() -> list[Any]:
        first = asyncio.ensure_future(engine.generate("first", greedy))
        await asyncio.sleep(0.05)  # the worker is now blocked inside the first forward
        queued = [asyncio.ensure_future(engine.generate(f"q{i}", greedy)) for i in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(EngineOverloadedError, match="max_queue=2"):
            await engine.generate_many(["x", "y", "z"], greedy)
        assert engine.stats()["waiting"] == 2  # nothing of the failed call was left queued
        scripted.gate.set()
        return await asyncio.gather(first, *queued)

    assert len(asyncio.run(main())) == 3


def test_n_must_be_a_positive_integer(make_engine: Callable[..., Engine]) -> None:
    with pytest.raises(InvalidParameterError, match="n"):
        make_engine().generate_many_sync(["a"], SAMPLED, n=0)


# --------------------------------------------------------------------------- the front doors (Must show)


@pytest.fixture
def shared(tiny_model_dir: Any) -> Iterator[str]:
    """The tiny model's name, its shared engine fresh for the test; LiteLLM registered."""
    saved = list(litellm.custom_provider_map)
    mlx_parallm_provider.register()
    shutdown_engines()
    yield str(tiny_model_dir)
    shutdown_engines()
    litellm.custom_provider_map[:] = saved


def test_sync_litellm_n16_is_one_decode_batch_without_a_thread_per_choice(shared: str) -> None:
    engine = get_engine(shared)
    with thread_peak() as threads:
        response = litellm.completion(
            model=f"mlx-parallm/{shared}", messages=[{"role": "user", "content": "Hi"}],
            n=16, max_tokens=8, temperature=0.8, seed=1, ignore_eos=True,
        )
    assert len(response.choices) == 16
    assert engine.stats()["max_batch_size"] == min(16, engine.config.max_num_seqs)
    assert threads.added < 4, threads.added  # a thread per choice would add 16


def test_sync_langchain_batch_of_64_is_one_decode_batch_without_a_thread_per_input(shared: str) -> None:
    engine = get_engine(shared)
    chat = ChatMLXParallm(model=shared, max_tokens=8, ignore_eos=True)
    with thread_peak() as threads:
        messages = chat.batch(prompts(64))
    assert len(messages) == 64 and all(m.usage_metadata["output_tokens"] == 8 for m in messages)
    assert engine.stats()["max_batch_size"] == min(64, engine.config.max_num_seqs)
    assert threads.added < 4, threads.added  # LangChain's default pool would add cpu_count + 4


def test_litellm_batch_completion_still_batches_fully(shared: str) -> None:
    engine = get_engine(shared)
    messages = [[{"role": "user", "content": p}] for p in prompts(24)]
    responses = litellm.batch_completion(model=f"mlx-parallm/{shared}", messages=messages, max_tokens=8, ignore_eos=True)
    assert len(responses) == 24
    assert engine.stats()["max_batch_size"] == 24
