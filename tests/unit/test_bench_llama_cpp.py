"""The llama.cpp runner's continuous batching, against a fake of llama-cpp-python's low-level
API (tests/fake_llama_cpp.py): one context, a sequence per request, prompts prefilled together,
sequences leaving at EOS or their budget and waiting requests taking their place."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest

from fake_llama_cpp import EOS, FakeLlamaCpp
from mlx_parallm_provider.bench.runners import RunnerOptions, Sampling, SkipSystem, make_runner
from mlx_parallm_provider.bench.runners.llama_batch import BatchScheduler, Job, LlamaDecodeError
from mlx_parallm_provider.bench.workloads import BenchRequest


class Recorder:
    """Jobs whose tokens and outcome are collected."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, Optional[BaseException]] = {}

    def job(self, name: str, prompt: list[int], max_tokens: int) -> Job:
        self.tokens[name] = []

        def on_done(error: Optional[BaseException]) -> None:
            assert name not in self.done, "on_done called twice"
            self.done[name] = error

        return Job(prompt, max_tokens, on_token=self.tokens[name].append, on_done=on_done)


def scheduler(lib: FakeLlamaCpp, n_seq_max: int, n_batch: int = 64, **kw) -> BatchScheduler:
    lib.llama_init_from_model("model", SimpleNamespace(n_seq_max=n_seq_max))
    return BatchScheduler(lib, "ctx", "vocab", n_seq_max=n_seq_max, n_batch=n_batch, n_ctx_seq=kw.pop("n_ctx_seq", 4096), **kw)


def drain(s: BatchScheduler, limit: int = 100) -> None:
    s.step()
    for _ in range(limit):
        if not s.busy:
            return
        s.step()
    raise AssertionError("scheduler did not finish")


def test_a_burst_is_prefilled_in_one_decode_and_each_sequence_stops_on_its_own() -> None:
    lib, rec = FakeLlamaCpp(), Recorder()
    s = scheduler(lib, n_seq_max=3)
    s.submit(rec.job("eos", [1, 45], 10))  # 46..50, then EOS (not counted)
    s.submit(rec.job("budget", [1, 10], 3))  # 11, 12, 13: its budget
    s.submit(rec.job("long", [1, 20, 30], 4))
    drain(s)
    assert rec.tokens == {"eos": [46, 47, 48, 49, 50], "budget": [11, 12, 13], "long": [31, 32, 33, 34]}
    assert rec.done == {"eos": None, "budget": None, "long": None}
    first = lib.decodes[0]  # the three prompts, whole, in one llama_decode; logits on each last token only
    assert sorted((seq, pos, tok, lg) for seq, pos, tok, lg in first) == [
        (0, 0, 1, False), (0, 1, 45, True), (1, 0, 1, False), (1, 1, 10, True),
        (2, 0, 1, False), (2, 1, 20, False), (2, 2, 30, True)]
    assert [len(d) for d in lib.decodes[1:]] == [3, 3, 2, 1, 1]  # one token per running sequence (the last sees EOS)
    assert s.max_decode_batch == 3
    assert lib.kv == {} and lib.live_samplers == 0  # every sequence's cache and sampler freed


def test_waiting_requests_take_the_sequence_of_one_that_finished() -> None:
    lib, rec = FakeLlamaCpp(), Recorder()
    s = scheduler(lib, n_seq_max=2)
    s.submit(rec.job("a", [5], 2))
    s.submit(rec.job("b", [100], 6))
    s.submit(rec.job("c", [200], 2))
    drain(s)
    assert rec.tokens == {"a": [6, 7], "b": [101, 102, 103, 104, 105, 106], "c": [201, 202]}
    assert max(len({seq for seq, *_ in d}) for d in lib.decodes) == 2 == s.max_decode_batch
    joined = next(d for d in lib.decodes if (0, 0, 200, True) in d)  # c, in a's freed sequence 0 ...
    assert any(seq == 1 for seq, *_ in joined)  # ... in the same decode as b's next token
    assert lib.decodes.index(joined) == 2  # as soon as a finished (its 2nd token came from decode 1)


