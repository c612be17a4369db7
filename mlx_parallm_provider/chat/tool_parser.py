"""Tool-call parsing: generated text to content, well-formed calls and malformed calls.

:func:`parse_tool_calls` reads a whole output; :class:`ToolCallStreamParser` reads it
delta by delta and gives the same answer. Neither ever raises on model output.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from .tool_defs import InvalidToolCall, ParsedOutput, StreamEvent, ToolCall, decode_arguments, new_tool_call_id, tool_names
from .tool_formats import HERMES_FORMAT, ToolCallFormat, strip_code_fence


def parse_tool_calls(
    text: str,
    tools: Optional[Sequence[Mapping[str, Any]]] = None,
    fmt: ToolCallFormat = HERMES_FORMAT,
    *,
    allow_bare_json: bool = True,
) -> ParsedOutput:
    """Split generated ``text`` into content, tool calls and invalid tool calls.

    Calls are the spans between ``fmt.start`` and ``fmt.end`` (an unterminated last span
    is still parsed, less any start of the end marker it ends in, since a stop string, the
    token budget or a forgetful model may cut the end marker).
    When ``tools`` are given, a call to a function not among them is invalid, and (with
    ``allow_bare_json``) an output that is nothing but a JSON call object such as
    ``{"name": "get_weather", "arguments": {...}}`` counts as a call too.

    Content is the text outside the calls; when there are calls, whitespace next to
    them and at the end is trimmed, and text before and after a call is joined with a
    newline. Without calls the content is ``text`` unchanged.
    Never raises on model output.
    """
    parser = ToolCallStreamParser(tools, fmt, allow_bare_json=allow_bare_json)
    events = parser.feed(text) + parser.finish()
    return ParsedOutput(
        content="".join(e for e in events if isinstance(e, str)),
        tool_calls=[e for e in events if isinstance(e, ToolCall)],
        invalid_tool_calls=[e for e in events if isinstance(e, InvalidToolCall)],
    )


class _State(enum.Enum):
    MAYBE_JSON = "the whole output so far may still be a bare JSON call"
    CONTENT = "plain text; a start marker may begin a call"
    IN_CALL = "inside a call, waiting for its end marker"
    DONE = "finish() was called"


class ToolCallStreamParser:
    """Incremental :func:`parse_tool_calls` for streamed output.

    Feed it text deltas; each :meth:`feed` returns the events that are now certain:
    content deltas (``str``) and completed :class:`ToolCall` / :class:`InvalidToolCall`.
    Text that might be the beginning of a start marker, a call still being written, and
    trailing whitespace are held back until they are resolved. With tools and
    ``allow_bare_json``, an output that begins like a JSON object or code fence is held
    for as long as it still looks like JSON, since it may turn out to be a bare JSON
    call (resolved at :meth:`finish`). Call :meth:`finish` once at the end. Joining all
    content events gives exactly :func:`parse_tool_calls`'s ``content``.

    ``tools`` are OpenAI tool dicts as :func:`~.tool_defs.normalize_tools` returns them.
    """

    def __init__(
        self,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        fmt: ToolCallFormat = HERMES_FORMAT,
        *,
        allow_bare_json: bool = True,
    ) -> None:
        self._tools = list(tools) if tools else None
        self._names = set(tool_names(self._tools))
        self._fmt = fmt
        self._state = _State.MAYBE_JSON if self._tools and allow_bare_json else _State.CONTENT
        self._buffer = ""
        self._text = _ContentJoiner()
        self._json_prefix = _JsonPrefix()
        self._json_scanned = 0  # characters of the JSON-looking output already scanned

    def feed(self, text: str) -> list[StreamEvent]:
        """Take the next text delta; return the events it completes."""
        if self._state is _State.DONE:
            raise RuntimeError("feed() after finish()")
        self._buffer += text
        return self._drain()

    def finish(self) -> list[StreamEvent]:
        """End of output: resolve everything held back and return the last events."""
        if self._state is _State.DONE:
            return []
        if self._state is _State.MAYBE_JSON:
            calls = self._bare_json_calls(self._buffer)
            if calls:
                self._buffer, self._state = "", _State.DONE
                return calls
            self._state = _State.CONTENT
        events = self._drain()
        if self._state is _State.IN_CALL:
            events += self._call_events(self._buffer, terminated=False)
        elif not self._text.saw_call:
            events += self._text.add(self._buffer, before_call=False)
        # (else what _drain held back is the cut start of one more call, "<tool" when the
        # token budget ran out: not content, as vLLM's parsers give none after a call either)
        self._buffer, self._state = "", _State.DONE
        return events + self._text.flush()

    # -- internals

    def _drain(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while True:
            if self._state is _State.IN_CALL:
                end = self._buffer.find(self._fmt.end) if self._fmt.end else -1
                if end < 0:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self._fmt.end) :]
                self._state = _State.CONTENT
                events += self._call_events(body, terminated=True)
                continue
            if self._state is _State.MAYBE_JSON:
                if self._could_be_bare_json(self._buffer):
                    return events
                self._state = _State.CONTENT
            start = self._buffer.find(self._fmt.start)
            if start >= 0:
                events += self._text.add(self._buffer[:start], before_call=True)
                self._buffer = self._buffer[start + len(self._fmt.start) :]
                self._state = _State.IN_CALL
                continue
            cut = len(self._buffer) - _marker_prefix_len(self._buffer, self._fmt.start)
            events += self._text.add(self._buffer[:cut], before_call=False)
            self._buffer = self._buffer[cut:]
            return events

    def _call_events(self, body: str, *, terminated: bool) -> list[StreamEvent]:
        self._text.call_seen()
        raw = self._fmt.start + body + (self._fmt.end if terminated else "")
        if not terminated and self._fmt.end:  # the budget ran out inside the end marker ("\n</tool_")
            body = body[: len(body) - _marker_prefix_len(body, self._fmt.end)]
        try:
            parsed = self._fmt.parse(body, self._tools)
        except Exception as error:
            reason = f"could not parse the tool call: {error}"
            if not terminated:
                reason += f" (no closing {self._fmt.end!r}; the output may have been cut off)"
            return [InvalidToolCall(id=new_tool_call_id(), raw=raw, error=reason)]
        items = parsed if isinstance(parsed, list) else [parsed]
        if not items:
            return [InvalidToolCall(id=new_tool_call_id(), raw=raw, error="empty tool call")]
        return [self._to_call(item, raw) for item in items]

    def _to_call(self, item: Any, raw: str) -> Union[ToolCall, InvalidToolCall]:
        call_id = item.get("id") if isinstance(item, Mapping) else None
        call_id = call_id if isinstance(call_id, str) and call_id else new_tool_call_id()
        name, arguments, error = _call_fields(item)
        if error is None and self._names and name not in self._names:
            error = f"unknown function {name!r}; the tools are {sorted(self._names)}"
        if error is not None:
            return InvalidToolCall(id=call_id, raw=raw, error=error, name=name, arguments=arguments)
        return ToolCall(id=call_id, name=name, arguments=arguments)  # type: ignore[arg-type]

    def _could_be_bare_json(self, text: str) -> bool:
        """Whether the output so far (all held in ``text``) may still be a bare JSON call."""
        head = text.lstrip()
        if head.startswith("```"):
            newline = head.find("\n")
            if newline < 0:
                return len(head) <= 16  # the fence's language tag may still be arriving
            head = head[newline + 1 :].lstrip()
        elif "```".startswith(head):
            return True
        if not head:
            return True
        if head[0] not in "{[":
            return False
        fresh, self._json_scanned = head[self._json_scanned :], len(head)
        return self._json_prefix.feed(fresh)

    def _bare_json_calls(self, text: str) -> list[StreamEvent]:
        stripped = strip_code_fence(text.strip())
        if not stripped or stripped[0] not in "{[":
            return []
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError:
            return []
        items = value if isinstance(value, list) else [value]
        calls = [self._to_call(item, text) for item in items] if items else []
        if not calls or not all(isinstance(c, ToolCall) for c in calls):
            return []
        self._text.call_seen()
        return calls


class _ContentJoiner:
    """The content side of the parser: trims whitespace next to calls, joins the text
    before and after a call with a newline, and holds trailing whitespace back."""

    def __init__(self) -> None:
        self._pending_ws = ""
        self._after_call = False
        self._saw_call = False
        self._sent = False

    def call_seen(self) -> None:
        self._saw_call = self._after_call = True

    @property
    def saw_call(self) -> bool:
        """A call (valid or not) has been parsed."""
        return self._saw_call

    def add(self, text: str, *, before_call: bool) -> list[StreamEvent]:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
            if self._sent:  # text resumes after a call: keep it apart from the earlier text
                text = "\n" + text
        text = self._pending_ws + text
        self._pending_ws = ""
        if before_call:
            text = text.rstrip()
        else:
            stripped = text.rstrip()
            self._pending_ws = text[len(stripped) :]
            text = stripped
        self._sent = self._sent or bool(text)
        return [text] if text else []

    def flush(self) -> list[StreamEvent]:
        """Trailing whitespace is content only when the output had no call."""
        pending, self._pending_ws = self._pending_ws, ""
        return [pending] if pending and not self._saw_call else []


def _call_fields(item: Any) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """``(name, arguments JSON, error)`` of one parsed call dict."""
    if not isinstance(item, Mapping):
        return None, None, f"a tool call must be a JSON object, got {type(item).__name__}"
    function = item.get("function")
    if isinstance(function, Mapping):  # OpenAI-shaped {"function": {"name", "arguments"}}
        item = function
    name = item.get("name")
    arguments, error = decode_arguments(item.get("arguments", item.get("parameters", {})))
    if error is not None:
        return name if isinstance(name, str) else None, arguments, error
    encoded = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(name, str) or not name:
        return None, encoded, "the tool call has no function 'name'"
    if not isinstance(arguments, Mapping):
        return name, encoded, f"arguments must be a JSON object, got {type(arguments).__name__}"
    return name, encoded, None


_JSON_SYNTAX = frozenset(" \t\r\n,:-+.0123456789eEtrufalsn")


class _JsonPrefix:
    """Incremental check that streamed text can still grow into one JSON object or array,
    optionally followed by a closing code fence. A cheap character scan (no parsing), so
    an answer that merely starts with ``[`` or ``{`` is released as soon as it stops
    looking like JSON; each character is looked at once."""

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._in_string = self._escaped = False
        self._tail: Optional[str] = None  # text after the top-level value closed
        self.viable = True

    def feed(self, text: str) -> bool:
        """Scan more text; return whether the whole text so far is still viable."""
        for i, ch in enumerate(text):
            if not self.viable:
                break
            if self._tail is not None:
                self._tail += text[i:]
                rest = self._tail.strip()
                self.viable = "```".startswith(rest[:3]) and not rest[3:].strip()
                break
            self._scan(ch)
        return self.viable

    def _scan(self, ch: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not self._stack or self._stack.pop() != ch:
                self.viable = False
            elif not self._stack:
                self._tail = ""
        elif ch not in _JSON_SYNTAX:
            self.viable = False


def _marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


