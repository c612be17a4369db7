"""The batching engine on the tiny random llama (real tokenizer, real KV caches)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine_helpers import ScriptedModel
from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.errors import (
    ContextWindowExceededError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidParameterError,
    RequestFailedError,
    RequestTimeoutError,
)

WORDS = "the quick brown fox jumps over a lazy dog while seven curious cats watch from the old wall".split()


def mixed_prompts(n: int = 16) -> list[str]:
    return [" ".join(WORDS[: 2 + (i * 5) % len(WORDS)]) + f" #{i}" for i in range(n)]


def run(coro):
    return asyncio.run(coro)


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_batched_greedy_equals_one_at_a_time(make_engine) -> None:
    prompts = mixed_prompts(16)
    alone = make_engine(max_num_seqs=1)
    expected = [alone.generate_sync(p, GREEDY).token_ids for p in prompts]
    assert alone.stats()["max_batch_size"] == 1

    together = make_engine()

    async def all_at_once():
        return await asyncio.gather(*(together.generate(p, GREEDY) for p in prompts))

    got = [c.token_ids for c in run(all_at_once())]
    assert got == expected
    assert together.stats()["max_batch_size"] == 16

    staggered = make_engine(batch_window_ms=0)

    async def one_by_one():
        async def later(i, p):
            await asyncio.sleep(0.004 * i)
            return await staggered.generate(p, GREEDY)

        return await asyncio.gather(*(later(i, p) for i, p in enumerate(prompts)))

    got = [c.token_ids for c in run(one_by_one())]
    assert got == expected
    assert staggered.stats()["max_batch_size"] > 1


def test_long_prompt_is_chunk_prefilled_while_others_decode(make_engine) -> None:
    engine = make_engine(prefill_chunk_size=16, max_num_batched_tokens=64)
    long_prompt = " ".join(WORDS * 4)
    reference = make_engine(max_num_seqs=1)
    expected_long = reference.generate_sync(long_prompt, GREEDY).token_ids
    expected_short = reference.generate_sync("hello there", GREEDY).token_ids

    async def both():
        return await asyncio.gather(engine.generate("hello there", GREEDY), engine.generate(long_prompt, GREEDY))

    short, long = run(both())
    assert short.token_ids == expected_short and long.token_ids == expected_long


def test_seeded_sampling_is_batch_independent(make_engine) -> None:
    engine = make_engine()
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate_sync("once upon a time", seeded).token_ids

    async def in_a_crowd():
        others = [engine.generate(p, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)) for p in mixed_prompts(8)]
        results = await asyncio.gather(engine.generate("once upon a time", seeded), *others)
        return results[0].token_ids

    assert run(in_a_crowd()) == alone
    assert engine.generate_sync("once upon a time", seeded).token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert engine.generate_sync("once upon a time", other_seed).token_ids != alone


def test_32_async_callers_share_one_decode_batch(make_engine) -> None:
    engine = make_engine()

    async def burst():
        return await asyncio.gather(*(engine.generate(p, GREEDY) for p in mixed_prompts(32)))

    results = run(burst())
    assert len(results) == 32 and all(r.usage.completion_tokens == 12 for r in results)
    stats = engine.stats()
    assert stats["max_batch_size"] >= 16
    assert stats["running"] == 0 and stats["finished"] == 32
    json.dumps(stats)


def test_32_threads_share_one_decode_batch(make_engine) -> None:
    engine = make_engine()
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: engine.generate_sync(p, GREEDY), mixed_prompts(32)))
    assert all(r.usage.completion_tokens == 12 for r in results)
    assert engine.stats()["max_batch_size"] >= 16


def test_callers_from_several_event_loops_batch_together(make_engine) -> None:
    engine = make_engine(batch_window_ms=50)
    barrier = threading.Barrier(4)

    def loop_in_thread(i: int):
        async def main():
            barrier.wait()
            return await asyncio.gather(*(engine.generate(p, GREEDY) for p in mixed_prompts(8)))

        return asyncio.run(main())

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(loop_in_thread, range(4)))
    assert sum(len(o) for o in outs) == 32
    assert engine.stats()["max_batch_size"] >= 16


def test_concurrent_streams_get_each_step_in_one_wake_up_of_their_loop(make_engine) -> None:
    engine = make_engine()
    prompts = mixed_prompts(8)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    expected = [engine.generate_sync(p, params) for p in prompts]

    async def collect(prompt: str) -> list[int]:
        return [t async for delta in engine.stream(prompt, params) for t in delta.token_ids]

    async def main() -> tuple[list[list[int]], list[str]]:
        loop = asyncio.get_running_loop()
        handed, real = [], loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda cb, *a, **k: handed.append(getattr(cb, "__name__", "")) or real(cb, *a, **k)
        return await asyncio.gather(*(collect(p) for p in prompts)), handed

    streamed, handed = run(main())
    assert streamed == [e.token_ids for e in expected]
    deliveries = [name for name in handed if name in ("_hand_over", "put_nowait")]
    assert 0 < len(deliveries) <= 12 + 4  # a call a step (and a first token or two apart), not one a token a row: 96


def test_cancel_one_stream_leaves_others_untouched(make_engine) -> None:
    engine = make_engine()
    prompts = mixed_prompts(8)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [engine.generate_sync(p, params).text for p in prompts]

    async def collect(i: int, prompt: str) -> str:
        text = ""
        async for delta in engine.stream(prompt, params):
            text += delta.text
            if i == 3 and len(text) > 0:
                break  # leaving the stream cancels the request
        return text

    async def main():
        return await asyncio.gather(*(collect(i, p) for i, p in enumerate(prompts)))

    texts = run(main())
    assert [t for i, t in enumerate(texts) if i != 3] == [t for i, t in enumerate(expected) if i != 3]
    assert texts[3] != expected[3]
    time.sleep(0.1)
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0


def test_cancelling_the_task_frees_the_row(make_engine) -> None:
    engine = make_engine()

    async def main():
        victim = asyncio.ensure_future(engine.generate("cancel me", SamplingParams(max_tokens=400, ignore_eos=True)))
        survivor = asyncio.ensure_future(engine.generate("keep me", GREEDY))
        await asyncio.sleep(0.05)
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        return await survivor

    assert run(main()).usage.completion_tokens == 12
    time.sleep(0.1)
    assert engine.stats()["running"] == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0), ("temperature", -1.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 2.0),
        ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -3.0),
        ("logit_bias", {"x": 1.0}), ("stop", [""]), ("stop_token_ids", [-1]), ("seed", -5),
        ("top_logprobs", 50), ("timeout", -1.0),
    ],
)
def test_invalid_parameters_name_the_field(field, value) -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**{field: value})
    assert info.value.field.startswith(field)


def test_errors_do_not_disturb_requests_in_flight(make_engine, tiny_model) -> None:
    engine = make_engine(max_queue=64)

    async def main():
        good = [asyncio.ensure_future(engine.generate(p, GREEDY)) for p in mixed_prompts(4)]
        await asyncio.sleep(0)
        with pytest.raises(ContextWindowExceededError, match="512"):
            await engine.generate("hi", SamplingParams(max_tokens=600))
        with pytest.raises(InvalidParameterError, match="prompt"):
            await engine.generate([1, 2, 10**9])
        with pytest.raises(InvalidParameterError, match="prompt"):
            await engine.generate("")
        with pytest.raises(RequestTimeoutError):
            await engine.generate("slow", SamplingParams(max_tokens=400, ignore_eos=True, timeout=0.02))
        return await asyncio.gather(*good)

    assert all(r.usage.completion_tokens == 12 for r in run(main()))


def test_a_lone_surrogate_and_a_deep_schema_are_typed_errors(make_engine) -> None:
    # Issue 21 items 10 and 12: a TypeError from tokenizers; a schema 1,200 levels deep.
    from mlx_parallm_provider.engine import Constraint

    engine = make_engine()
    for prompt in ("a\ud800b", "x" * 5000 + "\udfff"):  # inline and tokenized off the loop
        with pytest.raises(InvalidParameterError, match=r"^prompt: holds a lone surrogate"):
            run(engine.generate(prompt, GREEDY))
        with pytest.raises(InvalidParameterError, match=r"^prompt: holds a lone surrogate"):
            engine.generate_sync(prompt, GREEDY)
    schema: dict = {"type": "string"}
    for _ in range(1_200):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidParameterError, match=r"more than 128 levels deep.*GrammarLimits\.max_depth"):
        Constraint.json_schema(schema)
    assert run(engine.generate("a\U0001f600b", GREEDY)).usage.completion_tokens == 12  # the engine still serves


def test_overload_is_immediate_and_typed(make_engine, tiny_model) -> None:
    scripted = ScriptedModel(tiny_model.model, [100, 101, 102], vocab_size=49152)
    scripted.gate = threading.Event()
    engine = make_engine(scripted, max_num_seqs=1, max_num_batched_tokens=64, max_queue=3, batch_window_ms=0)

    async def main():
        first = asyncio.ensure_future(engine.generate("first", GREEDY))
        await asyncio.sleep(0.05)  # the worker is now blocked inside the first forward
        queued = [asyncio.ensure_future(engine.generate(f"q{i}", GREEDY)) for i in range(3)]
        await asyncio.sleep(0.01)
        tic = time.perf_counter()
        with pytest.raises(EngineOverloadedError, match="max_queue=3"):
            await engine.generate("one too many", GREEDY)
        assert time.perf_counter() - tic < 0.5
        scripted.gate.set()
        return await asyncio.gather(first, *queued)

    assert len(run(main())) == 4


def test_worker_death_fails_everyone_then_recovers(make_engine, tiny_model) -> None:
    scripted = ScriptedModel(tiny_model.model, [100, 101, 102], vocab_size=49152)
    engine = make_engine(scripted)
    scripted.fail_with = RuntimeError("metal exploded")

    async def doomed():
        return await asyncio.gather(*(engine.generate(p, GREEDY) for p in mixed_prompts(4)), return_exceptions=True)

    errors = run(doomed())
    assert all(isinstance(e, EngineDeadError) and "metal exploded" in str(e) for e in errors)
    scripted.fail_with = None
    n = len(engine.encode("alive again"))
    assert engine.generate_sync("alive again", GREEDY).token_ids == [[100, 101, 102][(n + i) % 3] for i in range(12)]


def test_fault_in_one_request_fails_only_it(make_engine, monkeypatch) -> None:
    from mlx_parallm_provider.engine import core as worker_module

    class Exploding(worker_module.TextStream):
        def add_token(self, token_id):
            if "BOOM" in self.matcher.stops:
                raise ValueError("detokenizer bug")
            return super().add_token(token_id)

    monkeypatch.setattr(worker_module, "TextStream", Exploding)
    engine = make_engine()

    async def main():
        return await asyncio.gather(
            engine.generate("a", SamplingParams(max_tokens=8, stop=["BOOM"])),
            *(engine.generate(p, GREEDY) for p in mixed_prompts(3)),
            return_exceptions=True,
        )

    first, *rest = run(main())
    # Issue 8 #7: the caller gets the package's own error, with the fault as its cause.
    assert isinstance(first, RequestFailedError) and isinstance(first.__cause__, ValueError)
    assert "detokenizer bug" in str(first)
    assert all(r.usage.completion_tokens == 12 for r in rest)


def _script_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_multibyte_text_streams_intact(make_engine, tiny_model) -> None:
    tokenizer = tiny_model.tokenizer
    target = "Café 😀 中文字 👨‍👩‍👧 ok"
    script = _script_ids(tokenizer, target)
    assert any("\ufffd" in tokenizer.decode([t]) for t in script)  # some tokens hold partial characters
    scripted = ScriptedModel(tiny_model.model, script, vocab_size=49152)
    engine = make_engine(scripted)
    prompt = list(script)  # position len(script)-1 -> next is script[0]: the text repeats from the start
    params = SamplingParams(max_tokens=len(script), ignore_eos=True)

    async def main():
        return [d async for d in engine.stream(prompt, params)]

    deltas = run(main())
    assert "".join(d.text for d in deltas) == target
    assert all("\ufffd" not in d.text for d in deltas)
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == len(script)


def _byte_ids(tokenizer, text: str) -> list[int]:
    """One byte-level token per UTF-8 byte of ``text`` (GPT-2's byte-to-character map), as
    a model emitting a character byte by byte would."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = sorted(set(range(256)) - set(printable))
    return [tokenizer.convert_tokens_to_ids(chr(b) if b in printable else chr(256 + others.index(b))) for b in text.encode()]


def _held_back_case(tokenizer, case: str) -> tuple[list[int], SamplingParams]:
    """A script and params whose output holds text back: characters split across tokens
    mid-stream (as BPE splits them, or byte by byte), a character cut at the end (by
    ``max_tokens`` or by EOS), or text that may begin a stop string."""
    hi, emoji = _script_ids(tokenizer, "Hi "), _byte_ids(tokenizer, "😀中")
    lp = dict(logprobs=True, top_logprobs=2, ignore_eos=True)
    if case == "bpe split":
        script = _script_ids(tokenizer, "Café 😀 中文字 ok")
        return script, SamplingParams(max_tokens=len(script), **lp)
    if case == "byte tokens":
        script = hi + emoji + _script_ids(tokenizer, " ok")
        return script, SamplingParams(max_tokens=len(script), **lp)
    if case == "max_tokens":
        return hi + emoji, SamplingParams(max_tokens=len(hi) + 3, **lp)
    if case == "eos":
        return hi + emoji[:2] + [2], SamplingParams(max_tokens=30, logprobs=True)
    return _script_ids(tokenizer, "中文 STOP HERE and more"), SamplingParams(max_tokens=30, stop=["STOP HERE"], **lp)


@pytest.mark.parametrize("case", ["bpe split", "byte tokens", "max_tokens", "eos", "stop string"])
def test_stream_carries_every_token_id_and_logprob(make_engine, tiny_model, case) -> None:
    """Tokens whose text is held back ride on the next delta, or the last one: the
    stream's token ids and logprobs are the Completion's (issue 22 item 2)."""
    script, params = _held_back_case(tiny_model.tokenizer, case)
    engine = make_engine(ScriptedModel(tiny_model.model, script, vocab_size=49152))

    async def main():
        return [d async for d in engine.stream(list(script), params)], await engine.generate(list(script), params)

    deltas, whole = run(main())
    ids = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in d.logprobs or []]
    assert ids == whole.token_ids
    assert max(len(d.token_ids) for d in deltas) > 1  # some delta carried held-back tokens
    assert len(logprobs) == len(ids) == len(whole.logprobs)
    assert [lp.token_id for lp in logprobs] == ids
    assert "".join(d.text for d in deltas) == whole.text
    assert all(d.text for d in deltas[:-1]) and deltas[-1].finish_reason == whole.finish_reason


