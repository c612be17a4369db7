"""Streaming text for one request: incremental detokenization and stop-string matching.

The engine's worker turns each sampled token into text as it is generated. Two problems:

* A token may hold only part of a UTF-8 character (byte-level BPE splits emoji and CJK
  across tokens; sentencepiece byte fallback emits one byte per token). Text must never
  be emitted with half a character. :class:`IncrementalDetokenizer` solves it with the
  "prefix_offset / read_offset" technique used by vLLM and TGI, decoding only a short
  window of recent tokens per step.
* Stop strings may span several tokens. :class:`StopStringMatcher` holds back text that
  could still become a stop string, so a stop string is never streamed.

:class:`TextStream` chains both for one request.

mlx-lm ships streaming detokenizers (``mlx_lm.tokenizer_utils``) but they are not reused:
``NaiveStreamingDetokenizer`` re-decodes every token since the last newline at each step
(quadratic on long lines) and calls ``encode``; ``BPEStreamingDetokenizer`` and
``SPMStreamingDetokenizer`` rebuild text from ``convert_ids_to_tokens`` instead of the
tokenizer's own decoder, so their output can differ from ``tokenizer.decode`` (the BPE
one drops a leading space and mis-maps the NUL byte). None take prompt context. The
technique here needs only ``decode`` and matches it for any tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional, Protocol

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens kept as decoding context (the value vLLM and TGI use).
DEFAULT_CONTEXT_TOKENS = 5

# A UTF-8 character is at most 4 bytes and each token carries at least one, so valid text
# never keeps more than 4 tokens pending. A longer run is invalid output (or tokens that
# decode to nothing) and is released as-is so the per-step decode window stays bounded.
DEFAULT_MAX_PENDING_TOKENS = 8


class Decoder(Protocol):
    """Anything with ``decode(ids) -> str``: an HF tokenizer or mlx-lm's TokenizerWrapper."""

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


class _RustDecoder:
    """A fast HF tokenizer's ``decode``, called on its Rust tokenizer directly."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)


def direct_decoder(tokenizer: Any) -> Decoder:
    """What decodes ``tokenizer``'s ids cheapest, giving its ``decode``'s text: for a fast HF
    tokenizer (or mlx-lm's wrapper of one) whose ``decode`` is transformers' own and cleans up
    no spaces, its Rust tokenizer called directly (transformers' conversion of the arguments
    costs more than the decoding of a few ids, and a step of 64 rows decodes ~80 times);
    else ``tokenizer`` itself."""
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return tokenizer
    decode = getattr(tokenizer, "decode", None)  # (mlx-lm's wrapper hands out its tokenizer's)
    hf = getattr(decode, "__self__", None)
    if getattr(decode, "__func__", None) is not PreTrainedTokenizerBase.decode or not isinstance(hf, PreTrainedTokenizerFast):
        return tokenizer
    backend = getattr(hf, "_tokenizer", None)
    if type(hf)._decode is not PreTrainedTokenizerFast._decode or not isinstance(backend, Tokenizer):
        return tokenizer
    if getattr(hf, "clean_up_tokenization_spaces", True):
        return tokenizer
    return _RustDecoder(backend)


class IncrementalDetokenizer:
    """Turns one request's tokens into text, one token at a time, UTF-8 safe.

    Each step decodes ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]`` and
    emits the difference, unless the new text ends in U+FFFD (a character still
    incomplete), in which case the token stays pending until the next one completes it.
    ``prefix_offset`` trails ``read_offset`` by one emitted chunk so that tokenizers
    whose rendering depends on the previous token (e.g. sentencepiece's leading space)
    decode consistently. Only that window is kept, so per-token cost does not grow with
    the output length.

    The concatenation of all pieces returned by :meth:`add_token` and :meth:`flush`
    equals ``tokenizer.decode(ids)`` for the generated ids (given no prompt context),
    provided the tokenizer's decode is "local" (true of byte-level BPE and sentencepiece;
    HF's ``clean_up_tokenization_spaces`` can make it differ by a space around
    punctuation).

    Args:
        tokenizer: object with ``decode(list[int]) -> str``.
        prompt_ids: the prompt's token ids; its last ``context_tokens`` ids are used as
            decoding context and are never emitted.
        skip_special_tokens: passed to ``decode`` when True (otherwise not passed, so a
            plain ``decode(ids)`` suffices).
        context_tokens: how many trailing prompt ids to keep as context.
        max_pending_tokens: tokens held waiting for a character to complete before the
            text is released as-is (with replacement characters).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Optional[Sequence[int]] = None,
        *,
        skip_special_tokens: bool = False,
        context_tokens: int = DEFAULT_CONTEXT_TOKENS,
        max_pending_tokens: int = DEFAULT_MAX_PENDING_TOKENS,
    ) -> None:
        if max_pending_tokens < 1:
            raise ValueError("max_pending_tokens must be >= 1")
        self._tokenizer = tokenizer
        self._decode_kwargs: dict[str, Any] = (
            {"skip_special_tokens": True} if skip_special_tokens else {}
        )
        self._max_pending = max_pending_tokens
        context = list(prompt_ids[-context_tokens:]) if prompt_ids and context_tokens > 0 else []
        # Only the window ids[prefix_offset:] is stored; offsets index into it.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: Optional[str] = None  # cached decode of ids[prefix:read]
        self.num_tokens = 0  # generated tokens seen

    def add_token(self, token_id: int) -> str:
        """Consume one generated token; return the text it completes (may be "")."""
        self._ids.append(int(token_id))
        self.num_tokens += 1
        prefix_text = self._get_prefix_text()
        new_text = self._decode(self._ids[self._prefix_offset :])
        pending = len(self._ids) - self._read_offset
        complete = len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR)
        if not complete and pending < self._max_pending:
            return ""
        return self._advance(new_text[len(prefix_text) :])

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Consume several tokens; return the concatenated text they complete."""
        return "".join(self.add_token(t) for t in token_ids)

    def flush(self) -> str:
        """Return text still held back, with replacement characters if truly invalid."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._get_prefix_text()
        new_text = self._decode(self._ids[self._prefix_offset :])
        return self._advance(new_text[len(prefix_text) :])

    @property
    def has_pending(self) -> bool:
        """True if some tokens have not yet produced their text."""
        return self._read_offset < len(self._ids)

    def _advance(self, piece: str) -> str:
        """Mark every stored token as read and slide the window to the last chunk."""
        # The chunk just read becomes the next step's context; drop ids before it.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return piece

    def _get_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, **self._decode_kwargs)


