"""Prompt-lookup (n-gram) drafts: the proposer of plain rows' drafts.

Each speculating row proposes up to ``k`` draft tokens by finding the latest earlier place
in its own prompt + output where its last ``n`` tokens occurred (``n`` from
:data:`MAX_NGRAM` down to 1; vLLM's ``ngram`` method, llama.cpp's lookup decoding) and
taking what followed there. One forward pass then runs every row's last token and its
drafts over its KV blocks; a row keeps the drafts up to the first one that differs from its
own choice at that position, plus that choice, so each step emits 1 to ``k + 1`` tokens,
exactly those plain decoding would (up to float rounding between a one-token and a
several-token pass). A greedy row's choice is the arg-max; a sampled row draws each position
in order with the key plain decoding would use there (its key is split once per token kept,
as a plain step splits it), so a sampled row keeps a draft with the probability its sampler
gives that token (the standard acceptance rule for a draft proposed with certainty), draws
exactly what it would draw without speculation, and a seeded request gives the same tokens
with speculation on or off. Rejected drafts' KV needs no undo: the scheduler fits the row's
blocks to its tokens at the next step, and their slots are written over.

Only rows whose next token needs no work on the host speculate: no constraint (grammar
fast-forward has those), no logprobs asked (:func:`~..sampled.plain_row`); a row's logit bias
and penalties apply at each position, over the tokens before it, drafts included. A step verifies drafts only when
every running row can and the batch is small (a large batch is compute-bound, and drafts
would only add work), and only as many drafts as pay: :meth:`NgramProposer.plan` picks
the number ``k`` that maximises expected tokens per second, from the measured time of a
step of each width at this batch size and each row's own acceptance rate (a width not yet
measured is tried once; the measures are forgotten now and then: :mod:`.step_times`).
Verification is the runner's (:mod:`.verify`); what it kept comes back through
:meth:`NgramProposer.verified`.
Acceptance is kept per row: a row whose recent drafts were rejected (below
:data:`MIN_ROW_ACCEPTANCE`) proposes none, and every match it finds meanwhile draws its rate
back towards :data:`ROW_PRIOR` (:data:`RELAX`), so it tries again now and then; other rows,
and rows that arrive later, are not held back by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..plan import Drafted
from ..sampled import plain_row
from .step_times import StepTimes, best_width, moving_average

MAX_NGRAM = 3
"""Longest n-gram matched."""

MIN_NGRAM = 2
"""Shortest n-gram matched (a single token repeats too often to predict what follows)."""

ROW_PRIOR = 0.5
"""A new row's acceptance rate (of one draft token), before any of its drafts is verified."""

MIN_ROW_ACCEPTANCE = 0.2
"""A row whose acceptance rate is below this proposes no drafts (its lookups only relax it)."""

RELAX = 1 / 32
"""How far each lookup match draws a row's acceptance rate back towards :data:`ROW_PRIOR`:
a row held back by rejections tries again after ~10 matches."""


class NgramIndex:
    """Where each n-gram (n = 1..MAX_NGRAM) of a growing token list last ended: the position
    that followed it. Updated as tokens are appended, so a lookup costs O(n), not a scan."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        self.matched: Optional[tuple[int, int]] = None  # the last proposal's n-gram length and first position (None: none)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens``; each n-gram ending just before a new token points at it."""
        for token in tokens:
            t = len(self.tokens)
            for n in range(1, MAX_NGRAM + 1):
                if t >= n:
                    self._after[tuple(self.tokens[t - n : t])] = t
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix (of at most MAX_NGRAM tokens) that occurred before; [] when none did (or
        ``k`` < 1). :attr:`matched` says which match it was."""
        tokens = self.tokens
        self.matched = None
        if k < 1:
            return []
        for n in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
            at = self._after.get(tuple(tokens[-n:]))
            if at is not None and at < len(tokens):
                self.matched = (n, at)
                return tokens[at : at + k]
        return []

    def follow(self, recent: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest occurrence here of the longest suffix
        of ``recent`` (another text's last tokens; :data:`MAX_NGRAM` down to
        :data:`MIN_NGRAM` of them); [] when none occurs. :attr:`matched` says which match."""
        self.matched = None
        if k < 1:
            return []
        for n in range(min(MAX_NGRAM, len(recent)), MIN_NGRAM - 1, -1):
            at = self._after.get(tuple(recent[len(recent) - n :]))
            if at is not None:
                self.matched = (n, at)
                return self.tokens[at : at + k]
        return []