@pytest.mark.parametrize("case", ["bpe split", "byte tokens", "max_tokens", "eos", "stop string"])
def test_stream_interval_sends_a_delta_every_n_tokens_and_loses_nothing(make_engine, tiny_model, case) -> None:
    """``stream_interval=3``: the first token with text at once, then a delta once three
    more tokens are due (held-back text rides along), the last at once; text, ids and
    logprobs over the stream are the Completion's."""
    script, params = _held_back_case(tiny_model.tokenizer, case)
    engine = make_engine(ScriptedModel(tiny_model.model, script, vocab_size=49152), stream_interval=3)

    async def main():
        return [d async for d in engine.stream(list(script), params)], await engine.generate(list(script), params)

    deltas, whole = run(main())
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert [lp.token_id for d in deltas for lp in d.logprobs or []] == (whole.token_ids if params.logprobs else [])
    assert "".join(d.text for d in deltas) == whole.text
    assert all(d.text for d in deltas[:-1]) and deltas[-1].finish_reason == whole.finish_reason
    assert all(len(d.token_ids) >= 3 for d in deltas[1:-1])  # (the first comes at once)
    assert len(deltas) <= 2 + len(whole.token_ids) // 3


def test_stop_strings_never_leak(make_engine, tiny_model) -> None:
    tokenizer = tiny_model.tokenizer
    target = "Hello there. STOP HERE and more text"
    script = _script_ids(tokenizer, target)
    scripted = ScriptedModel(tiny_model.model, script, vocab_size=49152)
    engine = make_engine(scripted)
    params = SamplingParams(max_tokens=40, stop=["STOP HERE", "never"], ignore_eos=True)

    async def main():
        streamed = [d async for d in engine.stream(list(script), params)]
        whole = await engine.generate(list(script), params)
        return streamed, whole

    streamed, whole = run(main())
    text = "".join(d.text for d in streamed)
    assert text == whole.text == "Hello there. "
    assert streamed[-1].finish_reason == whole.finish_reason == "stop"
    params.include_stop_str_in_output = True  # vLLM's: the stop string ends the text
    streamed, whole = run(main())
    assert "".join(d.text for d in streamed) == whole.text == "Hello there. STOP HERE"
    assert whole.finish_reason == "stop"


