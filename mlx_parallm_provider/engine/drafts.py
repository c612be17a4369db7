"""The worker's speculative steps, one face over both kinds of draft: prompt-lookup drafts
of plain greedy rows (:mod:`.speculation`) and the forced tokens of constrained rows
(:mod:`.fast_forward`). A step verifies one kind or decodes plainly; both plan by the same
measured step times."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .fast_forward import FastForward, can_fast_forward, fast_forward_for
from .sampling import SampledRow
from .speculation import NgramSpeculator, StepTimes, speculator_for


class Drafts:
    """What the worker's decode step asks about drafts.

    Args:
        ngram: the n-gram speculator, or None (off).
        forward: grammar fast-forward, or None (off).
        times: the step times both plan by.
    """

    def __init__(self, ngram: Optional[NgramSpeculator], forward: Optional[FastForward], times: StepTimes) -> None:
        self.ngram, self.forward, self.times = ngram, forward, times
        self._width = 0  # the last verify step's, as the times measure it
        self._ngram_verified = False  # whether the last step verified n-gram drafts

    @classmethod
    def for_engine(cls, config: Any) -> Optional["Drafts"]:
        """The drafts ``config`` asks for, or None when neither kind is on."""
        times = StepTimes()
        ngram = speculator_for(config, times)
        forward = fast_forward_for(config, times, ngram)
        return None if ngram is None and forward is None else cls(ngram, forward, times)

    def decode(self, runner: Any, rows: Sequence[Any]) -> Optional[tuple[list[list[SampledRow]], int]]:
        """Verify this step's drafts: what each row emits and the drafts a row verified; None:
        decode plainly. N-gram drafts go when every row can take them (no constrained rows),
        forced tokens otherwise."""
        k = self.ngram.plan(rows) if self.ngram is not None else 0
        self._ngram_verified = bool(k)
        if k:
            lengths = [len(r.draft) for r in rows]
            sampled = [[SampledRow(token=t) for t in got] for got in self.ngram.verify(runner, rows, k)]
        else:
            k = self.forward.plan(rows) if self.forward is not None else 0
            if not k:
                return None
            lengths = [len(r.draft) if can_fast_forward(r) else 0 for r in rows]
            sampled = self.forward.verify(runner, rows, k)
        self.times.ragged = runner.ragged
        self._width = self.times.width(lengths, k)
        return sampled, k

    def would_verify(self, rows: Sequence[Any]) -> bool:
        """Whether n-gram drafts of ``rows`` would be verified now (their drafts as they stand)."""
        return self.ngram is not None and self.ngram.plan(rows) > 0

    def record(self, rows: int, k: int, seconds: float) -> None:
        """The time of the step just run (``k`` drafts a row, 0: plain), at its width; a plain
        step right after an n-gram verify step is the verify step's restart cost
        (:meth:`.StepTimes.restart_cost`), not a plain step's time."""
        if not k and self._ngram_verified:
            self._ngram_verified = False
            self.times.record_restart(rows, seconds)
        else:
            self.times.record(rows, self._width if k else 0, seconds)

    def draft_all(self, rows: Sequence[Any]) -> None:
        """Every decoding row's drafts for the next step."""
        if self.ngram is not None:
            self.ngram.draft_all(rows)
        if self.forward is not None:
            self.forward.draft_all(rows)

    def forget(self, request: Any) -> None:
        """Drop a finished request's drafts (and its n-gram index)."""
        if self.ngram is not None:
            self.ngram.forget(request)
        request.draft = []

    def stats(self) -> dict[str, Optional[dict[str, float]]]:
        """``{"speculation": ..., "fast_forward": ...}``, each None when off."""
        return {"speculation": self.ngram.stats.as_dict() if self.ngram is not None else None,
                "fast_forward": self.forward.stats.as_dict() if self.forward is not None else None}
