"""Engine output to chat events: thinking, content, tool calls, invalid tool calls, and the end.

:func:`read_completion` reads a finished :class:`~mlx_parallm_provider.engine.Completion`;
:class:`ChatStreamReader` reads a stream of :class:`~mlx_parallm_provider.engine.Delta`
pieces into the same answer, event by event. Both honour what the prompt asked for
(:class:`~.prepare.PreparedPrompt`): the tools, their call format,
``parallel_tool_calls``, and whether a thinking block is split off (:mod:`.reasoning`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Union

from ..engine.request import Completion, Delta, TokenLogprob, Usage
from .prepare import PreparedPrompt
from .reasoning import ReasoningSplitter, reasoning_tokens, split_reasoning
from .tool_defs import InvalidToolCall, ToolCall
from .tool_parser import ToolCallStreamParser, parse_tool_calls


@dataclass(frozen=True)
class ChatOutput:
    """A finished chat answer. ``finish_reason`` is ``"tool_calls"`` when it has calls;
    ``reasoning`` is the thinking split off before the answer (None: none)."""

    content: str
    tool_calls: list[ToolCall]
    invalid_tool_calls: list[InvalidToolCall]
    finish_reason: str
    usage: Usage
    logprobs: Optional[list[TokenLogprob]] = None
    reasoning: Optional[str] = None


def read_completion(prepared: PreparedPrompt, completion: Completion) -> ChatOutput:
    """Split a finished completion into thinking, content and tool calls (the thinking's
    tokens counted in its usage's ``reasoning_tokens``)."""
    reasoning, text = (None, completion.text) if prepared.reasoning is None else split_reasoning(completion.text, prepared.reasoning)
    usage = completion.usage
    if reasoning is not None and prepared.thinking_tags is not None:
        usage = replace(usage, reasoning_tokens=reasoning_tokens(completion.token_ids, bool(prepared.reasoning), prepared.thinking_tags))
    if not prepared.tools:
        return ChatOutput(text, [], [], completion.finish_reason, usage, completion.logprobs, reasoning)
    parsed = parse_tool_calls(text, prepared.tools, prepared.tool_format)
    calls = parsed.tool_calls if prepared.parallel_tool_calls else parsed.tool_calls[:1]
    return ChatOutput(
        content=parsed.content,
        tool_calls=calls,
        invalid_tool_calls=parsed.invalid_tool_calls,
        finish_reason="tool_calls" if calls else completion.finish_reason,
        usage=usage,
        logprobs=completion.logprobs,
        reasoning=reasoning,
    )


@dataclass(frozen=True)
class ReasoningEvent:
    """More of the thinking before the answer."""

    text: str


@dataclass(frozen=True)
class ContentEvent:
    """More answer text."""

    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    """A complete, valid call: ``index`` among the valid calls, ``position`` among all calls."""

    call: ToolCall
    index: int
    position: int


@dataclass(frozen=True)
class InvalidToolCallEvent:
    """A call the model got wrong; ``position`` among all calls."""

    call: InvalidToolCall
    position: int


@dataclass(frozen=True)
class FinalEvent:
    """The end of the answer: why it stopped, and its usage."""

    finish_reason: str
    usage: Optional[Usage]


ChatEvent = Union[ReasoningEvent, ContentEvent, ToolCallEvent, InvalidToolCallEvent, FinalEvent]


class ChatStreamReader:
    """Reads one chat stream: each :meth:`on_delta` returns the events it completes; the
    last delta (with ``finish_reason``) also gives a :class:`FinalEvent`."""

    def __init__(self, prepared: PreparedPrompt) -> None:
        self._parser = ToolCallStreamParser(prepared.tools, prepared.tool_format) if prepared.tools else None
        self._thinking = ReasoningSplitter(prepared.reasoning) if prepared.reasoning is not None else None
        self._inside, self._tags = bool(prepared.reasoning), prepared.thinking_tags
        self._ids: list[int] = []  # the answer's tokens so far, where thinking is split off (to count its tokens)
        self._single_call = not prepared.parallel_tool_calls
        self._valid = 0
        self._positions = 0

    def on_delta(self, delta: Delta) -> list[ChatEvent]:
        """The events one delta completes."""
        events: list[ChatEvent] = []
        text = delta.text
        if self._thinking is not None:
            self._ids.extend(delta.token_ids)
            pieces = self._thinking.feed(text) + (self._thinking.finish() if delta.finish_reason is not None else [])
            events += [ReasoningEvent(t) for kind, t in pieces if kind == "reasoning"]
            text = "".join(t for kind, t in pieces if kind == "content")
        parsed: list[Any] = self._parser.feed(text) if self._parser else [text]
        if delta.finish_reason is not None and self._parser:
            parsed += self._parser.finish()
        events += [event for item in parsed for event in self._events(item)]
        if delta.finish_reason is not None:
            reason = "tool_calls" if self._valid else delta.finish_reason
            usage = delta.usage
            if usage is not None and self._thinking is not None and self._thinking.thought and self._tags is not None:
                usage = replace(usage, reasoning_tokens=reasoning_tokens(self._ids, self._inside, self._tags))
            events.append(FinalEvent(reason, usage))
        return events

    def _events(self, item: Union[str, ToolCall, InvalidToolCall]) -> list[ChatEvent]:
        if isinstance(item, str):
            return [ContentEvent(item)] if item else []
        if isinstance(item, ToolCall):
            if self._single_call and self._valid:
                return []
            self._valid += 1
            event: ChatEvent = ToolCallEvent(item, self._valid - 1, self._positions)
        else:
            event = InvalidToolCallEvent(item, self._positions)
        self._positions += 1
        return [event]
