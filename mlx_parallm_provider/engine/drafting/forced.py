"""Grammar fast-forward: the tokens a constrained row's grammar forces, proposed as its drafts
and verified in one forward instead of one decode step each (:mod:`.verify`).

Under a grammar many next tokens are forced (``{"name": "``, the keys of a closed schema,
closing braces). After each step every constrained row drafts the tokens llguidance reports
as forced (:meth:`~..grammar.guided.RowMatcher.forced`, its fast-forward tokens). The next step runs
each row's last token and its forced ones as one short causal block over its KV blocks (the
verify shape of n-gram drafts; rejected tokens' KV needs no undo, the scheduler fits
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
(:class:`~.step_times.StepTimes`, shared with the n-gram drafts) and the acceptance rate say
pay: a large compute-bound batch decodes plainly.

With n-gram speculation on (``speculative="ngram"``), a constrained row that nothing forces
drafts from its prompt + output instead (the speculator's lookup), cut to what its grammar
accepts: verified the same way, so its output stays what it would be; such drafts are
accepted less often, so they plan by the row's own lookup acceptance rate, kept by the
speculator (:meth:`~.ngram.NgramProposer.acceptance`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..plan import Drafted
from .ngram import NgramProposer
from .step_times import StepTimes, best_width, moving_average

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


class ForcedProposer:
    """Forced-token drafts of one engine's constrained rows, and their acceptance rate.

    Args:
        max_batch: fast-forward only while at most this many rows decode.
        times: the measured step times (shared with the n-gram speculator).
        limit: most forced tokens a row verifies a step.
        lookup: the n-gram speculator, whose drafts (and per-row acceptance) serve rows nothing
            forces (None: they draft nothing); ``lookup_limit`` of them at most.
    """

    def __init__(self, max_batch: int, times: StepTimes, limit: int = MAX_FORCED,
                 lookup: Optional[NgramProposer] = None, lookup_limit: int = 0) -> None:
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
        among the rows' draft lengths, expected to give the most tokens a second
        (:func:`.step_times.best_width`)."""
        if len(rows) > self.max_batch or not any(r.draft and can_fast_forward(r) for r in rows):
            return 0
        drafts = [(len(r.draft), self._rate_of(r)) if r.draft and can_fast_forward(r) else (0, 0.0) for r in rows]
        return best_width(self.times, drafts, sorted({d for d, _ in drafts if d}))

    def _rate_of(self, request: Any) -> float:
        """The acceptance rate ``request``'s draft plans by (forced or looked up)."""
        looked_up = self.lookup is not None and id(request) in self._looked_up
        return min(self.lookup.acceptance(request) if looked_up else self._acceptance, 0.999)

    def verified(self, request: Any, result: Drafted) -> None:
        """A verify step kept ``result.accepted`` of ``request``'s ``result.drafted`` drafts."""
        self.stats.row_steps += 1
        self.stats.emitted += result.emitted
        if self.lookup is not None and id(request) in self._looked_up:
            self.stats.looked_up += result.drafted
            self.stats.looked_up_accepted += result.accepted
            self.lookup.record_acceptance(request, result.drafted, result.accepted)
        else:
            self.stats.forced += result.drafted
            self.stats.accepted += result.accepted
            self._acceptance = moving_average(self._acceptance, result.accepted / min(result.drafted, result.accepted + 1))


def forced_proposer_for(config: Any, times: StepTimes, lookup: Optional[NgramProposer] = None) -> Optional["ForcedProposer"]:
    """The engine's fast-forward, or None when off; ``lookup``: the n-gram speculator, for
    constrained rows nothing forces."""
    if not getattr(config, "grammar_fast_forward", False):
        return None
    return ForcedProposer(config.speculative_max_batch, times, lookup=lookup, lookup_limit=config.num_speculative_tokens)
