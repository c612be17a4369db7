"""Tool (function) calling: tool definitions in, tool calls out.

Shared by the LiteLLM and LangChain adapters. Three concerns live here:

* **Definitions.** :func:`normalize_tools` accepts OpenAI tool dicts
  (``{"type": "function", "function": {...}}``, which is also what LangChain's
  ``convert_to_openai_tool`` returns) and bare function dicts, and
  :func:`apply_tool_choice` turns ``tool_choice`` into the tools to show the model plus
  an optional instruction.
* **Prompting.** A chat template that knows about tools gets them through
  ``apply_chat_template(tools=...)`` (see :mod:`mlx_parallm_provider.chat`). For a
  template without tool support (the embedded SmolLM2 has plain ChatML) the tools are
  described in the system message by :func:`fallback_tool_prompt`, which asks for the
  Hermes/Qwen format::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

* **Parsing.** :func:`parse_tool_calls` splits generated text into content, well-formed
  calls and malformed ones; :class:`ToolCallStreamParser` does the same incrementally for
  streaming. Neither ever raises on model output. The call format comes from
  :func:`tool_call_format`: the tokenizer's own (one of mlx-lm's ``tool_parsers``) when
  its template renders tools natively, else the Hermes format above.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from .errors import InvalidParameterError

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

#: The fallback tool prompt: Qwen2.5's own tool-use system text (Hermes format), so small
#: instruct models that saw it in training recognise it. ``{tools}`` is one JSON tool
#: definition per line.
FALLBACK_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>
If no function call is needed, answer the user directly without any <tool_call> tags."""

REQUIRED_TOOL_INSTRUCTION = (
    "You must answer with at least one function call in <tool_call></tool_call> tags."
)
NAMED_TOOL_INSTRUCTION = (
    'You must answer with a call to the function "{name}" in <tool_call></tool_call> tags.'
)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ToolCall:
    """A well-formed tool call: ``arguments`` is a JSON object serialised as a string."""

    id: str
    name: str
    arguments: str

    @property
    def args(self) -> dict[str, Any]:
        """The arguments decoded to a dict."""
        return json.loads(self.arguments)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry: ``{"id", "type": "function", "function"}``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class InvalidToolCall:
    """A tool call the model attempted but got wrong.

    ``raw`` is the text as generated (markers included), ``error`` says what is wrong;
    ``name`` and ``arguments`` are filled in when they could be recovered.
    """

    id: str
    raw: str
    error: str
    name: Optional[str] = None
    arguments: Optional[str] = None


