"""Tool definitions in, tool-call results out: the data both sides of tool calling share.

:func:`normalize_tools` accepts OpenAI tool dicts (``{"type": "function", "function":
{...}}``, which is also what LangChain's ``convert_to_openai_tool`` returns) and bare
function dicts; :func:`apply_tool_choice` turns ``tool_choice`` into the tools to show the
model plus an optional instruction. For a template without tool support the tools are
described in the system message by :func:`fallback_tool_prompt`, which asks for the
Hermes/Qwen format::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from .._validation import check_nested, check_text
from ..engine.grammar.limits import LIMITS
from ..errors import InvalidParameterError

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


#: What the tool-call parsers yield: a content delta or a finished call.
StreamEvent = Union[str, ToolCall, InvalidToolCall]


def new_tool_call_id() -> str:
    """A fresh OpenAI-style call id, ``call_<24 hex digits>``."""
    return f"call_{uuid.uuid4().hex[:24]}"


def decode_arguments(arguments: Any) -> tuple[Any, Optional[str]]:
    """Tool-call arguments as a value: ``(decoded, None)``, or ``(the text, error)`` when
    a JSON string does not parse. Empty text and ``None`` are ``{}``."""
    if arguments is None:
        return {}, None
    if not isinstance(arguments, str):
        return arguments, None
    if not arguments.strip():
        return {}, None
    try:
        return json.loads(arguments), None
    except json.JSONDecodeError as error:
        return arguments, f"arguments are not valid JSON: {error.msg}"
    except RecursionError:  # C's json.loads is bounded by the recursion limit
        return arguments, "arguments nest too deep to decode"


# --------------------------------------------------------------------------- definitions


def normalize_tools(tools: Optional[Sequence[Mapping[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    """Validate tool definitions and return them as OpenAI ``{"type": "function", ...}`` dicts.

    Accepts OpenAI tools and bare function dicts (``{"name", "description",
    "parameters"}``, the legacy ``functions`` form). Returns ``None`` for ``None`` or an
    empty list. Raises :class:`InvalidParameterError` naming the bad field.
    """
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidParameterError("tools", f"must be a list of tool definitions, got {type(tools).__name__}")
    if not tools:
        return None
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
    check_text(f"{where}.name", name)
    check_nested(f"{where}.parameters", parameters, LIMITS.max_depth, "GrammarLimits.max_depth")
    out: dict[str, Any] = {"name": name}
    if function.get("description"):
        out["description"] = str(function["description"])
        check_text(f"{where}.description", out["description"])
    out["parameters"] = dict(parameters)
    if "strict" in function:
        out["strict"] = function["strict"]
    return {"type": "function", "function": out}


def tool_names(tools: Optional[Sequence[Mapping[str, Any]]]) -> list[str]:
    """The function names of tools (OpenAI tool dicts or bare function dicts)."""
    return [(t.get("function") or t)["name"] for t in tools or []]


def apply_tool_choice(
    tools: Optional[Sequence[Mapping[str, Any]]], tool_choice: Any = None
) -> tuple[Optional[list[dict[str, Any]]], Optional[str]]:
    """Resolve ``tool_choice`` to ``(tools to show the model, instruction or None)``.

    The choices are prompted here; for ``"required"`` and a named function the chat layer
    also constrains decoding to the tool-call format (:mod:`.constraints`):

    * ``None`` / ``"auto"``: all tools, no instruction; the model decides.
    * ``"none"`` (or ``False``): the tools are dropped from the prompt, so the model
      answers in text. Tool calls already in the history still render.
    * ``"required"`` (or ``"any"``, ``True``): all tools plus
      :data:`REQUIRED_TOOL_INSTRUCTION` in the system message.
    * a named function (``{"type": "function", "function": {"name": ...}}``, or just the
      name): only that tool is shown, plus :data:`NAMED_TOOL_INSTRUCTION`.

    The returned tools are normalised (:func:`normalize_tools`). Raises
    :class:`InvalidParameterError` for an unknown choice or a named function that is
    not among the tools.
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
    """The system-message text describing ``tools`` (as :func:`normalize_tools` returns
    them) for a template without tool support."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return FALLBACK_TOOL_PROMPT.format(tools=lines)


def render_tool_call_text(name: str, arguments: Any) -> str:
    """One call in the Hermes format, as an assistant turn in the history shows it."""
    arguments, _ = decode_arguments(arguments) if isinstance(arguments, str) else (arguments, None)
    payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{payload}\n{TOOL_CALL_END}"
