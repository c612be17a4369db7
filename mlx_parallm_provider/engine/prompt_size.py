"""Prompts to token ids without stalling anyone: :class:`PromptEncoder` refuses a text far
over the context window from its length instead of tokenizing it first (a 10 MB message
took 13 s to tokenize before it was refused), and tokenizes async callers' long texts on a
thread, so one request never stalls the other streams of its event loop.

How many characters one token can cover is read from the vocabulary
(:func:`max_chars_per_token`).
No token covers more characters than its vocabulary entry has: byte-level BPE spells each
byte as one character, SentencePiece spells text as it is (``<0x0A>`` is longer than the
byte it stands for), added tokens are their own text. A normalizer that composes
characters (NFC, NFKC: at most 4 code points into one) multiplies the bound; one that may
delete characters (stripping, accents, regex replacements, unknown kinds) leaves no bound.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, Callable, Optional

from .._validation import check_text
from ..errors import ContextWindowExceededError, InvalidParameterError, MLXParallmError
from .fanout import Job
from .request import Prompt, SamplingParams

#: Texts longer than this (characters) are tokenized off an async caller's event loop.
INLINE_PROMPT_CHARS = 4096

#: A text longer than this many characters a token of the room it has is measured first by
#: tokenizing that much of it: twice what text averages (~4), far less than the longest
#: vocabulary entries allow (the bound :meth:`PromptEncoder.far_over` refuses by), so a text
#: of ~470,000 tokens (a 60,000-value enum written into the prompt) is refused after ~65,000
#: characters of an 8,192-token context, not after tokenizing all of it. A text that fits
#: with more characters a token than this is tokenized twice (the prefix, then whole).
PREFIX_CHARS_PER_TOKEN = 8

#: Tokens a prefix may count beyond the room before its text is refused: a prefix cut at a
#: word's end counts what the whole text counts for the same characters, give or take the
#: tokens a tokenizer adds (BOS) or splits differently at the cut.
PREFIX_SLACK_TOKENS = 16

#: Normalizers that never shorten a text.
_KEEPING = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
#: Normalizers that compose characters, and by how much at most.
_COMPOSING = {"NFC": 4, "NFKC": 4}


def max_chars_per_token(tokenizer: Any) -> Optional[int]:
    """The most characters of text one token of ``tokenizer`` can stand for, or None when
    that cannot be bounded (or the tokenizer cannot be read)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        longest = max(map(len, hf.get_vocab()), default=0)
        backend = getattr(hf, "backend_tokenizer", hf)
        normalizer = json.loads(backend.to_str()).get("normalizer")
    except Exception:  # not a Hugging Face tokenizer: no bound
        return None
    shrink = _shrink(normalizer)
    return longest * shrink if longest and shrink else None


def _shrink(config: Any) -> Optional[int]:
    """How many times shorter ``config`` (a normalizer's JSON) can make a text; None: unbounded."""
    if config is None:
        return 1
    kind = config.get("type") if isinstance(config, dict) else None
    if kind in _KEEPING:
        return 1
    if kind in _COMPOSING:
        return _COMPOSING[kind]
    if kind == "Sequence":
        factor = 1
        for part in config.get("normalizers") or []:
            step = _shrink(part)
            if step is None:
                return None
            factor *= step
        return factor
    if kind == "Replace":  # a fixed string for a fixed string (SentencePiece's " " -> "▁")
        pattern, content = (config.get("pattern") or {}).get("String"), config.get("content")
        if isinstance(pattern, str) and isinstance(content, str) and content:
            return max(1, math.ceil(len(pattern) / len(content)))
    return None


def kept_last(ids: list[int], keep: int, bos_id: Optional[int]) -> list[int]:
    """``ids`` cut to their last ``keep`` (vLLM's ``truncate_prompt_tokens``), a leading
    ``bos_id`` kept first as a tokenizer truncating from the left keeps its special tokens."""
    if len(ids) <= keep:
        return list(ids)
    if bos_id is not None and ids[0] == bos_id and keep > 1:
        return [bos_id, *ids[len(ids) - keep + 1:]]
    return list(ids[len(ids) - keep:])


class TokenIds(list):
    """Token ids the engine's own tokenizer produced: submitted without checking each id."""


class RefusedText(str):
    """A text refused from a tokenized prefix on a thread: submitting it raises ``error``
    without tokenizing it again on the caller's loop."""

    error: ContextWindowExceededError


