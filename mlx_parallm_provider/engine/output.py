"""Turning one request's sampled tokens into its results: text, stop strings and a finished
grammar (the scheduler has already judged EOS, stop token ids and ``max_tokens``), streamed
:class:`Delta` pieces and the final :class:`Completion`. Worker-side, per request; no MLX here."""

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
    logprobs: Optional[list] = None
    streamed: int = 0  # output tokens whose ids (and logprobs) a Delta has carried
    unsent: str = ""  # text held for the next Delta (stream_interval > 1)


def eos_token_ids(tokenizer: Any) -> set[int]:
    """The token ids that end a row's output: the tokenizer's ``eos_token_ids`` and ``eos_token_id``."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def emit(request: Request, row: SampledRow, ending: Optional[str], tokenizer: Any,
         stream_interval: int = 1) -> tuple[Optional[str], Optional[object]]:
    """Turn the token the scheduler just appended to ``request`` into its results.

    ``ending`` is the scheduler's verdict on that token (:meth:`.Scheduler.postprocess`):
    ``"stop"`` for a stop token (its text is not part of the answer), ``"length"``, or None;
    a stop string or a finished grammar ends the request here too (``"stop"``). Returns
    ``(finish_reason, result)``: the finish reason if the request is now done (else None),
    and what its caller gets now (a :class:`Delta` when streaming, the :class:`Completion`
    when a whole answer is done, else None). A stream's deltas come every
    ``stream_interval`` tokens (the first with text, and the last, at once).
    """
    state: RowState = request.state
    token = row.token
    finish = ending
    piece = ""
    is_stop_token = ending == "stop"
    matcher = state.sampler.matcher
    if not is_stop_token:
        if matcher is not None:
            matcher.consume(token)  # raises if the grammar refused it: the request fails alone
        if state.logprobs is not None:
            state.logprobs.append(token_logprob(tokenizer, row))
        piece, stopped = state.text.add_token(token)
        if stopped or (matcher is not None and matcher.done):
            finish = "stop"
    if finish is not None and not state.text.stopped:
        piece += state.text.finish()
    if request.stream:
        state.unsent += piece
        end = len(request.output_ids) - int(is_stop_token)
        if finish or (state.unsent and (not state.streamed or end - state.streamed >= stream_interval)):
            text, state.unsent = state.unsent, ""
            return finish, _delta(request, text, finish, end)
        return None, None
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
