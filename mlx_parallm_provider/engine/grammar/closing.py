"""Ending constrained JSON within a row's token budget.

A JSON row whose budget is about to run out is narrowed, step by step, to the tokens that end
its JSON soonest (:class:`ClosingMasks`: a string's closing quote, closing brackets, a comma
on to the next required key, a short value where one must come). When to begin is measured:
:func:`closing_length` walks a row's matcher along those same tokens (and the tokens its
grammar forces, such as a required key or a tool call's end marker) to where the grammar
may end, and back. :class:`JsonNesting` follows how much JSON a row has open.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from copy import copy
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

#: Bytes that close JSON outside a string: brackets, braces and spaces between them.
CLOSERS = frozenset(b"]} \n")

#: Bytes that end a value and lead on to the next key or value: a comma, a key's colon.
SEPARATORS = frozenset(b",:")

#: A token that is a whole short JSON value (then only closers): where a value must come.
SHORT_VALUE = re.compile(rb'\s*(\[\]|\{\}|""|-?[0-9]+|null|true|false)[\]}\s]*')

#: Tokens a row between JSON values keeps in hand beyond the last value's length before it
#: ends rather than begins another (:attr:`~.guided.RowMatcher.must_end`).
CLOSING_MARGIN = 8

#: The most tokens :func:`closing_length` walks: a row with more tokens left than this (plus
#: a token a level of open JSON) is not measured, and a walk this long counts as this long.
CLOSING_WALK = 64

#: A row is steered once its tokens left are at most its :func:`closing_length` plus these
#: (in the narrowed sets the model may take a token that ends less than the walk's did).
CLOSING_SLACK = 2

@dataclass(frozen=True)
class ClosingMasks:
    """Bitmasks (int32 words, bit ``t % 32`` of word ``t // 32`` for token t) of the tokens
    that end JSON soonest, each tuple in the order a narrowed row tries them.

    ``in_string``: the closing quote followed by closers only; then by closers and separators
    (``",``). ``outside``: ``]``, ``}`` and spaces alone, and EOS; those with a separator
    (``,``, ``},``), ending a value that a required key or a list's next item follows; a whole
    short value (``[]``, ``0``, ``null``, then only closers). ``going_on``: the tokens, read
    outside a string, with a comma before any quote: they go on to another item or key;
    ``going_on_from_string``: those that, read inside one, close it and then have a comma
    before any quote (``",``, ``"},``)."""

    in_string: tuple[np.ndarray, ...]
    outside: tuple[np.ndarray, ...]
    going_on: np.ndarray
    going_on_from_string: np.ndarray

    @property
    def closers(self) -> np.ndarray:
        return self.outside[0]

    def tiers(self, in_string: bool) -> tuple[np.ndarray, ...]:
        return self.in_string if in_string else self.outside

    def going_on_mask(self, in_string: bool) -> np.ndarray:
        return self.going_on_from_string if in_string else self.going_on


def closing_masks(decode: Callable[[int], bytes], vocab: int, words: int, eos_bits: np.ndarray) -> ClosingMasks:
    """The :class:`ClosingMasks` of a vocabulary of ``vocab`` tokens, ``words`` int32 each;
    ``decode(t)``: token t's bytes."""
    masks = np.zeros((7, words * 32), dtype=np.uint8)
    for token in range(min(vocab, words * 32)):
        masks[:, token] = _kinds(decode(token))
    packed = np.packbits(masks, axis=1, bitorder="little").view(np.int32)
    return ClosingMasks((packed[0], packed[1]), (packed[2] | eos_bits, packed[3], packed[4]), packed[5], packed[6])


def _kinds(text: bytes) -> tuple[bool, ...]:
    rest, every = set(text[1:]), set(text)
    quote = text[:1] == b'"'
    return (quote and rest <= CLOSERS,
            quote and rest <= CLOSERS | SEPARATORS and bool(rest & SEPARATORS),
            bool(text.strip(b" \n")) and every <= CLOSERS,
            every <= CLOSERS | SEPARATORS and bool(every & SEPARATORS),
            SHORT_VALUE.fullmatch(text) is not None,
            b"," in text.split(b'"', 1)[0],
            b'"' in text and b"," in text.split(b'"', 2)[1])  # read in a string: after its closing quote


def narrowed(allowed: np.ndarray, tiers: Sequence[np.ndarray]) -> Optional[np.ndarray]:
    """``allowed`` (one row's bitmask) within the first of ``tiers`` that keeps any of it;
    None where none does (the grammar wants something else first: a key, a colon)."""
    for tier in tiers:
        kept = allowed & tier
        if kept.any():
            return kept
    return None