def test_eos_and_stop_token_ids(make_engine, tiny_model) -> None:
    tokenizer = tiny_model.tokenizer
    script = _script_ids(tokenizer, "one two three") + [2]  # 2 = <|im_end|>, the EOS
    scripted = ScriptedModel(tiny_model.model, script, vocab_size=49152)
    engine = make_engine(scripted)
    done = engine.generate_sync(list(script), SamplingParams(max_tokens=30))
    assert done.text == "one two three" and done.finish_reason == "stop" and 2 not in done.token_ids
    assert done.usage.completion_tokens == len(script)
    two = _script_ids(tokenizer, " two")[0]
    cut = engine.generate_sync(list(script), SamplingParams(max_tokens=30, stop_token_ids=[two]))
    assert cut.text == "one" and cut.finish_reason == "stop"


def test_logprobs_and_logit_bias(make_engine) -> None:
    engine = make_engine()
    biased = engine.generate_sync("hello", SamplingParams(max_tokens=4, logit_bias={777: 100.0}, logprobs=True, top_logprobs=3))
    assert biased.token_ids == [777] * 4
    assert len(biased.logprobs) == 4 and all(lp.token_id == 777 and lp.logprob > -1e-3 for lp in biased.logprobs)
    assert all(len(lp.top_logprobs) == 3 and lp.top_logprobs[0][0] == 777 for lp in biased.logprobs)


