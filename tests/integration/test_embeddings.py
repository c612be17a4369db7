"""Embeddings on the tiny model: the engine's batched embedding calls (pooling checked
against the model's own layers), beside decoding rows, and through LiteLLM and LangChain."""

from __future__ import annotations

import asyncio
import base64
import math
import os
import struct
from pathlib import Path
from typing import Any

import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)

# isort: split
import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask

from mlx_parallm_provider import ContextWindowExceededError, Engine, EngineConfig, InvalidParameterError, SamplingParams
from mlx_parallm_provider.engine.embed.request import MAX_INPUTS

TEXTS = ["hello world", "The sea is calm tonight, the tide is full, the moon lies fair upon the straits.", "x", "two words"]
TOL = 2e-5


@pytest.fixture(scope="module")
def engine(tiny_model: Any) -> Any:
    engine = Engine("tiny", EngineConfig(), loaded=tiny_model)
    yield engine
    engine.shutdown()


def reference(model: Any, ids: list[int], pooling: str = "mean") -> list[float]:
    """The pooled, normalised final hidden state computed layer by layer, unbatched."""
    inner = model.model
    h = inner.embed_tokens(mx.array([ids]))
    mask = create_causal_mask(len(ids)) if len(ids) > 1 else None
    for layer in inner.layers:
        h = layer(h, mask, None)
    h = inner.norm(h)[0].astype(mx.float32)
    v = h.mean(axis=0) if pooling == "mean" else h[-1]
    return (v / mx.linalg.norm(v)).tolist()


def close(a: list[float], b: list[float], tol: float = TOL) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def test_batched_equals_one_at_a_time_unit_norm_and_usage(engine: Any) -> None:
    together = engine.embed_sync(TEXTS)
    alone = [engine.embed_sync([t]).embeddings[0] for t in TEXTS]
    ids = [engine.encode(t) for t in TEXTS]
    assert together.usage.prompt_tokens == sum(map(len, ids)) and together.usage.total_tokens == together.usage.prompt_tokens
    assert together.usage.completion_tokens == 0
    for v, w in zip(together.embeddings, alone):
        assert close(v, w)
        assert abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-5
    assert len({tuple(round(x, 4) for x in v) for v in together.embeddings}) == len(TEXTS)  # distinct texts, distinct vectors


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_pooling_equals_the_model_layers_reference(engine: Any, tiny_model: Any, pooling: str) -> None:
    got = engine.embed_sync(TEXTS, pooling=pooling)
    for text, v in zip(TEXTS, got.embeddings):
        assert close(v, reference(tiny_model.model, engine.encode(text), pooling)), text
    assert got.pooling == pooling


def test_padding_and_batch_company_do_not_change_a_row(engine: Any) -> None:
    short = engine.embed_sync(["x"]).embeddings[0]
    padded = engine.embed_sync(["x", " ".join(["padding"] * 200)]).embeddings[0]  # "x" right-padded to ~200 tokens
    assert close(short, padded)
    as_ids = engine.embed_sync([engine.encode("x")]).embeddings[0]  # token ids embed as the text does
    assert close(short, as_ids)


def test_dimensions_truncate_then_renormalise(engine: Any) -> None:
    full = engine.embed_sync(["hello world"]).embeddings[0]
    cut = engine.embed_sync(["hello world"], dimensions=8).embeddings[0]
    norm = math.sqrt(sum(x * x for x in full[:8]))
    assert close(cut, [x / norm for x in full[:8]])


@pytest.mark.parametrize("inputs, error, field", [
    ([], InvalidParameterError, "input"),
    ("one text", InvalidParameterError, "input"),
    ([""], InvalidParameterError, "input[0]"),
    (["ok", 3], InvalidParameterError, "input[1]"),
    ([[]], InvalidParameterError, "input[0]"),
    ([[1, 10**9]], InvalidParameterError, "input[0][1]"),
    (["ok"] * (MAX_INPUTS + 1), InvalidParameterError, "input"),
    (["ok", " ".join(["word"] * 600)], ContextWindowExceededError, None),
])
def test_bad_inputs_raise_typed_errors(engine: Any, inputs: Any, error: type, field: Any) -> None:
    with pytest.raises(error) as raised:
        engine.embed_sync(inputs)
    if field is not None:
        assert raised.value.field == field
    else:
        assert "input[1]" in str(raised.value) and "context window" in str(raised.value)


