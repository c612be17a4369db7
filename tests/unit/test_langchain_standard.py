"""LangChain's standard unit tests (``langchain-tests``) for :class:`ChatMLXParallm`.

None of them loads a model: construction, ``bind_tools`` and ``with_structured_output``
are lazy; the engine is resolved on the first call.
"""

from __future__ import annotations

from typing import Any

from langchain_tests.unit_tests import ChatModelUnitTests

from mlx_parallm_provider.langchain import ChatMLXParallm


class TestChatMLXParallmStandard(ChatModelUnitTests):
    """Capability flags, set to what the adapter really does."""

    @property
    def chat_model_class(self) -> type[ChatMLXParallm]:
        return ChatMLXParallm

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "default"}

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # A local in-process model has no API key and makes no network calls to retry, and
        # unknown fields are rejected (extra="forbid"), so those two standard params are left out.
        params = super().standard_chat_model_params
        params.pop("api_key")
        params.pop("max_retries")
        return params

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True  # auto / none by prompting; required / a named function constrained by a grammar

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True  # method="json_mode" / "json_schema": constrained decoding (llguidance)

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False  # text-only models: image parts raise InvalidParameterError

    @property
    def supports_model_override(self) -> bool:
        return True  # invoke(..., model="<other model>") uses that model's shared engine

    @property
    def model_override_value(self) -> str:
        return "HuggingFaceTB/SmolLM2-135M-Instruct"
