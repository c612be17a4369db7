"""Measured step times, and the one planner both kinds of draft use: the number of drafts a
row verifies that is expected to give the most tokens a second."""

from __future__ import annotations

from typing import Optional, Sequence

REMEASURE_STEPS = 256
"""Step times are measured again after this many steps (the machine's load changes)."""

SMOOTHING = 0.2
"""Weight of the newest sample in the moving averages of step times and acceptance."""


def moving_average(old: Optional[float], sample: float) -> float:
    """``old`` moved :data:`SMOOTHING` of the way to ``sample`` (``sample`` itself when None)."""
    return sample if old is None else old + SMOOTHING * (sample - old)


class StepTimes:
    """Measured seconds of a decode step of ``rows`` rows that verifies ``k`` tokens a row
    beyond the one it decodes (0: a plain step), as moving averages; shared by the n-gram
    speculator and grammar fast-forward (:mod:`.forced`), whose steps have the same
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


def best_width(times: StepTimes, drafts: Sequence[tuple[int, float]], widths: Sequence[int], extra: float = 0.0) -> int:
    """How many drafts a row verifies this step (0: decode plainly): of ``widths``, the one
    expected to give the most tokens a second. ``drafts``: each decoding row's draft length
    (0 for a row without) and the acceptance rate of one of its draft tokens (below 1);
    ``extra``: seconds a verify step costs beyond its own (the plain step after it). A row
    keeps drafts up to its first rejected one, so a row of length ``d`` at rate ``a`` is
    expected to keep ``a (1 - a^min(d, k)) / (1 - a)`` tokens, plus the one it samples. A
    width not yet measured is taken as cheap as a plain step, so it is tried once; nothing is
    planned before a plain step of this many rows was measured."""
    n = len(drafts)
    plain = times.get(n, 0)
    if not n or plain is None:
        return 0
    lengths = [d for d, _ in drafts]
    best, best_rate = 0, n / plain
    for k in widths:
        tokens = n + sum(a * (1 - a ** min(d, k)) / (1 - a) for d, a in drafts if d)
        seconds = (times.estimate(n, times.width(lengths, k)) or plain) + extra
        if tokens / seconds > best_rate:
            best, best_rate = k, tokens / seconds
    return best
