"""Decoding one step ahead (vLLM's async scheduling; mlx-lm's ``async_eval`` pipelining): the
runner's side.

While decode step t computes, the graph of step t+1 is built on step t's still-lazy tokens
and queued behind it, so the Python work of building a step, and of handing out the last
step's tokens (text, stop strings, deltas), overlaps the model's compute instead of
following it. One stream of the default model on 2 CPU cores spends ~3 ms of a ~15 ms step
building its graph.

The scheduler decides where the result cannot differ from plain steps and says so in the
plan (:attr:`.StepPlan.pipelined`, :attr:`.StepPlan.ahead`, with KV room for the token ahead
held): every row's token is the arg-max or a draw with its own key, after its logit bias and
penalties (the token of step t counted as the last of a row's history:
:func:`~.sampled.plain_row`), n-gram drafts would not be verified at that step, nothing
else could be planned, and a row whose step-t token is its last by ``max_tokens`` is left
out. A step computed ahead and not used (the next plan is not pipelined; a row that cannot be
decoded so joined; a draw failed) puts the rows' PRNG keys back, so a seeded row draws the same
tokens either way. Rows that end otherwise at step t (EOS, a stop string, cancelled) waste
their share of step t+1: its KV lands past every entry anyone reads.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import mlx.core as mx

from .request import Request
from .sampled import SampledRow
from .sampling import draw_requests

logger = logging.getLogger(__name__)

Pending = tuple[list[Request], mx.array, list[mx.array]]
"""The rows computed ahead, their lazy tokens, and their PRNG keys before those were drawn."""


class DecodeAhead:
    """The step computed ahead, taken by the next decode.

    Args:
        runner: the model runner (its ``decode`` and ``decode_ahead`` passes).
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.pending: Optional[Pending] = None
        self.steps = 0  # steps whose tokens were computed ahead (for tests and stats)

    @property
    def computing(self) -> list[Request]:
        """The rows whose next step is computed ahead now."""
        return list(self.pending[0]) if self.pending is not None else []

    def drop(self) -> None:
        """Drop what was computed ahead (its keys put back): this step is not pipelined."""
        pending, self.pending = self.pending, None
        if pending is not None:
            for r, key in zip(pending[0], pending[2]):
                if r.state is not None:  # (a cancelled row has none)
                    r.state.sampler.key = key

    def step(self, rows: list[Request], ahead: Sequence[Request]) -> Optional[tuple[list[Request], list[list[SampledRow]]]]:
        """Decode ``rows`` (with what was computed ahead for those it covers) and queue the
        next step of the ``ahead`` rows among them. Returns the rows, reordered (those computed
        ahead first), and their tokens; None when a draw failed: then decode them plainly
        (what was computed ahead is dropped, its keys put back; its KV is what a plain step
        writes again)."""
        pending, self.pending = self.pending, None
        keys = {id(r): r.state.sampler.key for r in rows}  # the keys plain steps would draw with
        if pending is not None:
            keys.update((id(r), key) for r, key in zip(pending[0], pending[2]))
        index = {id(r): i for i, r in enumerate(pending[0])} if pending is not None else {}  # row -> its place ahead
        try:
            got = self._step(rows, pending, index, {id(r) for r in ahead})
        except Exception:  # a draw failed: the plain step fails that row alone
            logger.debug("decoding ahead failed; decoding plainly", exc_info=True)
            self.pending, got = None, None
        taken = set() if got is None else {id(r) for r in got[0]}
        for r in [*rows, *(pending[0] if pending is not None else [])]:
            if id(r) not in taken and r.state is not None:  # (a cancelled row has none)
                r.state.sampler.key = keys[id(r)]
        return got

    def _step(self, rows: list[Request], pending: Optional[Pending], index: dict[int, int],
              ahead: set[int]) -> tuple[list[Request], list[list[SampledRow]]]:
        parts: list[tuple[list[Request], mx.array]] = []
        if pending is not None:
            covered = [r for r in rows if id(r) in index]
            if covered:
                same = len(covered) == len(pending[0])
                parts.append((covered, pending[1] if same else pending[1][mx.array([index[id(r)] for r in covered])]))
                self.steps += 1
            rows = [r for r in rows if id(r) not in index]
        if rows:  # (rows that joined since)
            parts.append((rows, draw_requests(self.runner.decode(rows), rows)))
        rows = [r for part, _ in parts for r in part]
        tokens = parts[0][1] if len(parts) == 1 else mx.concatenate([t for _, t in parts])
        mx.async_eval(tokens)
        on = [i for i, r in enumerate(rows) if id(r) in ahead]
        if on:
            going = [rows[i] for i in on]
            keys = [r.state.sampler.key for r in going]
            last = tokens if len(going) == len(rows) else tokens[mx.array(on)]
            drawn = draw_requests(self.runner.decode_ahead(going, last), going, pending=last)
            mx.async_eval(drawn)
            self.pending = (going, drawn, keys)
        return rows, [[SampledRow(token=t)] for t in tokens.tolist()]