def test_bad_options_raise_typed_errors(engine: Any) -> None:
    with pytest.raises(InvalidParameterError, match="pooling"):
        engine.embed_sync(["x"], pooling="max")
    with pytest.raises(InvalidParameterError, match="dimensions"):
        engine.embed_sync(["x"], dimensions=65)
    with pytest.raises(InvalidParameterError, match="timeout"):
        engine.embed_sync(["x"], timeout=0)


def test_concurrent_calls_batch_together(make_engine: Any) -> None:
    engine = make_engine(batch_window_ms=50)  # an idle engine gathers a burst
    expected = [engine.embed_sync([t]).embeddings[0] for t in TEXTS]

    async def burst() -> list[Any]:
        return await asyncio.gather(*(engine.embed([t]) for t in TEXTS))  # four callers, one input each

    before = engine.stats()["embedding_inputs"]
    calls = asyncio.run(burst())
    assert engine.stats()["max_embedding_batch"] == len(TEXTS) and engine.stats()["embedding_inputs"] == before + len(TEXTS)
    assert all(close(c.embeddings[0], e) for c, e in zip(calls, expected))


def test_embedding_beside_decoding_rows_leaves_their_greedy_output(engine: Any) -> None:
    prompts = ["Once upon a time", "The sea"]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    alone = [engine.generate_sync(p, params).token_ids for p in prompts]
    expected = engine.embed_sync(TEXTS).embeddings

    async def run() -> tuple[list[Any], list[Any]]:
        decoding = [asyncio.ensure_future(engine.generate(p, params)) for p in prompts]
        while engine.stats()["generated_tokens"] == 0 or engine.stats()["running"] < len(prompts):
            await asyncio.sleep(0.002)
        calls = [await engine.embed(TEXTS), *await asyncio.gather(*(engine.embed([t]) for t in TEXTS))]
        assert not any(t.done() for t in decoding)  # the embeddings ran between decode steps
        return await asyncio.gather(*decoding), calls

    done, calls = asyncio.run(run())
    assert [c.token_ids for c in done] == alone
    assert all(close(v, e) for v, e in zip(calls[0].embeddings, expected))
    assert all(close(c.embeddings[0], e) for c, e in zip(calls[1:], expected))


# --------------------------------------------------------------------------- adapters


@pytest.fixture
def model_name(tiny_model_dir: Path, fresh_litellm_engines: None) -> str:
    return str(tiny_model_dir)


def test_litellm_embedding_and_aembedding(model_name: str, engine: Any) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    expected = engine.embed_sync(TEXTS[:2]).embeddings
    r = litellm.embedding(model=f"mlx-parallm/{model_name}", input=TEXTS[:2])
    assert [d["index"] for d in r.data] == [0, 1] and all(close(d["embedding"], e) for d, e in zip(r.data, expected))
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(engine.encode(t)) for t in TEXTS[:2])
    one = asyncio.run(litellm.aembedding(model=f"mlx-parallm/{model_name}", input=TEXTS[0], extra_body={"encoding_format": "base64"}))
    raw = base64.b64decode(one.data[0]["embedding"])
    assert close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), expected[0])
    last = litellm.embedding(model=f"mlx-parallm/{model_name}", input=[TEXTS[0]], pooling="last")
    assert close(last.data[0]["embedding"], engine.embed_sync([TEXTS[0]], pooling="last").embeddings[0])
    for bad in ([], [""], [1.5], ["word " * 600]):
        with pytest.raises(litellm.BadRequestError):
            litellm.embedding(model=f"mlx-parallm/{model_name}", input=bad)
    with pytest.raises(litellm.BadRequestError, match="frobnicate"):
        litellm.embedding(model=f"mlx-parallm/{model_name}", input=["x"], frobnicate=1)


def test_langchain_embeddings(model_name: str, engine: Any) -> None:
    from mlx_parallm_provider.langchain import MLXParallmEmbeddings

    expected = engine.embed_sync(TEXTS).embeddings
    embeddings = MLXParallmEmbeddings(model=model_name)
    assert all(close(v, e) for v, e in zip(embeddings.embed_documents(TEXTS), expected))
    assert close(embeddings.embed_query(TEXTS[1]), expected[1])
    assert all(close(v, e) for v, e in zip(asyncio.run(embeddings.aembed_documents(TEXTS)), expected))
    assert close(asyncio.run(embeddings.aembed_query(TEXTS[2])), expected[2])
    assert embeddings.embed_documents([]) == []
    with pytest.raises(ValueError, match="pooling"):
        MLXParallmEmbeddings(model=model_name, pooling="max")