def test_ignore_eos_generates_the_whole_budget() -> None:
    lib, rec = FakeLlamaCpp(), Recorder()
    s = scheduler(lib, n_seq_max=1, ignore_eos=True)
    s.submit(rec.job("a", [48], 5))
    drain(s)
    assert rec.tokens["a"] == [49, 50, EOS, 3, 4]


def test_prompts_beyond_the_batch_wait_for_the_next_step_and_misfits_fail_alone() -> None:
    lib, rec = FakeLlamaCpp(), Recorder()
    s = scheduler(lib, n_seq_max=4, n_batch=8, n_ctx_seq=7)
    s.submit(rec.job("six", [1] * 5 + [10], 1))
    s.submit(rec.job("also-six", [1] * 5 + [20], 1))
    s.submit(rec.job("too-long", [1] * 8, 1))
    s.submit(rec.job("empty", [], 1))
    drain(s)
    assert rec.tokens["six"] == [11] and rec.tokens["also-six"] == [21]
    assert [len(d) for d in lib.decodes] == [6, 6]  # 12 prompt tokens > n_batch 8: two steps
    assert isinstance(rec.done["too-long"], ValueError) and isinstance(rec.done["empty"], ValueError)
    assert rec.done["six"] is None and rec.done["also-six"] is None


def test_generation_stops_at_the_context_of_a_sequence() -> None:
    lib, rec = FakeLlamaCpp(), Recorder()
    s = scheduler(lib, n_seq_max=1, n_ctx_seq=4)
    s.submit(rec.job("a", [1, 10], 100))
    drain(s)
    assert rec.tokens["a"] == [11, 12, 13] and rec.done["a"] is None  # positions 0..3 used


def test_a_failed_decode_fails_its_requests_and_frees_their_sequences() -> None:
    lib, rec = FakeLlamaCpp(), Recorder()
    s = scheduler(lib, n_seq_max=2)
    lib.fail_next = [1]
    s.submit(rec.job("a", [5], 3))
    s.submit(rec.job("b", [7], 3))
    s.step()
    assert isinstance(rec.done["a"], LlamaDecodeError) and rec.done["a"].kind == "llama_decode"
    assert isinstance(rec.done["b"], LlamaDecodeError) and sorted(s.free_ids) == [0, 1] and lib.kv == {}
    s.submit(rec.job("c", [9], 2))
    drain(s)
    assert rec.tokens["c"] == [10, 11] and rec.done["c"] is None and lib.live_samplers == 0


def test_temperature_gives_each_sequence_a_sampling_chain() -> None:
    lib = FakeLlamaCpp()
    s = scheduler(lib, n_seq_max=1, sampling=Sampling(0.7), seed=3)
    assert s._sampler() == ["temp=0.7", "dist=3"]
    assert scheduler(lib, n_seq_max=1)._sampler() == ["greedy"]
    filtered = scheduler(lib, n_seq_max=1, sampling=Sampling(0.7, top_p=0.9, top_k=20, min_p=0.05), seed=3)
    assert filtered._sampler() == ["top_k=20", "top_p=0.9", "min_p=0.05", "temp=0.7", "dist=3"]  # (llama-server's order)
    assert scheduler(lib, n_seq_max=1, sampling=Sampling(0.0, top_p=0.9))._sampler() == ["greedy"]


def test_stopping_fails_what_is_still_queued_or_running() -> None:
    lib, rec = FakeLlamaCpp(), Recorder()
    s = scheduler(lib, n_seq_max=1)
    s.submit(rec.job("running", [5], 100))
    s.step()
    s.submit(rec.job("waiting", [6], 1))
    s.stop()
    s.serve()
    assert isinstance(rec.done["running"], RuntimeError) and isinstance(rec.done["waiting"], RuntimeError)
    assert lib.kv == {} and lib.live_samplers == 0


