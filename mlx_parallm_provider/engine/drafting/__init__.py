"""Speculative drafts: the scheduler's side. A :class:`Proposer` sets each decoding row's
``draft`` after its step; :meth:`Drafting.plan` decides whether the next step verifies drafts
and how many a row (one planner for every kind, by the measured step times:
:mod:`.step_times`); the runner verifies them (:mod:`.verify`); :meth:`Drafting.verified`
and :meth:`Drafting.record` take back what they came to and what the step cost.

Two proposers today: prompt lookup of plain rows (:mod:`.ngram`) and the tokens a
constrained row's grammar forces (:mod:`.forced`); a draft model or a suffix tree would be a
third behind the same protocol."""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from ..plan import Drafted, StepOutput, Verify
from .forced import ForcedProposer, can_fast_forward, forced_proposer_for
from .ngram import NgramProposer, ngram_proposer_for
from .step_times import StepTimes

__all__ = ["Drafting", "ForcedProposer", "NgramProposer", "Proposer", "StepTimes"]


class Proposer(Protocol):
    """Proposes drafts for the rows it serves and learns how often they are kept."""

    def draft_all(self, rows: Sequence[Any]) -> None:
        """Set the ``draft`` of every row it serves among ``rows`` (all decoding) for their next step."""

    def plan(self, rows: Sequence[Any]) -> int:
        """How many drafts a row verifies this step (0: none)."""

    def verified(self, request: Any, result: Drafted) -> None:
        """What a verify step kept of ``request``'s drafts."""


class Drafting:
    """The drafts of one engine's rows: proposers, the plan of each step, what they came to.

    Args:
        ngram: the n-gram proposer, or None (off).
        forced: the forced-token proposer (grammar fast-forward), or None (off).
        times: the step times both plan by.
    """

    def __init__(self, ngram: Optional[NgramProposer], forced: Optional[ForcedProposer], times: StepTimes) -> None:
        self.ngram, self.forced, self.times = ngram, forced, times
        self._ngram_verified = False  # whether the last step verified n-gram drafts

    @classmethod
    def for_engine(cls, config: Any) -> Optional["Drafting"]:
        """The drafting ``config`` asks for, or None when neither kind is on."""
        times = StepTimes()
        ngram = ngram_proposer_for(config, times)
        forced = forced_proposer_for(config, times, ngram)
        return None if ngram is None and forced is None else cls(ngram, forced, times)

    @property
    def proposers(self) -> list[Proposer]:
        return [p for p in (self.ngram, self.forced) if p is not None]

    def plan(self, rows: Sequence[Any]) -> Optional[Verify]:
        """Whether this step verifies drafts, and how many a row: n-gram drafts when every row
        is plain, forced tokens otherwise; None: decode plainly."""
        k = self.ngram.plan(rows) if self.ngram is not None else 0
        if k:
            return Verify("ngram", k)
        k = self.forced.plan(rows) if self.forced is not None else 0
        return Verify("forced", k) if k else None

    def would_verify(self, rows: Sequence[Any]) -> bool:
        """Whether n-gram drafts of ``rows`` would be verified now (their drafts as they stand)."""
        return self.ngram is not None and self.ngram.plan(rows) > 0

    def verified(self, rows: Sequence[Any], verify: Optional[Verify], out: StepOutput, pipelined: bool = True) -> None:
        """Take back what a step's drafts came to, and the step's time at its width (a plain
        step right after an n-gram verify step is that verify step's restart cost:
        :meth:`.StepTimes.restart_cost`, not a plain step's time)."""
        if verify is not None:
            proposer = self.ngram if verify.kind == "ngram" else self.forced
            for request in rows:
                result = out.drafts.get(id(request))
                if result is not None:
                    proposer.verified(request, result)
            proposer.stats.steps += 1
            self.times.ragged = out.ragged
            lengths = [len(r.draft) if verify.kind == "ngram" or can_fast_forward(r) else 0 for r in rows]
            self.times.record(len(rows), self.times.width(lengths, verify.k), out.decode_seconds)
        elif self._ngram_verified and pipelined:
            self.times.record_restart(len(rows), out.decode_seconds)
        else:
            self.times.record(len(rows), 0, out.decode_seconds)
        self._ngram_verified = verify is not None and verify.kind == "ngram"

    def draft_all(self, rows: Sequence[Any]) -> None:
        """Every decoding row's drafts for the next step."""
        for proposer in self.proposers:
            proposer.draft_all(rows)

    def forget(self, request: Any) -> None:
        """Drop a finished request's drafts (and its n-gram index)."""
        if self.ngram is not None:
            self.ngram.forget(request)
        request.draft = []

    def stats(self) -> dict[str, Optional[dict[str, float]]]:
        """``{"speculation": ..., "fast_forward": ...}``, each None when off."""
        return {"speculation": self.ngram.stats.as_dict() if self.ngram is not None else None,
                "fast_forward": self.forced.stats.as_dict() if self.forced is not None else None}
