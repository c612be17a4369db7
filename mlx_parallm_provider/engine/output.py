"""Turning one request's sampled tokens into its results: finish detection (EOS, stop
tokens, stop strings, ``max_tokens``), streamed :class:`Delta` pieces and the final
:class:`Completion`. Worker-side, per request; no MLX here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .detokenize import TextStream
from .request import Completion, Delta, Request, Usage
from .sampling import RowSampler, SampledRow, token_logprob


@dataclass
class RowState:
    """Worker-private state of one request."""

    sampler: RowSampler
    text: TextStream
    cache: Optional[list[Any]] = None  # own KV cache while a long prompt is chunk-prefilled
    prefix: Optional[list[Any]] = None  # fetched KV of the cached prompt prefix, until used
    logprobs: Optional[list] = None
    streamed: int = 0  # output tokens whose ids (and logprobs) a Delta has carried


def eos_token_ids(tokenizer: Any) -> set[int]:
    """The token ids that end a row's output: the tokenizer's ``eos_token_ids`` and ``eos_token_id``."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def add_token(request: Request, row: SampledRow, eos_ids: set[int], tokenizer: Any) -> tuple[Optional[str], Optional[object]]:
    """Append a sampled token to ``request``.

    Returns ``(finish_reason, result)``: the finish reason if the request is now done
    (else None), and what its caller gets now (a :class:`Delta` when streaming, the
    :class:`Completion` when a whole answer is done, else None).
    """
    state: RowState = request.state
    params = request.params
    token = row.token
    request.output_ids.append(token)
    finish: Optional[str] = None
    piece = ""
    is_stop_token = (token in eos_ids and not params.ignore_eos) or token in params.stop_token_ids
    matcher = state.sampler.matcher
    if matcher is not None and not is_stop_token:
        matcher.consume(token)  # raises if the grammar refused it: the request fails alone
    if is_stop_token:
        finish = "stop"
    else:
        if state.logprobs is not None:
            state.logprobs.append(token_logprob(tokenizer, row))
        piece, stopped = state.text.add_token(token)
        if stopped or (matcher is not None and matcher.done):
            finish = "stop"
        elif len(request.output_ids) >= params.max_tokens:
            finish = "length"
    if finish is not None and not state.text.stopped:
        piece += state.text.finish()
    if request.stream and (piece or finish):
        return finish, _delta(request, piece, finish, len(request.output_ids) - int(is_stop_token))
    if finish is not None:
        return finish, Completion(
            request_id=request.request_id,
            text=state.text.text,
            token_ids=request.output_ids[:-1] if is_stop_token else list(request.output_ids),
            finish_reason=finish,
            usage=usage(request),
            logprobs=state.logprobs,
        )
    return None, None


def _delta(request: Request, text: str, finish: Optional[str], end: int) -> Delta:
    """The next streamed piece: ``text`` with the ids (and logprobs) of every output token
    before ``end`` not yet streamed, so tokens whose text was held back (half a UTF-8
    character, a possible stop string) ride on the delta that carries their text."""
    state: RowState = request.state
    start, state.streamed = state.streamed, end
    logprobs = state.logprobs[start:end] if state.logprobs is not None else None
    return Delta(
        request_id=request.request_id,
        text=text,
        token_ids=request.output_ids[start:end],
        finish_reason=finish,
        usage=usage(request) if finish else None,
        logprobs=logprobs or None,
    )


def usage(request: Request) -> Usage:
    """Token counts of a request so far."""
    return Usage(
        prompt_tokens=request.prompt_len,
        completion_tokens=len(request.output_ids),
        cached_tokens=request.num_cached,
    )