def test_penalties_change_output(make_engine) -> None:
    engine = make_engine()
    plain = engine.generate_sync("the the the", SamplingParams(max_tokens=16, ignore_eos=True))
    penalised = engine.generate_sync("the the the", SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=2.0, repetition_penalty=1.5))
    assert plain.token_ids != penalised.token_ids
    assert len(set(penalised.token_ids)) >= len(set(plain.token_ids))


def test_kv_budget_refuses_what_can_never_fit_and_queues_the_rest(make_engine) -> None:
    # Tiny model: 2 layers x 2 KV heads x 16 dims x 2 (K and V) x 4 bytes = 512 bytes/token.
    engine = make_engine(kv_cache_memory_gb=100 * 512 / 1024**3)  # room for 100 tokens in all
    with pytest.raises(InvalidParameterError, match="kv_cache_memory_gb"):
        engine.generate_sync("hello", SamplingParams(max_tokens=200))
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(engine.generate(p, params) for p in mixed_prompts(6)))

    assert all(r.usage.completion_tokens == 40 for r in run(main()))
    assert engine.stats()["max_batch_size"] < 6  # the budget held some back until others left

def test_rotating_cache_rows_keep_no_first_tokens_and_batching_does_not_change_them(make_engine) -> None:
    """Documented decision: batched rotating rows keep only the last ``max_kv_size`` entries
    (as mlx-lm's ``BatchRotatingKVCache``: none of the first tokens, unlike its
    single-sequence cache with keep=4). Past the window, a row's greedy tokens are the same in
    a burst as alone, so batching never changes what the window holds."""
    engine = make_engine(max_kv_size=32)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompts = mixed_prompts(4)
    alone = [engine.generate_sync(p, params).token_ids for p in prompts]

    async def burst():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    assert [r.token_ids for r in run(burst())] == alone
