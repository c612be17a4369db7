"""LiteLLM provider ``mlx-parallm``: ``litellm.completion(model="mlx-parallm/<model>", ...)``.

Importing this module registers the provider (:func:`register`); importing
``mlx_parallm_provider`` does so as soon as LiteLLM is imported. The handler only maps
types: OpenAI parameters to the chat layer (:func:`~mlx_parallm_provider.chat.prepare_chat`)
and :class:`SamplingParams` (:mod:`._litellm_params`), engine results to LiteLLM
responses and stream chunks, and the package's errors to LiteLLM exceptions. Batching
and ``n > 1`` fan-out happen in the shared engine (``generate_many``), sync calls
submitting from the calling thread, so the threads of ``litellm.batch_completion`` land
in one batch too.

How LiteLLM reaches this handler (litellm 1.110): ``completion`` dispatches any provider
listed in ``litellm.custom_provider_map`` to ``completion`` / ``streaming`` here;
``acompletion`` gets back the coroutine of :meth:`MLXParallmCustomLLM.acompletion` (or the
async generator of :meth:`MLXParallmCustomLLM.astreaming`) and awaits it on the caller's
loop; ``batch_completion`` calls ``completion`` from up to 100 threads; ``text_completion``
calls ``completion`` with each prompt as a user message and ``text_completion=True`` in
``litellm_params``, which this handler reads to skip the chat template. ``embedding`` /
``aembedding`` reach :meth:`MLXParallmCustomLLM.embedding` / ``aembedding`` the same way
(:mod:`.litellm_embed`).

Inside a stream, LiteLLM's stream wrapper re-raises retriable errors (429, 5xx,
timeouts) as ``litellm.exceptions.MidStreamFallbackError`` with ours as
``original_exception``. Streaming supports one choice (LiteLLM's stream wrapper folds every
choice into the first); logprobs ride on LiteLLM's own chunk type, which it passes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional, Union

import litellm
from litellm import CustomLLM
from litellm.types.utils import (
    ChatCompletionTokenLogprob,
    ChoiceLogprobs,
    Choices,
    EmbeddingResponse,
    GenericStreamingChunk,
    Message,
    ModelResponse,
    ModelResponseStream,
    StreamingChoices,
    TopLogprob,
)
from litellm.types.utils import Delta as LiteLLMDelta

from ..chat import (
    ChatOutput,
    ChatStreamReader,
    ContentEvent,
    FinalEvent,
    InvalidToolCall,
    InvalidToolCallEvent,
    PreparedPrompt,
    ReasoningEvent,
    ToolCallEvent,
    read_completion,
)
from ..engine import Completion, Delta, TokenLogprob, Usage, get_engine
from ..errors import (
    ContextWindowExceededError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidParameterError,
    MLXParallmError,
    ModelLoadError,
    ModelNotFoundError,
    RequestFailedError,
    RequestTimeoutError,
)
from ._common import PROVIDER, usage_dict, vllm_prompt_logprobs
from ._litellm_params import LiteLLMCall, prepare_call
from ._litellm_pricing import register_pricing
from .litellm_embed import prepare_embedding


class MLXParallmCustomLLM(CustomLLM):
    """LiteLLM ``CustomLLM`` serving ``mlx-parallm/<model>`` from the shared engine.

    LiteLLM passes every argument by keyword; the ones this handler reads are named,
    the rest (api keys, clients, headers, ...) mean nothing for a local model.
    """

    def completion(  # type: ignore[override]
        self, model: str, messages: list, *, optional_params: Optional[dict] = None,
        litellm_params: Optional[dict] = None, timeout: Any = None,
        model_response: Optional[ModelResponse] = None, **_: Any,
    ) -> ModelResponse:
        """A whole response; every choice submitted from the calling thread."""
        with _litellm_errors(model):
            call = _prepare(model, messages, optional_params, litellm_params, timeout, stream=False)
            completions = call.engine.generate_many_sync(call.prompt_texts, call.params, n=call.n, request_id=call.request_id)
        return _build_response(model_response, call, completions)

    async def acompletion(  # type: ignore[override]
        self, model: str, messages: list, *, optional_params: Optional[dict] = None,
        litellm_params: Optional[dict] = None, timeout: Any = None,
        model_response: Optional[ModelResponse] = None, **_: Any,
    ) -> ModelResponse:
        """A whole response, awaiting ``engine.generate_many`` on the caller's loop (the
        prompt rendered and its constraint compiled on a thread, not on the loop)."""
        with _litellm_errors(model):
            call = await asyncio.to_thread(_prepare, model, messages, optional_params, litellm_params, timeout, stream=False)
            completions = await call.engine.generate_many(call.prompt_texts, call.params, n=call.n, request_id=call.request_id)
        return _build_response(model_response, call, completions)

    def streaming(  # type: ignore[override]
        self, model: str, messages: list, *, optional_params: Optional[dict] = None,
        litellm_params: Optional[dict] = None, timeout: Any = None, **_: Any,
    ) -> Iterator[_Chunk]:
        """Streamed chunks from ``engine.stream_sync``. Parameters and the prompt are
        checked before the first chunk, so mistakes raise from ``completion`` itself."""
        with _litellm_errors(model):
            call = _prepare(model, messages, optional_params, litellm_params, timeout, stream=True)
        return _stream_sync(call)

    async def astreaming(  # type: ignore[override]
        self, model: str, messages: list, *, optional_params: Optional[dict] = None,
        litellm_params: Optional[dict] = None, timeout: Any = None, **_: Any,
    ) -> AsyncIterator[_Chunk]:
        """Streamed chunks from ``engine.stream`` (an async generator; the prompt prepared
        on a thread, not on the loop)."""
        with _litellm_errors(model):
            call = await asyncio.to_thread(_prepare, model, messages, optional_params, litellm_params, timeout, stream=True)
            deltas = call.engine.stream(call.prompt_texts[0], call.params, request_id=f"{call.request_id}-0")
            chunks = _ChunkWriter(call.prompts[0], call.model, logprobs=call.params.logprobs)
            try:
                async for delta in deltas:
                    for chunk in chunks.on_delta(delta):
                        yield chunk
            finally:
                await deltas.aclose()

    def embedding(  # type: ignore[override]
        self, model: str, input: Any, *, optional_params: Optional[dict] = None, litellm_params: Optional[dict] = None,
        timeout: Any = None, model_response: Optional[EmbeddingResponse] = None, **_: Any,
    ) -> EmbeddingResponse:
        """``litellm.embedding``: every input embedded in the shared engine's batches (see
        :mod:`.litellm_embed` for the parameters)."""
        with _litellm_errors(model):
            call = prepare_embedding(model, input, optional_params, litellm_params, timeout)
            result = call.engine.embed_sync(call.inputs, **call.options())
        return call.response(model_response, result)

    async def aembedding(  # type: ignore[override]
        self, model: str, input: Any, *, optional_params: Optional[dict] = None, litellm_params: Optional[dict] = None,
        timeout: Any = None, model_response: Optional[EmbeddingResponse] = None, **_: Any,
    ) -> EmbeddingResponse:
        """``litellm.aembedding``: awaits ``engine.embed`` on the caller's loop."""
        with _litellm_errors(model):
            call = await asyncio.to_thread(prepare_embedding, model, input, optional_params, litellm_params, timeout)
            result = await call.engine.embed(call.inputs, **call.options())
        return call.response(model_response, result)