def test_the_runner_sizes_a_context_per_run_and_records_each_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lib = FakeLlamaCpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", lib)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    requests = [BenchRequest([{"role": "user", "content": str(i)}], 4, group=i, prompt_ids=[1, 45 + i]) for i in range(3)]

    async def main() -> tuple:
        runner = make_runner("llama-cpp", RunnerOptions(model=str(gguf)))
        await runner.start()
        records, wall = await runner.run(requests, [0.0] * 3, 2, None)
        info = runner.run_info()
        await runner.stop()
        return runner, records, wall, info

    runner, records, wall, info = asyncio.run(main())
    assert runner.eos == "honoured"
    # 46..49 (budget), 47..50 (budget), 48..50 then EOS
    assert [r.output_tokens for r in records] == [4, 4, 3] and all(len(r.chunk_times) == r.output_tokens for r in records)
    assert all(r.ok and r.start <= r.chunk_times[0] <= r.end and r.prompt_tokens == 2 for r in records)
    assert info == {"max_decode_batch": 2} and wall > 0
    [params] = lib.contexts
    assert params.n_seq_max == 2 and not params.kv_unified and params.n_ctx == 2 * 6 and params.n_batch == params.n_ctx
    assert params.n_threads == params.n_threads_batch == max(1, (os.cpu_count() or 2) // 2)
    assert lib.live_contexts == 0 and lib.model_freed and lib.live_samplers == 0


def test_the_runner_passes_ignore_eos(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lib = FakeLlamaCpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", lib)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    request = BenchRequest([{"role": "user", "content": "x"}], 5, prompt_ids=[49])

    async def main() -> list:
        runner = make_runner("llama-cpp", RunnerOptions(model=str(gguf), ignore_eos=True, llama_cpp_threads=3))
        await runner.start()
        records, _ = await runner.run([request], [0.0], 1, None)
        await runner.stop()
        return records

    [record] = asyncio.run(main())
    assert record.output_tokens == 5 and lib.contexts[0].n_threads == 3


def test_an_error_inside_the_scheduler_thread_fails_the_request_instead_of_hanging(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lib = FakeLlamaCpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", lib)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    real_decode, prefills = lib.llama_decode, []

    def decode(ctx: str, batch: Any) -> int:
        prefills.extend(batch.token[i] for i in range(batch.n_tokens) if batch.pos[i] == 0)
        if prefills.count(5) == 2:  # the timed run's prefill (the warm-up's went through)
            raise OSError("device lost")
        return real_decode(ctx, batch)

    lib.llama_decode = decode  # type: ignore[method-assign]
    requests = [BenchRequest([], 3, prompt_ids=[5]), BenchRequest([], 3, prompt_ids=[7])]

    async def main() -> list:
        runner = make_runner("llama-cpp", RunnerOptions(model=str(gguf)))
        await runner.start()
        records, _ = await asyncio.wait_for(runner.run(requests, [0.0, 0.0], 2, None), 10)
        await runner.stop()
        return records

    records = asyncio.run(main())
    assert [r.error for r in records] == ["OSError", "OSError"] and lib.live_samplers == 0


def test_a_llama_cpp_python_without_the_memory_api_is_skipped_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = FakeLlamaCpp()
    lib.__version__ = "0.3.1"  # type: ignore[attr-defined]
    monkeypatch.delattr(FakeLlamaCpp, "llama_memory_seq_rm")
    monkeypatch.setitem(sys.modules, "llama_cpp", lib)
    with pytest.raises(SkipSystem) as info:
        asyncio.run(make_runner("llama-cpp", RunnerOptions(model="default")).start())
    assert str(info.value) == "llama-cpp-python 0.3.1 is too old: no llama_memory_seq_rm"
