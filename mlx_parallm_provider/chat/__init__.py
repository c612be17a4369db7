"""The engine-neutral chat layer both front doors sit on.

* :func:`prepare_chat` turns messages, tools, ``tool_choice``, ``response_format`` and
  ``parallel_tool_calls`` into one :class:`PreparedPrompt` (the prompt text and the
  tool-call format it asks for), deciding everything once.
* :func:`read_completion` and :class:`ChatStreamReader` turn engine output into content,
  tool calls, invalid tool calls and the final event.

Tool definitions (:mod:`.tool_defs`), formats (:mod:`.tool_formats`) and parsing
(:mod:`.tool_parser`) live in modules of their own; messages are validated in
:mod:`.messages` and rendered in :mod:`.render`. The engine never imports this package.
"""

from .messages import content_text, normalize_messages
from .output import ChatEvent, ChatOutput, ChatStreamReader, ContentEvent, FinalEvent, InvalidToolCallEvent, ReasoningEvent, ToolCallEvent, read_completion
from .prepare import JSON_OBJECT_INSTRUCTION, JSON_SCHEMA_INSTRUCTION, PreparedPrompt, prepare_chat, prepare_text, response_format_instruction
from .render import render_chat
from .structured_outputs import structured_outputs_constraint
from .tool_defs import (
    FALLBACK_TOOL_PROMPT,
    NAMED_TOOL_INSTRUCTION,
    REQUIRED_TOOL_INSTRUCTION,
    InvalidToolCall,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    add_system_instruction,
    apply_tool_choice,
    fallback_tool_prompt,
    new_tool_call_id,
    normalize_tools,
    render_tool_call_text,
    tool_names,
)
from .tool_formats import HERMES_FORMAT, ToolCallFormat, template_supports_tools, tool_call_format
from .tool_parser import ToolCallStreamParser, parse_tool_calls

__all__ = [
    "FALLBACK_TOOL_PROMPT",
    "HERMES_FORMAT",
    "JSON_OBJECT_INSTRUCTION",
    "JSON_SCHEMA_INSTRUCTION",
    "NAMED_TOOL_INSTRUCTION",
    "REQUIRED_TOOL_INSTRUCTION",
    "ChatEvent",
    "ChatOutput",
    "ChatStreamReader",
    "ContentEvent",
    "FinalEvent",
    "InvalidToolCall",
    "InvalidToolCallEvent",
    "ParsedOutput",
    "PreparedPrompt",
    "ReasoningEvent",
    "StreamEvent",
    "ToolCall",
    "ToolCallEvent",
    "ToolCallFormat",
    "ToolCallStreamParser",
    "add_system_instruction",
    "apply_tool_choice",
    "content_text",
    "fallback_tool_prompt",
    "new_tool_call_id",
    "normalize_messages",
    "normalize_tools",
    "parse_tool_calls",
    "prepare_chat",
    "prepare_text",
    "read_completion",
    "render_chat",
    "render_tool_call_text",
    "response_format_instruction",
    "structured_outputs_constraint",
    "template_supports_tools",
    "tool_call_format",
    "tool_names",
]
