"""One chat request to one prepared prompt, with every decision about it made once.

:func:`prepare_chat` validates the messages, tools, ``tool_choice``, ``response_format``
and ``parallel_tool_calls`` of a call, decides whether the template renders the tools
itself, renders the prompt accordingly, and records the tool-call format that prompt
asks for, so :mod:`.output` parses exactly what the prompt requested.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from .._validation import check_nested
from ..engine import Constraint
from ..engine.grammar.limits import LIMITS
from ..errors import InvalidParameterError
from .constraints import response_format_constraint, tool_call_constraint
from .messages import normalize_messages
from .reasoning import opens_thinking, thinking_tags, thinking_variables
from .render import check_template_kwargs, render_conversation
from .special_tokens import guard_conversation, is_one_token
from .structured_outputs import structured_outputs_constraint
from .tool_defs import TOOL_CALL_START, add_system_instruction, apply_tool_choice
from .tool_formats import HERMES_FORMAT, ToolCallFormat, template_supports_tools, tool_call_format

JSON_OBJECT_INSTRUCTION = "Answer with one JSON object and nothing else: no text before or after it."
JSON_SCHEMA_INSTRUCTION = (
    "Answer with one JSON object that matches this JSON schema, and nothing else:\n{schema}"
)


@dataclass(frozen=True)
class PreparedPrompt:
    """What to submit to the engine, and how to read what comes back.

    ``prompt`` is text that already holds the template's special tokens, or, when a
    message's text holds special tokens of its own, the token ids with that text as
    plain text (:mod:`.special_tokens`). ``tools`` are
    the (normalised) tools the model was shown, ``None`` if none; ``tool_format`` is the
    format the prompt asked for; with ``parallel_tool_calls=False`` only the first
    valid call of an answer is kept. ``constraint`` is what decoding must follow (JSON
    output, a forced tool call), to be put in the request's ``SamplingParams``.
    ``reasoning``: how the answer's thinking is split from it (:mod:`.reasoning`): None for
    not at all, True when the prompt opened the thinking block, False when the answer may;
    ``thinking_tags``, then, the tags' token ids (to count the thinking's tokens).
    """

    prompt: Union[str, list[int]]
    tools: Optional[list[dict[str, Any]]] = None
    tool_format: ToolCallFormat = HERMES_FORMAT
    parallel_tool_calls: bool = True
    constraint: Optional[Constraint] = None
    reasoning: Optional[bool] = None
    thinking_tags: Optional[tuple[int, int]] = None


def prepare_text(prompt: Any) -> PreparedPrompt:
    """A raw completion prompt (no template, no tools): a string or a list of token ids."""
    if not isinstance(prompt, (str, list)):
        raise InvalidParameterError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
    return PreparedPrompt(prompt)


def prepare_chat(
    tokenizer: Any,
    messages: Sequence[Any],
    *,
    tools: Optional[Sequence[Mapping[str, Any]]] = None,
    tool_choice: Any = None,
    response_format: Any = None,
    parallel_tool_calls: Optional[bool] = None,
    continue_final_message: bool = False,
    structured_outputs: Any = None,
    chat_template_kwargs: Any = None,
    reasoning_effort: Any = None,
    thinking: Any = None,
) -> PreparedPrompt:
    """Validate one chat request and render its prompt.

    ``tools`` are OpenAI tool dicts (or bare function dicts); ``tool_choice`` and
    ``response_format`` take OpenAI's values and are honoured by prompting: a required
    or named tool and JSON output become instructions in the system message (see
    :func:`~.tool_defs.apply_tool_choice` and :func:`response_format_instruction`).
    With ``continue_final_message`` (vLLM's name), or a last message marked ``prefix:
    True`` (LiteLLM's), the answer continues the last message, an assistant's: the prompt
    ends with its text and the answer is what comes after it. ``structured_outputs`` is
    vLLM's field (``{"choice": [...]}``, ``regex``, ``json``, ``grammar``, ``json_object``;
    :mod:`.structured_outputs`): decoding follows it, without a prompt instruction; it
    cannot be combined with ``response_format`` or tools the grammar would constrain.
    ``chat_template_kwargs`` (vLLM's field) are more variables for the chat template
    (:func:`~.render.check_template_kwargs`); ``reasoning_effort`` or ``thinking`` turn a
    reasoning model's thinking on or off through its template (:func:`~.reasoning.thinking_variables`;
    ``chat_template_kwargs`` setting the same variable win).
    Raises :class:`InvalidParameterError` naming the field for any malformed input.
    """
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidParameterError("parallel_tool_calls", f"must be true or false, got {parallel_tool_calls!r}")
    if not isinstance(continue_final_message, bool):
        raise InvalidParameterError("continue_final_message", f"must be true or false, got {continue_final_message!r}")
    shown, tool_instruction = apply_tool_choice(tools, tool_choice)
    instructions = [tool_instruction, response_format_instruction(response_format)]
    structured = structured_outputs_constraint(structured_outputs)
    variables = {**thinking_variables(reasoning_effort, thinking), **check_template_kwargs(tokenizer, chat_template_kwargs)}
    conversation = normalize_messages(messages)
    continuing = continue_final_message or bool(conversation[-1].get("prefix"))
    if continuing:
        _check_continuable(conversation[-1], constrained=tool_instruction is not None or instructions[1] is not None or structured is not None)
    for instruction in instructions:
        conversation = add_system_instruction(conversation, instruction)
    renders_tools = bool(shown) and template_supports_tools(tokenizer, shown)
    conversation, guarded = guard_conversation(tokenizer, conversation)
    rendered = render_conversation(tokenizer, conversation, shown, renders_tools=renders_tools, continue_final=continuing,
                                   template_kwargs=variables)
    prompt = rendered if guarded is None else guarded.encode(rendered)
    fmt = tool_call_format(tokenizer, shown, renders_tools=renders_tools) if shown else HERMES_FORMAT
    parallel = parallel_tool_calls is not False
    forced = tool_instruction is not None  # "required" or a named function
    named = forced and _choice_is_named(tool_choice)  # a named function is called once
    special_start = is_one_token(tokenizer, TOOL_CALL_START)
    answer = response_format_constraint(response_format)
    constraint = tool_call_constraint(shown, forced, fmt, parallel and not named, special_start, answer) or answer
    if structured is not None:
        if constraint is not None:
            raise InvalidParameterError(
                "structured_outputs", "cannot be combined with response_format or with tools in the Hermes format (their calls are constrained)"
            )
        constraint = structured
    # Thinking needs free text: none under JSON output, forced calls or structured_outputs; the
    # grammar of optional tool calls (tool_choice "auto") leaves text free until a call opens.
    free_text = constraint is None or (not forced and answer is None and structured is None)
    tags = thinking_tags(tokenizer) if free_text else None
    return PreparedPrompt(prompt=prompt, tools=shown, tool_format=fmt, parallel_tool_calls=parallel, constraint=constraint,
                          reasoning=opens_thinking(rendered) if tags is not None else None, thinking_tags=tags)


def _check_continuable(final: Mapping[str, Any], constrained: bool) -> None:
    if final["role"] != "assistant" or final.get("tool_calls"):
        raise InvalidParameterError(
            "continue_final_message", f"needs the last message to be an assistant's text to continue, got a {final['role']} message"
            + (" with tool calls" if final.get("tool_calls") else "")
        )
    if constrained:  # the grammar would start at the answer's first token, not after the prefix
        raise InvalidParameterError(
            "continue_final_message",
            "cannot be combined with response_format, structured_outputs or a forced tool call (tool_choice 'required' or a named tool)",
        )


def _choice_is_named(tool_choice: Any) -> bool:
    return isinstance(tool_choice, Mapping) or (isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required", "any"))


def response_format_instruction(response_format: Any) -> Optional[str]:
    """The system instruction for an OpenAI ``response_format`` (None for text).

    ``{"type": "json_object"}`` asks for one JSON object; ``{"type": "json_schema",
    "json_schema": {"name", "schema"}}`` puts the schema in the instruction. Decoding is
    constrained to match as well (:func:`~.constraints.response_format_constraint`).
    ``{"type": "json_object", "schema": {...}}`` (JSON mode with a schema, as Fireworks and
    Together take it) is prompted as JSON mode, the schema left to the caller's own
    prompt, and constrained to the schema.
    """
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        if schema is not None and not isinstance(schema, Mapping):
            raise InvalidParameterError("response_format.schema", f"must be a JSON schema dict, got {schema!r}")
        if schema is not None:
            check_nested("response_format.schema", schema, LIMITS.max_depth, "GrammarLimits.max_depth")
        return JSON_OBJECT_INSTRUCTION
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", spec) if isinstance(spec, Mapping) else None
        if isinstance(schema, Mapping):
            check_nested("response_format.json_schema", schema, LIMITS.max_depth, "GrammarLimits.max_depth")
            return JSON_SCHEMA_INSTRUCTION.format(schema=json.dumps(schema, ensure_ascii=False))
    raise InvalidParameterError(
        "response_format",
        "must be {'type': 'text'}, {'type': 'json_object'} (with an optional 'schema') or "
        f"{{'type': 'json_schema', 'json_schema': {{'name', 'schema'}}}}, got {response_format!r}",
    )
