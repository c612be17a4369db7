"""A model's forward split at its output head, so that a step computes logits only at the
positions it samples.

A verify step computes every position of its rows (drafts, forced tokens, padding), but a
constrained row's forced positions are decided by its grammar alone, and padding by nothing:
only a few positions need their logits. The output head is a matmul by the vocabulary (a
fifth of the default model's weights): 8 rows x 9 positions through it cost ~28 ms of a
~215 ms verify step on 2 cores, 8 positions ~5.5 ms. Where the model's ``__call__`` is known
to be exactly "the inner model, then the head" (:data:`_PLAIN_MODELS`), the two run apart;
everywhere else the model runs whole and its logits are indexed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx

from .backends.attention_step import plain_code

_PLAIN_MODELS = (("mlx_lm.models.llama", "Model"), ("mlx_lm.models.qwen2", "Model"), ("mlx_lm.models.qwen3", "Model"))
"""mlx-lm models whose ``__call__`` is ``self.model(inputs, cache, input_embeddings)`` followed
by ``embed_tokens.as_linear`` (tied embeddings) or ``lm_head``, nothing else."""


@dataclass(frozen=True)
class SplitModel:
    """A model's inner model (tokens -> final normalised hidden states) and head."""

    body: Callable[..., mx.array]
    """``body(tokens, cache)``: hidden states ``(B, L, D)``."""
    head: Callable[[mx.array], mx.array]
    """``head(hidden)``: logits over the last axis, as the whole model computes them."""
    vocab: int
    """The logits' width."""


def split_head(model: Any) -> Optional[SplitModel]:
    """``model`` as body and head, or None where its ``__call__`` is not one of
    :data:`_PLAIN_MODELS`'."""
    inner, args = getattr(model, "model", None), getattr(model, "args", None)
    if inner is None or args is None or not plain_code(type(model), _PLAIN_MODELS):
        return None
    if getattr(args, "tie_word_embeddings", False):
        head = inner.embed_tokens.as_linear
    elif hasattr(model, "lm_head"):
        head = model.lm_head
    else:
        return None
    return SplitModel(lambda tokens, cache: inner(tokens, cache), head, int(args.vocab_size))
