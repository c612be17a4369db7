"""Taking one request's sampled tokens: whether it ends there (EOS, stop token ids,
``max_tokens``, a stop string, its grammar's end: judged in one place, :func:`take_token`), and
its results: text, streamed :class:`Delta` pieces and the final :class:`Completion`. Per
request; no MLX here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Optional

from .detokenize import TextStream
from .request import Completion, Delta, Request, TokenLogprob, Usage
from .sampled import SampledRow, token_logprob

if TYPE_CHECKING:
    from .sampling import RowSampler


@dataclass
class RowState:
    """The engine-side state of one request: its sampler, text stream and logprobs."""

    sampler: "RowSampler"
    text: TextStream
    logprobs: Optional[list] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # (one per prompt token, once scored)
    streamed: int = 0  # output tokens whose ids (and logprobs) a Delta has carried
    unsent: str = ""  # text held for the next Delta (stream_interval > 1)


def eos_token_ids(tokenizer: Any) -> set[int]:
    """The token ids that end a row's output: the tokenizer's ``eos_token_ids`` and ``eos_token_id``."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def token_ending(request: Request, token: int, eos_ids: Collection[int]) -> Optional[str]:
    """Why ``request`` ends at ``token``, appended to its output, by the token alone:
    ``"stop"`` (EOS unless ``ignore_eos``, or a stop token id: not part of the answer),
    ``"length"`` (``max_tokens`` reached), else None."""
    params = request.params
    if (token in eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
        return "stop"
    return "length" if len(request.output_ids) >= params.max_tokens else None


def take_token(request: Request, row: SampledRow, eos_ids: Collection[int], tokenizer: Any,
               stream_interval: int = 1) -> tuple[Optional[str], Optional[object]]:
    """Append the token of ``row`` to ``request``'s output and turn it into its results.

    The request ends here for its token (:func:`token_ending`: a stop token's text is not part
    of the answer, ``"length"``), or for a stop string or a finished grammar (``"stop"``). Returns
    ``(finish_reason, result)``: the finish reason if the request is now done (else None),
    and what its caller gets now (a :class:`Delta` when streaming, the :class:`Completion`
    when a whole answer is done, else None). A stream's deltas come every
    ``stream_interval`` tokens (the first with text, and the last, at once).
    """
    state: RowState = request.state
    token = row.token
    request.output_ids.append(token)
    ending = token_ending(request, token, eos_ids)
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
            prompt_logprobs=state.prompt_logprobs,
        )
    return None, None


def record_prompt_logprobs(request: Request, first: int, scores: list[SampledRow], tokenizer: Any) -> None:
    """Keep the scores of prompt tokens ``first``, ``first + 1``, ... (a prompt recomputed
    after preemption is scored again: the same values)."""
    kept = request.state.prompt_logprobs if isinstance(request.state, RowState) else None
    if kept is not None:
        for i, row in enumerate(scores, start=first):
            kept[i] = token_logprob(tokenizer, row)


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
        prompt_logprobs=state.prompt_logprobs if start == 0 else None,
    )


def usage(request: Request) -> Usage:
    """Token counts of a request so far."""
    return Usage(
        prompt_tokens=request.prompt_len,
        completion_tokens=len(request.output_ids),
        cached_tokens=request.num_cached,
    )
