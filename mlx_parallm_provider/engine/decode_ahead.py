"""Decoding one step ahead (vLLM's async scheduling; mlx-lm's ``async_eval`` pipelining).

While decode step t computes, the graph of step t+1 is built on step t's still-lazy tokens
and queued behind it, so the Python work of building a step, and of handing out the last
step's tokens (text, stop strings, deltas), overlaps the model's compute instead of
following it. One stream of the default model on 2 CPU cores spends ~3 ms of a ~15 ms step
building its graph.

Only where the result cannot differ from a plain step: every row takes the batched arg-max
(greedy, no penalties, bias, grammar or logprobs), KV is paged, there is no n-gram
speculation, and the scheduler has nothing else to plan (:meth:`.Scheduler.reserve_ahead`
gives each row room for one more token); a row whose step-t token is its last by
``max_tokens`` is left out. Rows that end otherwise at step t (EOS, a stop string,
cancelled) waste their share of step t+1: its KV lands past every entry anyone reads.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

from .request import Request
from .sampling import SampledRow
from .scheduler import Scheduler


def plain(request: Request) -> bool:
    """Whether a row's next token is the arg-max of its logits and nothing else."""
    sampler = request.state.sampler
    return sampler.greedy and not sampler.processors and sampler.matcher is None and not request.params.logprobs


class DecodeAhead:
    """The step computed ahead (rows and their lazy tokens), taken by the next decode."""

    def __init__(self, runner: Any, scheduler: Scheduler) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.pending: Optional[tuple[list[Request], mx.array]] = None
        self.steps = 0  # steps whose tokens were computed ahead (for tests and stats)

    def step(self, rows: list[Request]) -> Optional[tuple[list[Request], list[SampledRow]]]:
        """Decode ``rows`` (using what was computed ahead for those it covers) and queue the
        next step ahead where allowed. Returns the rows, reordered (those computed ahead
        first), and their tokens; None if some row is not :func:`plain` (decode normally;
        anything computed ahead is dropped: its KV is what a plain step writes again)."""
        pending, self.pending = self.pending, None
        if not all(plain(r) for r in rows):
            return None
        parts: list[tuple[list[Request], mx.array]] = []
        if pending is not None:
            index = {id(r): i for i, r in enumerate(pending[0])}
            covered = [r for r in rows if id(r) in index]
            if covered:
                same = len(covered) == len(pending[0])
                parts.append((covered, pending[1] if same else pending[1][mx.array([index[id(r)] for r in covered])]))
                self.steps += 1
            rows = [r for r in rows if id(r) not in index]
        if rows:  # (rows that joined since)
            parts.append((rows, mx.argmax(self.runner.decode(rows), axis=-1)))
        rows = [r for part, _ in parts for r in part]
        tokens = parts[0][1] if len(parts) == 1 else mx.concatenate([t for _, t in parts])
        mx.async_eval(tokens)
        going = [i for i, r in enumerate(rows) if len(r.output_ids) + 1 < r.params.max_tokens]  # the rest end now
        if going and self.scheduler.reserve_ahead([rows[i] for i in going]):
            ahead_rows = [rows[i] for i in going]
            last = tokens if len(going) == len(rows) else tokens[mx.array(going)]
            ahead = mx.argmax(self.runner.decode_ahead(ahead_rows, last), axis=-1)
            mx.async_eval(ahead)
            self.pending = (ahead_rows, ahead)
        return rows, [SampledRow(token=t) for t in tokens.tolist()]
