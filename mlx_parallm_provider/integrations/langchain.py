"""LangChain adapters: :class:`MLXParallmLLM` (a text-completion ``BaseLLM``) and
:class:`ChatMLXParallm` (a ``BaseChatModel``), both served by the shared engine.

Usage::

    from mlx_parallm_provider.langchain import ChatMLXParallm, MLXParallmLLM

    chat = ChatMLXParallm(model="default", max_tokens=128)
    await (prompt | chat | StrOutputParser()).abatch(inputs)   # one decode batch

The adapters only translate: LangChain messages to OpenAI-style dicts rendered by
``engine.apply_chat_template``, fields and call kwargs to :class:`SamplingParams`, engine
results to LangChain generations. Batching happens in the engine, which every front door
(LiteLLM, LangChain, direct calls) shares per model name. How calls reach it:

* ``MLXParallmLLM``: ``batch`` / ``abatch`` hand all prompts to one ``_generate`` /
  ``_agenerate`` call, which submits every prompt at once (``asyncio.gather`` over
  ``engine.generate``; sync: ``engine.generate_sync`` from a thread pool).
* ``ChatMLXParallm``: LangChain batches chat models one input per ``invoke`` / ``ainvoke``
  (threads / ``asyncio.gather``), and each call awaits ``engine.generate`` natively, so
  concurrent calls meet in the engine's batch. ``batch`` runs as many threads as the
  engine decodes at once (``EngineConfig.max_num_seqs``) unless ``max_concurrency`` is set,
  since LangChain's default thread pool is only ``cpu_count + 4`` wide.

Tool calling and JSON output are prompted (there is no constrained decoding): tools go
through the chat template or the fallback tool prompt of :mod:`mlx_parallm_provider.tools`,
which also parses the calls. Malformed calls become ``invalid_tool_calls``, never an
exception. Errors of this package (``ModelNotFoundError``, ``InvalidParameterError``, ...)
propagate unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter
from typing import Any, Literal, Optional, Union

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, BaseLLM, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    UsageMetadata,
    convert_to_openai_messages,
)
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
    Generation,
    GenerationChunk,
    LLMResult,
)
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import get_config_list
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, model_validator
from typing_extensions import Self

from ..engine import Engine
from ..engine.request import Completion, Delta, SamplingParams, TokenLogprob, Usage
from ..errors import InvalidParameterError, MLXParallmError
from ..tools import (
    HERMES_FORMAT,
    InvalidToolCall,
    ParsedOutput,
    ToolCall,
    ToolCallFormat,
    ToolCallStreamParser,
    add_system_instruction,
    apply_tool_choice,
    parse_tool_calls,
    tool_call_format,
)

PROVIDER = "mlx-parallm"

#: The :class:`SamplingParams` fields, settable as model fields and per call (``bind``).
SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingParams))
#: Call kwargs LangChain itself may add, ignored here (tracing only, or already honoured).
_IGNORED_CALL_KWARGS = frozenset(("stream", "ls_structured_output_format", "structured_output_format"))
_CHAT_CALL_KWARGS = frozenset(("tools", "tool_choice", "parallel_tool_calls", "response_format"))

JSON_OBJECT_INSTRUCTION = "Answer with one JSON object and nothing else: no text before or after it."
JSON_SCHEMA_INSTRUCTION = (
    "Answer with one JSON object that matches this JSON schema, and nothing else:\n{schema}"
)


def get_engine(model: str) -> Engine:
    """The shared engine for ``model`` (indirection so tests can substitute one)."""
    from .. import get_engine as shared_engine

    return shared_engine(model)


# --------------------------------------------------------------------------- shared fields

_DEFAULTS = SamplingParams()  # the adapters' defaults are the engine's own


class _EngineFields(BaseModel):
    """The fields both adapters share: the model name and every sampling setting.

    Defaults are :class:`SamplingParams`' own (greedy, no filtering, no penalties);
    the whole set is validated by building a :class:`SamplingParams`, so the accepted
    ranges are exactly the engine's.
    """

    model: str = Field(
        default="default",
        description="'default', a path to an mlx-lm folder or a .gguf file, or a Hugging Face "
        "repo id; the same names as the LiteLLM provider's 'mlx-parallm/<model>'.",
    )
    max_tokens: int = Field(default=_DEFAULTS.max_tokens, description="Most tokens to generate.")
    temperature: float = Field(default=_DEFAULTS.temperature, description="0 is greedy decoding.")
    top_p: float = _DEFAULTS.top_p
    top_k: int = _DEFAULTS.top_k
    min_p: float = _DEFAULTS.min_p
    repetition_penalty: float = _DEFAULTS.repetition_penalty
    presence_penalty: float = _DEFAULTS.presence_penalty
    frequency_penalty: float = _DEFAULTS.frequency_penalty
    logit_bias: Optional[dict[int, float]] = None
    stop: Optional[list[str]] = Field(default=None, description="Stop strings (not included in the output).")
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = _DEFAULTS.ignore_eos
    seed: Optional[int] = Field(default=None, description="Seed of this request's sampler (batch-independent).")
    logprobs: bool = _DEFAULTS.logprobs
    top_logprobs: int = _DEFAULTS.top_logprobs
    timeout: Optional[float] = Field(default=None, description="Per-request timeout in seconds.")

    @model_validator(mode="after")
    def _validate_sampling(self) -> Self:
        try:
            self._sampling_params(None, {})
        except InvalidParameterError as error:
            raise ValueError(str(error)) from None
        return self

    def _sampling_params(self, stop: Optional[list[str]], overrides: Mapping[str, Any]) -> SamplingParams:
        """This model's settings with per-call ``overrides``; a call's ``stop`` replaces the field's."""
        values = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        values.update(overrides)
        if stop is not None:
            values["stop"] = stop
        return SamplingParams(**values)

    def _split_call_kwargs(self, kwargs: Mapping[str, Any], extra: frozenset[str]) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """``(model name, sampling overrides, other allowed kwargs)``; unknown kwargs raise."""
        known = {*SAMPLING_FIELDS, *extra, *_IGNORED_CALL_KWARGS, "model"}
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise InvalidParameterError(
                unknown[0],
                f"is not a parameter of {type(self).__name__}; use one of "
                f"{', '.join(sorted((*SAMPLING_FIELDS, 'model', *extra)))}",
            )
        model = kwargs.get("model") or self.model
        sampling = {k: v for k, v in kwargs.items() if k in SAMPLING_FIELDS}
        rest = {k: v for k, v in kwargs.items() if k in extra}
        return model, sampling, rest

    def _sampling_dict(self) -> dict[str, Any]:
        return {"model": self.model, **{name: getattr(self, name) for name in SAMPLING_FIELDS}}

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._sampling_dict()

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)  # type: ignore[misc]
        params["ls_provider"] = PROVIDER
        params["ls_model_name"] = kwargs.get("model") or self.model
        if "ls_stop" not in params and self.stop:
            params["ls_stop"] = self.stop
        return params


