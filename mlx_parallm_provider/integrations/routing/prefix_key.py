"""The part of a chat request that requests sharing a KV prefix have in common.

Requests whose rendered prompts start the same way (one agent's system prompt and tool
schemas, turn 2 of a conversation repeating turn 1) should meet on one replica. The key is
built from what the chat template renders first: the tool schemas and the leading system
(or developer) messages when there are any, else the messages in order; cut to
``max_chars`` characters, since only a bounded prefix is worth matching.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Optional

SYSTEM_ROLES = ("system", "developer")


def message_text(message: Mapping[str, Any]) -> str:
    """A message's role and text content (text parts of a list content joined)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content)
    return f"<{message.get('role', '')}>{'' if content is None else content}"


def prefix_key(
    messages: Optional[Sequence[Any]],
    tools: Optional[Sequence[Any]] = None,
    max_chars: int = 1024,
    mode: str = "auto",
) -> Optional[str]:
    """The routing key of a request, or None when it has no text to key on.

    Args:
        messages: OpenAI chat messages (dicts).
        tools: OpenAI tool definitions, rendered before the messages by chat templates.
        max_chars: characters of the key kept (the first ones).
        mode: ``"auto"``: tools + leading system messages when there are any, else every
            message; ``"messages"``: tools + every message (the first ``max_chars`` of the
            whole rendered conversation); ``"system"``: tools + leading system messages only
            (None without them).
    """
    if mode not in ("auto", "messages", "system"):
        raise ValueError(f"mode must be 'auto', 'messages' or 'system', got {mode!r}")
    msgs = [m for m in (messages or []) if isinstance(m, Mapping)]
    head = json.dumps(list(tools), sort_keys=True, default=str) if tools else ""
    leading = []
    for m in msgs:
        if m.get("role") not in SYSTEM_ROLES:
            break
        leading.append(m)
    if mode == "system" or (mode == "auto" and leading):
        chosen = leading
    else:
        chosen = msgs
    text = head + "".join(message_text(m) for m in chosen)
    if mode == "system" and not leading and not head:
        return None
    return text[:max_chars] or None