Kind = tuple[int, str]
"""A kind of match: its n-gram's length, and where what followed it is: ``"prompt"``,
``"output"`` (the answer so far) or ``"prediction"`` (the request's predicted output)."""


def kind(n: int, at: int, prompt_len: int) -> Kind:
    """The kind of a match of ``n`` tokens in a row's prompt + output whose draft starts at
    position ``at``. Kinds differ a lot: plain chat on the default model (32 answers, every
    draft verified) kept the first draft token of 7% of 2-token matches, 35% of 3-token
    matches in the prompt and 78% of 3-token matches in the answer so far."""
    return n, "prompt" if at < prompt_len else "output"


@dataclass
class SpeculationStats:
    """Counts of one engine's speculation."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"speculative_steps": self.steps, "draft_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "tokens_per_step": self.emitted / self.steps if self.steps else 0.0}


class NgramProposer:
    """Drafts of one engine's plain rows, and their acceptance rates.

    Args:
        k: most draft tokens a row proposes per step (``num_speculative_tokens``).
        max_batch: speculate only while at most this many rows decode.
        times: the step times to plan by (shared with fast-forward; a new table when None).
    """

    def __init__(self, k: int, max_batch: int, times: Optional[StepTimes] = None) -> None:
        self.k, self.max_batch = k, max_batch
        self.stats = SpeculationStats()
        self.times = StepTimes() if times is None else times
        self._index: dict[int, NgramIndex] = {}
        self._predicted: dict[int, NgramIndex] = {}  # per row with a predicted output: its tokens, indexed
        self._matched: dict[int, Kind] = {}  # per row: the kind of its latest lookup's match (none: absent)
        self._acceptance: dict[int, float] = {}  # per row, of one draft token: a moving average
        self._kinds: dict[Kind, float] = {}  # per kind of match, engine-wide: a moving average

    def acceptance(self, request: Any) -> float:
        """The acceptance rate of one of ``request``'s draft tokens: the lower of its own
        (:data:`ROW_PRIOR` until verified) and its current draft's kind's (:func:`kind`;
        :data:`ROW_PRIOR` until one was verified)."""
        own = self._acceptance.get(id(request), ROW_PRIOR)
        kind = self._kind_of(request)
        return own if kind is None else min(own, self._kinds.get(kind, ROW_PRIOR))

    def _kind_of(self, request: Any) -> Optional[Kind]:
        """The kind of ``request``'s latest lookup's match (None: it found none)."""
        return self._matched.get(id(request))

    def record_acceptance(self, request: Any, drafted: int, accepted: int) -> None:
        """A verify step kept ``accepted`` of ``request``'s ``drafted`` drafts."""
        if drafted:  # per draft token: accepted / tried (a rejection ends the row's tries)
            sample = accepted / min(drafted, accepted + 1)
            self._acceptance[id(request)] = moving_average(self._acceptance.get(id(request), ROW_PRIOR), sample)
            kind = self._kind_of(request)
            if kind is not None:
                self._kinds[kind] = moving_average(self._kinds.get(kind, ROW_PRIOR), sample)

    def draft(self, request: Any) -> None:
        """Set ``request.draft`` for its next step (after it took its latest token)."""
        if not plain_row(request) or request.finished:
            request.draft = []  # (a constrained row's index stays: fast-forward looks up in it)
            return
        left = request.params.max_tokens - len(request.output_ids) - 1  # the step emits one token besides
        request.draft = self.propose(request, min(self.k, left))

    def propose(self, request: Any, k: int) -> list[int]:
        """:meth:`lookup`'s drafts where ``request``'s acceptance rate is at least
        :data:`MIN_ROW_ACCEPTANCE`, else none (a match found then relaxes the rate)."""
        draft = self.lookup(request, k)
        if draft:  # each match draws the rates below the prior back towards it
            for rates, key in ((self._acceptance, id(request)), (self._kinds, self._kind_of(request))):
                rate = rates.get(key, ROW_PRIOR)
                if rate < ROW_PRIOR:
                    rates[key] = rate + RELAX * (ROW_PRIOR - rate)
        return draft if self.acceptance(request) >= MIN_ROW_ACCEPTANCE else []

    def lookup(self, request: Any, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest occurrence of ``request``'s longest
        recent n-gram: in its predicted output first (OpenAI's ``prediction``: what the answer
        is expected to be), else earlier in its prompt + output (its index brought up to date)."""
        index = self._index.get(id(request))
        if index is None:
            index = self._index[id(request)] = NgramIndex()
        prompt = request.prompt_ids  # index only the tokens it has not seen (no prompt + output copy a step)
        index.extend(prompt[len(index.tokens) :])
        index.extend(request.output_ids[len(index.tokens) - len(prompt) :])
        self._matched.pop(id(request), None)
        predicted = request.predicted_ids
        if predicted:
            expected = self._predicted.get(id(request))
            if expected is None:
                expected = self._predicted[id(request)] = NgramIndex()
                expected.extend(predicted)
            draft = expected.follow(index.tokens[-MAX_NGRAM:], k)
            if draft:
                self._matched[id(request)] = (expected.matched[0], "prediction")  # type: ignore[index]
                return draft
        draft = index.propose(k)
        if index.matched is not None:
            self._matched[id(request)] = kind(*index.matched, len(prompt))
        return draft

    def draft_all(self, rows: Sequence[Any]) -> None:
        """Set every decoding row's drafts for the next step (none while too many rows decode:
        they would not be verified, only held room for)."""
        few = len(rows) <= self.max_batch
        for request in rows:
            if few:
                self.draft(request)
            else:
                request.draft = []

    def forget(self, request: Any) -> None:
        """Drop a finished or preempted request's index and acceptance."""
        self._index.pop(id(request), None)
        self._predicted.pop(id(request), None)
        self._matched.pop(id(request), None)
        self._acceptance.pop(id(request), None)
        request.draft = []

    def plan(self, rows: Sequence[Any]) -> int:
        """How many drafts a row verifies this step (0: decode plainly): few rows, all plain
        (:func:`~..sampled.plain_row`), one with a draft, and the width expected to give the
        most tokens a second (:func:`.step_times.best_width`), the plain step a verify step
        delays counted."""
        if not (0 < len(rows) <= self.max_batch and any(r.draft for r in rows) and all(plain_row(r) for r in rows)):
            return 0
        drafts = [(len(r.draft), min(self.acceptance(r), 0.999)) for r in rows]
        widths = range(1, min(self.k, max(d for d, _ in drafts)) + 1)
        return best_width(self.times, drafts, widths, self.times.restart_cost(len(rows)))

    def verified(self, request: Any, result: Drafted) -> None:
        """A verify step kept ``result.accepted`` of ``request``'s ``result.drafted`` drafts."""
        self.stats.drafted += result.drafted
        self.stats.accepted += result.accepted
        self.stats.emitted += result.accepted + 1
        self.record_acceptance(request, result.drafted, result.accepted)


def ngram_proposer_for(config: Any, times: Optional[StepTimes] = None) -> Optional["NgramProposer"]:
    """The engine's speculator, or None when off."""
    if getattr(config, "speculative", None) != "ngram":
        return None
    return NgramProposer(config.num_speculative_tokens, config.speculative_max_batch, times)
