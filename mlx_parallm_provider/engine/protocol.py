""":class:`EngineLike`: what the front doors need from an engine.

The real :class:`~mlx_parallm_provider.engine.Engine` satisfies it, and so does the test
suite's fake; the adapters are typed against it, never against the concrete class.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any, Optional, Protocol, Union, runtime_checkable

from .embed.request import EmbeddingResult
from .request import Completion, Delta, Prompt, SamplingParams


@runtime_checkable
class EngineLike(Protocol):
    """One model served to concurrent callers: single requests, streams, fan-out, embeddings."""

    model_name: str
    tokenizer: Any
    context_length: int

    def encode(self, prompt: Prompt) -> list[int]: ...

    async def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, request_id: Optional[str] = None) -> Completion: ...

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, request_id: Optional[str] = None) -> AsyncGenerator[Delta, None]: ...

    def generate_sync(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, request_id: Optional[str] = None) -> Completion: ...

    def stream_sync(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, request_id: Optional[str] = None) -> Generator[Delta, None, None]: ...

    async def generate_many(
        self,
        prompts: Sequence[Prompt],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        n: int = 1,
        request_id: Optional[str] = None,
        return_exceptions: bool = False,
    ) -> list[Any]: ...

    def generate_many_sync(
        self,
        prompts: Sequence[Prompt],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        n: int = 1,
        request_id: Optional[str] = None,
        return_exceptions: bool = False,
    ) -> list[Any]: ...

    async def embed(
        self, inputs: Sequence[Any], *, pooling: str = "mean", dimensions: Optional[int] = None,
        timeout: Optional[float] = None, request_id: Optional[str] = None, truncate_prompt_tokens: Optional[int] = None,
    ) -> EmbeddingResult: ...

    def embed_sync(
        self, inputs: Sequence[Any], *, pooling: str = "mean", dimensions: Optional[int] = None,
        timeout: Optional[float] = None, request_id: Optional[str] = None, truncate_prompt_tokens: Optional[int] = None,
    ) -> EmbeddingResult: ...

    def stats(self) -> dict[str, Any]: ...
