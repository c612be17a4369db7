"""Grammar-constrained decoding inside the batch, with llguidance.

A request whose :class:`~.request.SamplingParams` carries a
:class:`~.constraint.Constraint` gets its own matcher. Each step the token masks of all
constrained rows are filled together (in parallel, by llguidance's executor, while MLX
computes the step's logits) and applied inside the batched sampling step; unconstrained
rows are untouched and pay nothing. EOS is allowed only where the grammar may end, and a
row whose grammar is complete finishes with ``"stop"``.

Each distinct grammar is built into a matcher once, on a compiler thread (llguidance
recurses on the calling thread's stack, see :mod:`.build_threads`), and probed a few tokens
(:mod:`.probe`: the engine does it at submit, so a grammar that fails early is a
400 before admission); the rows that use it get copies of that matcher.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from copy import copy
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from ...errors import InvalidParameterError
from .build_threads import run_compiler
from .closing import (
    CLOSING_MARGIN,
    CLOSING_SLACK,
    CLOSING_WALK,
    ClosingGauge,
    ClosingMasks,
    JsonNesting,
    closing_length,
    closing_masks,
    continuing_length,
    narrowed,
)
from .constraint import Constraint, import_llguidance
from .probe import build_checked, grammar_error

#: Built matchers each :class:`GrammarTokenizer` keeps, one per distinct grammar.
MATCHER_CACHE = 64

#: llguidance tokenizers built, per Hugging Face tokenizer object and (vocabulary size, EOS
#: ids): engines on one loaded model (replicas, a restarted worker) build it once.
_BUILT: "weakref.WeakKeyDictionary[Any, dict[tuple, Any]]" = weakref.WeakKeyDictionary()
_BUILT_LOCK = threading.Lock()


def _llg_tokenizer(hf: Any, vocab_size: int, eos: list[int]) -> Any:
    key = (vocab_size, tuple(eos))
    with _BUILT_LOCK:  # held while building: a second engine waits for the first's
        try:
            per_tokenizer = _BUILT.setdefault(hf, {})
        except TypeError:  # not weakly referenceable: built for this caller alone
            per_tokenizer = {}
        if key not in per_tokenizer:
            llg = import_llguidance()
            per_tokenizer[key] = llg.LLTokenizer(_unpadded_spec(hf.backend_tokenizer), n_vocab=vocab_size or None, eos_token=eos or None)
        return per_tokenizer[key]


def _unpadded_spec(backend: Any) -> str:
    """The tokenizer's JSON without padding or truncation (llguidance tokenizes whole
    texts). Read as it is where neither is set (the usual case): copying the tokenizer, or
    parsing its JSON, holds the GIL for a long single call (126 ms / 84 ms for a 49k
    vocabulary, stalling every stream of an event loop); ``to_str`` does not."""
    spec = backend.to_str()
    if backend.padding is None and backend.truncation is None:
        return spec
    edited = json.loads(spec)
    edited["padding"] = edited["truncation"] = None  # what no_padding() / no_truncation() leave
    return json.dumps(edited)


class GrammarTokenizer:
    """llguidance's view of one model's tokenizer, built on first use (about 0.5 s; once a
    process for each tokenizer object, vocabulary size and EOS ids)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_ids)
        self._built: Any = None
        self._lock = threading.Lock()
        self.executor: Any = None
        self._matchers: "OrderedDict[str, tuple[Any, str]]" = OrderedDict()  # grammar -> (matcher, "") or (None, error)
        self._closing: Optional[ClosingMasks] = None

    def get(self) -> Any:
        with self._lock:
            if self._built is None:
                hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
                self._built = _llg_tokenizer(hf, self._vocab_size, self._eos)
                self.executor = import_llguidance().LLExecutor()
            return self._built

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token, as the grammar sees them."""
        return self.get().decode_bytes([token])

    def closing_bits(self, words: int) -> ClosingMasks:
        """:func:`~.closing.closing_masks` of ``words`` int32 each, on this tokenizer. Built once."""
        with self._lock:
            cached = self._closing
        if cached is None or cached.closers.shape[0] != words:
            built = self.get()
            cached = closing_masks(lambda token: built.decode_bytes([token]), built.vocab_size, words, self.eos_bits(words))
            with self._lock:
                self._closing = cached
        return cached

    def eos_bits(self, words: int) -> np.ndarray:
        """A bitmask (``words`` int32) of the end-of-sequence tokens alone."""
        bits = np.zeros(words * 32, dtype=np.uint8)
        for token in self._eos:
            if token < words * 32:
                bits[token] = 1
        return np.packbits(bits, bitorder="little").view(np.int32)

    def matcher(self, grammar: str) -> Any:
        """A fresh llguidance matcher of ``grammar``: a copy of the one built and probed (on
        a compiler thread, :func:`~.grammar_probe.build_checked`) the first time this grammar
        was asked for. A grammar the probe failed raises its :class:`InvalidParameterError`."""
        built = self.get()
        with self._lock:
            entry = self._matchers.get(grammar)
            if entry is not None:
                self._matchers.move_to_end(grammar)
        if entry is None:
            entry = run_compiler(build_checked, built, grammar, self._eos)
            with self._lock:
                self._matchers[grammar] = entry
                while len(self._matchers) > MATCHER_CACHE:
                    self._matchers.popitem(last=False)
        original, error = entry
        if error:
            raise InvalidParameterError("constraint", error)
        return original.deep_copy()

    def check(self, grammar: str) -> None:
        """Raise the :class:`InvalidParameterError` of a grammar that fails on this model's
        tokenizer within a few tokens (see :mod:`.probe`); builds it if not yet built."""
        with self._lock:
            entry = self._matchers.get(grammar)
        if entry is None:
            self.matcher(grammar)
        elif entry[1]:
            raise InvalidParameterError("constraint", entry[1])

    def checked(self, grammar: str) -> bool:
        """``grammar`` was built and probed (its matcher or its error is cached)."""
        with self._lock:
            return grammar in self._matchers


class RowMatcher:
    """The matcher of one constrained request."""

    def __init__(self, constraint: Constraint, tokenizer: GrammarTokenizer) -> None:
        self.matcher = tokenizer.matcher(constraint.grammar())
        self._tokenizer = tokenizer
        self.consumed = 0
        self.json: Optional[JsonNesting] = JsonNesting() if constraint.json_output else None
        self.tokens_left: Optional[int] = None  # set by the worker before each step
        self._gauge = ClosingGauge()
        self._going_on_from_string: tuple[int, Optional[int]] = (-1, None)  # (string_start, its continuing_length)
        self.check()

    def consume(self, token: int) -> None:
        """Advance past a sampled token; raises if the grammar refused it."""
        self.matcher.consume_token(token)
        self.consumed += 1
        self.check()
        if self.json is not None:
            self.json.feed(self._tokenizer.token_bytes(token))
            if not self.json.open:
                self._gauge.reset()

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next, as llguidance tokenizes the bytes
        it forces (its fast-forward tokens); [] when none, or the matcher is done or failed."""
        if limit <= 0 or self.matcher.is_stopped() or self.matcher.is_error():
            return []
        return list(self.matcher.compute_ff_tokens()[:limit])

    def allowed_prefix(self, tokens: list[int]) -> list[int]:
        """The longest start of ``tokens`` the grammar accepts from here ([] on any fault)."""
        if not tokens or self.matcher.is_stopped() or self.matcher.is_error():
            return []
        try:
            return tokens[: self.matcher.validate_tokens(tokens)]
        except Exception:
            return []

    def mark(self) -> tuple[int, Optional["JsonNesting"]]:
        """Where the matcher is now, for :meth:`rewind` after looking ahead."""
        return self.consumed, copy(self.json)

    def rewind(self, mark: tuple[int, Optional["JsonNesting"]]) -> None:
        """Undo the tokens consumed since ``mark`` was taken."""
        consumed, nesting = mark
        if self.consumed > consumed:
            self.matcher.rollback(self.consumed - consumed)
            self._going_on_from_string = (-1, None)  # a string opened since may open again elsewhere
        self.consumed, self.json = consumed, nesting

    @property
    def near_budget_end(self) -> bool:
        """Open JSON, and few enough tokens left that :meth:`must_close` measures."""
        left, nesting = self.tokens_left, self.json
        return left is not None and nesting is not None and nesting.open > 0 and left <= nesting.open + CLOSING_WALK

    def must_close(self, masks: ClosingMasks, vocab: int) -> bool:
        """The row's token budget is about to run out before its open JSON can end: its tokens
        left are at most its :func:`~.closing.closing_length` along ``masks`` (the tokenizer's
        :meth:`~GrammarTokenizer.closing_bits`) plus a slack (:class:`~.closing.ClosingGauge`)."""
        if not self.near_budget_end:
            return False
        nesting = self.json
        return self._gauge.must_close(self.tokens_left, nesting, lambda: closing_length(
            self.matcher, nesting, masks, vocab, self._tokenizer.token_bytes))

    def steered(self, allowed: np.ndarray, masks: ClosingMasks, vocab: int) -> Optional[np.ndarray]:
        """``allowed`` (this row's bitmask) narrowed for the end of its budget, or None where
        it is left as it is: to the tokens that end its JSON soonest (:meth:`must_close`), where
        the grammar allows any; or, at a point where its JSON may end a container or go on
        (another item, an optional key), without the tokens that go on, where what they
        begin would not fit (:func:`~.closing.continuing_length`)."""
        nesting = self.json
        if self.must_close(masks, vocab):
            return narrowed(allowed, masks.tiers(nesting.in_string))
        going_on_mask = masks.going_on_mask(nesting.in_string)
        # In a string, a token such as '"},' ends the value, its object, and goes on at once.
        if not (allowed & going_on_mask).any() or not (nesting.in_string or (allowed & masks.closers).any()):
            return None
        going_on = self._continuing_length(allowed, masks, vocab)
        if going_on is None or self.tokens_left > going_on + CLOSING_SLACK:
            return None
        return narrowed(allowed, (~going_on_mask,))

    def _continuing_length(self, allowed: np.ndarray, masks: ClosingMasks, vocab: int) -> Optional[int]:
        """:func:`~.closing.continuing_length` here; in a string, measured once for that string
        (what follows its closing quote does not depend on its text)."""
        nesting = self.json
        if nesting.in_string and self._going_on_from_string[0] == nesting.string_start:
            return self._going_on_from_string[1]
        length = continuing_length(self.matcher, nesting, masks, vocab, self._tokenizer.token_bytes, allowed)
        if nesting.in_string:
            self._going_on_from_string = (nesting.string_start, length)
        return length

    @property
    def must_end(self) -> bool:
        """Between JSON values (tool calls) with too few tokens left for another as long as
        the last (with its markers): ending here beats a value the budget would cut short and
        close with made-up contents (an empty argument, a call an agent would then run)."""
        left, nesting = self.tokens_left, self.json
        return (left is not None and nesting is not None and nesting.open == 0 and nesting.value_tokens > 0
                and left <= nesting.value_tokens + CLOSING_MARGIN)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return self.matcher.is_stopped()

    def check(self) -> None:
        """Raise the :func:`~.grammar_probe.grammar_error` of a failed matcher: before any
        token, nothing can satisfy the grammar; later, its parser gave up (an ambiguous
        grammar's limit). Either is an :class:`InvalidParameterError` naming the cause."""
        if self.matcher.is_error():
            raise grammar_error(self.matcher.get_error(), self.consumed)