litellm_handler = MLXParallmCustomLLM()

def register(models: Iterable[str] = ()) -> None:
    """Make ``mlx-parallm/<model>`` usable in LiteLLM; safe to call any number of times.

    Adds ``{"provider": "mlx-parallm", "custom_handler": litellm_handler}`` to
    ``litellm.custom_provider_map`` (pointing an existing ``mlx-parallm`` entry at
    :data:`litellm_handler` rather than adding a second; other providers' entries are
    left alone) and runs LiteLLM's ``custom_llm_setup()``. Zero pricing is registered
    for each model on its first call, and up front for ``models``.
    """
    from litellm.utils import custom_llm_setup

    entries = litellm.custom_provider_map
    ours = [e for e in entries if isinstance(e, Mapping) and e.get("provider") == PROVIDER]
    if not ours:
        entries.append({"provider": PROVIDER, "custom_handler": litellm_handler})
    for entry in ours:
        if entry.get("custom_handler") is not litellm_handler:
            entry["custom_handler"] = litellm_handler
    custom_llm_setup()
    for model in models:
        register_pricing(model)


def _prepare(
    model: str, messages: list, optional_params: Optional[dict], litellm_params: Optional[dict], timeout: Any, *, stream: bool
) -> LiteLLMCall:
    model_name = model or "default"
    engine = get_engine(model_name)
    register_pricing(model_name, getattr(engine, "context_length", None))
    return prepare_call(engine, model_name, messages, optional_params or {}, litellm_params or {}, timeout, stream=stream)


#: A stream's chunk: LiteLLM's generic one, or its own type where the generic one has no field
#: (thinking, as ``delta.reasoning_content``; logprobs).
_Chunk = Union[GenericStreamingChunk, ModelResponseStream]


