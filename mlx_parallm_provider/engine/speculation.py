"""Prompt-lookup (n-gram) speculative decoding inside the batch (issue 24).

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

Only rows whose next token depends on its logits alone speculate: no logits processors (bias,
penalties: they depend on the tokens before), no constraint (grammar fast-forward has those),
no logprobs asked. The worker speculates in a step only when
every running row does and the batch is small (a large batch is compute-bound, and drafts
would only add work), and only as many drafts as pay: :meth:`NgramSpeculator.plan` picks
the number ``k`` that maximises expected tokens per second, from the measured time of a
step of each width at this batch size and each row's own acceptance rate (a width not yet
measured is tried once; the measures are forgotten every :data:`REMEASURE_STEPS` steps).
Acceptance is kept per row: a row whose recent drafts were rejected (below
:data:`MIN_ROW_ACCEPTANCE`) proposes none, and every match it finds meanwhile draws its rate
back towards :data:`ROW_PRIOR` (:data:`RELAX`), so it tries again now and then; other rows,
and rows that arrive later, are not held back by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import mlx.core as mx

from .sampling import draw_tokens

MAX_NGRAM = 3
"""Longest n-gram matched."""

MIN_NGRAM = 2
"""Shortest n-gram matched (a single token repeats too often to predict what follows)."""

REMEASURE_STEPS = 256
"""Step times are measured again after this many steps (the machine's load changes)."""

SMOOTHING = 0.2
"""Weight of the newest sample in the moving averages of step times and acceptance."""

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


Kind = tuple[int, bool]
"""A kind of match: its n-gram's length, and whether what followed it is in the prompt."""


def kind(n: int, at: int, prompt_len: int) -> Kind:
    """The kind of a match of ``n`` tokens whose draft starts at position ``at``. Kinds differ
    a lot: plain chat on the default model (32 answers, every draft verified) kept the first
    draft token of 7% of 2-token matches, 35% of 3-token matches in the prompt and 78% of
    3-token matches in the answer so far."""
    return n, at < prompt_len


def can_speculate(request: Any) -> bool:
    """Whether ``request``'s next token depends on its logits alone (greedy or sampled, no
    processors, constraint or logprobs)."""
    sampler = request.state.sampler if request.state is not None else None
    return (sampler is not None and not sampler.processors and sampler.matcher is None
            and not request.params.logprobs and not request.params.top_logprobs)


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


def moving_average(old: Optional[float], sample: float) -> float:
    """``old`` moved :data:`SMOOTHING` of the way to ``sample`` (``sample`` itself when None)."""
    return sample if old is None else old + SMOOTHING * (sample - old)


class StepTimes:
    """Measured seconds of a decode step of ``rows`` rows that verifies ``k`` tokens a row
    beyond the one it decodes (0: a plain step), as moving averages; shared by the n-gram
    speculator and grammar fast-forward (:mod:`.fast_forward`), whose steps have the same
    shape. Widths other than 0 are forgotten every :data:`REMEASURE_STEPS` steps."""

    def __init__(self) -> None:
        self._seconds: dict[tuple[int, int], float] = {}
        self._restart: dict[int, float] = {}  # rows -> the plain step right after an n-gram verify step
        self._steps = 0
        # Whether verify steps compute each row's real positions only (the runner's ``ragged``),
        # so that their cost follows the drafts' total (see width()).
        self.ragged = False

    def width(self, drafts: Sequence[int], k: int) -> int:
        """The width a step verifying up to ``k`` of each row's drafts (``drafts``: their
        lengths, 0 for a row without) is measured and estimated at: ``k`` where every row
        computes the widest row's positions (right padding), else the rows' mean, rounded up."""
        if not self.ragged or k == 0 or not drafts:
            return k
        return -(-sum(min(d, k) for d in drafts) // len(drafts))

    def get(self, rows: int, k: int) -> Optional[float]:
        """The measured time, or None when not measured (since the last forgetting)."""
        return self._seconds.get((rows, k))

    def estimate(self, rows: int, k: int) -> Optional[float]:
        """The time a step of ``rows`` rows verifying ``k`` tokens a row should take: measured,
        else from the widths measured at this row count (between the nearest narrower one, or
        the plain step, and the nearest wider one, linearly: on the CPU a step's cost grows
        with its positions; past the widest, the widest's own, so a wider one is tried once
        and then known), else from the nearest row count that measured ``k`` (its cost
        relative to its plain step); None where nothing says (the planners then try the width
        once). Each untried width was tried once before, and eight rows of constrained tool
        calls through LiteLLM spent more time trying widths than fast-forward saved (0.67x)."""
        exact = self._seconds.get((rows, k))
        plain = self._seconds.get((rows, 0))
        if exact is not None or k == 0 or plain is None:
            return exact
        widths = sorted(w for n, w in self._seconds if n == rows and w > 0)
        wider = [w for w in widths if w > k]
        if wider:
            lo, hi = max([w for w in widths if w < k], default=0), wider[0]
            low, high = self._seconds[(rows, lo)], self._seconds[(rows, hi)]
            return low + (high - low) * (k - lo) / (hi - lo)
        if widths:
            return self._seconds[(rows, widths[-1])]
        others = [n for n, w in self._seconds if w == k and n != rows and (n, 0) in self._seconds]
        if others:
            n = min(others, key=lambda n: abs(n - rows))
            return plain * self._seconds[(n, k)] / self._seconds[(n, 0)]
        return None

    def record(self, rows: int, k: int, seconds: float) -> None:
        """The time of a step of ``rows`` rows that verified ``k`` tokens a row."""
        self._steps += 1
        if self._steps % REMEASURE_STEPS == 0:
            self._seconds = {key: s for key, s in self._seconds.items() if key[1] == 0}
        self._seconds[(rows, k)] = moving_average(self._seconds.get((rows, k)), seconds)

    def record_restart(self, rows: int, seconds: float) -> None:
        """The time of the plain step of ``rows`` rows that followed an n-gram verify step."""
        self._restart[rows] = moving_average(self._restart.get(rows), seconds)

    def restart_cost(self, rows: int) -> float:
        """What a verify step of ``rows`` plain rows costs the plain step after it (seconds,
        0 until measured): with decoding ahead (:mod:`.decode_ahead`) a plain step's graph is
        built while the step before it computes, but a verify step's tokens are known only
        when it ends, so the step after it builds and computes in turn. One stream of the
        default model: a plain step 7.3 ms, one after a verify step 9.5 ms; a draft kept half
        the time paid for its verify step without this and lost with it."""
        restart, plain = self._restart.get(rows), self._seconds.get((rows, 0))
        return max(0.0, restart - plain) if restart is not None and plain is not None else 0.0


class NgramSpeculator:
    """Drafts and verification for one engine's rows.

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
        index = self._index.get(id(request))
        matched = index.matched if index is not None else None
        return None if matched is None else kind(*matched, len(request.prompt_ids))

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
        if not can_speculate(request) or request.finished:
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
        """Up to ``k`` tokens that followed the latest earlier occurrence of ``request``'s
        longest recent n-gram in its prompt + output (its index brought up to date)."""
        index = self._index.get(id(request))
        if index is None:
            index = self._index[id(request)] = NgramIndex()
        prompt = request.prompt_ids  # index only the tokens it has not seen (no prompt + output copy a step)
        index.extend(prompt[len(index.tokens) :])
        index.extend(request.output_ids[len(index.tokens) - len(prompt) :])
        return index.propose(k)

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
        self._acceptance.pop(id(request), None)
        request.draft = []

    def plan(self, rows: Sequence[Any]) -> int:
        """How many drafts a row verifies this step (0: decode plainly): few rows, all able to
        speculate, one with a draft, and the ``k`` expected to give most tokens a second."""
        if not (0 < len(rows) <= self.max_batch and any(r.draft for r in rows) and all(can_speculate(r) for r in rows)):
            return 0
        n = len(rows)
        plain = self.times.get(n, 0)
        if plain is None:
            return 0  # measure a plain step first
        lengths = [len(r.draft) for r in rows]
        rates = [min(self.acceptance(r), 0.999) for r in rows]
        best, best_rate = 0, n / plain
        for k in range(1, min(self.k, max(lengths)) + 1):
            # expected: each row's accepted drafts + the one token it chooses
            tokens = n + sum(a * (1 - a ** min(d, k)) / (1 - a) for a, d in zip(rates, lengths))
            seconds = (self.times.estimate(n, self.times.width(lengths, k)) or plain) + self.times.restart_cost(n)
            rate = tokens / seconds  # width not known: as cheap as a plain step, so tried once
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def verify(self, runner: Any, rows: Sequence[Any], k: int) -> list[list[int]]:
        """One forward over each row's last token and its first ``k`` drafts; the tokens each
        row emits (its choice at every position up to the first rejected draft)."""
        drafts = [list(r.draft[:k]) for r in rows]
        spots = runner.logits_where_asked(list(rows), [[r.output_ids[-1], *d] for r, d in zip(rows, drafts)],
                                          [r.num_tokens - 1 for r in rows])
        firsts = [sum(len(d) + 1 for d in drafts[:i]) for i in range(len(rows))]  # each row's first position's
        logits = spots.at([(i, j) for i, d in enumerate(drafts) for j in range(len(d) + 1)])  # real positions only
        greedy = mx.argmax(logits, axis=-1)
        draws = {i: _draws(r.state.sampler, logits[firsts[i] : firsts[i] + len(drafts[i]) + 1]) for i, r in enumerate(rows)
                 if not r.state.sampler.greedy}
        mx.eval(greedy, [tokens for tokens, _ in draws.values()])
        flat = greedy.tolist()
        choices = [flat[firsts[i] : firsts[i] + len(d) + 1] for i, d in enumerate(drafts)]
        for i, (tokens, _) in draws.items():
            choices[i] = tokens.tolist()
        emitted: list[list[int]] = []
        for i, (draft, chosen) in enumerate(zip(drafts, choices)):
            n = 0
            while n < len(draft) and draft[n] == chosen[n]:
                n += 1
            emitted.append(chosen[: n + 1])
            if i in draws:  # the key as n + 1 plain draws leave it
                rows[i].state.sampler.key = draws[i][1][n]
            self.stats.drafted += len(draft)
            self.stats.accepted += n
            self.stats.emitted += n + 1
            self.record_acceptance(rows[i], len(draft), n)
        self.stats.steps += 1
        return emitted


def _draws(sampler: Any, logits: mx.array) -> tuple[mx.array, list[mx.array]]:
    """A sampled row's draw at each position of ``logits`` (``(width, vocab)``), each with
    the next key of the row's chain, lazily; and the key after each draw (the row's key is
    put back to the one after the last kept token)."""
    tokens, keys = [], []
    for j in range(logits.shape[0]):
        tokens.append(draw_tokens(logits[j : j + 1], [sampler]))
        keys.append(sampler.key)
    return mx.concatenate(tokens), keys


def speculator_for(config: Any, times: Optional[StepTimes] = None) -> Optional[NgramSpeculator]:
    """The engine's speculator, or None when off."""
    if getattr(config, "speculative", None) != "ngram":
        return None
    return NgramSpeculator(config.num_speculative_tokens, config.speculative_max_batch, times)
