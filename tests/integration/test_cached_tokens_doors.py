"""Issue 10: prompt tokens served from the prefix cache are reported through both doors,
as OpenAI (``usage.prompt_tokens_details.cached_tokens``) and LangChain
(``usage_metadata["input_token_details"]["cache_read"]``) name them."""

from __future__ import annotations

import litellm
import pytest

from mlx_parallm_provider.langchain import ChatMLXParallm

pytestmark = pytest.mark.usefixtures("fresh_litellm_engines")

SYSTEM = {"role": "system", "content": " ".join(f"Rule {i}: answer briefly and politely." for i in range(30))}


def test_litellm_reports_cached_prompt_tokens(tiny_model_dir) -> None:
    model = f"mlx-parallm/{tiny_model_dir}"
    first = litellm.completion(model=model, messages=[SYSTEM, {"role": "user", "content": "One?"}], max_tokens=4)
    again = litellm.completion(model=model, messages=[SYSTEM, {"role": "user", "content": "Two?"}], max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 100 < cached < again.usage.prompt_tokens  # the system prompt, not the new question


def test_langchain_reports_cache_reads(tiny_model_dir) -> None:
    chat = ChatMLXParallm(model=str(tiny_model_dir), max_tokens=4)
    chat.invoke([("system", SYSTEM["content"]), ("human", "One?")])
    again = chat.invoke([("system", SYSTEM["content"]), ("human", "Two?")])
    details = again.usage_metadata["input_token_details"]
    assert 100 < details["cache_read"] < again.usage_metadata["input_tokens"]
