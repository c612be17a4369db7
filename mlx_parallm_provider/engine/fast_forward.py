"""Grammar fast-forward inside the batch (issue 24): the tokens a constrained row's grammar
forces, computed in one forward instead of one decode step each.

Under a grammar many next tokens are forced (``{"name": "``, the keys of a closed schema,
closing braces). After each step every constrained row drafts the tokens llguidance reports
as forced (:meth:`~.guided.RowMatcher.forced`, its fast-forward tokens). The next step runs
each row's last token and its forced ones as one short causal block over its KV blocks (the
verify shape of :mod:`.speculation`; rejected tokens' KV needs no undo, the scheduler fits
the row's blocks to its tokens), then walks each drafting row's positions in order and
samples each exactly as a plain step would: the mask of the matcher advanced past the tokens
before it (then rewound: the worker consumes the kept tokens as usual), the logits
processors over the same history, the filters, the row's PRNG key split once a token, its
logprobs, the steer to close JSON near the budget. The row keeps the tokens up to the first
one that differs from its draft, plus that one, so each step emits 1 to ``k + 1`` tokens.

Why it is on by default (``EngineConfig.grammar_fast_forward``): it cannot change output.
Every token a row keeps is the one its own sampler draws, with the key it would have used,
from the masked logits at its position; and where a token is forced, the mask allows it
alone (llguidance allows only its own tokenization of forced bytes: every fast-forward token
of a schema's keys measured here was the one token of its mask), so no logits choose another.
The one difference from plain decoding is that a position's logits come from a several-token
forward rather than a one-token one: float rounding of the kind a row's logits already have
between batches of different sizes. It runs only while at most ``speculative_max_batch``
rows decode, with as many forced tokens a row as the measured step times
(:class:`~.speculation.StepTimes`, shared with the n-gram drafts) and the acceptance rate say
pay: a large compute-bound batch decodes plainly.

With n-gram speculation on (``speculative="ngram"``), a constrained row that nothing forces
drafts from its prompt + output instead (the speculator's lookup), cut to what its grammar
accepts: verified the same way, so its output stays what it would be; such drafts are
accepted less often, so they plan by the row's own lookup acceptance rate, kept by the
speculator (:meth:`~.speculation.NgramSpeculator.acceptance`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import mlx.core as mx

from .guided import fill_bitmask, only_tokens
from .sampling import SampledRow, sample_batch, sample_requests
from .speculation import NgramSpeculator, StepTimes

logger = logging.getLogger(__name__)

MAX_FORCED = 16
"""Most forced tokens a row verifies in one step."""


def can_fast_forward(request: Any) -> bool:
    """Whether ``request`` decodes under a grammar (its drafts are its forced tokens)."""
    sampler = request.state.sampler if request.state is not None else None
    return sampler is not None and sampler.matcher is not None


@dataclass
class FastForwardStats:
    """Counts of one engine's fast-forward (``stats()["fast_forward"]``)."""

    steps: int = 0  # steps that verified forced tokens
    row_steps: int = 0  # (row, step) pairs with forced tokens
    forced: int = 0  # forced tokens verified
    accepted: int = 0  # of them, kept
    looked_up: int = 0  # n-gram tokens verified (rows nothing forced)
    looked_up_accepted: int = 0  # of them, kept
    emitted: int = 0  # tokens those row-steps emitted (kept + the one sampled after)

    def as_dict(self) -> dict[str, float]:
        return {"fast_forward_steps": self.steps, "forced_tokens": self.forced, "accepted_tokens": self.accepted,
                "acceptance_rate": self.accepted / self.forced if self.forced else 0.0,
                "lookup_tokens": self.looked_up, "lookup_accepted_tokens": self.looked_up_accepted,
                "tokens_per_row_step": self.emitted / self.row_steps if self.row_steps else 0.0}


