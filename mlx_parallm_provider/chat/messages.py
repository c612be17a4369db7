"""OpenAI-style chat messages: validated and normalised to plain dicts.

What LiteLLM passes and what the LangChain adapter converts to. Every mistake is an
:class:`~mlx_parallm_provider.errors.InvalidParameterError` naming the field, text that is not
valid Unicode (a lone surrogate) and tool-call arguments nested more than
``GrammarLimits.max_depth`` levels included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._validation import check_json_text_depth, check_nested, check_text
from ..engine.grammar.limits import LIMITS
from ..errors import InvalidParameterError
from .tool_defs import decode_arguments, new_tool_call_id

_ROLE_ALIASES = {"developer": "system", "function": "tool"}
_ROLES = ("system", "user", "assistant", "tool")
_TEXT_PART_TYPES = ("text", "input_text", "output_text")
_DEPTH_LIMIT = "GrammarLimits.max_depth"



def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate OpenAI-style messages and return plain dicts.

    Each result has ``role`` (one of system/user/assistant/tool; ``developer`` becomes
    system, the legacy ``function`` role becomes tool) and ``content`` as a string.
    Assistant messages keep ``tool_calls`` (arguments decoded to dicts, as chat templates
    expect) and ``prefix: True`` (LiteLLM's mark of a final assistant message the answer
    continues; only the last message may carry it); tool messages keep ``tool_call_id``,
    which must answer a call of an earlier assistant message, and get ``name`` from that
    call when they lack one.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidParameterError("messages", "must be a list of message dicts")
    if not messages:
        raise InvalidParameterError("messages", "must hold at least one message")
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for index, message in enumerate(messages):
        normalized = _normalize_message(index, message)
        for call in normalized.get("tool_calls", []):
            call_names[call["id"]] = call["function"]["name"]
        call_id = normalized.get("tool_call_id")
        if call_id is not None and call_id not in call_names:
            known = f"the earlier calls are {sorted(call_names)}" if call_names else "no earlier assistant message has tool calls"
            raise InvalidParameterError(
                f"messages[{index}].tool_call_id", f"{call_id!r} answers no earlier tool call ({known})"
            )
        if normalized["role"] == "tool" and "name" not in normalized and call_id is not None:
            normalized["name"] = call_names[call_id]
        if normalized.get("prefix") and index != len(messages) - 1:
            raise InvalidParameterError(f"messages[{index}].prefix", "only the last message can be a prefix for the answer to continue")
        out.append(normalized)
    return out


def _as_mapping(value: Any) -> Any:
    """A pydantic message object (LiteLLM's ``Message``, OpenAI SDK types) as a dict."""
    if isinstance(value, Mapping):
        return value
    dump = getattr(value, "model_dump", None)
    return dump() if callable(dump) else value


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    message = _as_mapping(message)
    if not isinstance(message, Mapping):
        raise InvalidParameterError(where, f"must be a dict with 'role' and 'content', got {type(message).__name__}")
    if message.get("role") is None:
        raise InvalidParameterError(f"{where}.role", "is missing; give every message one of system, user, assistant, tool")
    role = message["role"]
    role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    if role not in _ROLES:
        raise InvalidParameterError(
            f"{where}.role", f"must be one of system, user, assistant, tool; got {message.get('role')!r}"
        )
    out: dict[str, Any] = {"role": role, "content": content_text(message.get("content"), f"{where}.content")}
    prefix = message.get("prefix")
    if prefix is not None and not isinstance(prefix, bool):
        raise InvalidParameterError(f"{where}.prefix", f"must be true or false, got {prefix!r}")
    if prefix and role != "assistant":
        raise InvalidParameterError(f"{where}.prefix", f"marks an assistant message for the answer to continue; this is a {role} message")
    if role == "assistant":
        calls = _assistant_tool_calls(message, where)
        if calls:
            out["tool_calls"] = calls
        if prefix:
            out["prefix"] = True
    elif role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None:
            out["tool_call_id"] = str(call_id)
    if isinstance(message.get("name"), str) and message["name"] and role in ("tool", "user", "system"):
        check_text(f"{where}.name", message["name"])
        out["name"] = message["name"]
    return out


def content_text(content: Any, where: str = "content") -> str:
    """A message's content as text: a string, ``None``, or a list of text parts.

    Raises :class:`InvalidParameterError` for images and every other non-text part.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        check_text(where, content)
        return content
    if not isinstance(content, Sequence) or isinstance(content, (bytes, Mapping)):
        raise InvalidParameterError(where, f"must be a string or a list of text parts, got {type(content).__name__}")
    return "".join(_part_text(part, f"{where}[{i}]") for i, part in enumerate(content))


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        check_text(where, part)
        return part
    if not isinstance(part, Mapping):
        raise InvalidParameterError(where, f"must be a dict like {{'type': 'text', 'text': ...}}, got {type(part).__name__}")
    kind = part.get("type")
    if kind not in _TEXT_PART_TYPES:
        raise InvalidParameterError(
            where,
            f"content parts of type {kind!r} are not supported: this provider serves text-only "
            "models, so send only {'type': 'text'} parts",
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidParameterError(f"{where}.text", "must be a string")
    check_text(f"{where}.text", text)
    return text


def _assistant_tool_calls(message: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    calls = message.get("tool_calls") or []
    if message.get("function_call"):  # the legacy single-call form
        calls = [*calls, {"type": "function", "function": message["function_call"]}]
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes, Mapping)):
        raise InvalidParameterError(f"{where}.tool_calls", "must be a list")
    return [_normalize_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)]


def _normalize_tool_call(call: Any, where: str) -> dict[str, Any]:
    call = _as_mapping(call)
    if not isinstance(call, Mapping):
        raise InvalidParameterError(where, "must be a dict like {'id', 'type': 'function', 'function': {...}}")
    function = call.get("function", call)  # LangChain-style {"name", "args", "id"} also works
    if not isinstance(function, Mapping):
        raise InvalidParameterError(f"{where}.function", "must be a dict with 'name' and 'arguments'")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidParameterError(f"{where}.function.name", "must be a non-empty string")
    check_text(f"{where}.function.name", name)
    arguments = function.get("arguments", function.get("args", {}))
    if isinstance(arguments, str):  # depth read before parsing: json.loads recurses
        check_json_text_depth(f"{where}.function.arguments", arguments, LIMITS.max_depth, _DEPTH_LIMIT)
    arguments, _ = decode_arguments(arguments)  # a malformed call from the past keeps its text
    check_nested(f"{where}.function.arguments", arguments, LIMITS.max_depth, _DEPTH_LIMIT)
    call_id = call.get("id")
    return {
        "id": call_id if isinstance(call_id, str) and call_id else new_tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