@dataclass(frozen=True)
class ParsedOutput:
    """Generated text split into content and tool calls."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)


#: What :class:`ToolCallStreamParser` yields: a content delta or a finished call.
StreamEvent = Union[str, ToolCall, InvalidToolCall]


def new_tool_call_id() -> str:
    """A fresh OpenAI-style call id, ``call_<24 hex digits>``."""
    return f"call_{uuid.uuid4().hex[:24]}"


# --------------------------------------------------------------------------- definitions


def normalize_tools(tools: Optional[Sequence[Mapping[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    """Validate tool definitions and return them as OpenAI ``{"type": "function", ...}`` dicts.

    Accepts OpenAI tools and bare function dicts (``{"name", "description",
    "parameters"}``, the legacy ``functions`` form). Returns ``None`` for no tools.
    Raises :class:`InvalidParameterError` naming the bad field.
    """
    if not tools:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidParameterError("tools", "must be a list of tool definitions")
    normalized = [_normalize_tool(i, tool) for i, tool in enumerate(tools)]
    names = [t["function"]["name"] for t in normalized]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidParameterError("tools", f"duplicate function names {duplicates}")
    return normalized


def _normalize_tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping):
        raise InvalidParameterError(where, "must be a dict like {'type': 'function', 'function': {...}}")
    if "function" in tool or "type" in tool:
        if tool.get("type", "function") != "function":
            raise InvalidParameterError(
                f"{where}.type",
                f"only 'function' tools are supported, got {tool.get('type')!r}",
            )
        function, where = tool.get("function"), f"{where}.function"
    else:
        function = tool
    if not isinstance(function, Mapping):
        raise InvalidParameterError(where, "must be a dict with 'name' and 'parameters'")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidParameterError(f"{where}.name", "must be a non-empty string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise InvalidParameterError(f"{where}.parameters", "must be a JSON schema dict")
    out: dict[str, Any] = {"name": name}
    if function.get("description"):
        out["description"] = str(function["description"])
    out["parameters"] = dict(parameters)
    if "strict" in function:
        out["strict"] = function["strict"]
    return {"type": "function", "function": out}


def tool_names(tools: Optional[Sequence[Mapping[str, Any]]]) -> list[str]:
    """The function names of normalised tools."""
    return [t["function"]["name"] for t in tools or []]


def apply_tool_choice(
    tools: Optional[Sequence[Mapping[str, Any]]], tool_choice: Any = None
) -> tuple[Optional[list[dict[str, Any]]], Optional[str]]:
    """Resolve ``tool_choice`` to ``(tools to show the model, instruction or None)``.

    A small local model cannot be forced to call a tool (there is no constrained
    decoding), so the choices are honoured by prompting:

    * ``None`` / ``"auto"``: all tools, no instruction; the model decides.
    * ``"none"`` (or ``False``): the tools are dropped from the prompt, so the model
      answers in text. Tool calls already in the history still render.
    * ``"required"`` (or ``"any"``, ``True``): all tools plus
      :data:`REQUIRED_TOOL_INSTRUCTION` in the system message.
    * a named function (``{"type": "function", "function": {"name": ...}}``, or just the
      name): only that tool is shown, plus :data:`NAMED_TOOL_INSTRUCTION`.

    The instruction is meant to be appended to the system message (see
    :func:`add_system_instruction`). Raises :class:`InvalidParameterError` for an
    unknown choice or a named function that is not among the tools.
    """
    tools = normalize_tools(tools)
    choice = _choice_kind(tool_choice)
    if choice == "auto":
        return tools, None
    if choice == "none":
        return None, None
    if not tools:
        raise InvalidParameterError("tool_choice", f"{tool_choice!r} needs tools; pass `tools` too")
    if choice == "required":
        return tools, REQUIRED_TOOL_INSTRUCTION
    chosen = [t for t in tools if t["function"]["name"] == choice]
    if not chosen:
        raise InvalidParameterError(
            "tool_choice", f"function {choice!r} is not among the tools {tool_names(tools)}"
        )
    return chosen, NAMED_TOOL_INSTRUCTION.format(name=choice)


def _choice_kind(tool_choice: Any) -> str:
    """``"auto"``, ``"none"``, ``"required"`` or the name of the chosen function."""
    if tool_choice is None or tool_choice == "auto":
        return "auto"
    if tool_choice is False or tool_choice == "none":
        return "none"
    if tool_choice is True or tool_choice in ("required", "any"):
        return "required"
    if isinstance(tool_choice, str) and tool_choice:
        return tool_choice
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else tool_choice.get("name")
        if isinstance(name, str) and name:
            return name
    raise InvalidParameterError(
        "tool_choice",
        f"must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
        f"{{'name': ...}}}}, got {tool_choice!r}",
    )


def add_system_instruction(messages: Sequence[Mapping[str, Any]], instruction: Optional[str]) -> list[dict[str, Any]]:
    """Append ``instruction`` to the leading system message (inserting one if needed).

    Returns a new list; the caller's messages are not modified.
    """
    messages = list(messages)
    if not instruction:
        return messages
    first = messages[0] if messages else None
    if isinstance(first, Mapping) and first.get("role") in ("system", "developer"):
        first = dict(first)
        content = first.get("content")
        if isinstance(content, list):
            first["content"] = [*content, {"type": "text", "text": "\n\n" + instruction}]
        else:
            first["content"] = f"{content}\n\n{instruction}" if content else instruction
        return [first, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]


def fallback_tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system-message text describing ``tools`` for a template without tool support."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in normalize_tools(tools) or [])
    return FALLBACK_TOOL_PROMPT.format(tools=lines)


def render_tool_call_text(name: str, arguments: Any) -> str:
    """One call in the Hermes format, as an assistant turn in the history shows it."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{payload}\n{TOOL_CALL_END}"


# --------------------------------------------------------------------------- formats


ParseFn = Callable[[str, Optional[list]], Any]


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes tool calls: text markers around a body, and the body's parser.

    ``parse(body, tools)`` returns one ``{"name", "arguments"}`` dict or a list of them
    (mlx-lm's ``tool_parsers`` contract) and may raise on bad input. An empty ``end``
    means the call runs to the end of the output (Mistral's ``[TOOL_CALLS]``).
    """

    name: str
    start: str
    end: str
    parse: ParseFn


def _parse_hermes(body: str, tools: Optional[list] = None) -> Any:
    """Parse a Hermes ``<tool_call>`` body: one JSON object, or several in a row.

    Tolerates a Markdown code fence around the JSON and stray closing braces after it,
    which small models often produce. A superset of mlx-lm's ``json_tools`` parser (a
    plain ``json.loads``), written out here so parsing never imports mlx.
    """
    text = _strip_code_fence(body.strip())
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        values = _decode_json_values(text)
        if not values:
            raise ValueError(f"not valid JSON ({error.msg} at char {error.pos})") from None
        return values if len(values) > 1 else values[0]


def _decode_json_values(text: str) -> list[Any]:
    """JSON values written one after another; stops at the first undecodable text."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] in "}]":
            return values if not text[pos:].strip(" \t\r\n}]") else []
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return []
        values.append(value)