def _stream_sync(call: LiteLLMCall) -> Iterator[_Chunk]:
    with _litellm_errors(call.model):
        deltas = call.engine.stream_sync(call.prompt_texts[0], call.params, request_id=f"{call.request_id}-0")
        chunks = _ChunkWriter(call.prompts[0], call.model, logprobs=call.params.logprobs)
        try:
            for delta in deltas:
                yield from chunks.on_delta(delta)
        finally:
            deltas.close()


# --------------------------------------------------------------------------- responses


def _build_response(model_response: Optional[ModelResponse], call: LiteLLMCall, completions: list[Completion]) -> ModelResponse:
    response = model_response if model_response is not None else ModelResponse()
    outputs = [read_completion(call.prompts[i // call.n], c) for i, c in enumerate(completions)]
    response.choices = [_choice(i, output) for i, output in enumerate(outputs)]
    response.model = call.model
    response.created = int(time.time())
    firsts = completions[:: call.n]  # each prompt once
    prompt_tokens = sum(c.usage.prompt_tokens for c in firsts)
    cached_tokens = sum(c.usage.cached_tokens for c in firsts)
    completion_tokens = sum(c.usage.completion_tokens for c in completions)
    usage = Usage(prompt_tokens, completion_tokens, cached_tokens=cached_tokens,
                  reasoning_tokens=sum(o.usage.reasoning_tokens for o in outputs))
    setattr(response, "usage", litellm.Usage(**usage_dict(usage)))
    if call.params.prompt_logprobs is not None:  # where vLLM puts them: the response's (one prompt), else each choice's
        if len(call.prompts) == 1:
            setattr(response, "prompt_logprobs", vllm_prompt_logprobs(completions[0].prompt_logprobs))
        else:
            for choice, completion in zip(response.choices, completions):
                setattr(choice, "prompt_logprobs", vllm_prompt_logprobs(completion.prompt_logprobs))
    return response


def _choice(index: int, output: ChatOutput) -> Choices:
    invalid = output.invalid_tool_calls
    content = _with_invalid_text(output.content, invalid)
    message = Message(
        content=content if content or not output.tool_calls else None,
        role="assistant",
        tool_calls=[c.to_openai() for c in output.tool_calls] or None,
        provider_specific_fields={"invalid_tool_calls": [_invalid_dict(c) for c in invalid]} if invalid else None,
        reasoning_content=output.reasoning or None,
    )
    return Choices(index=index, finish_reason=output.finish_reason, message=message, logprobs=_logprobs(output.logprobs))


def _with_invalid_text(content: str, invalid: Sequence[InvalidToolCall]) -> str:
    """OpenAI has no invalid tool calls: malformed ones stay visible as text, after the content."""
    return "\n".join(part for part in (content, *(c.raw for c in invalid)) if part)


def _invalid_dict(call: InvalidToolCall) -> dict[str, Any]:
    return {"id": call.id, "name": call.name, "arguments": call.arguments, "raw": call.raw, "error": call.error}


def _logprobs(logprobs: Optional[list[TokenLogprob]]) -> Optional[ChoiceLogprobs]:
    if logprobs is None:
        return None
    return ChoiceLogprobs(
        content=[
            ChatCompletionTokenLogprob(
                token=lp.token,
                logprob=lp.logprob,
                bytes=list(lp.token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=text, logprob=value, bytes=list(text.encode("utf-8")))
                    for _, text, value in lp.top_logprobs
                ],
            )
            for lp in logprobs
        ]
    )


class _ChunkWriter:
    """One stream's deltas to LiteLLM ``GenericStreamingChunk`` dicts (thinking, and text where
    logprobs are asked: LiteLLM's own ``ModelResponseStream``), through the chat layer's events.
    Malformed calls come out as text just before the final chunk, as in a whole response.
    ``logprobs``: each chunk of text or thinking carries the logprobs of the tokens taken since
    the chunk before (the rest, of tokens whose text no chunk carried, go on an empty one
    before the last), so a stream's logprobs, joined, are the whole response's."""

    def __init__(self, prepared: PreparedPrompt, model: str, logprobs: bool = False) -> None:
        self._reader = ChatStreamReader(prepared)
        self._model = model
        self._sent_text = False
        self._invalid: list[InvalidToolCall] = []
        self._own_id: Optional[str] = None  # (LiteLLM's own chunks: one id, the stream's)
        self._logprobs: Optional[list[TokenLogprob]] = [] if logprobs else None  # (not yet sent)

    def on_delta(self, delta: Delta) -> list[_Chunk]:
        chunks: list[_Chunk] = []
        if self._logprobs is not None:
            self._logprobs += delta.logprobs or []
        for event in self._reader.on_delta(delta):
            if isinstance(event, ReasoningEvent):
                chunks.append(self._own(reasoning_content=event.text))
            elif isinstance(event, ContentEvent):
                chunks.append(self._text(event.text))
            elif isinstance(event, ToolCallEvent):
                chunks.append(_chunk(tool_use={**event.call.to_openai(), "index": event.index}))
            elif isinstance(event, InvalidToolCallEvent):
                self._invalid.append(event.call)
            elif isinstance(event, FinalEvent):
                chunks += [self._text(("\n" if self._sent_text else "") + c.raw) for c in self._invalid]
                if self._logprobs:
                    chunks.append(self._own(content=""))
                usage = None if event.usage is None else usage_dict(event.usage)
                chunks.append(_chunk(is_finished=True, finish_reason=event.finish_reason or "stop", usage=usage))
        return chunks

    def _text(self, text: str) -> _Chunk:
        self._sent_text = True
        return self._own(content=text) if self._logprobs is not None else _chunk(text=text)

    def _own(self, **fields: str) -> ModelResponseStream:
        """LiteLLM's own chunk type (its generic chunk has no field for thinking or logprobs;
        it passes a provider's ``ModelResponseStream`` through as is), with the logprobs not
        yet sent."""
        if self._own_id is None:
            fields["role"] = "assistant"
        sent = self._logprobs
        if sent:
            self._logprobs = []
        choice = StreamingChoices(index=0, delta=LiteLLMDelta(**fields), logprobs=_logprobs(sent) if sent else None)
        chunk = ModelResponseStream(choices=[choice], model=self._model, id=self._own_id)
        self._own_id = chunk.id
        return chunk


def _chunk(
    text: str = "",
    tool_use: Optional[dict[str, Any]] = None,
    is_finished: bool = False,
    finish_reason: str = "",
    usage: Optional[dict[str, int]] = None,
) -> GenericStreamingChunk:
    return {
        "text": text,
        "tool_use": tool_use,  # type: ignore[typeddict-item]
        "is_finished": is_finished,
        "finish_reason": finish_reason,
        "usage": usage,  # type: ignore[typeddict-item]
        "index": 0,
    }


# --------------------------------------------------------------------------- errors


@contextlib.contextmanager
def _litellm_errors(model: str) -> Iterator[None]:
    """Re-raise this package's errors as the LiteLLM exception a caller would expect."""
    try:
        yield
    except MLXParallmError as error:
        raise to_litellm_error(error, model) from error


def to_litellm_error(error: MLXParallmError, model: str) -> Exception:
    """The LiteLLM exception for one of this package's errors, saying what to change."""
    where = {"model": model, "llm_provider": PROVIDER}
    if isinstance(error, InvalidParameterError):
        return litellm.BadRequestError(message=f"invalid parameter {error}", **where)
    if isinstance(error, ContextWindowExceededError):
        return litellm.ContextWindowExceededError(message=str(error), **where)
    if isinstance(error, ModelNotFoundError):
        hint = f"check the model name after '{PROVIDER}/' (a Hugging Face repo id, a local folder or 'default')"
        return litellm.NotFoundError(message=f"{error}; {hint}", **where)
    if isinstance(error, ModelLoadError):  # UnsupportedModelError too: a bad or unsupported file, not a retry
        hint = f"the model after '{PROVIDER}/' could not be loaded: fix or replace it, or name another model"
        return litellm.BadRequestError(message=f"{type(error).__name__}: {error}; {hint}", **where)
    if isinstance(error, EngineOverloadedError):
        hint = "retry later, send fewer concurrent requests, or raise the engine's max_queue"
        return litellm.RateLimitError(message=f"{error}; {hint}", **where)
    if isinstance(error, RequestTimeoutError):
        # The engine's message already says what to change (for an embedding call, not max_tokens).
        return litellm.Timeout(message=str(error), **where)
    if isinstance(error, EngineDeadError):
        hint = "retry the request: the engine starts a fresh worker (the server log has the cause)"
        return litellm.ServiceUnavailableError(message=f"{error}; {hint}", **where)
    if isinstance(error, RequestFailedError):  # one request broke inside the engine; others ran on
        return litellm.InternalServerError(message=f"{error} (the server log has the traceback)", **where)
    return litellm.APIError(status_code=500, message=f"{type(error).__name__}: {error}", **where)


__all__ = ["PROVIDER", "MLXParallmCustomLLM", "litellm_handler", "register", "register_pricing", "to_litellm_error"]

# Importing this module registers the provider: the one registration path. The package
# imports this module once LiteLLM is imported (see ``mlx_parallm_provider._import_hook``).
register()
