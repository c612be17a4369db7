"""A batch's rows' logits processors, each for all rows at once: logit biases, the penalties
(mlx-lm's arithmetic and order, so each row's logits are what its processors give it alone)
and the token bans (:mod:`.token_bans`). :func:`processed` applies them; :func:`last_tokens` is
the history they see."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Sequence

import mlx.core as mx

from .token_bans import MAX_BAD_WORD_TOKENS, banned, held_open

if TYPE_CHECKING:
    from .sampling import RowSampler

History = Callable[[], Sequence[int]]
"""A row's tokens so far (prompt, output), at least its last :data:`HISTORY_TOKENS`."""


PENALTY_CONTEXT = 20
"""How many of a row's last tokens its penalties count (mlx-lm's default)."""

HISTORY_TOKENS = max(PENALTY_CONTEXT, MAX_BAD_WORD_TOKENS)
"""How many of a row's last tokens its logits processors see: its penalties count the last
:data:`PENALTY_CONTEXT`, its bad words match the output's last tokens."""


class Penalties(NamedTuple):
    """A row's repetition, presence and frequency penalties (off: 1, 0, 0)."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0


def processed(logits: mx.array, samplers: Sequence["RowSampler"], contexts: Sequence[Optional[History]],
              pending: Optional[mx.array] = None, produced: Optional[Sequence[int]] = None, hold: bool = True) -> mx.array:
    """The rows' logits ``(B, vocab)`` through their logits processors, as mlx-lm's give each
    row alone: the rows' logit biases, then their penalties, each for all rows at once
    (:func:`_biased`, :func:`_penalised`), then their bans (:func:`.token_bans.banned`;
    ``hold``: and their stop tokens while short of ``min_tokens``, :func:`.token_bans.held_open`).
    ``pending``: ``(B,)`` tokens drawn after the contexts end and not yet on the host (a step
    decoded ahead), each row's last token. ``produced``: each row's output tokens before the
    one drawn from these logits (needed where a row has bans)."""
    if any(s.bias for s in samplers):
        logits = _biased(logits, samplers)
    if any(s.penalties for s in samplers):
        logits = _penalised(logits, [s.penalties for s in samplers], contexts, pending)
    bans = [s.bans for s in samplers]
    if any(bans):
        counts = output_lengths(produced)
        needs_output = [b is not None and b.needs_output for b in bans]
        if pending is not None and any(needs_output):
            raise ValueError("a row whose bad words follow its output cannot be drawn ahead of its last token")
        tails = [_output_tail(context, n) if needs else [] for context, n, needs in zip(contexts, counts, needs_output)]
        logits = banned(logits, bans, tails)
        if hold:
            logits = held_open(logits, bans, counts)
    return logits


def output_lengths(produced: Optional[Sequence[int]]) -> Sequence[int]:
    """``produced``: each row's output tokens before the one sampled, which rows with bans
    need (their ``min_tokens`` count from it)."""
    if produced is None:
        raise ValueError("rows with token bans are sampled with each row's output length")
    return produced


def _output_tail(context: Optional[History], produced: int) -> list[int]:
    """The last tokens of a row's output (of ``produced``), as many as its history holds."""
    if not produced or context is None:
        return []
    history = list(context())
    return history[max(0, len(history) - produced) :]


def _biased(logits: mx.array, samplers: Sequence["RowSampler"]) -> mx.array:
    """The rows' logit biases by one scatter-add (mlx-lm's processor's: the biases as float32
    added at their tokens); a row's padding adds 0 to token 0."""
    for sampler in samplers:
        if sampler.bias:
            sampler.check_width(logits.shape[-1])
    pairs = [list(s.params.logit_bias.items()) if s.bias else [] for s in samplers]
    width = max(map(len, pairs))
    ids = mx.array([[t for t, _ in p] + [0] * (width - len(p)) for p in pairs], dtype=mx.int32)
    values = mx.array([[v for _, v in p] + [0.0] * (width - len(p)) for p in pairs], dtype=mx.float32)
    return logits.at[mx.arange(logits.shape[0])[:, None], ids].add(values)


def _penalised(logits: mx.array, penalties: Sequence[Optional[Penalties]], contexts: Sequence[Optional[History]],
               pending: Optional[mx.array] = None) -> mx.array:
    """The rows' penalties, each kind for all rows by one gather and one scatter (mlx-lm's
    processors' arithmetic and order, so each row's logits are what its processors give it
    alone): over each row's last :data:`PENALTY_CONTEXT` tokens (the ``pending`` one last,
    where given), the repetition penalty divides a positive logit and multiplies a negative
    one, the presence penalty is taken once from a token's logit, the frequency penalty once
    for each time the token occurs. Rows without a kind take its identity (1 or 0), a row's
    padding repeats its first token."""
    known = PENALTY_CONTEXT - (pending is not None)
    tails = [list(contexts[i]())[-known:] if p else [] for i, p in enumerate(penalties)]
    width = max(map(len, tails))
    if not width and pending is None:
        return logits
    if max(max(t, default=0) for t in tails) >= logits.shape[-1]:  # (MLX does not bounds-check: it would reach other rows)
        raise ValueError(f"a penalised token id is outside the model's {logits.shape[-1]} logits")
    ids = mx.array([t[:1] * (width - len(t)) + t if t else [0] * width for t in tails], dtype=mx.int32).reshape(len(tails), width)
    if pending is not None:
        ids = mx.concatenate([ids, pending.astype(mx.int32)[:, None]], axis=1)
    off = Penalties()

    def per_row(kind: str) -> Optional[mx.array]:
        values = [getattr(p, kind) if p and (t or pending is not None) else getattr(off, kind) for p, t in zip(penalties, tails)]
        if all(v == getattr(off, kind) for v in values):
            return None
        return mx.array(values, dtype=mx.float32)[:, None].astype(logits.dtype)

    if (k := per_row("repetition")) is not None:
        picked = mx.take_along_axis(logits, ids, axis=1)
        logits = mx.put_along_axis(logits, ids, mx.where(picked < 0, picked * k, picked / k), axis=1)
    if (k := per_row("presence")) is not None:
        logits = mx.put_along_axis(logits, ids, mx.take_along_axis(logits, ids, axis=1) - k, axis=1)
    if (k := per_row("frequency")) is not None:
        counted = mx.array([[j >= width - len(t) for j in range(width)] + [True] * (pending is not None) for t in tails])
        amounts = mx.where(counted, k, mx.zeros_like(k))
        logits = logits.at[mx.arange(logits.shape[0])[:, None], ids].subtract(amounts)
    return logits


def last_tokens(*parts: Sequence[int]) -> list[int]:
    """The last :data:`HISTORY_TOKENS` tokens of ``parts`` joined (what a row's penalties and bad words see)."""
    out: list[int] = []
    for part in reversed(parts):
        out[:0] = part[max(0, len(part) - (HISTORY_TOKENS - len(out))) :]
        if len(out) >= HISTORY_TOKENS:
            break
    return out
