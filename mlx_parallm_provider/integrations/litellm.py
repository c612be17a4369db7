"""LiteLLM provider ``mlx-parallm``: ``litellm.completion(model="mlx-parallm/<model>", ...)``.

Usage::

    import litellm
    from mlx_parallm_provider.integrations.litellm import register

    register()
    litellm.completion(model="mlx-parallm/default", messages=[{"role": "user", "content": "Hi"}])

The handler only translates: OpenAI parameters to :class:`SamplingParams`, messages to a
prompt (``engine.apply_chat_template``), engine results to LiteLLM responses, and engine
errors to LiteLLM exceptions. Batching happens in the shared engine: every sync call goes
through ``engine.generate_sync`` / ``engine.stream_sync`` (so the threads of
``litellm.batch_completion`` land in one batch) and every async call awaits
``engine.generate`` / ``engine.stream``.

How LiteLLM reaches this handler (litellm 1.110): ``completion`` dispatches any provider
listed in ``litellm.custom_provider_map`` to ``completion`` / ``streaming`` here;
``acompletion`` runs ``completion(acompletion=True)`` in a thread pool, which hands back
the coroutine of :meth:`MLXParallmLLM.acompletion` (or the async generator of
:meth:`MLXParallmLLM.astreaming`), and awaits it on the caller's event loop;
``batch_completion`` calls ``completion`` from up to 100 threads; ``text_completion``
calls ``completion`` with each prompt as a user message and ``text_completion=True`` in
``litellm_params``, which this handler reads to skip the chat template.

Errors of this package become LiteLLM exceptions here (see :func:`to_litellm_error`).
Inside a stream, LiteLLM's stream wrapper re-raises retriable ones (429, 5xx, timeouts)
as ``litellm.exceptions.MidStreamFallbackError`` with ours as ``original_exception``.
Streaming supports one choice and no logprobs (LiteLLM's generic stream chunks carry
neither a choice index nor logprobs), so ``n > 1`` or ``logprobs`` with ``stream=True``
are rejected unless ``drop_params`` is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import litellm
from litellm import CustomLLM
from litellm.types.utils import (
    ChatCompletionTokenLogprob,
    ChoiceLogprobs,
    Choices,
    GenericStreamingChunk,
    Message,
    ModelResponse,
    TopLogprob,
)

from ..engine.request import Completion, Delta, SamplingParams, TokenLogprob
from ..errors import (
    ContextWindowExceededError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidParameterError,
    MLXParallmError,
    ModelNotFoundError,
    RequestTimeoutError,
)
from ..tools import (
    HERMES_FORMAT,
    InvalidToolCall,
    ToolCall,
    ToolCallFormat,
    ToolCallStreamParser,
    add_system_instruction,
    apply_tool_choice,
    parse_tool_calls,
    tool_call_format,
)

PROVIDER = "mlx-parallm"

#: Parameters copied straight into :class:`SamplingParams`.
_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
)
#: Parameters this handler honours in some other way.
_HANDLED_KEYS = frozenset(
    (
        *_SAMPLING_KEYS,
        "max_tokens",
        "max_completion_tokens",
        "n",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "response_format",
    )
)
#: Keys LiteLLM or OpenAI clients add that mean nothing for a local model: ignored.
_IGNORED_KEYS = frozenset(
    (
        "stream",
        "stream_options",
        "max_retries",
        "timeout",
        "request_timeout",
        "user",
        "metadata",
        "extra_headers",
        "extra_query",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "api_version",
        "deployment_id",
    )
)


def get_engine(model: str = "default") -> Any:
    """The shared engine for ``model`` (indirection so tests can substitute a fake)."""
    from .. import get_engine as shared_engine

    return shared_engine(model)


# --------------------------------------------------------------------------- the handler


class MLXParallmLLM(CustomLLM):
    """LiteLLM ``CustomLLM`` serving ``mlx-parallm/<model>`` from the shared engine."""

    def completion(
        self,
        model: str,
        messages: list,
        api_base: Optional[str] = None,
        custom_prompt_dict: Optional[dict] = None,
        model_response: Optional[ModelResponse] = None,
        print_verbose: Optional[Callable] = None,
        encoding: Any = None,
        api_key: Optional[str] = None,
        logging_obj: Any = None,
        optional_params: Optional[dict] = None,
        acompletion: Any = None,
        litellm_params: Optional[dict] = None,
        logger_fn: Any = None,
        headers: Optional[dict] = None,
        timeout: Any = None,
        client: Any = None,
    ) -> ModelResponse:
        """A whole response, from the calling thread (``engine.generate_sync``)."""
        with _litellm_errors(model):
            request = _prepare(model, messages, optional_params, litellm_params, timeout, stream=False)
            completions = _generate_sync(request)
        return _build_response(model_response, request, completions)

    async def acompletion(
        self,
        model: str,
        messages: list,
        api_base: Optional[str] = None,
        custom_prompt_dict: Optional[dict] = None,
        model_response: Optional[ModelResponse] = None,
        print_verbose: Optional[Callable] = None,
        encoding: Any = None,
        api_key: Optional[str] = None,
        logging_obj: Any = None,
        optional_params: Optional[dict] = None,
        acompletion: Any = None,
        litellm_params: Optional[dict] = None,
        logger_fn: Any = None,
        headers: Optional[dict] = None,
        timeout: Any = None,
        client: Any = None,
    ) -> ModelResponse:
        """A whole response, awaiting ``engine.generate`` (``n`` requests concurrently)."""
        with _litellm_errors(model):
            request = _prepare(model, messages, optional_params, litellm_params, timeout, stream=False)
            completions = await _generate_async(request)
        return _build_response(model_response, request, completions)

    def streaming(
        self,
        model: str,
        messages: list,
        api_base: Optional[str] = None,
        custom_prompt_dict: Optional[dict] = None,
        model_response: Optional[ModelResponse] = None,
        print_verbose: Optional[Callable] = None,
        encoding: Any = None,
        api_key: Optional[str] = None,
        logging_obj: Any = None,
        optional_params: Optional[dict] = None,
        acompletion: Any = None,
        litellm_params: Optional[dict] = None,
        logger_fn: Any = None,
        headers: Optional[dict] = None,
        timeout: Any = None,
        client: Any = None,
    ) -> Iterator[GenericStreamingChunk]:
        """Streamed chunks from ``engine.stream_sync``.

        Parameters and the prompt are checked before the first chunk, so mistakes raise
        from ``litellm.completion(stream=True)`` itself.
        """
        with _litellm_errors(model):
            request = _prepare(model, messages, optional_params, litellm_params, timeout, stream=True)
        return _stream_sync(request)

    async def astreaming(  # type: ignore[override]
        self,
        model: str,
        messages: list,
        api_base: Optional[str] = None,
        custom_prompt_dict: Optional[dict] = None,
        model_response: Optional[ModelResponse] = None,
        print_verbose: Optional[Callable] = None,
        encoding: Any = None,
        api_key: Optional[str] = None,
        logging_obj: Any = None,
        optional_params: Optional[dict] = None,
        acompletion: Any = None,
        litellm_params: Optional[dict] = None,
        logger_fn: Any = None,
        headers: Optional[dict] = None,
        timeout: Any = None,
        client: Any = None,
    ) -> AsyncIterator[GenericStreamingChunk]:
        """Streamed chunks from ``engine.stream`` (an async generator)."""
        with _litellm_errors(model):
            request = _prepare(model, messages, optional_params, litellm_params, timeout, stream=True)
            deltas = request.engine.stream(request.prompts[0], request.params[0], request_id=request.request_ids[0])
            translator = _StreamTranslator(request)
            try:
                async for delta in deltas:
                    for chunk in translator.on_delta(delta):
                        yield chunk
            finally:
                aclose = getattr(deltas, "aclose", None)
                if aclose is not None:
                    await aclose()


litellm_handler = MLXParallmLLM()

_pricing_lock = threading.Lock()
_priced_models: set[str] = set()


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


def register_pricing(model: str, context_length: Optional[int] = None) -> None:
    """Register ``mlx-parallm/<model>`` with zero cost, so ``completion_cost`` returns 0.

    LiteLLM's cost map has no wildcards, so each model name is registered (once).
    """
    key = f"{PROVIDER}/{model}"
    with _pricing_lock:
        if key in _priced_models:
            return
        info: dict[str, Any] = {
            "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0,
            "cache_creation_input_token_cost": 0.0,
            "cache_read_input_token_cost": 0.0,
            "litellm_provider": PROVIDER,
            "mode": "chat",
            "supports_function_calling": True,
        }
        if isinstance(context_length, int) and context_length > 0:
            info["max_input_tokens"] = info["max_tokens"] = context_length
        litellm.register_model({key: info})
        _priced_models.add(key)


# --------------------------------------------------------------------------- requests


@dataclass
class _Request:
    """One LiteLLM call, translated: what to submit to the engine and how to read it."""

    model: str
    engine: Any
    prompts: list[Any]  # one per engine request (a prompt repeats for n > 1)
    params: list[SamplingParams]
    request_ids: list[str]
    prompt_count: int
    tools: Optional[list[dict[str, Any]]] = None
    tool_format: ToolCallFormat = HERMES_FORMAT
    parallel_tool_calls: bool = True


def _prepare(
    model: str,
    messages: list,
    optional_params: Optional[dict],
    litellm_params: Optional[dict],
    timeout: Any,
    *,
    stream: bool,
) -> _Request:
    litellm_params = litellm_params or {}
    model_name = model or "default"
    params = _honoured_params(optional_params or {}, litellm_params, model_name, stream=stream)
    engine = get_engine(model_name)
    register_pricing(model_name, getattr(engine, "context_length", None))
    sampling = _sampling_kwargs(params, timeout)
    n = _choice_count(params.get("n"))
    if litellm_params.get("text_completion"):
        prompts, tools, tool_fmt = _text_prompts(messages), None, HERMES_FORMAT
    else:
        prompts, tools, tool_fmt = _chat_prompt(engine, messages, params)
    call_id = str(litellm_params.get("litellm_call_id") or time.time_ns())
    expanded = [(p, j) for p in prompts for j in range(n)]
    return _Request(
        model=model_name,
        engine=engine,
        prompts=[p for p, _ in expanded],
        params=[_choice_params(sampling, j) for _, j in expanded],
        request_ids=[f"{call_id}-{i}" for i in range(len(expanded))],
        prompt_count=len(prompts),
        tools=tools,
        tool_format=tool_fmt,
        parallel_tool_calls=params.get("parallel_tool_calls") is not False,
    )


def _honoured_params(
    optional_params: Mapping[str, Any], litellm_params: Mapping[str, Any], model: str, *, stream: bool
) -> dict[str, Any]:
    """The call's parameters (``extra_body`` merged in) minus ignored and dropped ones.

    Raises ``litellm.BadRequestError`` for parameters this provider cannot honour unless
    ``drop_params`` is on (``litellm.drop_params`` or the call's ``drop_params``).
    """
    params = {k: v for k, v in optional_params.items() if v is not None and k != "extra_body"}
    extra_body = optional_params.get("extra_body") or {}
    if not isinstance(extra_body, Mapping):
        raise InvalidParameterError("extra_body", f"must be a dict, got {type(extra_body).__name__}")
    params.update({k: v for k, v in extra_body.items() if v is not None})
    for key in _IGNORED_KEYS:
        params.pop(key, None)
    unsupported = _unsupported(params, stream=stream)
    if unsupported and not _drop_params(litellm_params):
        raise litellm.BadRequestError(
            message=(
                f"{PROVIDER} cannot honour {', '.join(f'{k}={params.get(k)!r}' for k in unsupported)}. "
                "Remove them, or set litellm.drop_params=True (or pass drop_params=True) to drop them."
            ),
            model=model,
            llm_provider=PROVIDER,
        )
    for key in unsupported:
        params.pop(key, None)
    return params


def _unsupported(params: Mapping[str, Any], *, stream: bool) -> list[str]:
    names = [k for k in params if k not in _HANDLED_KEYS]
    response_format = params.get("response_format")
    if response_format is not None and _format_type(response_format) != "text":
        names.append("response_format")
    if stream and _choice_count(params.get("n")) > 1:
        names.append("n")  # LiteLLM's stream wrapper folds every choice into index 0
    if stream and (params.get("logprobs") or params.get("top_logprobs")):
        names += [k for k in ("logprobs", "top_logprobs") if params.get(k)]
    return names


def _format_type(response_format: Any) -> Any:
    if isinstance(response_format, Mapping):
        return response_format.get("type")
    return response_format


def _drop_params(litellm_params: Mapping[str, Any]) -> bool:
    return _flag(getattr(litellm, "drop_params", None)) or _flag(litellm_params.get("drop_params"))


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return value is True


def _choice_count(n: Any) -> int:
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidParameterError("n", f"must be an integer >= 1, got {n!r}")
    return n


def _sampling_kwargs(params: Mapping[str, Any], timeout: Any) -> dict[str, Any]:
    kwargs = {k: params[k] for k in _SAMPLING_KEYS if k in params}
    max_tokens = params.get("max_completion_tokens", params.get("max_tokens"))
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    logprobs = params.get("logprobs")
    if isinstance(logprobs, int) and not isinstance(logprobs, bool):  # text completions: a count
        kwargs["logprobs"], kwargs["top_logprobs"] = logprobs > 0, logprobs
    elif logprobs is not None:
        kwargs["logprobs"] = logprobs
    if params.get("top_logprobs") is not None:
        kwargs["top_logprobs"] = params["top_logprobs"]
    seconds = _timeout_seconds(timeout)
    if seconds is not None:
        kwargs["timeout"] = seconds
    return kwargs


def _timeout_seconds(timeout: Any) -> Optional[float]:
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        return float(timeout) if timeout > 0 else None
    read = getattr(timeout, "read", None)  # an httpx.Timeout
    return float(read) if isinstance(read, (int, float)) and read > 0 else None


def _choice_params(kwargs: Mapping[str, Any], choice: int) -> SamplingParams:
    """Choice ``i`` of ``n`` samples with ``seed + i``, so each choice is reproducible."""
    seed = kwargs.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        seed += choice
    return SamplingParams(**{**kwargs, "seed": seed})  # validates everything, seed included


def _chat_prompt(engine: Any, messages: list, params: Mapping[str, Any]) -> tuple[list[str], Any, ToolCallFormat]:
    tools = params.get("tools")
    tool_choice = params.get("tool_choice")
    if tools is None and params.get("functions"):  # the legacy OpenAI form
        tools, tool_choice = params["functions"], params.get("function_call", tool_choice)
    tools, instruction = apply_tool_choice(tools, tool_choice)
    prompt = engine.apply_chat_template(add_system_instruction(messages, instruction), tools)
    tool_fmt = tool_call_format(engine.tokenizer, tools) if tools else HERMES_FORMAT
    return [prompt], tools, tool_fmt


def _text_prompts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """``litellm.text_completion`` wraps each prompt as a user message: unwrap them."""
    prompts = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, str):
            raise InvalidParameterError(f"prompt[{i}]", "must be a string")
        prompts.append(content)
    return prompts


# --------------------------------------------------------------------------- running


def _generate_sync(request: _Request) -> list[Completion]:
    jobs = list(zip(request.prompts, request.params, request.request_ids))
    if len(jobs) == 1:
        prompt, params, request_id = jobs[0]
        return [request.engine.generate_sync(prompt, params, request_id=request_id)]
    # One thread per choice just submits and waits; the engine batches them.
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="mlx-parallm-n") as pool:
        futures = [pool.submit(request.engine.generate_sync, p, sp, request_id=rid) for p, sp, rid in jobs]
        return [future.result() for future in futures]


async def _generate_async(request: _Request) -> list[Completion]:
    tasks = [
        asyncio.ensure_future(request.engine.generate(p, sp, request_id=rid))
        for p, sp, rid in zip(request.prompts, request.params, request.request_ids)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


def _stream_sync(request: _Request) -> Iterator[GenericStreamingChunk]:
    with _litellm_errors(request.model):
        deltas = request.engine.stream_sync(request.prompts[0], request.params[0], request_id=request.request_ids[0])
        translator = _StreamTranslator(request)
        try:
            for delta in deltas:
                yield from translator.on_delta(delta)
        finally:
            close = getattr(deltas, "close", None)
            if close is not None:
                close()


# --------------------------------------------------------------------------- responses


def _build_response(model_response: Optional[ModelResponse], request: _Request, completions: list[Completion]) -> ModelResponse:
    response = model_response if model_response is not None else ModelResponse()
    response.choices = [_choice(i, c, request) for i, c in enumerate(completions)]
    response.model = request.model
    response.created = int(time.time())
    per_prompt = len(completions) // max(request.prompt_count, 1)
    prompt_tokens = sum(c.usage.prompt_tokens for c in completions[::per_prompt])
    completion_tokens = sum(c.usage.completion_tokens for c in completions)
    setattr(
        response,
        "usage",
        litellm.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        ),
    )
    return response


def _choice(index: int, completion: Completion, request: _Request) -> Choices:
    content: Optional[str] = completion.text
    calls: list[ToolCall] = []
    extra: dict[str, Any] = {}
    if request.tools:
        parsed = parse_tool_calls(completion.text, request.tools, request.tool_format)
        calls = parsed.tool_calls[:1] if not request.parallel_tool_calls else parsed.tool_calls
        content = _with_invalid_text(parsed.content, parsed.invalid_tool_calls)
        if parsed.invalid_tool_calls:
            extra["invalid_tool_calls"] = [_invalid_dict(c) for c in parsed.invalid_tool_calls]
    message = Message(
        content=content if content or not calls else None,
        role="assistant",
        tool_calls=[c.to_openai() for c in calls] or None,
        provider_specific_fields=extra or None,
    )
    return Choices(
        index=index,
        finish_reason="tool_calls" if calls else completion.finish_reason,
        message=message,
        logprobs=_logprobs(completion.logprobs),
    )


def _with_invalid_text(content: str, invalid: Sequence[InvalidToolCall]) -> str:
    """Malformed calls stay visible as text, after the content."""
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


class _StreamTranslator:
    """Engine deltas to LiteLLM ``GenericStreamingChunk`` dicts, tool calls included."""

    def __init__(self, request: _Request) -> None:
        self._parser = ToolCallStreamParser(request.tools, request.tool_format) if request.tools else None
        self._single_call = not request.parallel_tool_calls
        self._calls = 0
        self._sent_text = False
        self._invalid: list[InvalidToolCall] = []

    def on_delta(self, delta: Delta) -> list[GenericStreamingChunk]:
        """The chunks one engine delta produces (the last delta also ends the stream)."""
        events = self._parser.feed(delta.text) if self._parser else [delta.text]
        if delta.finish_reason is not None and self._parser:
            events += self._parser.finish()
        chunks = [chunk for event in events for chunk in self._event_chunks(event)]
        if delta.finish_reason is not None:
            chunks += [self._text_chunk(text) for text in self._invalid_texts()]
            chunks.append(self._final_chunk(delta))
        return chunks

    def _event_chunks(self, event: Any) -> list[GenericStreamingChunk]:
        if isinstance(event, str):
            return [self._text_chunk(event)] if event else []
        if isinstance(event, InvalidToolCall):
            self._invalid.append(event)
            return []
        if self._single_call and self._calls:
            return []
        self._calls += 1
        return [_chunk(tool_use={**event.to_openai(), "index": self._calls - 1})]

    def _text_chunk(self, text: str) -> GenericStreamingChunk:
        self._sent_text = True
        return _chunk(text=text)

    def _invalid_texts(self) -> list[str]:
        texts = []
        for call in self._invalid:
            texts.append(("\n" if self._sent_text or texts else "") + call.raw)
        return texts

    def _final_chunk(self, delta: Delta) -> GenericStreamingChunk:
        usage = delta.usage
        return _chunk(
            is_finished=True,
            finish_reason="tool_calls" if self._calls else (delta.finish_reason or "stop"),
            usage=None
            if usage is None
            else {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            },
        )


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
    if isinstance(error, EngineOverloadedError):
        hint = "retry later, send fewer concurrent requests, or raise the engine's max_queue"
        return litellm.RateLimitError(message=f"{error}; {hint}", **where)
    if isinstance(error, RequestTimeoutError):
        return litellm.Timeout(message=f"{error}; raise `timeout` or lower `max_tokens`", **where)
    if isinstance(error, EngineDeadError):
        hint = "the engine's worker stopped; restart the process (its log has the cause)"
        return litellm.ServiceUnavailableError(message=f"{error}; {hint}", **where)
    return litellm.APIError(status_code=500, message=f"{type(error).__name__}: {error}", **where)


__all__ = ["PROVIDER", "MLXParallmLLM", "litellm_handler", "register", "register_pricing", "to_litellm_error", "get_engine"]

# When this module is what first imports LiteLLM (e.g. ``mlx_parallm_provider.litellm_handler``
# read before ``import litellm``), the package's import hook runs while this module is only
# half-initialised and cannot register; so importing this module registers too (idempotent).
register()
