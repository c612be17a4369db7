""":class:`ChatMLXParallm`: a LangChain ``BaseChatModel`` on the shared engine."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Literal, Optional, Union

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, convert_to_openai_messages
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field

from ...chat import PreparedPrompt, prepare_chat, read_completion
from ...engine import Completion, Delta, EngineLike, SamplingParams
from ...errors import InvalidParameterError
from .._common import PROVIDER, usage_dict
from .batch import BatchesFromOneThread, prefetched
from .fields import EngineFields, engine_for
from .messages import ChunkWriter, ai_message

_CHAT_CALL_KWARGS = frozenset(("tools", "tool_choice", "parallel_tool_calls", "response_format", "continue_final_message", "structured_outputs",
                                "chat_template_kwargs", "reasoning_effort", "thinking", "stream_usage"))


@dataclass(frozen=True)
class _ChatCall:
    """One chat call, translated: the engine, the prepared prompt and its settings."""

    engine: EngineLike
    model: str
    prepared: PreparedPrompt
    params: SamplingParams

    def prefetched(self) -> Optional[Completion]:
        return prefetched(self.engine, self.prepared.prompt, self.params)


class ChatMLXParallm(EngineFields, BatchesFromOneThread, BaseChatModel):
    """Chat model on the shared batching engine.

    Messages (system, human, AI with tool calls, tool results) are rendered by the
    model's chat template. Every async call awaits the engine natively, so the concurrent
    ``ainvoke`` calls of ``abatch``, a chain or an agent decode as one batch; a sync
    ``batch`` submits every input from the calling thread, no thread per input. Example::

        chat = ChatMLXParallm(model="default", max_tokens=128)
        chain = ChatPromptTemplate.from_template("Tell me about {topic}") | chat | StrOutputParser()
        chain.batch([{"topic": t} for t in topics])  # one decode batch

    Supports ``bind_tools`` (LangChain tools, pydantic models, functions, OpenAI dicts),
    ``with_structured_output`` (``function_calling``, ``json_schema``, ``json_mode``),
    vLLM's ``structured_outputs`` (``bind(structured_outputs={"choice": [...]})``; ``regex``,
    ``json``, ``grammar``, ``json_object``), streaming with tool-call chunks, and
    ``usage_metadata`` on every answer.
    """

    model_config = ConfigDict(extra="forbid")
    CALL_KWARGS = _CHAT_CALL_KWARGS

    streaming: bool = Field(default=False, description="Stream internally on invoke (callbacks get every token).")
    stream_usage: bool = Field(default=True, description="A stream's last chunk carries usage_metadata (as ChatOpenAI's; "
                                                         "a call's stream_usage=... wins).")

    @property
    def _llm_type(self) -> str:
        return f"{PROVIDER}-chat"

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = self._prepare(messages, stop, kwargs)
        completion = call.prefetched()
        if completion is None:
            completion = call.engine.generate_sync(call.prepared.prompt, call.params)
        return _chat_result(call, completion)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> ChatResult:
        call = await asyncio.to_thread(self._prepare, messages, stop, kwargs)  # off the loop: rendering, grammars
        return _chat_result(call, await call.engine.generate(call.prepared.prompt, call.params))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        call = self._prepare(messages, stop, kwargs)
        writer = ChunkWriter(call.prepared, call.model, usage=self._stream_usage(kwargs))
        done = call.prefetched()
        if done is not None:  # in a sync batch the answer is already there: one piece
            yield from _emit(writer, [_as_delta(done)], run_manager)
            return
        deltas = call.engine.stream_sync(call.prepared.prompt, call.params)
        try:
            yield from _emit(writer, deltas, run_manager)
        finally:
            deltas.close()

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        call = await asyncio.to_thread(self._prepare, messages, stop, kwargs)  # off the loop: rendering, grammars
        writer = ChunkWriter(call.prepared, call.model, usage=self._stream_usage(kwargs))
        deltas = call.engine.stream(call.prepared.prompt, call.params)
        try:
            async for delta in deltas:
                for chunk in writer.on_delta(delta):
                    if run_manager:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk, logprobs=_chunk_logprobs(chunk))
                    yield chunk
        finally:
            await deltas.aclose()

    def _stream_usage(self, kwargs: Mapping[str, Any]) -> bool:
        """Whether a stream's last chunk carries usage: the call's ``stream_usage``, else the model's."""
        given = kwargs.get("stream_usage")
        if given is None:
            return self.stream_usage
        if not isinstance(given, bool):
            raise InvalidParameterError("stream_usage", f"must be a boolean, got {given!r}")
        return given

    def _batch_request(self, value: LanguageModelInput, stop: Optional[list[str]], kwargs: dict[str, Any]) -> tuple[EngineLike, str, SamplingParams]:
        call = self._prepare(self._convert_input(value).to_messages(), stop, kwargs)
        return call.engine, call.prepared.prompt, call.params

    def _prepare(self, messages: Sequence[BaseMessage], stop: Optional[list[str]], kwargs: Mapping[str, Any]) -> _ChatCall:
        model, sampling, extra = self._split_call_kwargs(kwargs)
        params = self._sampling_params(stop, sampling)
        engine = engine_for(model)
        prepared = prepare_chat(
            engine.tokenizer,
            convert_to_openai_messages(list(messages)),
            tools=_openai_tools(extra.get("tools")),
            tool_choice=extra.get("tool_choice"),
            response_format=_openai_response_format(extra.get("response_format")),
            parallel_tool_calls=extra.get("parallel_tool_calls"),
            continue_final_message=extra.get("continue_final_message", False),
            structured_outputs=extra.get("structured_outputs"),
            chat_template_kwargs=extra.get("chat_template_kwargs"),
            reasoning_effort=extra.get("reasoning_effort"),
            thinking=extra.get("thinking"),
        )
        if prepared.constraint is not None:  # JSON output, a forced tool call, structured_outputs
            params = dataclasses.replace(params, constraint=prepared.constraint)
        return _ChatCall(engine, model, prepared, params)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Optional[Sequence[Any]] = None) -> int:
        """Tokens of the prompt that ``messages`` (and ``tools``) make: rendered by the model's
        chat template as a call renders them, so the count is the call's
        ``usage_metadata["input_tokens"]`` (LangChain's default counts each message's text
        alone, without the template's tokens; ``trim_messages(token_counter=chat)`` uses
        this). With ``custom_get_token_ids`` set, LangChain's count with it."""
        if not messages or getattr(self, "custom_get_token_ids", None) is not None:
            return super().get_num_tokens_from_messages(messages, tools)
        call = self._prepare(messages, None, {"tools": tools} if tools else {})
        return len(call.engine.encode(call.prepared.prompt))

    def _combine_llm_outputs(self, llm_outputs: list[Optional[dict]]) -> dict:
        outputs = [o for o in llm_outputs if o]
        totals: dict[str, Any] = {}
        for output in outputs:
            _add_counts(totals, output.get("token_usage") or {})
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
        formatted = _openai_tools(tools, strict=strict)
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
        ``"json_mode"`` (JSON output, the prompt left to the caller; with a ``schema``
        decoding is held to it, else to any JSON object). Output that does not
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


