"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): each prompt token's
log-probability given the tokens before it, with the top alternatives there, from the raw
logits of the passes that prefill the prompt (no temperature, penalties or bans, as vLLM's).

The runner scores a row's positions as its prefill pieces run (:func:`score_piece`); the
scheduler records what a step scored (:func:`.output.record_prompt_logprobs`); the first
result carries them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import mlx.core as mx

from .sampled import SampledRow
from .sampling import log_softmax, top_tokens

if TYPE_CHECKING:
    from ..models.backends import MLXOps

SLICE = 256
"""Positions taken through the head and the log-softmax at once: their float32 logits are
``SLICE`` x vocabulary floats (50 MB for a 49k vocabulary), whatever the piece's length."""


def score_piece(out: mx.array, head: Optional[Callable[[mx.array], mx.array]], ids: list[int], start: int, prompt_len: int,
                top: int, ops: Optional["MLXOps"]) -> Optional[tuple[int, list[SampledRow]]]:
    """Score one row's pass from position ``start``: ``out`` is its ``(n, vocab)`` logits, or
    its ``(n, hidden)`` final states with the model's ``head``; ``ids`` its tokens; ``ops``
    the model's backend, whose log-softmax and top tokens sampling uses too. Position
    ``p`` gives prompt token ``p + 1``'s logprob and the ``top`` likeliest tokens there.
    Returns ``(index of the first token scored, scores)``, or None where the pass holds no
    position before the prompt's last."""
    end = min(start + out.shape[0], prompt_len - 1)
    if end <= start:
        return None
    scores: list[SampledRow] = []
    for a in range(start, end, SLICE):
        b = min(a + SLICE, end)
        states = out[a - start : b - start]
        logits = (head(states[None])[0] if head is not None else states).astype(mx.float32)
        logprobs = log_softmax(logits, ops)
        targets = ids[a + 1 : b + 1]
        chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)
        ranks = (logprobs > chosen).sum(axis=-1) + 1
        if top:
            best, values = top_tokens(logprobs, top, ops)
            mx.eval(chosen, ranks, best, values)
            tops = [sorted(zip(i, v), key=lambda pair: -pair[1]) for i, v in zip(best.tolist(), values.tolist())]
        else:
            mx.eval(chosen, ranks)
            tops = [[] for _ in targets]
        scores.extend(SampledRow(token=t, logprob=lp, top=tp, rank=rank)
                      for t, lp, tp, rank in zip(targets, chosen[:, 0].tolist(), tops, ranks.tolist()))
    return start + 1, scores

