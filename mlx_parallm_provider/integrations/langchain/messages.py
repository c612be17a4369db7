"""Chat-layer answers to LangChain messages: ``AIMessage`` and stream chunks."""

from __future__ import annotations

from typing import Any, Optional

from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk

from ...chat import ChatOutput, ChatStreamReader, ContentEvent, FinalEvent, InvalidToolCall, InvalidToolCallEvent, PreparedPrompt, ReasoningEvent, ToolCallEvent
from ...engine import Delta, TokenLogprob
from .._common import vllm_prompt_logprobs
from .fields import logprobs_dict, usage_metadata


def ai_message(output: ChatOutput, model: str, prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None) -> AIMessage:
    """The :class:`AIMessage` of a finished answer: content, tool calls (malformed ones as
    ``invalid_tool_calls``), ``usage_metadata`` and ``response_metadata``
    (``finish_reason``, ``model_name``, ``logprobs`` and vLLM's ``prompt_logprobs`` if asked
    for); a reasoning model's
    thinking in ``additional_kwargs["reasoning_content"]``, as LangChain's DeepSeek and
    Ollama models put it."""
    metadata: dict[str, Any] = {"finish_reason": output.finish_reason, "model_name": model}
    if output.logprobs is not None:
        metadata["logprobs"] = logprobs_dict(output.logprobs)
    if prompt_logprobs is not None:
        metadata["prompt_logprobs"] = vllm_prompt_logprobs(prompt_logprobs)
    return AIMessage(
        content=output.content,
        tool_calls=[tool_call(name=c.name, args=c.args, id=c.id) for c in output.tool_calls],
        invalid_tool_calls=[_invalid_call(c) for c in output.invalid_tool_calls],
        usage_metadata=usage_metadata(output.usage),
        response_metadata=metadata,
        additional_kwargs={"reasoning_content": output.reasoning} if output.reasoning else {},
    )


def _invalid_call(call: InvalidToolCall) -> Any:
    # ``args`` holds the text as generated (markers included): it is what went wrong, and
    # it never parses as JSON, so merged stream chunks keep the call invalid too.
    return invalid_tool_call(name=call.name, args=call.raw, id=call.id, error=call.error)


class ChunkWriter:
    """One chat stream's deltas to ``ChatGenerationChunk``s, through the chat layer.

    Thinking arrives as ``additional_kwargs["reasoning_content"]`` pieces (which merge),
    text as content chunks, each completed tool call as one ``tool_call_chunks``
    entry (malformed calls with their raw text as ``args``, which merges into
    ``invalid_tool_calls``), and the last chunk carries ``usage_metadata`` (unless ``usage`` is False),
    ``finish_reason``, ``model_name`` (and vLLM's ``prompt_logprobs``, if asked for).

    Logprobs, if asked for, ride as ``ChatOpenAI`` streams them: each chunk of thinking or
    text has ``generation_info["logprobs"]`` (LangChain moves it to ``response_metadata``)
    for the tokens taken since the chunk before; those of tokens whose text no chunk
    carried go on the last, so the chunks, summed, hold every token's logprob in order.
    """

    def __init__(self, prepared: PreparedPrompt, model: str, usage: bool = True) -> None:
        self._reader = ChatStreamReader(prepared)
        self._model, self._usage = model, usage
        self._logprobs: list[TokenLogprob] = []  # (not yet sent)
        self._prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None

    def on_delta(self, delta: Delta) -> list[ChatGenerationChunk]:
        """The chunks one delta completes; the last delta also gives the final chunk."""
        chunks = []
        self._logprobs += delta.logprobs or []
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs
        for event in self._reader.on_delta(delta):
            carries_logprobs = True
            if isinstance(event, ReasoningEvent):
                message = AIMessageChunk(content="", additional_kwargs={"reasoning_content": event.text})
            elif isinstance(event, ContentEvent):
                message = AIMessageChunk(content=event.text)
            elif isinstance(event, ToolCallEvent):
                call = event.call
                message, carries_logprobs = _call_chunk(call.name, call.arguments, call.id, event.position), False
            elif isinstance(event, InvalidToolCallEvent):
                message, carries_logprobs = _call_chunk(event.call.name, event.call.raw, event.call.id, event.position), False
            else:
                message = self._final(event)
            chunks.append(ChatGenerationChunk(message=message, generation_info=self._unsent() if carries_logprobs else None))
        return chunks

    def _unsent(self) -> Optional[dict[str, Any]]:
        if not self._logprobs:
            return None
        sent, self._logprobs = self._logprobs, []
        return {"logprobs": logprobs_dict(sent)}

    def _final(self, event: FinalEvent) -> AIMessageChunk:
        metadata: dict[str, Any] = {"finish_reason": event.finish_reason, "model_name": self._model}
        if self._prompt_logprobs is not None:
            metadata["prompt_logprobs"] = vllm_prompt_logprobs(self._prompt_logprobs)
        return AIMessageChunk(
            content="",
            usage_metadata=usage_metadata(event.usage) if event.usage is not None and self._usage else None,
            response_metadata=metadata,
            chunk_position="last",
        )


def _call_chunk(name: Any, args: Any, call_id: str, index: int) -> AIMessageChunk:
    return AIMessageChunk(content="", tool_call_chunks=[tool_call_chunk(name=name, args=args, id=call_id, index=index)])