def _openai_tools(tools: Any, strict: Optional[bool] = None) -> Optional[list[dict[str, Any]]]:
    """LangChain tools, pydantic models, functions or OpenAI dicts as OpenAI tool dicts."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidParameterError("tools", f"must be a list of tools, got {type(tools).__name__}")
    converted = []
    for i, tool in enumerate(tools):
        try:
            converted.append(convert_to_openai_tool(tool, strict=strict))
        except (ValueError, TypeError) as error:
            raise InvalidParameterError(f"tools[{i}]", f"is not a tool LangChain can convert ({error})") from None
    return converted


def _response_format(schema: Any, method: str, strict: Optional[bool]) -> dict[str, Any]:
    if method == "json_mode":
        # The parser accepts only the schema, so decoding is held to it as well.
        return {"type": "json_object"} if schema is None else {"type": "json_object", "schema": convert_to_json_schema(schema)}
    json_schema = convert_to_json_schema(schema)
    name = json_schema.get("title") or "answer"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": json_schema, "strict": strict}}


def _openai_response_format(response_format: Any) -> Any:
    """A pydantic class as OpenAI's ``json_schema`` response format; anything else as is."""
    if isinstance(response_format, type) and is_basemodel_subclass(response_format):
        return _response_format(response_format, "json_schema", None)
    return response_format


def _chat_result(call: _ChatCall, completion: Completion) -> ChatResult:
    message = ai_message(read_completion(call.prepared, completion), call.model, completion.prompt_logprobs)
    llm_output = {"token_usage": usage_dict(completion.usage), "model_name": call.model}
    return ChatResult(generations=[ChatGeneration(message=message)], llm_output=llm_output)


def _emit(writer: ChunkWriter, deltas: Iterable[Delta], run_manager: Optional[CallbackManagerForLLMRun]) -> Iterator[ChatGenerationChunk]:
    for delta in deltas:
        for chunk in writer.on_delta(delta):
            # LangChain passes a run manager only where it does not report tokens itself.
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk, logprobs=_chunk_logprobs(chunk))
            yield chunk


def _chunk_logprobs(chunk: ChatGenerationChunk) -> Optional[dict[str, Any]]:
    # ChatOpenAI hands each chunk's logprobs to the callbacks too.
    return (chunk.generation_info or {}).get("logprobs")


def _as_delta(completion: Completion) -> Delta:
    return Delta(completion.request_id, completion.text, completion.token_ids, completion.finish_reason, completion.usage, completion.logprobs,
                 completion.prompt_logprobs)


def _add_counts(totals: dict[str, Any], counts: Mapping[str, Any]) -> None:
    """Add OpenAI usage ``counts`` into ``totals``, nested dicts (``prompt_tokens_details``) too."""
    for key, value in counts.items():
        if isinstance(value, Mapping):
            _add_counts(totals.setdefault(key, {}), value)
        else:
            totals[key] = totals.get(key, 0) + value
