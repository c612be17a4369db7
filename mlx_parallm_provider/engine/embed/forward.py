"""Embedding forward passes (worker thread): one step's embedding inputs through the model's
layers as one right-padded batch, without decoding and without a KV cache, the final hidden
state (after the final norm, before ``lm_head``) pooled per input and L2-normalised.

Right padding needs no mask of its own: the model's causal mask already keeps every real
token from attending to the padding after it, so a row's vector does not depend on what
else is in the batch (up to float rounding of the batched matmuls).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import mlx.core as mx

from .request import EmbedRequest

logger = logging.getLogger(__name__)

Piece = tuple[EmbedRequest, list[int]]
"""An embedding request and the indices of its inputs a step embeds."""


def hidden_model(model: Any) -> Optional[Any]:
    """The part of an mlx-lm model that returns the final normalised hidden states
    (``model.model``: embeddings, layers, final norm; no ``lm_head``), or None."""
    inner = getattr(model, "model", None)
    return inner if callable(inner) and hasattr(inner, "layers") else None


def embed_pieces(model: Any, pieces: list[Piece], pad_id: int) -> list[list[float]]:
    """The vectors of ``pieces``' inputs (in the order given), from one batched forward."""
    inner = hidden_model(model)
    if inner is None:  # checked at submit; a model swapped underneath would land here
        raise TypeError(f"{type(model).__name__} does not expose its hidden states (no .model with layers)")
    seqs = [request.inputs[i] for request, indices in pieces for i in indices]
    lengths = [len(s) for s in seqs]
    width = max(lengths)
    tokens = mx.array([s + [pad_id] * (width - len(s)) for s in seqs])
    hidden = inner(tokens).astype(mx.float32)  # (B, width, D)
    n = mx.array(lengths)
    real = (mx.arange(width)[None, :] < n[:, None])[..., None]
    mean = mx.sum(mx.where(real, hidden, 0.0), axis=1) / n[:, None].astype(mx.float32)
    last = hidden[mx.arange(len(seqs)), n - 1]
    wants_last = mx.array([request.pooling == "last" for request, indices in pieces for _ in indices])
    pooled = mx.where(wants_last[:, None], last, mean)
    size = pooled.shape[-1]
    dims = [request.dimensions or size for request, indices in pieces for _ in indices]
    kept = mx.where(mx.arange(size)[None, :] < mx.array(dims)[:, None], pooled, 0.0)  # Matryoshka truncation
    unit = kept / mx.maximum(mx.linalg.norm(kept, axis=-1, keepdims=True), 1e-12)
    return [row[:d] for row, d in zip(unit.tolist(), dims)]


def embed_step(model: Any, pieces: list[Piece], pad_id: int, metrics: Any) -> tuple[list[EmbedRequest], list[tuple[EmbedRequest, Exception]]]:
    """Embed one step's pieces (skipping calls that have finished meanwhile), give each
    input its vector and record the step in ``metrics``. Returns the calls whose inputs all
    have their vectors now, and, if the forward failed, each call of the step with the error."""
    pieces = [(r, indices) for r, indices in pieces if not r.finished]
    calls = list({id(r): r for r, _ in pieces}.values())
    if not pieces:
        return [], []
    tic = time.perf_counter()
    try:
        vectors = iter(embed_pieces(model, pieces, pad_id))
    except Exception as exc:
        return [], [(r, exc) for r in calls]
    for request, indices in pieces:
        for i in indices:
            request.vectors[i] = next(vectors)
    inputs = [request.inputs[i] for request, indices in pieces for i in indices]
    metrics.record_embeddings(len(inputs), sum(map(len, inputs)))
    logger.debug("embedding step: inputs=%d step_ms=%.1f", len(inputs), (time.perf_counter() - tic) * 1000)
    return [r for r in calls if r.done], []
