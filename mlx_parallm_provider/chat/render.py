"""Chat messages to prompt text through the model's chat template.

Tools go to the template itself when it renders them (Qwen2.5, Llama 3.1, ...);
otherwise they are described in the system message with the fallback prompt of
:mod:`.tool_defs`, and tool calls and tool results in the history are written out as
``<tool_call>`` / ``<tool_response>`` text, so the whole conversation fits a plain
template such as SmolLM2's ChatML.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from .._validation import check_nested
from ..errors import InvalidParameterError
from .messages import normalize_messages
from .special_tokens import special_texts
from .tool_defs import fallback_tool_prompt, normalize_tools, render_tool_call_text
from .tool_formats import template_source, template_supports_tools


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Optional[Sequence[Mapping[str, Any]]] = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Optional[Mapping[str, Any]] = None,
) -> str:
    """Render ``messages`` (and ``tools``) to the prompt text the model expects.

    ``tokenizer`` is an mlx-lm ``TokenizerWrapper`` or a transformers tokenizer. The
    result already holds the template's special tokens, so tokenize it without adding
    special tokens again. A tokenizer without a chat template gets a plain
    ``"User: ...\\n\\nAssistant:"`` transcript.

    A last assistant message marked ``prefix: True`` is continued: the prompt ends with its
    text. Raises :class:`InvalidParameterError` naming the offending field for malformed
    messages or tools, non-text content (images, audio, ...), or a conversation the
    template rejects. ``chat_template_kwargs`` are more variables for the template (vLLM's
    field, e.g. ``{"enable_thinking": False}``), checked by :func:`check_template_kwargs`.
    """
    conversation = normalize_messages(messages)
    continue_final = bool(conversation[-1].get("prefix"))
    variables = check_template_kwargs(tokenizer, chat_template_kwargs)
    return render_conversation(tokenizer, conversation, normalize_tools(tools), add_generation_prompt, continue_final=continue_final,
                               template_kwargs=variables)


#: ``apply_chat_template``'s own arguments, and what the renderer sets: not template variables.
_RESERVED_TEMPLATE_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
))
#: How deep a template variable's value may nest dicts and lists.
_MAX_TEMPLATE_KWARGS_DEPTH = 16


def check_template_kwargs(tokenizer: Any, kwargs: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` (vLLM's field: more variables for the chat template, such as
    Qwen3's ``enable_thinking``) as a dict, checked: names as keys, none of the template call's
    own arguments, no deeper than 16 levels, and no text holding a special token of the
    tokenizer (a variable cannot add control tokens, as message text cannot). Raises
    :class:`InvalidParameterError` naming the variable."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise InvalidParameterError("chat_template_kwargs", f"must be a dict of template variables, got {type(kwargs).__name__}")
    check_nested("chat_template_kwargs", kwargs, _MAX_TEMPLATE_KWARGS_DEPTH)
    specials = special_texts(tokenizer)
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidParameterError("chat_template_kwargs", f"keys must be variable names, got {key!r}")
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise InvalidParameterError(f"chat_template_kwargs.{key}", "is set from the request itself, not as a template variable")
        for text in _texts(value):
            found = next((t for t in specials if t in text), None)
            if found is not None:
                raise InvalidParameterError(
                    f"chat_template_kwargs.{key}", f"holds the special token {found!r}: template variables cannot add control tokens"
                )
    return dict(kwargs)


def _texts(value: Any) -> list[str]:
    """Every string in ``value`` (keys too), which :func:`check_nested` has bounded."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [t for k, v in value.items() for t in (*_texts(k), *_texts(v))]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _texts(v)]
    return []


def render_conversation(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    tools: Optional[list[dict[str, Any]]],
    add_generation_prompt: bool = True,
    *,
    renders_tools: Optional[bool] = None,
    continue_final: bool = False,
    template_kwargs: Optional[Mapping[str, Any]] = None,
) -> str:
    """:func:`render_chat` for messages and tools that are already normalised.

    ``renders_tools`` is whether the template renders tools itself; a caller that
    already decided it (:func:`~.prepare.prepare_chat`) passes it, so the prompt and the
    tool-call parser always agree on the format. With ``continue_final`` the prompt ends
    inside the last (assistant) message, right after its text, so the answer continues it
    (what transformers' ``continue_final_message`` renders). ``template_kwargs``: checked
    variables for the template (:func:`check_template_kwargs`).
    """
    variables = dict(template_kwargs or {})
    if continue_final:
        return _continuing(tokenizer, conversation, tools, renders_tools, variables)
    has_template = template_source(tokenizer, tools) is not None or getattr(
        tokenizer, "_chat_template", None
    ) is not None
    if not has_template:
        return _render_transcript(_for_plain_template(conversation, tools), add_generation_prompt)
    if renders_tools is None:
        renders_tools = template_supports_tools(tokenizer, tools)
    if renders_tools:
        return _apply_template(tokenizer, _for_tool_template(conversation), tools, add_generation_prompt, variables)
    return _apply_template(tokenizer, _for_plain_template(conversation, tools), None, add_generation_prompt, variables)


def _continuing(tokenizer: Any, conversation: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]],
                renders_tools: Optional[bool], variables: dict[str, Any]) -> str:
    """The prompt that ends with the final message's text: the conversation rendered with a
    marker for that text, cut at the marker, the text put back. A template that trims
    message text trims it here too."""
    *history, final = conversation
    text = final["content"]
    if not text:  # nothing written yet: a new answer
        return render_conversation(tokenizer, history, tools, True, renders_tools=renders_tools, template_kwargs=variables)
    marker = f"MLXPARALLMCONTINUE{secrets.token_hex(8)}X"
    rendered = render_conversation(tokenizer, [*history, {**final, "content": f" {marker} "}], tools, False, renders_tools=renders_tools,
                                   template_kwargs=variables)
    at = rendered.rfind(marker)
    if at < 0:
        raise InvalidParameterError(
            "messages", "the model's chat template does not render the final assistant message's text, so an answer cannot continue it"
        )
    if rendered.startswith(" ", at + len(marker)):  # the template keeps the text as it is
        return rendered[: at - 1] + text
    return rendered[:at] + text.strip()


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
    variables: dict[str, Any],
) -> str:
    try:
        return _call_template(tokenizer, conversation, tools, add_generation_prompt, variables)
    except Exception as error:
        if not (conversation and conversation[0]["role"] == "system"):
            raise _template_error(error) from error
        # Some templates (Gemma's) reject a system role: fold it into the first user turn.
        try:
            return _call_template(tokenizer, _system_into_user(conversation), tools, add_generation_prompt, variables)
        except Exception:
            raise _template_error(error) from error


def _call_template(tokenizer: Any, conversation: list[dict[str, Any]], tools: Any, add_generation_prompt: bool,
                   variables: dict[str, Any]) -> str:
    kwargs: dict[str, Any] = {**variables, "add_generation_prompt": add_generation_prompt, "tokenize": False}
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