# --------------------------------------------------------------------------- the LLM


class MLXParallmLLM(_EngineFields, BaseLLM):
    """Text completion on the shared batching engine: prompts go to the model as is.

    ``batch`` / ``abatch`` / ``generate`` submit every prompt to the engine at once, so
    they decode as one batch. Example::

        llm = MLXParallmLLM(model="default", max_tokens=64)
        await llm.abatch(["The capital of France is", "Two plus two is"])
    """

    model_config = ConfigDict(extra="forbid")

    @property
    def _llm_type(self) -> str:
        return PROVIDER

    def _generate(
        self,
        prompts: list[str],
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> LLMResult:
        engine, params, model = self._prepare(stop, kwargs)
        return _llm_result(_generate_all_sync(engine, prompts, params), model)

    async def _agenerate(
        self,
        prompts: list[str],
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> LLMResult:
        engine, params, model = self._prepare(stop, kwargs)
        return _llm_result(await _generate_all(engine, prompts, params), model)

    def _stream(
        self,
        prompt: str,
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        engine, params, _ = self._prepare(stop, kwargs)
        deltas = engine.stream_sync(prompt, params)
        try:
            for delta in deltas:
                chunk = _generation_chunk(delta)
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            deltas.close()

    async def _astream(
        self,
        prompt: str,
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        engine, params, _ = self._prepare(stop, kwargs)
        deltas = engine.stream(prompt, params)
        try:
            async for delta in deltas:
                chunk = _generation_chunk(delta)
                if run_manager:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            await deltas.aclose()

    def _prepare(self, stop: Optional[list[str]], kwargs: Mapping[str, Any]) -> tuple[Engine, SamplingParams, str]:
        model, sampling, _ = self._split_call_kwargs(kwargs, frozenset())
        params = self._sampling_params(stop, sampling)
        return get_engine(model), params, model


def _llm_result(completions: list[Completion], model: str) -> LLMResult:
    generations = [[Generation(text=c.text, generation_info=_generation_info(c))] for c in completions]
    usage = Usage(
        prompt_tokens=sum(c.usage.prompt_tokens for c in completions),
        completion_tokens=sum(c.usage.completion_tokens for c in completions),
    )
    return LLMResult(generations=generations, llm_output={"token_usage": _usage_dict(usage), "model_name": model})


def _generation_info(completion: Completion) -> dict[str, Any]:
    info: dict[str, Any] = {"finish_reason": completion.finish_reason, "token_usage": _usage_dict(completion.usage)}
    if completion.logprobs is not None:
        info["logprobs"] = _logprobs_dict(completion.logprobs)
    return info


def _generation_chunk(delta: Delta) -> GenerationChunk:
    info: Optional[dict[str, Any]] = None
    if delta.finish_reason is not None:
        info = {"finish_reason": delta.finish_reason}
        if delta.usage is not None:
            info["token_usage"] = _usage_dict(delta.usage)
    if delta.logprobs:
        info = {**(info or {}), "logprobs": _logprobs_dict(delta.logprobs)}
    return GenerationChunk(text=delta.text, generation_info=info)


# --------------------------------------------------------------------------- submitting


def _generate_all_sync(engine: Engine, prompts: Sequence[Any], params: SamplingParams) -> list[Completion]:
    """Submit every prompt at once from a plain thread and wait for all of them."""
    if len(prompts) == 1:
        return [engine.generate_sync(prompts[0], params)]
    # Each thread only submits one request and waits; the engine batches them. More
    # threads than the decode batch holds would only wait in the engine's queue.
    workers = min(len(prompts), _decode_slots(engine, len(prompts)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mlx-parallm-lc") as pool:
        return list(pool.map(lambda prompt: engine.generate_sync(prompt, params), prompts))


async def _generate_all(engine: Engine, prompts: Sequence[Any], params: SamplingParams) -> list[Completion]:
    """Submit every prompt at once on the running loop; cancel the rest if one fails."""
    tasks = [asyncio.ensure_future(engine.generate(prompt, params)) for prompt in prompts]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


def _decode_slots(engine: Any, fallback: int) -> int:
    config = getattr(engine, "config", None)
    slots = getattr(config, "max_num_seqs", None)
    return slots if isinstance(slots, int) and slots > 0 else fallback


# --------------------------------------------------------------------------- the chat model


@dataclasses.dataclass
class _ChatRequest:
    """One chat call, translated: the prompt and settings to submit, and how to read the output."""

    engine: Engine
    model: str
    prompt: str
    params: SamplingParams
    tools: Optional[list[dict[str, Any]]] = None
    tool_format: ToolCallFormat = HERMES_FORMAT
    parallel_tool_calls: bool = True


class ChatMLXParallm(_EngineFields, BaseChatModel):
    """Chat model on the shared batching engine.

    Messages (system, human, AI with tool calls, tool results) are rendered by the
    model's chat template. Every call awaits the engine natively, so the concurrent
    ``ainvoke`` calls of ``abatch``, a chain or an agent decode as one batch. Example::

        chat = ChatMLXParallm(model="default", max_tokens=128)
        chain = ChatPromptTemplate.from_template("Tell me about {topic}") | chat | StrOutputParser()
        await chain.abatch([{"topic": t} for t in topics], config={"max_concurrency": 32})

    Supports ``bind_tools`` (LangChain tools, pydantic models, functions, OpenAI dicts),
    ``with_structured_output`` (``function_calling``, ``json_schema``, ``json_mode``),
    streaming with tool-call chunks, and ``usage_metadata`` on every answer.
    """

    model_config = ConfigDict(extra="forbid")

    streaming: bool = Field(default=False, description="Stream internally on invoke (callbacks get every token).")

    @property
    def _llm_type(self) -> str:
        return f"{PROVIDER}-chat"

    # -- running

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._prepare(messages, stop, kwargs)
        return _chat_result(request, request.engine.generate_sync(request.prompt, request.params))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._prepare(messages, stop, kwargs)
        return _chat_result(request, await request.engine.generate(request.prompt, request.params))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request = self._prepare(messages, stop, kwargs)
        translator = ChunkTranslator(request.tools, request.tool_format, request.model, request.parallel_tool_calls)
        deltas = request.engine.stream_sync(request.prompt, request.params)
        try:
            for delta in deltas:
                for chunk in translator.on_delta(delta):
                    # LangChain passes a run manager only where it does not report tokens itself.
                    if run_manager:
                        run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        finally:
            deltas.close()

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        request = self._prepare(messages, stop, kwargs)
        translator = ChunkTranslator(request.tools, request.tool_format, request.model, request.parallel_tool_calls)
        deltas = request.engine.stream(request.prompt, request.params)
        try:
            async for delta in deltas:
                for chunk in translator.on_delta(delta):
                    if run_manager:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        finally:
            await deltas.aclose()

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: Union[RunnableConfig, list[RunnableConfig], None] = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[BaseMessage]:
        """Invoke on every input from its own thread (as many at once as the engine
        decodes, unless ``max_concurrency`` says otherwise), so they batch together."""
        configs = get_config_list(config, len(inputs))
        if len(inputs) > 1 and configs[0].get("max_concurrency") is None:
            width = min(len(inputs), self._batch_width(kwargs.get("model"), len(inputs)))
            configs = [{**c, "max_concurrency": width} for c in configs]
        return super().batch(inputs, configs, return_exceptions=return_exceptions, **kwargs)

    def _batch_width(self, model: Optional[str], fallback: int) -> int:
        try:
            return _decode_slots(get_engine(model or self.model), fallback)
        except MLXParallmError:
            return fallback  # each invoke raises the error itself (return_exceptions applies)

    def _prepare(self, messages: Sequence[BaseMessage], stop: Optional[list[str]], kwargs: Mapping[str, Any]) -> _ChatRequest:
        model, sampling, extra = self._split_call_kwargs(kwargs, _CHAT_CALL_KWARGS)
        params = self._sampling_params(stop, sampling)
        engine = get_engine(model)
        tools = [convert_to_openai_tool(t) for t in extra.get("tools") or []]
        tools, instruction = apply_tool_choice(tools, extra.get("tool_choice"))
        conversation = convert_to_openai_messages(list(messages))
        conversation = add_system_instruction(conversation, instruction)
        conversation = add_system_instruction(conversation, _response_format_instruction(extra.get("response_format")))
        return _ChatRequest(
            engine=engine,
            model=model,
            prompt=engine.apply_chat_template(conversation, tools),
            params=params,
            tools=tools,
            tool_format=tool_call_format(engine.tokenizer, tools) if tools else HERMES_FORMAT,
            parallel_tool_calls=extra.get("parallel_tool_calls") is not False,
        )

    def _combine_llm_outputs(self, llm_outputs: list[Optional[dict]]) -> dict:
        outputs = [o for o in llm_outputs if o]
        totals: dict[str, int] = {}
        for output in outputs:
            for key, value in (output.get("token_usage") or {}).items():
                totals[key] = totals.get(key, 0) + value
        combined: dict[str, Any] = {"token_usage": totals}
        if outputs:
            combined["model_name"] = outputs[0].get("model_name")
        return combined

    # -- tools and structured output

    def bind_tools(
        self,
        tools: Sequence[Union[dict[str, Any], type, Callable[..., Any], BaseTool]],
        *,
        tool_choice: Optional[Union[str, bool, dict[str, Any]]] = None,
        parallel_tool_calls: Optional[bool] = None,
        strict: Optional[bool] = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, pydantic models, functions, OpenAI tool dicts).

        ``tool_choice``: ``"auto"`` (default), ``"none"``, ``"required"`` / ``"any"`` /
        ``True``, or a function name (or ``{"type": "function", "function": {"name": ...}}``).
        Choices are honoured by prompting, as is ``parallel_tool_calls=False`` (then only
        the first call is kept). Returns the model bound to ``tools=[OpenAI tool dicts]``.
        """
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: Optional[Union[dict[str, Any], type]] = None,
        *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        include_raw: bool = False,
        strict: Optional[bool] = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Union[dict[str, Any], BaseModel]]:
        """A runnable that answers with ``schema`` (a pydantic class, TypedDict or JSON schema).

        ``method``: ``"function_calling"`` (a forced call of a tool named after the schema),
        ``"json_schema"`` (the schema in the system prompt, the answer parsed as JSON) or
        ``"json_mode"`` (any JSON object; ``schema`` only parses it). Output that does not
        parse raises LangChain's ``OutputParserException``, or with ``include_raw=True``
        gives ``{"raw", "parsed": None, "parsing_error"}``.
        """
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        trace = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        if method == "function_calling":
            if schema is None:
                raise ValueError("schema is required for method='function_calling'")
            tool = convert_to_openai_tool(schema, strict=strict)
            name = tool["function"]["name"]
            llm = self.bind_tools([tool], tool_choice=name, ls_structured_output_format=trace)
            parser: Runnable = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if is_pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema" and schema is None:
                raise ValueError("schema is required for method='json_schema'")
            llm = self.bind(response_format=_response_format(schema, method, strict), ls_structured_output_format=trace)
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()  # type: ignore[arg-type]
        else:
            raise ValueError(f"method must be 'function_calling', 'json_schema' or 'json_mode', got {method!r}")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")


def _response_format(schema: Any, method: str, strict: Optional[bool]) -> dict[str, Any]:
    if method == "json_mode":
        return {"type": "json_object"}
    json_schema = convert_to_json_schema(schema)
    name = json_schema.get("title") or "answer"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": json_schema, "strict": strict}}


def _response_format_instruction(response_format: Any) -> Optional[str]:
    """The system instruction for an OpenAI-style ``response_format`` (None for text)."""
    if response_format is None:
        return None
    if isinstance(response_format, type) and is_basemodel_subclass(response_format):
        response_format = _response_format(response_format, "json_schema", None)
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_INSTRUCTION
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", spec) if isinstance(spec, Mapping) else None
        if isinstance(schema, Mapping):
            return JSON_SCHEMA_INSTRUCTION.format(schema=json.dumps(schema, ensure_ascii=False))
    raise InvalidParameterError(
        "response_format",
        "must be {'type': 'text'}, {'type': 'json_object'} or "
        f"{{'type': 'json_schema', 'json_schema': {{'name', 'schema'}}}}, got {response_format!r}",
    )


# --------------------------------------------------------------------------- results


def _chat_result(request: _ChatRequest, completion: Completion) -> ChatResult:
    message = ai_message(completion, request.model, request.tools, request.tool_format, request.parallel_tool_calls)
    llm_output = {"token_usage": _usage_dict(completion.usage), "model_name": request.model}
    return ChatResult(generations=[ChatGeneration(message=message)], llm_output=llm_output)


def ai_message(
    completion: Completion,
    model: str,
    tools: Optional[list[dict[str, Any]]] = None,
    tool_format: ToolCallFormat = HERMES_FORMAT,
    parallel_tool_calls: bool = True,
) -> AIMessage:
    """The :class:`AIMessage` for a finished completion: content, parsed tool calls
    (malformed ones as ``invalid_tool_calls``), ``usage_metadata`` and
    ``response_metadata`` (``finish_reason``, ``model_name``, ``logprobs`` if asked for)."""
    parsed = parse_tool_calls(completion.text, tools, tool_format) if tools else ParsedOutput(completion.text)
    calls = parsed.tool_calls if parallel_tool_calls else parsed.tool_calls[:1]
    metadata: dict[str, Any] = {
        "finish_reason": "tool_calls" if calls else completion.finish_reason,
        "model_name": model,
    }
    if completion.logprobs is not None:
        metadata["logprobs"] = _logprobs_dict(completion.logprobs)
    return AIMessage(
        content=parsed.content,
        tool_calls=[tool_call(name=c.name, args=c.args, id=c.id) for c in calls],
        invalid_tool_calls=[_invalid_call(c) for c in parsed.invalid_tool_calls],
        usage_metadata=_usage_metadata(completion.usage),
        response_metadata=metadata,
    )


def _invalid_call(call: InvalidToolCall) -> Any:
    # ``args`` holds the text as generated (markers included): it is what went wrong, and
    # it never parses as JSON, so merged stream chunks keep the call invalid too.
    return invalid_tool_call(name=call.name, args=call.raw, id=call.id, error=call.error)


class ChunkTranslator:
    """Engine deltas of one chat stream to ``ChatGenerationChunk``s.

    Text arrives as content chunks, each completed tool call as one ``tool_call_chunks``
    entry (malformed calls with their raw text as ``args``, which merges into
    ``invalid_tool_calls``), and the last chunk carries ``usage_metadata``,
    ``finish_reason`` and ``model_name`` (and every logprob, if asked for).
    """

    def __init__(
        self,
        tools: Optional[list[dict[str, Any]]],
        tool_format: ToolCallFormat,
        model: str,
        parallel_tool_calls: bool = True,
    ) -> None:
        self._parser = ToolCallStreamParser(tools, tool_format) if tools else None
        self._model = model
        self._single_call = not parallel_tool_calls
        self._calls = 0
        self._valid_calls = 0
        self._logprobs: list[TokenLogprob] = []

    def on_delta(self, delta: Delta) -> list[ChatGenerationChunk]:
        """The chunks one delta completes; the last delta also gives the final chunk."""
        self._logprobs += delta.logprobs or []
        events = self._parser.feed(delta.text) if self._parser else [delta.text]
        if delta.finish_reason is not None and self._parser:
            events += self._parser.finish()
        messages = [m for event in events for m in self._event_messages(event)]
        if delta.finish_reason is not None:
            messages.append(self._final_message(delta))
        return [ChatGenerationChunk(message=m) for m in messages]

    def _event_messages(self, event: Union[str, ToolCall, InvalidToolCall]) -> list[AIMessageChunk]:
        if isinstance(event, str):
            return [AIMessageChunk(content=event)] if event else []
        if isinstance(event, ToolCall):
            if self._single_call and self._valid_calls:
                return []
            self._valid_calls += 1
            name, args = event.name, event.arguments
        else:
            name, args = event.name, event.raw
        self._calls += 1
        chunk = tool_call_chunk(name=name, args=args, id=event.id, index=self._calls - 1)
        return [AIMessageChunk(content="", tool_call_chunks=[chunk])]

    def _final_message(self, delta: Delta) -> AIMessageChunk:
        metadata: dict[str, Any] = {
            "finish_reason": "tool_calls" if self._valid_calls else delta.finish_reason,
            "model_name": self._model,
        }
        if self._logprobs:
            metadata["logprobs"] = _logprobs_dict(self._logprobs)
        return AIMessageChunk(
            content="",
            usage_metadata=_usage_metadata(delta.usage) if delta.usage is not None else None,
            response_metadata=metadata,
            chunk_position="last",
        )


def _usage_metadata(usage: Usage) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


def _usage_dict(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def _logprobs_dict(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's ``logprobs`` shape: ``{"content": [{"token", "logprob", "top_logprobs"}]}``."""
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "top_logprobs": [{"token": text, "logprob": value} for _, text, value in lp.top_logprobs],
            }
            for lp in logprobs
        ]
    }


__all__ = ["ChatMLXParallm", "ChunkTranslator", "MLXParallmLLM", "SAMPLING_FIELDS", "ai_message", "get_engine"]