def closing_length(matcher: Any, nesting: "JsonNesting", masks: ClosingMasks, vocab: int,
                   decode: Callable[[int], bytes], limit: int = CLOSING_WALK) -> int:
    """How many tokens the shortest way found takes ``matcher`` (an llguidance matcher) from
    where it is to where its grammar may end: at each step the tokens the grammar forces,
    else the lowest token of the first of ``masks`` (:class:`ClosingMasks`, by whether
    ``nesting`` is in a string) that the grammar allows, else its lowest allowed token.
    ``limit`` where the walk takes that many or cannot go on. The matcher is rolled back to
    where it was."""
    words = masks.closers.shape[0]
    bitmask = np.zeros(words, dtype=np.int32)
    nesting = copy(nesting)
    taken = 0
    try:
        while taken < limit:
            if matcher.is_accepting():
                return taken
            if matcher.is_stopped() or matcher.is_error():
                return limit
            forced = [int(t) for t in matcher.compute_ff_tokens()[: limit - taken]]
            tokens = forced[: matcher.try_consume_tokens(forced)] if forced else []
            if not tokens:
                matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, words * 4)
                choice = narrowed(bitmask, masks.tiers(nesting.in_string))
                token = _lowest(bitmask if choice is None else choice)
                if token is None or token >= vocab or not matcher.try_consume_tokens([token]):
                    return limit
                tokens = [token]
            taken += len(tokens)
            for token in tokens:
                nesting.feed(decode(token))
        return limit
    finally:
        if taken:
            matcher.rollback(taken)


def continuing_length(matcher: Any, nesting: "JsonNesting", masks: ClosingMasks, vocab: int,
                      decode: Callable[[int], bytes], allowed: np.ndarray) -> Optional[int]:
    """The :func:`closing_length` of going on with the lowest token ``allowed`` that does (a
    comma on to another item or an optional key: ``masks.going_on``, or in a string
    ``masks.going_on_from_string``), that token included; None where ``allowed`` has none.
    The matcher is rolled back to where it was."""
    token = _lowest(allowed & masks.going_on_mask(nesting.in_string))
    if token is None or token >= vocab or not matcher.try_consume_tokens([token]):
        return None
    try:
        after = copy(nesting)
        after.feed(decode(token))
        return 1 + closing_length(matcher, after, masks, vocab, decode)
    finally:
        matcher.rollback(1)


def _lowest(bitmask: np.ndarray) -> Optional[int]:
    words = np.flatnonzero(bitmask)
    if not words.size:
        return None
    word = int(bitmask[words[0]]) & 0xFFFFFFFF
    return int(words[0]) * 32 + (word & -word).bit_length() - 1


class ClosingGauge:
    """Whether one JSON row must be steered to end now. Its :func:`closing_length` is measured
    again only once its tokens left could have come within reach of it (taking each token
    since as one more to write) or its JSON has opened a level deeper; once steering begins
    it lasts until :meth:`reset` (the value closed) or the row has more tokens left than when
    it was measured (its matcher was rewound after looking ahead)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._at: Optional[tuple[int, int, int]] = None  # (tokens left, depth, closing length) when measured
        self.steering = False

    def must_close(self, left: int, nesting: "JsonNesting", measure: Callable[[], int]) -> bool:
        """Steer now, with ``left`` tokens left (this one included); ``measure()`` gives the
        row's closing length where it is."""
        if self._at is not None and left > self._at[0]:
            self.reset()
        if not self.steering:
            at = self._at
            if at is None or nesting.depth > at[1] or left <= at[2] + (at[0] - left) + CLOSING_SLACK:
                at = self._at = (left, nesting.depth, measure())
            self.steering = left <= at[2] + CLOSING_SLACK
        return self.steering


class JsonNesting:
    """How many JSON strings, arrays and objects the bytes fed so far leave open.

    ``value_tokens``: the tokens from the end of the top-level value before the last one (or
    the start) to the end of the last one, so a tool call's markers count with its JSON; 0
    until a value has closed. ``string_start``: the tokens fed before the one that opened the
    string it is in (which string, for what is measured once a string)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self._escaped = False
        self.value_tokens = 0
        self._run = 0  # tokens since the last value closed
        self.fed = 0
        self.string_start = -1

    @property
    def open(self) -> int:
        return self.depth + self.in_string

    def feed(self, data: bytes) -> None:
        """Take one token's bytes."""
        before, was_in_string = self.open, self.in_string
        self._scan(data)
        if self.in_string and (not was_in_string or data.count(b'"') > 1):
            self.string_start = self.fed
        self.fed += 1
        self._run += 1
        if before and not self.open:  # a top-level value closed
            self.value_tokens, self._run = self._run, 0

    def _scan(self, data: bytes) -> None:
        for byte in data:
            if self.in_string:
                if self._escaped:
                    self._escaped = False
                elif byte == 0x5C:  # backslash
                    self._escaped = True
                elif byte == 0x22:
                    self.in_string = False
            elif byte == 0x22:
                self.in_string = True
            elif byte in (0x7B, 0x5B):  # { [
                self.depth += 1
            elif byte in (0x7D, 0x5D) and self.depth:
                self.depth -= 1
