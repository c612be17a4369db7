"""Tool-call formats: how a model writes its calls, and whether its template renders tools.

A :class:`ToolCallFormat` is a start marker, an end marker and a body parser. The
lenient :data:`HERMES_FORMAT` is what the fallback tool prompt asks for; a model whose
chat template renders tools natively writes in the format of the parser mlx-lm picked
for its tokenizer (one of ``mlx_lm.tool_parsers``).
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from .. import mlx_lm_compat
from .tool_defs import TOOL_CALL_END, TOOL_CALL_START

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
    text = strip_code_fence(body.strip())
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


def strip_code_fence(text: str) -> str:
    """The text inside a Markdown code fence that wraps all of ``text`` (else ``text``)."""
    match = _FENCE.match(text)
    return match.group(1).strip() if match else text


HERMES_FORMAT = ToolCallFormat("hermes", TOOL_CALL_START, TOOL_CALL_END, _parse_hermes)


# --------------------------------------------------------------------------- templates


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


def tool_call_format(tokenizer: Any, tools: Any = None, *, renders_tools: Optional[bool] = None) -> ToolCallFormat:
    """The format this tokenizer's model writes tool calls in.

    With a tool-aware template (``renders_tools``, decided by
    :func:`template_supports_tools` when not given): the parser mlx-lm picked for the
    tokenizer (its ``tool_parser`` / ``tool_call_start`` / ``tool_call_end``), or, for a
    plain transformers tokenizer, the one mlx-lm would infer from the template.
    Otherwise, and whenever the parser is mlx-lm's ``json_tools``, the lenient
    :data:`HERMES_FORMAT` that the fallback prompt asks for.
    """
    if renders_tools is None:
        renders_tools = template_supports_tools(tokenizer, tools)
    if not renders_tools:
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
    parser_type = mlx_lm_compat.infer_tool_parser(tokenizer)
    if parser_type is None or parser_type == "json_tools":
        return HERMES_FORMAT
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser_type}")
    return ToolCallFormat(parser_type, module.tool_call_start, module.tool_call_end, module.parse_tool_call)
