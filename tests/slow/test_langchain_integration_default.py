"""LangChain's standard integration suite (``langchain-tests``' ``ChatModelIntegrationTests``)
for :class:`ChatMLXParallm` on the real default model (SmolLM2-135M-Instruct).

The whole suite takes many minutes on a CPU, so by default only a few of its tests run
(:data:`CI_SUBSET`: forced tool calls, invoked and streamed, and JSON-schema output).
Run all of it with::

    MLX_PARALLM_LANGCHAIN_SUITE=all .venv/bin/python -m pytest -m slow tests/slow/test_langchain_integration_default.py

The capability flags are set to what the adapter really does. Known failure on this 135M
model: ``test_agent_loop`` (run twice, output versions v0 and v1; ``tool_choice`` auto: the
model answers in prose instead of calling the tool), marked ``xfail(strict=True)`` as the
suite's own docstring advises for a model that does not call tools reliably; strict, so the
day it passes the run fails and the mark must go. Measured 2026-12-01 (greedy, ``repetition_penalty=1.1``, 12 questions a
bound tool answers, 12 it does not): the model opens ``<tool_call>`` first with probability
about 0.5-1% (0.8% for this test's question) and called a tool in 0 of 12, and no honest
rewording of the tool prompt (an instruction to call, SmolLM2's own function-calling prompt,
a shorter one, an example call, the tools in the user turn) raised that above 1 of 12
without also making unwarranted calls. Auto tool calling is left to the model; it is not
forced.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests

from mlx_parallm_provider.langchain import ChatMLXParallm
from mlx_parallm_provider.models.registry import default_gguf_path

# The suite's async tests carry no asyncio mark (it expects asyncio_mode=auto, which this
# test suite does not use); marking every test is how to mark them without overriding
# (the suite fails a subclass that overrides its tests). Sync tests ignore the mark.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("fresh_litellm_engines"),
    pytest.mark.asyncio,
    pytest.mark.filterwarnings("ignore:.*marked with '@pytest.mark.asyncio' but it is not an async function"),
]

#: The tests run when ``MLX_PARALLM_LANGCHAIN_SUITE`` is not ``all`` (about a minute).
CI_SUBSET = frozenset({
    "test_tool_calling[model0]",
    "test_tool_choice",
    "test_structured_output[json_schema]",
})


@pytest.fixture(autouse=True)
def _subset(request: pytest.FixtureRequest) -> None:
    if os.environ.get("MLX_PARALLM_LANGCHAIN_SUITE") != "all" and request.node.name not in CI_SUBSET:
        pytest.skip("part of the full LangChain suite: set MLX_PARALLM_LANGCHAIN_SUITE=all to run it")


class TestChatMLXParallmIntegration(ChatModelIntegrationTests):
    """The standard suite against the embedded default model."""

    @property
    def chat_model_class(self) -> type[ChatMLXParallm]:
        return ChatMLXParallm

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Greedy decoding with a light repetition penalty, the default of Ollama and LM Studio:
        # greedy alone, a 135M model loops inside a JSON string ("a cat is a cat, a cat is
        # a cat, ...") until max_tokens cuts it: 8 structured-output tests more fail so.
        # Full suite, 2026-11-29: greedy alone 11 failed; with the penalty 40 passed, 3 failed
        # (agent loop x2, JSON mode), 7 skipped. 2026-12-01, JSON mode with a schema held to
        # it: 41 passed, 2 failed (test_agent_loop[model0], [model1]), 7 skipped.
        return {"model": "default", "max_tokens": 256, "repetition_penalty": 1.1}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)  # as the suite's
    @pytest.mark.xfail(strict=True, reason=(
        "SmolLM2-135M does not call a tool under tool_choice auto: 0 of 12 warranted questions, "
        "P(<tool_call> first) ~0.8% here; auto is left to the model, not forced (see module docstring)"
    ))
    def test_agent_loop(self, model: Any) -> None:
        super().test_agent_loop(model)

    @property
    def has_tool_choice(self) -> bool:
        return True  # "any" and a named tool are constrained by a grammar

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return True

    @property
    def model_override_value(self) -> str:
        # Another model name for the same weights: the default model's own GGUF file (a
        # second engine; no download, so it runs offline).
        return str(default_gguf_path())