def grammar_bitmask(logits: mx.array, matchers: Sequence[Optional[RowMatcher]], tokenizer: GrammarTokenizer) -> Optional[np.ndarray]:
    """The tokens each row of ``logits`` may take, as a bitmask ``(batch, words)`` int32 (bit
    ``t % 32`` of word ``t // 32``: token t allowed; every bit set for a row left free); None
    when no row is constrained.

    ``matchers[i]`` is row i's matcher or None (that row is left as it is). The masks of
    all constrained rows are computed together by llguidance's parallel executor; a row
    whose matcher failed raises (:meth:`RowMatcher.check`). A row whose budget is about to
    run out with JSON still open (:meth:`RowMatcher.must_close`) is narrowed to the tokens
    that end it soonest (:mod:`.closing`), where the grammar allows any, so the answer ends
    valid rather than cut;
    one between JSON values (tool calls) with too few tokens left for another
    (:attr:`RowMatcher.must_end`) is narrowed to EOS, where the grammar allows it.
    """
    if all(m is None for m in matchers):
        return None
    mx.async_eval(logits)  # the model computes while the masks are filled
    return fill_bitmask(logits.shape[1], matchers, tokenizer)


def fill_bitmask(vocab: int, matchers: Sequence[Optional[RowMatcher]], tokenizer: GrammarTokenizer) -> np.ndarray:
    """:func:`grammar_bitmask`'s masks for rows of ``vocab`` logits, without the logits (a
    verify walk's forced positions, whose logits are never computed)."""
    rows = [(m.matcher, i) for i, m in enumerate(matchers) if m is not None]
    batch = len(matchers)
    words = (vocab + 31) // 32
    bitmask = np.full((batch, words), -1, dtype=np.int32)
    # The executor exists: it is built with the tokenizer, which every RowMatcher needed.
    tokenizer.executor.unsafe_compute_mask_ptr(rows, bitmask.ctypes.data, words * 4, batch)
    for matcher in matchers:  # a failed row fails alone (sample_batch retries row by row)
        if matcher is not None:
            matcher.check()
    ending = [i for i, m in enumerate(matchers) if m is not None and m.must_end]
    if ending:
        eos = tokenizer.eos_bits(words)
        for i in ending:
            kept = narrowed(bitmask[i], (eos,))
            if kept is not None:  # else the grammar wants more first (a second value it requires)
                bitmask[i] = kept
    near = [(i, m) for i, m in enumerate(matchers) if m is not None and m.near_budget_end]
    if near:
        masks = tokenizer.closing_bits(words)
        for i, m in near:
            kept = m.steered(bitmask[i], masks, vocab)
            if kept is not None:
                bitmask[i] = kept
    return bitmask


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """``logits`` with the tokens ``bitmask`` (:func:`grammar_bitmask`) forbids at -inf."""
    batch, vocab = logits.shape
    bits = (mx.array(bitmask)[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1
    allowed = bits.reshape(batch, bitmask.shape[1] * 32)[:, :vocab].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))


def only_tokens(bitmask: np.ndarray, vocab: int) -> Optional[list[int]]:
    """The one token each row of ``bitmask`` allows, where every row allows exactly one
    below ``vocab`` (a token the grammar forces); else None."""
    nonzero = bitmask != 0
    if not (nonzero.sum(axis=1) == 1).all():
        return None
    at = nonzero.argmax(axis=1)
    words = bitmask[np.arange(bitmask.shape[0]), at].view(np.uint32).astype(np.int64)
    if (words & (words - 1)).any():
        return None
    tokens = [int(w) * 32 + int(word).bit_length() - 1 for w, word in zip(at, words)]
    return tokens if max(tokens) < vocab else None