class StopStringMatcher:
    """Cuts a text stream at the first stop string, never emitting any part of it (with
    ``include``, the whole of it, as the text's end).

    :meth:`feed` holds back the longest suffix of the pending text that is a proper
    prefix of some stop string. A stop string is taken to occur where it *ends* first
    (ties go to the one starting earliest), which is what a character-by-character
    stream sees, so the result does not depend on how the text was chunked into tokens.
    """

    def __init__(self, stop: Optional[Iterable[str]] = None, *, include: bool = False) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in (stop or ()) if s))
        self.include = include  # emit the stop string itself, as the text's end
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._prefixes = frozenset(s[:k] for s in self.stops for k in range(1, len(s)))
        self._pending = ""
        self.stopped = False
        self.matched: Optional[str] = None  # the stop string that ended the stream

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string completed)."""
        if not self.stops:
            return text, False
        if self.stopped:
            return "", True
        buf = self._pending + text
        match = self._find_stop(buf)
        if match is not None:
            start, stop = match
            self._pending = ""
            self.stopped = True
            self.matched = stop
            return buf[: start + len(stop) if self.include else start], True
        hold = self._held_suffix_len(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Release text held back (when the request ends without a stop string)."""
        text, self._pending = self._pending, ""
        return "" if self.stopped else text

    @property
    def pending(self) -> str:
        """Text currently held back because it may begin a stop string."""
        return self._pending

    def _find_stop(self, buf: str) -> Optional[tuple[int, str]]:
        best: Optional[tuple[int, int, str]] = None  # (end, start, stop)
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _held_suffix_len(self, buf: str) -> int:
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            if buf[-k:] in self._prefixes:
                return k
        return 0


class TextStream:
    """One request's text: detokenize each token, cut at stop strings, keep the full text.

    Args:
        tokenizer: object with ``decode(list[int]) -> str``.
        stop: stop strings (excluded from the output).
        prompt_ids: prompt token ids, used as decoding context.
        skip_special_tokens: forwarded to :class:`IncrementalDetokenizer`.
        include_stop: the stop string that ends the text is part of it.
        unchecked: how many first tokens' text is not searched for stop strings (a request's
            ``min_tokens``: stop strings are looked for from the next token's text on).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        stop: Optional[Iterable[str]] = None,
        prompt_ids: Optional[Sequence[int]] = None,
        *,
        skip_special_tokens: bool = False,
        include_stop: bool = False,
        unchecked: int = 0,
    ) -> None:
        self.unchecked = unchecked
        self._tokens = 0
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
        )
        self.matcher = StopStringMatcher(stop, include=include_stop)
        self._parts: list[str] = []

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Consume one token; return (new text to stream, whether a stop string hit)."""
        if self.matcher.stopped:
            return "", True
        text = self.detokenizer.add_token(token_id)
        self._tokens += 1
        return self._emit(*self.matcher.feed(text)) if self._tokens > self.unchecked else self._emit(text, False)

    def finish(self) -> str:
        """End of the request for a reason other than a stop string: release held text."""
        if self.matcher.stopped:
            return ""
        piece, stopped = self.matcher.feed(self.detokenizer.flush())
        if not stopped:
            piece += self.matcher.flush()
        return self._emit(piece, stopped)[0]

    @property
    def stopped(self) -> bool:
        """True once a stop string has been generated."""
        return self.matcher.stopped

    @property
    def matched_stop(self) -> Optional[str]:
        """The stop string that ended the stream, if any."""
        return self.matcher.matched

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _emit(self, piece: str, stopped: bool) -> tuple[str, bool]:
        if piece:
            self._parts.append(piece)
        return piece, stopped
