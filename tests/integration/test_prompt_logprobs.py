"""vLLM's ``prompt_logprobs`` on the tiny model: each prompt token's logprob (and the top
alternatives) against the model run whole, through batched prefill, chunked prefill,
streams, prefix caching and preemption, for a model split at its head and one that is not."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.errors import InvalidParameterError

TOL = 1e-3
TEXT = "The sea is calm tonight. The tide is full, the moon lies fair upon the straits; on the French coast the light gleams."


class Whole:
    """The model run whole (its ``__call__`` not known as body + head: logits at every position)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.layers = inner, inner.layers

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.inner(inputs, cache=cache)


def reference(model: Any, ids: list[int]) -> mx.array:
    """Log-softmax of the model's logits at every position, run unbatched and uncached."""
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def check(entries: list[Any], ids: list[int], expected: mx.array, top: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == ids[i]
        assert abs(entry.logprob - expected[i - 1, ids[i]].item()) < TOL, i
        above = expected[i - 1]
        assert (above > entry.logprob + TOL).sum().item() + 1 <= entry.rank <= (above > entry.logprob - TOL).sum().item() + 1
        assert len(entry.top_logprobs) == top
        best = sorted(expected[i - 1].tolist(), reverse=True)[:top]
        assert all(abs(lp - want) < TOL for (_, _, lp), want in zip(entry.top_logprobs, best)), i
        assert all(abs(lp - expected[i - 1, tid].item()) < TOL for tid, _, lp in entry.top_logprobs)


@pytest.mark.parametrize("split", [True, False], ids=["split-head", "whole-model"])
def test_prompt_logprobs_match_the_model_in_a_batch(make_engine: Any, tiny_model: Any, split: bool) -> None:
    engine = make_engine(None if split else Whole(tiny_model.model), enable_prefix_caching=False)
    prompts = [TEXT, "hello there", TEXT[:57], "x"]
    asks = [SamplingParams(max_tokens=3, prompt_logprobs=2), SamplingParams(max_tokens=3),
            SamplingParams(max_tokens=3, prompt_logprobs=0), SamplingParams(max_tokens=3, prompt_logprobs=5)]

    async def together() -> list[Any]:
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, asks)))

    answers = asyncio.run(together())
    for prompt, params, answer in zip(prompts, asks, answers):
        ids = engine.encode(prompt)
        if params.prompt_logprobs is None:
            assert answer.prompt_logprobs is None
        else:
            check(answer.prompt_logprobs, ids, reference(tiny_model.model, ids), params.prompt_logprobs)
        assert answer.token_ids == engine.generate_sync(prompt, SamplingParams(max_tokens=3)).token_ids  # (the answer is unchanged)
    assert answers[3].prompt_logprobs == [None]  # one token: nothing before it


@pytest.mark.parametrize("split", [True, False], ids=["split-head", "whole-model"])
def test_chunked_prefill_scores_every_chunk(make_engine: Any, tiny_model: Any, split: bool) -> None:
    engine = make_engine(None if split else Whole(tiny_model.model), prefill_chunk_size=8, enable_prefix_caching=False)
    ids = engine.encode(TEXT * 2)
    answer = engine.generate_sync(ids, SamplingParams(max_tokens=2, prompt_logprobs=1))
    check(answer.prompt_logprobs, ids, reference(tiny_model.model, ids), 1)


def test_a_stream_carries_them_on_its_first_delta_and_a_cached_prefix_is_not_used(make_engine: Any, tiny_model: Any) -> None:
    engine = make_engine(enable_prefix_caching=True)
    ids = engine.encode(TEXT)
    expected = reference(tiny_model.model, ids)
    engine.generate_sync(TEXT, SamplingParams(max_tokens=2))
    assert engine.generate_sync(TEXT, SamplingParams(max_tokens=2)).usage.cached_tokens > 0  # (cached now)
    scored = engine.generate_sync(TEXT, SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert scored.usage.cached_tokens == 0
    check(scored.prompt_logprobs, ids, expected, 1)

    async def stream() -> list[Any]:
        return [d async for d in engine.stream(TEXT, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1))]

    deltas = asyncio.run(stream())
    check(deltas[0].prompt_logprobs, ids, expected, 1)
    assert len(deltas) > 1 and all(d.prompt_logprobs is None for d in deltas[1:])


