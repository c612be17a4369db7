"""A reasoning model's thinking apart from its answer.

Models that think before answering (Qwen3, QwQ, DeepSeek-R1 and its distills, SmolLM3)
write ``<think> ... </think>`` and then the answer; some templates open the block in the
prompt, so the output starts inside it. Where the tokenizer has both tags as single tokens,
the chat layer splits the output: the thinking goes to ``reasoning_content`` (what vLLM's
reasoning parsers, LiteLLM and LangChain's DeepSeek and Ollama models call it), the rest is
the answer, whose tool calls are parsed as usual. Text before an opening tag, or with no tag
at all, is answer; a block never closed (cut by ``max_tokens``) is all thinking.

A request turns thinking on or off with ``reasoning_effort`` (OpenAI's, LiteLLM's, vLLM's) or
``thinking`` (Anthropic's shape): :func:`thinking_variables` makes them the chat template's
own switch, ``enable_thinking`` (Qwen3, SmolLM3), and ``reasoning_effort`` (gpt-oss).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from ..errors import InvalidParameterError

OPEN, CLOSE = "<think>", "</think>"

#: OpenAI's ``reasoning_effort`` levels; the first two turn thinking off (as LiteLLM maps them
#: for Ollama, whose models also only think or not).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_OFF = frozenset(("none", "minimal"))
#: Anthropic's ``thinking`` types, and whether each thinks.
_THINKING_TYPES = {"enabled": True, "adaptive": True, "disabled": False}


def thinking_variables(reasoning_effort: Any = None, thinking: Any = None) -> dict[str, Any]:
    """The chat template variables a request's ``reasoning_effort`` (a level of
    :data:`EFFORTS`, or ``{"effort": level, ...}`` as LiteLLM's Responses bridge sends it)
    or ``thinking`` (``{"type": "enabled" | "adaptive" | "disabled", ...}``) sets:
    ``enable_thinking`` and, for a level, ``reasoning_effort``. A template without them
    ignores them (a model that always thinks still does); a thinking budget is not kept."""
    variables: dict[str, Any] = {}
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, Mapping) else None
        if kind not in _THINKING_TYPES:
            raise InvalidParameterError("thinking", f"must be {{'type': 'enabled' | 'adaptive' | 'disabled', ...}}, got {thinking!r}")
        variables["enable_thinking"] = _THINKING_TYPES[kind]
    if reasoning_effort is not None:
        level = reasoning_effort.get("effort") if isinstance(reasoning_effort, Mapping) else reasoning_effort
        if level not in EFFORTS:
            raise InvalidParameterError("reasoning_effort", f"must be one of {', '.join(EFFORTS)}, got {reasoning_effort!r}")
        variables.update(enable_thinking=level not in _OFF, reasoning_effort=level)
    return variables


def thinking_tags(tokenizer: Any) -> Optional[tuple[int, int]]:
    """The token ids of the opening and closing thinking tags, or None where either is not one token."""
    opening, closing = (tokenizer.encode(tag, add_special_tokens=False) for tag in (OPEN, CLOSE))
    return (opening[0], closing[0]) if len(opening) == len(closing) == 1 else None


def reasoning_tokens(token_ids: Sequence[int], inside: bool, tags: tuple[int, int]) -> int:
    """How many of an answer's ``token_ids`` are its thinking (OpenAI's ``reasoning_tokens``, as
    vLLM counts them): those between the opening tag (the answer's first, or the prompt's where
    it is ``inside``) and the closing one, the tags not counted; to the end if none closes.
    For an answer the splitter found thinking in."""
    open_id, close_id = tags
    start = 0 if inside else next((i + 1 for i, t in enumerate(token_ids) if t == open_id), len(token_ids))
    end = next((i for i in range(start, len(token_ids)) if token_ids[i] == close_id), len(token_ids))
    return end - start


def reasoning_start(tokenizer: Any, prompt: str) -> Optional[bool]:
    """How an answer to ``prompt`` is split: None (not at all: the tokenizer has no thinking
    tags), True (the prompt opened a block, so the answer starts inside it) or False (the
    answer may open one)."""
    return opens_thinking(prompt) if thinking_tags(tokenizer) is not None else None


def opens_thinking(prompt: str) -> bool:
    """Whether ``prompt`` ends inside a thinking block (its template opened one)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


class ReasoningSplitter:
    """Splits a stream of answer text into ``("reasoning", text)`` and ``("content", text)``
    pieces; a tag cut across two pieces is held until it is whole (or is not a tag)."""

    def __init__(self, inside: bool) -> None:
        self._state = "reasoning" if inside else "start"
        self._held = ""
        #: Whether the answer has thinking (a block opened, in the prompt or the answer).
        self.thought = inside

    def feed(self, text: str) -> list[tuple[str, str]]:
        """The pieces ``text`` completes."""
        out: list[tuple[str, str]] = []
        text = self._held + text
        self._held = ""
        while text:
            if self._state == "start":  # only whitespace so far: an opening tag may come
                stripped = text.lstrip()
                if not stripped:
                    self._held = text
                    return out
                if stripped.startswith(OPEN):
                    self._state, text, self.thought = "reasoning", stripped[len(OPEN):], True
                elif OPEN.startswith(stripped):
                    self._held = text
                    return out
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                at = text.find(CLOSE)
                if at >= 0:
                    _append(out, "reasoning", text[:at])
                    self._state, text = "after", text[at + len(CLOSE):]
                    continue
                keep = _partial_tail(text, CLOSE)
                _append(out, "reasoning", text[: len(text) - keep])
                self._held = text[len(text) - keep:]
                return out
            elif self._state == "after":  # the blank lines between the thinking and the answer
                text = text.lstrip("\n")
                if text:
                    self._state = "content"
            else:
                _append(out, "content", text)
                return out
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is still held, at the end of the answer."""
        held, self._held = self._held, ""
        if not held or self._state == "after":
            return []
        return [("reasoning" if self._state == "reasoning" else "content", held)]


def split_reasoning(text: str, inside: bool) -> tuple[Optional[str], str]:
    """``(thinking, answer)`` of a finished answer; thinking is None where there is none."""
    splitter = ReasoningSplitter(inside)
    pieces = splitter.feed(text) + splitter.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    return (reasoning if splitter.thought else None), "".join(t for kind, t in pieces if kind == "content")


def _append(out: list[tuple[str, str]], kind: str, text: str) -> None:
    if text:
        out.append((kind, text))


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