_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n?(.*?)\n?\s*```$", re.DOTALL)


def _strip_code_fence(text: str) -> str:
    match = _FENCE.match(text)
    return match.group(1).strip() if match else text


HERMES_FORMAT = ToolCallFormat("hermes", TOOL_CALL_START, TOOL_CALL_END, _parse_hermes)


def template_source(tokenizer: Any, tools: Any = None) -> Optional[str]:
    """The Jinja source of the tokenizer's chat template (the ``tool_use`` one when a
    template dict has it and tools are given), or ``None`` if there is none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        key = "tool_use" if tools and "tool_use" in template else "default"
        template = template.get(key) or next(iter(template.values()), None)
    return template if isinstance(template, str) and template else None


def template_supports_tools(tokenizer: Any, tools: Any = None) -> bool:
    """Whether the chat template renders a ``tools`` list itself.

    True when the Jinja template reads a variable named ``tools`` (as transformers passes
    them), or when the tokenizer renders chats in Python (mlx-lm ``chat_template_type``)
    and mlx-lm found a tool parser for it.
    """
    source = template_source(tokenizer, tools)
    if source is not None:
        return _reads_tools_variable(source)
    wrapper_renderer = getattr(tokenizer, "_chat_template", None)
    return wrapper_renderer is not None and bool(getattr(tokenizer, "has_tool_calling", False))


@functools.lru_cache(maxsize=32)
def _reads_tools_variable(source: str) -> bool:
    try:
        from jinja2 import Environment, meta

        return "tools" in meta.find_undeclared_variables(Environment().parse(source))
    except Exception:  # a template jinja2 cannot parse: fall back to a text search
        return re.search(r"\btools\b", source) is not None


def tool_call_format(tokenizer: Any, tools: Any = None) -> ToolCallFormat:
    """The format this tokenizer's model writes tool calls in.

    With a tool-aware template: the parser mlx-lm picked for the tokenizer (its
    ``tool_parser`` / ``tool_call_start`` / ``tool_call_end``), or, for a plain
    transformers tokenizer, the one mlx-lm would infer from the template. Otherwise, and
    whenever the parser is mlx-lm's ``json_tools``, the lenient :data:`HERMES_FORMAT`
    that the fallback prompt asks for.
    """
    if not template_supports_tools(tokenizer, tools):
        return HERMES_FORMAT
    if not hasattr(tokenizer, "tool_parser"):  # a transformers tokenizer, not mlx-lm's wrapper
        return _inferred_format(tokenizer)
    parse = tokenizer.tool_parser
    start = getattr(tokenizer, "tool_call_start", None)
    if not callable(parse) or not isinstance(start, str):
        return HERMES_FORMAT  # mlx-lm found no parser when it loaded the model
    name = (getattr(parse, "__module__", "") or "").rsplit(".", 1)[-1]
    if name == "json_tools":
        return HERMES_FORMAT
    return ToolCallFormat(name, start, getattr(tokenizer, "tool_call_end", "") or "", parse)


def _inferred_format(tokenizer: Any) -> ToolCallFormat:
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser  # private, so guarded

        parser_type = _infer_tool_parser(tokenizer)
    except Exception:
        parser_type = None
    if parser_type is None or parser_type == "json_tools":
        return HERMES_FORMAT
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser_type}")
    return ToolCallFormat(parser_type, module.tool_call_start, module.tool_call_end, module.parse_tool_call)


# --------------------------------------------------------------------------- parsing


def parse_tool_calls(
    text: str,
    tools: Optional[Sequence[Mapping[str, Any]]] = None,
    fmt: ToolCallFormat = HERMES_FORMAT,
    *,
    allow_bare_json: bool = True,
) -> ParsedOutput:
    """Split generated ``text`` into content, tool calls and invalid tool calls.

    Calls are the spans between ``fmt.start`` and ``fmt.end`` (an unterminated last span
    is still parsed, since a stop string or a forgetful model may cut the end marker).
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


class ToolCallStreamParser:
    """Incremental :func:`parse_tool_calls` for streamed output.

    Feed it text deltas; each :meth:`feed` returns the events that are now certain:
    content deltas (``str``) and completed :class:`ToolCall` / :class:`InvalidToolCall`.
    Text that might be the beginning of a start marker, a call still being written, and
    trailing whitespace are held back until they are resolved. With tools and
    ``allow_bare_json``, an output that begins like a JSON object or code fence is held
    for as long as it still looks like JSON, since it may turn out to be a bare JSON
    call (resolved at :meth:`finish`). Call
    :meth:`finish` once at the end. Joining all content events gives exactly
    :func:`parse_tool_calls`'s ``content``.
    """

    def __init__(
        self,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        fmt: ToolCallFormat = HERMES_FORMAT,
        *,
        allow_bare_json: bool = True,
    ) -> None:
        self._tools = normalize_tools(tools)
        self._names = set(tool_names(self._tools))
        self._fmt = fmt
        self._maybe_bare = bool(self._tools) and allow_bare_json
        self._buffer = ""
        self._in_call = False
        self._pending_ws = ""
        self._after_call = False
        self._saw_call = False
        self._sent_content = False
        self._finished = False
        self._json_prefix = _JsonPrefix()
        self._json_scanned = 0  # characters of the JSON-looking output already scanned

    def feed(self, text: str) -> list[StreamEvent]:
        """Take the next text delta; return the events it completes."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buffer += text
        return self._drain()

    def finish(self) -> list[StreamEvent]:
        """End of output: resolve everything held back and return the last events."""
        if self._finished:
            return []
        self._finished = True
        events: list[StreamEvent] = []
        if self._maybe_bare and not self._in_call:
            calls = self._bare_json_calls(self._buffer)
            if calls:
                self._buffer = ""
                return calls
        self._maybe_bare = False
        events += self._drain()
        if self._in_call:
            events += self._call_events(self._buffer, terminated=False)
        else:
            events += self._content(self._buffer, before_call=False)
        self._buffer = ""
        if not self._saw_call and self._pending_ws:
            events.append(self._pending_ws)
        self._pending_ws = ""
        return events

    # -- internals

    def _drain(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while True:
            if self._in_call:
                if not self._fmt.end:
                    return events
                end = self._buffer.find(self._fmt.end)
                if end < 0:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self._fmt.end):]
                self._in_call = False
                events += self._call_events(body, terminated=True)
                continue
            if self._maybe_bare and self._could_be_bare_json(self._buffer):
                return events
            self._maybe_bare = False
            start = self._buffer.find(self._fmt.start)
            if start >= 0:
                events += self._content(self._buffer[:start], before_call=True)
                self._buffer = self._buffer[start + len(self._fmt.start):]
                self._in_call = True
                continue
            keep = _marker_prefix_len(self._buffer, self._fmt.start)
            cut = len(self._buffer) - keep
            events += self._content(self._buffer[:cut], before_call=False)
            self._buffer = self._buffer[cut:]
            return events

    def _content(self, text: str, *, before_call: bool) -> list[StreamEvent]:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
            if self._sent_content:  # text resumes after a call: keep it apart from the earlier text
                text = "\n" + text
        text = self._pending_ws + text
        self._pending_ws = ""
        if before_call:
            text = text.rstrip()
        else:
            stripped = text.rstrip()
            self._pending_ws = text[len(stripped):]
            text = stripped
        self._sent_content = self._sent_content or bool(text)
        return [text] if text else []

    def _call_events(self, body: str, *, terminated: bool) -> list[StreamEvent]:
        self._saw_call = True
        self._after_call = True
        raw = self._fmt.start + body + (self._fmt.end if terminated else "")
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
        return ToolCall(id=call_id, name=name, arguments=arguments)

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
        stripped = _strip_code_fence(text.strip())
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
        self._saw_call = True
        return calls


def _call_fields(item: Any) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """``(name, arguments JSON, error)`` of one parsed call dict."""
    if not isinstance(item, Mapping):
        return None, None, f"a tool call must be a JSON object, got {type(item).__name__}"
    function = item.get("function")
    if isinstance(function, Mapping):  # OpenAI-shaped {"function": {"name", "arguments"}}
        item = function
    name = item.get("name")
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return _str_or_none(name), arguments, f"arguments are not valid JSON: {error.msg}"
    if arguments is None:
        arguments = {}
    encoded = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(name, str) or not name:
        return None, encoded, "the tool call has no function 'name'"
    if not isinstance(arguments, Mapping):
        return name, encoded, f"arguments must be a JSON object, got {type(arguments).__name__}"
    return name, encoded, None


def _str_or_none(value: Any) -> Optional[str]:
    return value if isinstance(value, str) else None


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


__all__ = [
    "TOOL_CALL_START",
    "TOOL_CALL_END",
    "FALLBACK_TOOL_PROMPT",
    "REQUIRED_TOOL_INSTRUCTION",
    "NAMED_TOOL_INSTRUCTION",
    "ToolCall",
    "InvalidToolCall",
    "ParsedOutput",
    "StreamEvent",
    "ToolCallFormat",
    "HERMES_FORMAT",
    "new_tool_call_id",
    "normalize_tools",
    "tool_names",
    "apply_tool_choice",
    "add_system_instruction",
    "fallback_tool_prompt",
    "render_tool_call_text",
    "template_source",
    "template_supports_tools",
    "tool_call_format",
    "parse_tool_calls",
    "ToolCallStreamParser",
]
