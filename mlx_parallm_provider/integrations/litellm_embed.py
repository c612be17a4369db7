"""LiteLLM ``embedding`` / ``aembedding`` for ``mlx-parallm/<model>``: OpenAI's embedding
parameters to :meth:`Engine.embed <mlx_parallm_provider.engine.Engine.embed>` and its
result to a LiteLLM ``EmbeddingResponse``.

What reaches the handler (litellm 1.110): LiteLLM itself refuses ``encoding_format`` and
``dimensions`` given as arguments for any custom provider (``UnsupportedParamsError``, 400)
unless ``drop_params`` drops them; parameters it does not know (``pooling``) and
``extra_body`` pass through. So ``encoding_format`` (``"float"`` or ``"base64"``: float32
little-endian, as OpenAI sends) and ``dimensions`` are read from ``extra_body`` too, and
``pooling`` (``"mean"`` or ``"last"``) and vLLM's ``truncate_prompt_tokens`` as top-level
parameters or in ``extra_body``.
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import litellm
from litellm.types.utils import EmbeddingResponse

from ..engine import EmbeddingResult, EngineLike, get_engine
from ..errors import InvalidParameterError
from ._litellm_params import _timeout_seconds, merged_params, refuse_unless_dropped

ENCODINGS = ("float", "base64")
#: Keys LiteLLM or OpenAI clients add that mean nothing here: ignored.
_IGNORED = frozenset(("user", "metadata", "extra_headers", "extra_query", "max_retries", "timeout", "request_timeout", "input_type"))
_HANDLED = frozenset(("encoding_format", "dimensions", "pooling", "truncate_prompt_tokens"))


@dataclass(frozen=True)
class EmbeddingCall:
    """One LiteLLM embedding call, translated."""

    model: str
    engine: EngineLike
    inputs: list[Any]
    pooling: str
    dimensions: Optional[int]
    encoding_format: str
    timeout: Optional[float]
    truncate_prompt_tokens: Optional[int] = None

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``engine.embed``."""
        return {"pooling": self.pooling, "dimensions": self.dimensions, "timeout": self.timeout,
                "truncate_prompt_tokens": self.truncate_prompt_tokens}

    def response(self, model_response: Optional[EmbeddingResponse], result: EmbeddingResult) -> EmbeddingResponse:
        """The LiteLLM response: one ``embedding`` object per input, in order, and usage."""
        response = model_response if model_response is not None else EmbeddingResponse()
        response.model = self.model
        response.object = "list"
        response.data = [
            {"object": "embedding", "index": i, "embedding": _encoded(vector, self.encoding_format)}
            for i, vector in enumerate(result.embeddings)
        ]
        tokens = result.usage.prompt_tokens
        response.usage = litellm.Usage(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens)
        response.created = int(time.time())  # type: ignore[attr-defined]
        return response


def prepare_embedding(model: str, input: Any, optional_params: Optional[Mapping[str, Any]], litellm_params: Optional[Mapping[str, Any]],
                      timeout: Any) -> EmbeddingCall:
    """Check the call's parameters and find (or load) its engine."""
    params = _params(model, optional_params or {}, litellm_params or {})
    encoding = params.get("encoding_format", "float")
    if encoding not in ENCODINGS:
        raise InvalidParameterError("encoding_format", f"must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    model_name = model or "default"
    engine = get_engine(model_name)
    from ._litellm_pricing import register_pricing

    register_pricing(model_name, getattr(engine, "context_length", None))
    return EmbeddingCall(model_name, engine, _inputs(input), params.get("pooling", "mean"), params.get("dimensions"), encoding,
                         _timeout_seconds(timeout), params.get("truncate_prompt_tokens"))


def _params(model: str, optional_params: Mapping[str, Any], litellm_params: Mapping[str, Any]) -> dict[str, Any]:
    params = merged_params(optional_params)
    refuse_unless_dropped([k for k in params if k not in _HANDLED and k not in _IGNORED], params, litellm_params, model, " embeddings")
    return {k: v for k, v in params.items() if k in _HANDLED}


def _inputs(input: Any) -> Any:
    """OpenAI's ``input``: one text, a list of texts, one list of token ids, or a list of them."""
    if isinstance(input, str):
        return [input]
    if isinstance(input, list) and input and all(isinstance(t, int) and not isinstance(t, bool) for t in input):
        return [input]
    return input


def _encoded(vector: list[float], encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
