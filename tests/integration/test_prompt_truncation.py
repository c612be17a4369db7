"""vLLM's ``truncate_prompt_tokens`` on the tiny model (512-token context): a longer prompt
keeps its last tokens (a leading BOS first) instead of being refused, for generation and
embeddings, through the engine, LiteLLM and LangChain; bad values are refused."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from mlx_parallm_provider import ContextWindowExceededError, InvalidParameterError, SamplingParams

GREEDY = {"max_tokens": 6, "ignore_eos": True}
LONG = "The tide is full and the moon lies fair upon the straits. " * 120  # ~1,700 tokens: over the 512 context


def kept(engine: Any, prompt: Any, keep: int) -> list[int]:
    """What truncation should feed the model: the last ``keep`` ids, a leading BOS kept first."""
    ids = engine.encode(prompt)
    bos = engine.tokenizer.bos_token_id
    if len(ids) <= keep:
        return ids
    return [bos, *ids[len(ids) - keep + 1:]] if bos is not None and ids[0] == bos else ids[len(ids) - keep:]


def test_a_long_prompt_keeps_its_last_tokens(make_engine: Any) -> None:
    engine = make_engine()
    with pytest.raises(ContextWindowExceededError):
        engine.generate_sync(LONG, SamplingParams(**GREEDY))
    for keep in (1, 7, 100):
        cut = engine.generate_sync(LONG, SamplingParams(**GREEDY, truncate_prompt_tokens=keep))
        direct = engine.generate_sync(kept(engine, LONG, keep), SamplingParams(**GREEDY))
        assert cut.usage.prompt_tokens == keep and cut.token_ids == direct.token_ids, keep
    fitting = engine.generate_sync(LONG, SamplingParams(**GREEDY, truncate_prompt_tokens=-1))
    assert fitting.usage.prompt_tokens == engine.context_length - GREEDY["max_tokens"]
    assert fitting.token_ids == engine.generate_sync(kept(engine, LONG, fitting.usage.prompt_tokens), SamplingParams(**GREEDY)).token_ids


def test_short_prompts_and_token_id_prompts(make_engine: Any) -> None:
    engine = make_engine()
    short = engine.generate_sync("hello there", SamplingParams(**GREEDY, truncate_prompt_tokens=100))
    assert short.token_ids == engine.generate_sync("hello there", SamplingParams(**GREEDY)).token_ids
    assert short.usage.prompt_tokens == len(engine.encode("hello there"))
    ids = engine.encode(LONG)[1:900]  # (no BOS: the last 50 ids alone)
    cut = engine.generate_sync(ids, SamplingParams(**GREEDY, truncate_prompt_tokens=50))
    assert cut.token_ids == engine.generate_sync(ids[-50:], SamplingParams(**GREEDY)).token_ids
    with pytest.raises(InvalidParameterError, match=r"prompt\[0\]"):  # ids are still checked, even those cut off
        engine.generate_sync([10**9, *ids], SamplingParams(**GREEDY, truncate_prompt_tokens=50))


def test_async_calls_many_prompts_and_n_truncate_too(make_engine: Any) -> None:
    """Long texts tokenized off the caller's loop are truncated, not refused; a prompt without
    truncation beside them is still refused alone."""
    engine = make_engine()
    params = SamplingParams(**GREEDY, truncate_prompt_tokens=64)
    expected = engine.generate_sync(LONG, params).token_ids

    async def main() -> Any:
        one = await engine.generate(LONG, params)
        streamed = [d async for d in engine.stream(LONG, params)]
        many = await engine.generate_many([LONG, LONG + "more"], params, n=2)
        mixed = await engine.generate_many([LONG, LONG], [params, SamplingParams(**GREEDY)], return_exceptions=True)
        return one, streamed, many, mixed

    one, streamed, many, mixed = asyncio.run(main())
    assert one.token_ids == expected and one.usage.prompt_tokens == 64
    assert [t for d in streamed for t in d.token_ids] == expected
    assert len(many) == 4 and all(c.usage.prompt_tokens == 64 for c in many) and many[0].token_ids == expected
    assert mixed[0].token_ids == expected and isinstance(mixed[1], ContextWindowExceededError)


def test_truncated_prompts_still_have_to_leave_room_for_the_answer(make_engine: Any) -> None:
    engine = make_engine()
    with pytest.raises(ContextWindowExceededError):
        engine.generate_sync(LONG, SamplingParams(max_tokens=100, truncate_prompt_tokens=500))
    with pytest.raises(ContextWindowExceededError):
        engine.generate_sync(LONG, SamplingParams(max_tokens=512, truncate_prompt_tokens=-1))


@pytest.mark.parametrize("value", [0, -2, 1.5, "8", True])
def test_bad_values_are_refused(value: Any) -> None:
    with pytest.raises(InvalidParameterError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=value)


def test_embeddings_truncate(make_engine: Any) -> None:
    engine = make_engine()
    with pytest.raises(ContextWindowExceededError):
        engine.embed_sync([LONG])
    cut = engine.embed_sync([LONG, "short"], truncate_prompt_tokens=40)
    direct = engine.embed_sync([kept(engine, LONG, 40), engine.encode("short")])
    assert cut.usage.prompt_tokens == 40 + len(engine.encode("short"))
    assert all(max(abs(x - y) for x, y in zip(a, b)) < 2e-5 for a, b in zip(cut.embeddings, direct.embeddings))
    whole = engine.embed_sync([LONG], truncate_prompt_tokens=-1)
    assert whole.usage.prompt_tokens == engine.context_length
    ids = engine.encode(LONG)[1:]
    assert asyncio.run(engine.embed([ids], truncate_prompt_tokens=30)).usage.prompt_tokens == 30
    with pytest.raises(InvalidParameterError, match="truncate_prompt_tokens"):
        engine.embed_sync(["x"], truncate_prompt_tokens=0)


def test_through_litellm_and_langchain(tiny_model_dir: Path, fresh_litellm_engines: None) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    from mlx_parallm_provider.langchain import ChatMLXParallm, MLXParallmEmbeddings, MLXParallmLLM

    model = f"mlx-parallm/{tiny_model_dir}"
    messages = [{"role": "user", "content": LONG}]
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=model, messages=messages, max_tokens=4)
    chat = litellm.completion(model=model, messages=messages, max_tokens=4, truncate_prompt_tokens=32)
    extra = litellm.completion(model=model, messages=messages, max_tokens=4, extra_body={"truncate_prompt_tokens": 32})
    assert chat.usage.prompt_tokens == extra.usage.prompt_tokens == 32
    text = litellm.text_completion(model=model, prompt=LONG, max_tokens=4, truncate_prompt_tokens=-1)
    assert text.usage.prompt_tokens == 512 - 4
    with pytest.raises(litellm.BadRequestError, match="truncate_prompt_tokens"):
        litellm.completion(model=model, messages=messages, max_tokens=4, truncate_prompt_tokens=0)
    vectors = litellm.embedding(model=model, input=[LONG], truncate_prompt_tokens=24)
    assert vectors.usage.prompt_tokens == 24
    assert litellm.embedding(model=model, input=[LONG], extra_body={"truncate_prompt_tokens": 24}).data == vectors.data

    answer = ChatMLXParallm(model=str(tiny_model_dir), max_tokens=4, truncate_prompt_tokens=32).invoke(LONG)
    assert answer.usage_metadata["input_tokens"] == 32
    bound = ChatMLXParallm(model=str(tiny_model_dir), max_tokens=4).bind(truncate_prompt_tokens=16).invoke(LONG)
    assert bound.usage_metadata["input_tokens"] == 16
    llm = MLXParallmLLM(model=str(tiny_model_dir), max_tokens=4, truncate_prompt_tokens=20)
    assert llm.generate([LONG]).llm_output["token_usage"]["prompt_tokens"] == 20
    embeddings = MLXParallmEmbeddings(model=str(tiny_model_dir), truncate_prompt_tokens=24)
    assert max(abs(x - y) for x, y in zip(embeddings.embed_query(LONG), vectors.data[0]["embedding"])) < 2e-5
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        MLXParallmEmbeddings(model=str(tiny_model_dir), truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        ChatMLXParallm(model=str(tiny_model_dir), truncate_prompt_tokens=-3)
