"""Message text never becomes control tokens.

A rendered prompt is text, and tokenizers turn every special token they find in it into its
control id, wherever it came from: a user (or a web page returned as a tool result) writing
``<|im_start|>system ...`` would open a real system turn. When any message's text holds a
special token, :func:`guard_conversation` renders that text as a placeholder the template
cannot mistake, and :meth:`GuardedContents.encode` tokenizes the rendered prompt in pieces:
the template's own text as usual, each message's text cut wherever a special token would
match, so its markers come out as the plain-text tokens they spell. Prompts whose messages
hold no special token are rendered and tokenized exactly as before (text, by the engine).

On SentencePiece tokenizers that add a leading space to every encoded piece, the cut text of
a guarded message may gain a space at each cut; its markers are still plain text.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Optional


def special_texts(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens' texts (declared ones and added tokens marked special)
    of two or more characters, longest first."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            found.add(str(added))
    return sorted((t for t in found if len(t) > 1), key=len, reverse=True)  # one character cannot be cut


def is_one_token(tokenizer: Any, text: str) -> bool:
    """Whether ``tokenizer`` encodes ``text`` (no special tokens added) as a single token."""
    return len(tokenizer.encode(text, add_special_tokens=False)) == 1


@dataclass(frozen=True)
class GuardedContents:
    """Placeholders in a conversation and the message text each stands for."""

    tokenizer: Any
    texts: dict[str, str]
    specials: list[str]

    def encode(self, rendered: str) -> list[int]:
        """Token ids of ``rendered`` (a template's output over the placeholders) with every
        message text put back as plain text. Special tokens are added as the engine adds
        them to a text prompt (BOS unless the prompt starts with it)."""
        ids: list[int] = []
        for i, (piece, is_message) in enumerate(_split(rendered, self.texts)):
            if not is_message:
                ids += _encode(self.tokenizer, piece, first=i == 0)
                continue
            for segment in _cut(piece, self.specials):
                ids += _encode(self.tokenizer, segment, first=False)
        return ids


def guard_conversation(tokenizer: Any, conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Optional[GuardedContents]]:
    """``conversation`` with each message text that holds a special token replaced by a
    placeholder, and what the placeholders stand for (None, conversation unchanged, when no
    message text holds one)."""
    specials = special_texts(tokenizer)
    if not specials:
        return conversation, None
    texts: dict[str, str] = {}
    guarded = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, str) and any(s in content for s in specials):
            placeholder = f"MLXPARALLMTEXT{secrets.token_hex(8)}X"
            texts[placeholder] = content
            message = {**message, "content": placeholder}
        guarded.append(message)
    return (guarded, GuardedContents(tokenizer, texts, specials)) if texts else (conversation, None)


def _split(rendered: str, texts: dict[str, str]) -> list[tuple[str, bool]]:
    """``rendered`` as (template text, False) and (message text, True) pieces, in order."""
    pieces: list[tuple[str, bool]] = []
    rest = rendered
    while True:
        hits = [(rest.find(p), p) for p in texts if p in rest]
        if not hits:
            break
        at, placeholder = min(hits)
        pieces += [(rest[:at], False), (texts[placeholder], True)]
        rest = rest[at + len(placeholder):]
    return [*pieces, (rest, False)]


def _cut(text: str, specials: list[str]) -> list[str]:
    """``text`` in segments none of which holds a whole special token: cut before the last
    character of the match that ends first, and again from there."""
    segments, start = [], 0
    while True:
        ends = [at + len(s) for s in specials if (at := text.find(s, start)) >= 0]
        if not ends:
            break
        cut = min(ends) - 1  # specials are 2+ characters long, so cut > start
        segments.append(text[start:cut])
        start = cut
    return [s for s in [*segments, text[start:]] if s]


def _encode(tokenizer: Any, text: str, first: bool) -> list[int]:
    if not text:
        return []
    bos = getattr(tokenizer, "bos_token", None)
    add_special = first and (bos is None or not text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=add_special))
