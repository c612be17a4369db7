"""Chat messages to prompt text.

:func:`render_chat` takes OpenAI-style messages (what LiteLLM passes, and what the
LangChain adapter converts to), validates and normalises them, and renders them through
the model's chat template. Tools go to the template itself when it renders them
(Qwen2.5, Llama 3.1, ...); otherwise they are described in the system message with the
fallback prompt of :mod:`mlx_parallm_provider.tools`, and tool calls and tool results in
the history are written out as ``<tool_call>`` / ``<tool_response>`` text, so the whole
conversation fits a plain template such as SmolLM2's ChatML.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from .errors import InvalidParameterError
from .tools import (
    fallback_tool_prompt,
    new_tool_call_id,
    normalize_tools,
    render_tool_call_text,
    template_source,
    template_supports_tools,
)

_ROLE_ALIASES = {"developer": "system", "function": "tool"}
_ROLES = ("system", "user", "assistant", "tool")
_TEXT_PART_TYPES = ("text", "input_text", "output_text")


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Optional[Sequence[Mapping[str, Any]]] = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render ``messages`` (and ``tools``) to the prompt text the model expects.

    ``tokenizer`` is an mlx-lm ``TokenizerWrapper`` or a transformers tokenizer. The
    result already holds the template's special tokens, so tokenize it without adding
    special tokens again. A tokenizer without a chat template gets a plain
    ``"User: ...\\n\\nAssistant:"`` transcript.

    Raises :class:`InvalidParameterError` naming the offending field for malformed
    messages or tools, non-text content (images, audio, ...), or a conversation the
    template rejects.
    """
    conversation = normalize_messages(messages)
    tools = normalize_tools(tools)
    has_template = template_source(tokenizer, tools) is not None or getattr(
        tokenizer, "_chat_template", None
    ) is not None
    if not has_template:
        return _render_transcript(_for_plain_template(conversation, tools), add_generation_prompt)
    if template_supports_tools(tokenizer, tools):
        return _apply_template(tokenizer, _for_tool_template(conversation), tools, add_generation_prompt)
    return _apply_template(tokenizer, _for_plain_template(conversation, tools), None, add_generation_prompt)


# --------------------------------------------------------------------------- normalising


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate OpenAI-style messages and return plain dicts.

    Each result has ``role`` (one of system/user/assistant/tool; ``developer`` becomes
    system, the legacy ``function`` role becomes tool) and ``content`` as a string.
    Assistant messages keep ``tool_calls`` (arguments decoded to dicts, as chat templates
    expect); tool messages keep ``tool_call_id`` and get ``name`` from the matching call
    when they lack one.
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
        if normalized["role"] == "tool" and "name" not in normalized:
            name = call_names.get(normalized.get("tool_call_id", ""))
            if name:
                normalized["name"] = name
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
    role = message.get("role")
    role = _ROLE_ALIASES.get(role, role)
    if role not in _ROLES:
        raise InvalidParameterError(
            f"{where}.role", f"must be one of system, user, assistant, tool; got {message.get('role')!r}"
        )
    out: dict[str, Any] = {"role": role, "content": content_text(message.get("content"), f"{where}.content")}
    if role == "assistant":
        calls = _assistant_tool_calls(message, where)
        if calls:
            out["tool_calls"] = calls
    elif role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None:
            out["tool_call_id"] = str(call_id)
    if isinstance(message.get("name"), str) and message["name"] and role in ("tool", "user", "system"):
        out["name"] = message["name"]
    return out


def content_text(content: Any, where: str = "content") -> str:
    """A message's content as text: a string, ``None``, or a list of text parts.

    Raises :class:`InvalidParameterError` for images and every other non-text part.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or isinstance(content, (bytes, Mapping)):
        raise InvalidParameterError(where, f"must be a string or a list of text parts, got {type(content).__name__}")
    return "".join(_part_text(part, f"{where}[{i}]") for i, part in enumerate(content))


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
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
    arguments = function.get("arguments", function.get("args", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # keep the text: a malformed call from the past still renders
    call_id = call.get("id")
    return {
        "id": call_id if isinstance(call_id, str) and call_id else new_tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


# --------------------------------------------------------------------------- conversations


def _for_tool_template(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A template that renders tools also renders tool calls and results: pass as is."""
    return conversation


def _for_plain_template(conversation: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rewrite tool use as text for a template that knows only system/user/assistant.

    The tool prompt joins the leading system message; assistant tool calls become
    ``<tool_call>`` blocks; consecutive tool results become one user message of
    ``<tool_response>`` blocks (as Qwen2.5's template renders them).
    """
    out: list[dict[str, Any]] = []
    for message in conversation:
        role, content = message["role"], message["content"]
        if role == "assistant" and message.get("tool_calls"):
            blocks = [render_tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [content, *blocks]))})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for message in out:
        message.pop("_tool_results", None)
    return _with_tool_prompt(out, tools)


def _with_tool_prompt(conversation: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    if not tools:
        return conversation
    prompt = fallback_tool_prompt(tools)
    if conversation and conversation[0]["role"] == "system":
        system = conversation[0]["content"]
        first = {"role": "system", "content": f"{system}\n\n{prompt}" if system else prompt}
        return [first, *conversation[1:]]
    return [{"role": "system", "content": prompt}, *conversation]


# --------------------------------------------------------------------------- rendering


def _apply_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    tools: Optional[list[dict[str, Any]]],
    add_generation_prompt: bool,
) -> str:
    try:
        return _call_template(tokenizer, conversation, tools, add_generation_prompt)
    except Exception as error:
        if not (conversation and conversation[0]["role"] == "system"):
            raise _template_error(error) from error
        # Some templates (Gemma's) reject a system role: fold it into the first user turn.
        try:
            return _call_template(tokenizer, _system_into_user(conversation), tools, add_generation_prompt)
        except Exception:
            raise _template_error(error) from error


def _call_template(tokenizer: Any, conversation: list[dict[str, Any]], tools: Any, add_generation_prompt: bool) -> str:
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "tokenize": False}
    if tools:
        kwargs["tools"] = tools
    text = tokenizer.apply_chat_template(conversation, **kwargs)
    if not isinstance(text, str):  # some tokenizers return a one-element batch
        text = text[0] if isinstance(text, list) and text and isinstance(text[0], str) else str(text)
    return text


def _system_into_user(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system, rest = conversation[0]["content"], [dict(m) for m in conversation[1:]]
    for message in rest:
        if message["role"] == "user":
            message["content"] = f"{system}\n\n{message['content']}"
            return rest
    return [{"role": "user", "content": system}, *rest]


def _template_error(error: Exception) -> InvalidParameterError:
    return InvalidParameterError(
        "messages",
        f"the model's chat template rejected this conversation ({type(error).__name__}: {error}); "
        "check the roles and their order (many templates want user/assistant turns to alternate)",
    )


def _render_transcript(conversation: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """For a model without a chat template: ``Role: content`` paragraphs."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in conversation]
    if add_generation_prompt:
        lines.append("Assistant:")
    return "\n\n".join(lines)


__all__ = ["render_chat", "normalize_messages", "content_text"]