class FastForward:
    """Forced-token drafts and their verification for one engine's constrained rows.

    Args:
        max_batch: fast-forward only while at most this many rows decode.
        times: the measured step times (shared with the n-gram speculator).
        limit: most forced tokens a row verifies a step.
        lookup: the n-gram speculator, whose drafts (and per-row acceptance) serve rows nothing
            forces (None: they draft nothing); ``lookup_limit`` of them at most.
    """

    def __init__(self, max_batch: int, times: StepTimes, limit: int = MAX_FORCED,
                 lookup: Optional[NgramSpeculator] = None, lookup_limit: int = 0) -> None:
        self.max_batch, self.times, self.limit = max_batch, times, limit
        self.lookup, self.lookup_limit = lookup, lookup_limit
        self.stats = FastForwardStats()
        self._acceptance = 0.9  # of one forced token, a moving average (forced tokens are mostly the mask's only one)
        self._looked_up: set[int] = set()  # the rows whose drafts are looked up, not forced

    def draft_all(self, rows: Sequence[Any]) -> None:
        """Set every constrained row's draft to its forced tokens (none while too many rows
        decode); other rows' drafts are left as they are."""
        few = len(rows) <= self.max_batch
        self._looked_up.clear()
        for request in rows:
            if not can_fast_forward(request) or request.finished:
                continue
            left = request.params.max_tokens - len(request.output_ids) - 1  # the step samples one token besides
            matcher = request.state.sampler.matcher
            try:
                request.draft = matcher.forced(min(self.limit, left)) if few else []
                if few and not request.draft and self.lookup is not None and left > 0:
                    request.draft = matcher.allowed_prefix(self.lookup.propose(request, min(self.lookup_limit, left)))
                    if request.draft:
                        self._looked_up.add(id(request))
            except Exception:  # the next plain step's mask reports the matcher's fault, for this row alone
                logger.debug("no drafts for request %s", request.request_id, exc_info=True)
                request.draft = []

    def plan(self, rows: Sequence[Any]) -> int:
        """How many forced tokens a row verifies this step (0: decode plainly): the number,
        among the rows' draft lengths, expected to give the most tokens a second."""
        drafting = [(len(r.draft), self._rate_of(r)) for r in rows if r.draft and can_fast_forward(r)]
        if not drafting or len(rows) > self.max_batch:
            return 0
        n = len(rows)
        plain = self.times.get(n, 0)
        if plain is None:
            return 0  # measure a plain step first
        lengths = [length for length, _ in drafting]
        best, best_rate = 0, n / plain
        for k in sorted(set(lengths)):
            gained = sum(a * (1 - a ** min(length, k)) / (1 - a) for length, a in drafting)  # expected kept tokens
            seconds = self.times.estimate(n, self.times.width(lengths + [0] * (n - len(lengths)), k))
            rate = (n + gained) / (seconds or plain)  # nothing known: as cheap as a plain step, so tried once
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _rate_of(self, request: Any) -> float:
        """The acceptance rate ``request``'s draft plans by (forced or looked up)."""
        looked_up = self.lookup is not None and id(request) in self._looked_up
        return min(self.lookup.acceptance(request) if looked_up else self._acceptance, 0.999)

    def verify(self, runner: Any, rows: Sequence[Any], k: int) -> list[list[SampledRow]]:
        """One forward over each row's last token and its first ``k`` forced tokens (rows
        without, their last token only); what each row emits, in order. Logits are computed
        only at the positions sampled from them (see :class:`_Walk`)."""
        drafts = [list(r.draft[:k]) if can_fast_forward(r) else [] for r in rows]
        spots = runner.logits_where_asked(list(rows), [[r.output_ids[-1], *d] for r, d in zip(rows, drafts)],
                                          [r.num_tokens - 1 for r in rows])
        out: list[list[SampledRow]] = [[] for _ in rows]
        plain = [i for i, d in enumerate(drafts) if not d]
        if plain:  # sampled together, as in a plain step (each row as if alone)
            for i, row in zip(plain, sample_requests(spots.at([(i, 0) for i in plain]), [rows[i] for i in plain])):
                out[i] = [row]
        walks = {i: _Walk(rows[i], draft, spots.vocab) for i, draft in enumerate(drafts) if draft}
        try:
            while walks:  # each round: every walk on to a position its grammar leaves open, whose logits come together
                asked = [(i, walk) for i, walk in walks.items() if walk.advance()]
                if asked:  # sampled together, each as if alone
                    got = sample_batch(spots.at([(i, w.j) for i, w in asked]), [w.sampler for _, w in asked],
                                       [w.history for _, w in asked], [w.left - w.j for _, w in asked])
                    for (_, walk), row in zip(asked, got):
                        walk.took(row)
                for i in [i for i, walk in walks.items() if walk.done]:
                    out[i] = self._count(rows[i], drafts[i], walks.pop(i).finish())
        finally:  # (a step that fails leaves every matcher where it was)
            for walk in walks.values():
                walk.finish()
        self.stats.steps += 1
        return out

    def _count(self, request: Any, draft: list[int], out: list[SampledRow]) -> list[SampledRow]:
        """Record what ``request``'s walk kept of ``draft``; ``out`` unchanged."""
        kept = sum(1 for got, want in zip(out, draft) if got.error is None and got.token == want)
        self.stats.row_steps += 1
        self.stats.emitted += len(out)
        if self.lookup is not None and id(request) in self._looked_up:
            self.stats.looked_up += len(draft)
            self.stats.looked_up_accepted += kept
            self.lookup.record_acceptance(request, len(draft), kept)
        else:
            self.stats.forced += len(draft)
            self.stats.accepted += kept
            self._acceptance += 0.2 * (kept / min(len(draft), kept + 1) - self._acceptance)
        return out