class PromptEncoder:
    """One engine's prompts to token ids. ``encode`` is the engine's
    :meth:`~.api.Engine.encode`; ``tokenizer`` gives the characters-per-token bound."""

    def __init__(self, encode: Callable[[Prompt], list[int]], tokenizer: Any, context_length: int) -> None:
        self._encode = encode
        self.context_length = context_length
        self.chars_per_token = max_chars_per_token(tokenizer)
        self._bos_id: Optional[int] = getattr(tokenizer, "bos_token_id", None)
        self._tokenizer = tokenizer

    def far_over(self, text: str, max_tokens: int) -> bool:
        """``text`` has more characters than the room left for the prompt could hold."""
        room = max(0, self.context_length - max_tokens)
        return self.chars_per_token is not None and len(text) > room * self.chars_per_token

    def prediction_ids(self, prediction: Optional[str]) -> list[int]:
        """A request's ``prediction`` (OpenAI's predicted output) as token ids, no special
        token added; a text longer than the context could hold is refused untokenized."""
        if not prediction:
            return []
        check_text("prediction", prediction)
        if self.far_over(prediction, 0):
            raise InvalidParameterError("prediction", f"is longer than the model's {self.context_length}-token context could hold")
        return list(self._tokenizer.encode(prediction, add_special_tokens=False))

    def encode_within_context(self, prompt: Prompt, max_tokens: int, truncate: Optional[int] = None) -> list[int]:
        """Token ids of ``prompt``; a prompt that cannot fit is refused from its length, or
        from a prefix (:meth:`prefix_over`). With ``truncate`` (``SamplingParams.
        truncate_prompt_tokens``) nothing is refused here: the ids are cut to their last
        that many (-1: as many as fit beside ``max_tokens``), a leading BOS kept first."""
        if truncate is not None:
            ids = prompt if isinstance(prompt, TokenIds) else self._encode(prompt)
            keep = truncate if truncate > 0 else self.context_length - max_tokens
            return kept_last(ids, max(1, keep), self._bos_id)
        if isinstance(prompt, TokenIds):
            return prompt
        if isinstance(prompt, RefusedText):
            raise prompt.error
        if isinstance(prompt, str) and self.far_over(prompt, max_tokens):
            fewest = -(-len(prompt) // (self.chars_per_token or 1))
            raise ContextWindowExceededError(fewest, max_tokens, self.context_length, at_least=True)
        if isinstance(prompt, (list, tuple)) and len(prompt) + max_tokens > self.context_length:
            raise ContextWindowExceededError(len(prompt), max_tokens, self.context_length)
        if isinstance(prompt, str):
            self.prefix_over(prompt, max_tokens)
        return self._encode(prompt)

    def prefix_over(self, text: str, max_tokens: int) -> None:
        """Refuse ``text`` when its first ``PREFIX_CHARS_PER_TOKEN`` characters a token of
        the room left (cut back to a whitespace) already count more tokens than the room
        (plus :data:`PREFIX_SLACK_TOKENS`); a shorter text is left to be tokenized whole."""
        room = max(0, self.context_length - max_tokens)
        cut = room * PREFIX_CHARS_PER_TOKEN
        if len(text) <= cut:
            return
        check_text("prompt", text)  # as encoding it whole would (a lone surrogate past the prefix)
        space = max(text.rfind(" ", 0, cut), text.rfind("\n", 0, cut))
        prefix = text[: space if space > cut // 2 else cut]
        counted = len(self._encode(prefix))
        if counted > room + PREFIX_SLACK_TOKENS:
            raise ContextWindowExceededError(counted, max_tokens, self.context_length, at_least=True)

    async def tokenized_off_loop(self, prompt: Prompt, params: Optional[SamplingParams]) -> Prompt:
        """``prompt``, a long text tokenized on a thread (see :meth:`jobs_tokenized_off_loop`)."""
        if params is None:
            params = SamplingParams()
        if not isinstance(prompt, str) or len(prompt) <= INLINE_PROMPT_CHARS or not isinstance(params, SamplingParams):
            return prompt  # short, ids, or refused when submitted
        return (await self.jobs_tokenized_off_loop([(prompt, params)]))[0][0]

    async def jobs_tokenized_off_loop(self, jobs: list[Job]) -> list[Job]:
        """``jobs`` with each long text replaced by its :class:`TokenIds`, tokenized on a
        thread (once per prompt, whatever its ``n``). Texts refused from their length, and
        texts whose tokenization fails, stay text: submitting them raises their error."""
        texts = {id(p): (p, s) for p, s in jobs if isinstance(p, str) and len(p) > INLINE_PROMPT_CHARS
                 and (s.truncate_prompt_tokens is not None or not self.far_over(p, s.max_tokens))}
        if not texts:
            return jobs

        def encode_all() -> dict[int, Prompt]:
            done: dict[int, Prompt] = {}
            for key, (text, params) in texts.items():
                try:
                    if params.truncate_prompt_tokens is None:
                        self.prefix_over(text, params.max_tokens)
                    done[key] = TokenIds(self._encode(text))
                except ContextWindowExceededError as error:
                    refused = done[key] = RefusedText(text)
                    refused.error = error
                except MLXParallmError:
                    pass
            return done

        done = await asyncio.to_thread(encode_all)
        return [(done.get(id(p), p), s) for p, s in jobs]