def test_preempted_requests_keep_one_entry_per_prompt_token(make_engine: Any, tiny_model: Any) -> None:
    """Rows preempted and recomputed (prompt + output) are scored again over their prompt only."""
    prompts = [[100 + (7 * i + j) % 300 for j in range(5 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    engine = make_engine(kv_cache_memory_gb=10 * 8 * 2 * 2 * 2 * 16 * 4 / 1024**3, kv_block_size=8, enable_prefix_caching=False)

    async def together() -> list[Any]:
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    answers = asyncio.run(together())
    assert engine.stats()["kv_cache"]["num_preemptions"] > 0
    for prompt, answer in zip(prompts, answers):
        check(answer.prompt_logprobs, prompt, reference(tiny_model.model, prompt), 1)


@pytest.mark.parametrize("value", [-1, 21, "2", True, 1.0])
def test_bad_values_are_refused(value: Any) -> None:
    with pytest.raises(InvalidParameterError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_through_litellm_and_langchain(tiny_model_dir: Path, fresh_litellm_engines: None, tiny_model: Any) -> None:
    """vLLM's response shape: ``prompt_logprobs``, for each prompt token None (the first) or
    ``{token id: {"logprob", "rank", "decoded_token"}}``; not with ``stream=True``, as vLLM."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm
    from langchain_core.messages import AIMessageChunk

    from mlx_parallm_provider.engine import get_engine
    from mlx_parallm_provider.langchain import ChatMLXParallm, MLXParallmLLM

    model = f"mlx-parallm/{tiny_model_dir}"
    messages = [{"role": "user", "content": TEXT}]
    answer = litellm.completion(model=model, messages=messages, max_tokens=2, prompt_logprobs=2)
    same = litellm.completion(model=model, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 2})
    entries = answer.prompt_logprobs
    assert entries[0] is None and len(entries) == answer.usage.prompt_tokens and same.prompt_logprobs == entries
    prompt = get_engine(str(tiny_model_dir)).tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = get_engine(str(tiny_model_dir)).encode(prompt)
    expected = reference(tiny_model.model, ids)
    for i, entry in enumerate(entries[1:], start=1):
        assert ids[i] in entry and 2 <= len(entry) <= 3
        assert abs(entry[ids[i]]["logprob"] - expected[i - 1, ids[i]].item()) < TOL
        assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2]  # (the two likeliest, one maybe the token itself)
    assert litellm.completion(model=model, messages=messages, max_tokens=2).model_dump().get("prompt_logprobs") is None
    with pytest.raises(litellm.BadRequestError, match="prompt_logprobs.*stream=True"):
        litellm.completion(model=model, messages=messages, max_tokens=2, prompt_logprobs=1, stream=True)
    dropped = litellm.completion(model=model, messages=messages, max_tokens=2, prompt_logprobs=1, stream=True, drop_params=True)
    assert "".join(c.choices[0].delta.content or "" for c in dropped) == answer.choices[0].message.content
    with pytest.raises(litellm.BadRequestError, match="prompt_logprobs"):
        litellm.text_completion(model=model, prompt=TEXT, max_tokens=2, prompt_logprobs=0)
    with pytest.raises(litellm.BadRequestError, match="prompt_logprobs"):
        litellm.completion(model=model, messages=messages, max_tokens=2, prompt_logprobs=21)

    chat = ChatMLXParallm(model=str(tiny_model_dir), max_tokens=2, prompt_logprobs=2)
    assert chat.invoke(TEXT).response_metadata["prompt_logprobs"] == entries
    assert sum(chat.stream(TEXT), AIMessageChunk(content="")).response_metadata["prompt_logprobs"] == entries
    llm = MLXParallmLLM(model=str(tiny_model_dir), max_tokens=2)
    scored = llm.generate([TEXT], prompt_logprobs=0).generations[0][0].generation_info["prompt_logprobs"]
    text_ids = get_engine(str(tiny_model_dir)).encode(TEXT)
    assert len(scored) == len(text_ids) and all(list(e) == [t] for e, t in zip(scored[1:], text_ids[1:]))
    assert next(llm._stream(TEXT, prompt_logprobs=0)).generation_info["prompt_logprobs"] == scored  # (a stream's first chunk)