class _Walk:
    """One drafting row's positions, sampled in order while each draws its draft token: the
    mask of the matcher advanced past the tokens before it, the row's PRNG key split once a
    token, as a plain step samples. Where the mask allows one token and nothing else needs
    the logits (no logits processors, no logprobs), the token is taken without them, as
    :func:`~.sampling.sample_batch` takes it; elsewhere the walk waits for the position's
    logits (:meth:`advance` says so). The matcher is left where it was (:meth:`finish`)."""

    def __init__(self, request: Any, draft: list[int], vocab: int) -> None:
        self.request, self.draft, self.vocab = request, draft, vocab
        self.sampler = request.state.sampler
        self.matcher = self.sampler.matcher
        self.left = request.params.max_tokens - len(request.output_ids)
        self.mark = self.matcher.mark()
        self.j, self.out, self.done = 0, [], False
        self.without_logits = not self.sampler.processors and not request.params.logprobs

    def advance(self) -> bool:
        """Take the positions whose one allowed token needs no logits; whether the walk now
        waits for the logits of position :attr:`j`."""
        try:
            while not self.done and self.without_logits:
                self.matcher.tokens_left = self.left - self.j
                forced = only_tokens(fill_bitmask(self.vocab, [self.matcher], self.sampler.grammar), self.vocab)
                if forced is None:
                    break
                if not self.sampler.greedy:
                    self.sampler.next_key()  # (the draw it skips would have taken it)
                self.took(SampledRow(token=forced[0]))
        except Exception as exc:  # the matcher failed: this row alone fails
            self.took(SampledRow(error=exc))
        return not self.done

    def history(self) -> mx.array:
        """The tokens before position :attr:`j` (prompt, output, the draft's), for penalties."""
        return mx.array(self.request.prompt_ids + self.request.output_ids + self.draft[: self.j])

    def took(self, row: SampledRow) -> None:
        """Position :attr:`j`'s token (or error): the walk goes on past it, or ends."""
        self.out.append(row)
        if row.error is not None or self.j == len(self.draft) or row.token != self.draft[self.j]:
            self.done = True
            return
        try:
            self.matcher.consume(row.token)  # the next position's mask follows it
            self.j += 1
        except Exception as exc:  # consume() refused a token the mask allowed: this row alone fails
            self.out[-1] = SampledRow(error=exc)
            self.done = True

    def finish(self) -> list[SampledRow]:
        """What the row emits; its matcher rewound to where the walk began."""
        self.matcher.rewind(self.mark)
        return self.out


def fast_forward_for(config: Any, times: StepTimes, lookup: Optional[NgramSpeculator] = None) -> "FastForward | None":
    """The engine's fast-forward, or None when off; ``lookup``: the n-gram speculator, for
    constrained rows nothing forces."""
    if not getattr(config, "grammar_fast_forward", False):
        return None
    return FastForward(config.speculative_max_batch, times, lookup=lookup, lookup_limit=config.num_speculative_tokens)
