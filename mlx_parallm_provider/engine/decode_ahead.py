"""Decoding one step ahead (vLLM's async scheduling; mlx-lm's ``async_eval`` pipelining).

While decode step t computes, the graph of step t+1 is built on step t's still-lazy tokens
and queued behind it, so the Python work of building a step, and of handing out the last
step's tokens (text, stop strings, deltas), overlaps the model's compute instead of
following it. One stream of the default model on 2 CPU cores spends ~3 ms of a ~15 ms step
building its graph.

Only where the result cannot differ from plain steps: every row's token is the arg-max or a
draw with its own key (no penalties, bias, grammar or logprobs), n-gram
speculation (when on) would not verify drafts at that step (drafts depend on the last
token: rows with an n-gram match in view decode plainly, then verify), and the scheduler has
nothing else it could plan: no prompt with a free slot, chunk or embedding; a queue behind a
full batch does not stop it (:meth:`.Scheduler.reserve_ahead` gives each row room for one
more token); a row whose step-t
token is its last by ``max_tokens`` is left out. A step computed ahead and not used (a row
that cannot be decoded so joined; a draw failed) puts the rows' PRNG keys back, so a seeded
row draws the same tokens either way. Rows that end otherwise at step t (EOS, a stop
string, cancelled) waste their share of step t+1: its KV lands past every entry anyone reads.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import mlx.core as mx

from .request import Request
from .sampling import SampledRow, draw_tokens
from .scheduler import Scheduler

logger = logging.getLogger(__name__)

Pending = tuple[list[Request], mx.array, list[mx.array]]
"""The rows computed ahead, their lazy tokens, and their PRNG keys before those were drawn."""


def plain(request: Request) -> bool:
    """Whether a row's next token needs nothing but its logits and its own key."""
    sampler = request.state.sampler
    return not sampler.processors and sampler.matcher is None and not request.params.logprobs


class DecodeAhead:
    """The step computed ahead, taken by the next decode."""

    def __init__(self, runner: Any, scheduler: Scheduler, drafting: Callable[[list[Request]], bool] = lambda rows: False) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.drafting = drafting  # whether n-gram speculation would verify drafts of these rows now
        self.pending: Optional[Pending] = None
        self.steps = 0  # steps whose tokens were computed ahead (for tests and stats)

    def step(self, rows: list[Request]) -> Optional[tuple[list[Request], list[SampledRow]]]:
        """Decode ``rows`` (with what was computed ahead for those it covers) and queue the
        next step ahead where allowed. Returns the rows, reordered (those computed ahead
        first), and their tokens; None when some row is not :func:`plain`, none was computed
        ahead and their drafts are to be verified, or a draw failed:
        then decode them plainly (what was computed ahead is dropped, its keys put back; its
        KV is what a plain step writes again)."""
        pending, self.pending = self.pending, None
        keys = {id(r): r.state.sampler.key for r in rows}  # the keys plain steps would draw with
        if pending is not None:
            keys.update((id(r), key) for r, key in zip(pending[0], pending[2]))
        got = None
        index = {id(r): i for i, r in enumerate(pending[0])} if pending is not None else {}  # row -> its place ahead
        ahead = any(id(r) in index for r in rows)
        if all(plain(r) for r in rows) and (ahead or not self.drafting(rows)):
            try:
                got = self._step(rows, pending, index)
            except Exception:  # a draw failed: the plain step fails that row alone
                logger.debug("decoding ahead failed; decoding plainly", exc_info=True)
                self.pending = None
        taken = set() if got is None else {id(r) for r in got[0]}
        for r in [*rows, *(pending[0] if pending is not None else [])]:
            if id(r) not in taken and r.state is not None:  # (a cancelled row has none)
                r.state.sampler.key = keys[id(r)]
        return got

    def _step(self, rows: list[Request], pending: Optional[Pending], index: dict[int, int]) -> tuple[list[Request], list[SampledRow]]:
        parts: list[tuple[list[Request], mx.array]] = []
        if pending is not None:
            covered = [r for r in rows if id(r) in index]
            if covered:
                same = len(covered) == len(pending[0])
                parts.append((covered, pending[1] if same else pending[1][mx.array([index[id(r)] for r in covered])]))
                self.steps += 1
            rows = [r for r in rows if id(r) not in index]
        if rows:  # (rows that joined since)
            parts.append((rows, draw_tokens(self.runner.decode(rows), [r.state.sampler for r in rows])))
        rows = [r for part, _ in parts for r in part]
        tokens = parts[0][1] if len(parts) == 1 else mx.concatenate([t for _, t in parts])
        mx.async_eval(tokens)
        on = [i for i, r in enumerate(rows) if len(r.output_ids) + 1 < r.params.max_tokens]  # the rest end now
        going = [rows[i] for i in on]
        if going and not self.drafting(going) and self.scheduler.reserve_ahead(going):
            keys = [r.state.sampler.key for r in going]
            last = tokens if len(going) == len(rows) else tokens[mx.array(on)]
            ahead = draw_tokens(self.runner.decode_ahead(going, last), [r.state.sampler for r in going])
            mx.async_eval(ahead)
            self.pending = (going, ahead, keys)
        return rows, [SampledRow(token=t) for t in tokens.tolist()]
