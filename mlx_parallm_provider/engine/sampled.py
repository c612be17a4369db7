"""What sampling gives a row (:class:`SampledRow`), and the questions about a row that policy
asks without MLX: whether its next token needs no work on the host (:func:`plain_row`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .request import TokenLogprob


@dataclass
class SampledRow:
    """A sampled token and, when asked for, its log-probability and the top alternatives.

    ``error`` is set instead when sampling this row failed; the other rows are unaffected.
    ``rank``: the token's place among all (1: the likeliest), where it was counted.
    """

    token: int = -1
    logprob: Optional[float] = None
    top: Optional[list[tuple[int, float]]] = None
    error: Optional[Exception] = None
    rank: Optional[int] = None


def plain_row(request: Any) -> bool:
    """Whether a row's next token needs no work on the host between steps: its logits through
    its logit bias, penalties and bans (over tokens the step itself has: a token still on the
    device, a draft), its own PRNG key; no grammar, no logprobs, no bad word of several tokens
    (matched against its last token). Only such rows decode ahead or verify n-gram drafts."""
    sampler = request.state.sampler if request.state is not None else None
    return (sampler is not None and sampler.matcher is None and not request.params.logprobs
            and not (sampler.bans is not None and sampler.bans.needs_output))


def token_logprob(tokenizer: Any, row: SampledRow) -> TokenLogprob:
    """Turn a sampled row's numbers into the public :class:`TokenLogprob`."""
    top = [(tid, tokenizer.decode([tid]), lp) for tid, lp in (row.top or [])]
    return TokenLogprob(token_id=row.token, token=tokenizer.decode([row.token]), logprob=row.logprob or 0.0, top_logprobs=top,
                        rank=row.rank)
