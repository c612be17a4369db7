"""The tokens a row may not sample next, as vLLM's sampling controls ban them: every token but
its ``allowed_token_ids``, the last token of each of its ``bad_words`` whose other tokens the
output ends with, and its stop tokens (EOS, ``stop_token_ids``) until it has ``min_tokens``.

:class:`TokenBans` is one row's; :func:`banned` and :func:`held_open` apply a batch's rows' bans
to their logits, each by a few ops for all rows at once (a banned token's logit is ``-inf``).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import mlx.core as mx

from ..errors import InvalidParameterError

MAX_BAD_WORD_TOKENS = 32
"""Most tokens one of ``bad_words`` may take (its first ones are matched against the output's
last tokens, which a row's history holds this many of)."""


def bad_word_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """Each of ``words`` as token ids, as vLLM bans them: the word alone (leading spaces cut),
    and again after a space where that starts with another token and takes as many tokens
    (the word in the middle of a text). A word that writes no token, or more than
    :data:`MAX_BAD_WORD_TOKENS`, is an :class:`InvalidParameterError`."""
    out: list[list[int]] = []
    for i, word in enumerate(words):
        alone = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not alone:
            raise InvalidParameterError(f"bad_words[{i}]", f"{word!r} writes no token")
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (alone, spaced) if spaced[:1] != alone[:1] and len(spaced) == len(alone) else (alone,):
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise InvalidParameterError(f"bad_words[{i}]", f"{word!r} takes {len(ids)} tokens; at most {MAX_BAD_WORD_TOKENS} are supported")
            out.append(ids)
    return out


class TokenBans:
    """One row's banned tokens.

    ``min_tokens``: stop tokens (``stop_ids``: EOS and the row's ``stop_token_ids``) are banned
    while the row has fewer output tokens; ``allowed``: the only tokens the row may sample
    (None: all); ``bad_words``: token sequences the output may not end with (their last token
    is banned where the output ends with the rest)."""

    def __init__(self, min_tokens: int = 0, stop_ids: Iterable[int] = (), allowed: Optional[Sequence[int]] = None,
                 bad_words: Sequence[Sequence[int]] = ()) -> None:
        self.min_tokens = min_tokens
        self.stop_ids = sorted(set(stop_ids))
        self.allowed = sorted(set(allowed)) if allowed is not None else None
        self.single = sorted({w[0] for w in bad_words if len(w) == 1})
        self.sequences = [list(w) for w in bad_words if len(w) > 1]
        self._mask: Optional[mx.array] = None

    @classmethod
    def of(cls, params: Any, eos_ids: Iterable[int], bad_words: Sequence[Sequence[int]] = ()) -> Optional["TokenBans"]:
        """A request's bans from its :class:`~.request.SamplingParams` and the model's EOS
        ids, or None where it bans nothing."""
        if not (params.min_tokens or params.allowed_token_ids is not None or bad_words):
            return None
        return cls(params.min_tokens, [*eos_ids, *params.stop_token_ids], params.allowed_token_ids, bad_words)

    @property
    def needs_output(self) -> bool:
        """Whether the bans depend on the output's last tokens (a bad word of several tokens):
        a row's next token then needs its last token on the host."""
        return bool(self.sequences)

    def allowed_mask(self, vocab: int) -> mx.array:
        """``(vocab,)`` bools: the tokens of ``allowed`` (made once, so a long list costs no
        host work a step)."""
        if self._mask is None or self._mask.shape[0] != vocab:
            assert self.allowed is not None
            _check_width([self.allowed], vocab)
            mask = mx.zeros((vocab,), dtype=mx.bool_)
            mask[mx.array(self.allowed, dtype=mx.int32)] = True
            self._mask = mask
        return self._mask

    def holds(self, produced: int) -> bool:
        """Whether the stop tokens are banned after ``produced`` output tokens."""
        return produced < self.min_tokens and bool(self.stop_ids)

    def words_ending(self, output_tail: Sequence[int]) -> list[int]:
        """The tokens banned for the bad words, after an output ending with ``output_tail``."""
        out = list(self.single)
        for word in self.sequences:
            prefix = word[:-1]
            if len(output_tail) >= len(prefix) and list(output_tail[len(output_tail) - len(prefix):]) == prefix:
                out.append(word[-1])
        return out


def _scatter(logits: mx.array, rows: Sequence[Sequence[int]]) -> mx.array:
    """``logits`` with each row's ``rows[i]`` tokens at -inf (a row with none as it was; a
    row's padding repeats its first token)."""
    width = max(map(len, rows))
    ids = mx.array([list(r) + [r[0]] * (width - len(r)) if r else [0] * width for r in rows], dtype=mx.int32)
    kept = mx.take_along_axis(logits, ids, axis=1)
    real = mx.array([[bool(r)] for r in rows])
    return mx.put_along_axis(logits, ids, mx.where(real, mx.array(-float("inf"), dtype=logits.dtype), kept), axis=1)


def _check_width(rows: Sequence[Sequence[int]], vocab: int) -> None:
    """Refuse a token id outside the logits: MLX does not bounds-check a scatter's index."""
    if max((max(r) for r in rows if r), default=0) >= vocab:
        raise ValueError(f"a banned or allowed token id is outside the model's {vocab} logits")


def banned(logits: mx.array, bans: Sequence[Optional[TokenBans]], tails: Sequence[Sequence[int]]) -> mx.array:
    """The rows' logits ``(B, vocab)`` with each row's tokens outside its ``allowed`` set and
    its bad words' tokens (after an output ending with ``tails[i]``) at -inf."""
    vocab = logits.shape[-1]
    if any(b is not None and b.allowed is not None for b in bans):
        every = mx.ones((vocab,), dtype=mx.bool_)
        masks = [b.allowed_mask(vocab) if b is not None and b.allowed is not None else every for b in bans]
        logits = mx.where(mx.stack(masks), logits, mx.array(-float("inf"), dtype=logits.dtype))
    words = [b.words_ending(t) if b is not None else [] for b, t in zip(bans, tails)]
    if any(words):
        _check_width(words, vocab)
        logits = _scatter(logits, words)
    return logits


def held_open(logits: mx.array, bans: Sequence[Optional[TokenBans]], produced: Sequence[int]) -> mx.array:
    """The rows' logits with each row's stop tokens at -inf while it has fewer than its
    ``min_tokens`` output tokens (``produced[i]``), except in a row where they are all that is
    left (its other bans, or its grammar, allow nothing else: it ends)."""
    holding = [b is not None and b.holds(n) for b, n in zip(bans, produced)]
    if not any(holding):
        return logits
    stops = [b.stop_ids if h else [] for b, h in zip(bans, holding)]  # type: ignore[union-attr]
    _check_width(stops, logits.shape[-1])
    held = _scatter(logits, stops)
    nothing_else = mx.max(held, axis=-1, keepdims=True) == -float("inf")
    return mx.where(nothing_else, logits, held)
