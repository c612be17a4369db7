"""The engine's embedding calls, :meth:`Engine.embed <EmbedMethods.embed>` and
:meth:`~EmbedMethods.embed_sync`: inputs checked and tokenized on the caller's side, then
one :class:`~.request.EmbedRequest` queued on the engine's worker, where its inputs are
embedded in the steps' batches beside (and with) everyone else's."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Any, Optional, Union

from ..._validation import check_number
from ...errors import EngineOverloadedError, InvalidParameterError, UnsupportedModelError
from ..prompt_size import INLINE_PROMPT_CHARS
from ..request import ResultSink, check_truncate_prompt_tokens
from ..sinks import LoopSink, ThreadSink
from .forward import hidden_model
from .request import EmbeddingResult, EmbedRequest, check_options, input_ids

EmbedInputs = Union[Sequence[str], Sequence[Sequence[int]]]


class EmbedMethods:
    """Embedding calls of :class:`~..api.Engine` (which this is mixed into; it
    provides the model, the prompt encoder, the worker and the result plumbing)."""

    async def embed(
        self, inputs: EmbedInputs, *, pooling: str = "mean", dimensions: Optional[int] = None,
        timeout: Optional[float] = None, request_id: Optional[str] = None, truncate_prompt_tokens: Optional[int] = None,
    ) -> EmbeddingResult:
        """Embed ``inputs`` (texts, or lists of token ids): one L2-normalised vector each,
        in order, from the model's final hidden state (after its final norm), pooled over
        each input's tokens: ``"mean"`` (the default, for any LLM) or ``"last"`` (the last
        token's state, for decoder embedding models such as Qwen3-Embedding).

        ``dimensions`` keeps the first that many components of each pooled vector before
        normalising (Matryoshka truncation). ``truncate_prompt_tokens`` (vLLM's) keeps only a
        longer input's last that many tokens (-1: the model's context length; a leading BOS
        stays first) instead of refusing it. All inputs batch together, and with other
        callers' inputs, in the engine's steps; nothing is decoded and no KV is kept.
        Invalid input raises :class:`InvalidParameterError` or
        :class:`ContextWindowExceededError`; cancelling the awaiting task cancels the call.
        """
        sink = LoopSink()
        if _total_chars(inputs) > INLINE_PROMPT_CHARS:  # tokenize long texts off the caller's loop
            request = await asyncio.to_thread(self._submit_embedding, inputs, pooling, dimensions, timeout, request_id, sink,
                                              truncate_prompt_tokens)
        else:
            request = self._submit_embedding(inputs, pooling, dimensions, timeout, request_id, sink, truncate_prompt_tokens)
        sink.request = request
        return await self._result(sink, request)  # type: ignore[attr-defined]

    def embed_sync(
        self, inputs: EmbedInputs, *, pooling: str = "mean", dimensions: Optional[int] = None,
        timeout: Optional[float] = None, request_id: Optional[str] = None, truncate_prompt_tokens: Optional[int] = None,
    ) -> EmbeddingResult:
        """Blocking :meth:`embed`, for plain threads (not inside a running event loop's thread)."""
        sink = ThreadSink()
        request = self._submit_embedding(inputs, pooling, dimensions, timeout, request_id, sink, truncate_prompt_tokens)
        return self._result_sync(sink, request)  # type: ignore[attr-defined]

    def _submit_embedding(
        self, inputs: Any, pooling: Any, dimensions: Any, timeout: Any, request_id: Optional[str], sink: ResultSink, truncate: Any
    ) -> EmbedRequest:
        with self._submission():  # type: ignore[attr-defined]  (counted in flight, and the engine awake)
            return self._submit_embedding_awake(inputs, pooling, dimensions, timeout, request_id, sink, truncate)

    def _submit_embedding_awake(
        self, inputs: Any, pooling: Any, dimensions: Any, timeout: Any, request_id: Optional[str], sink: ResultSink, truncate: Any
    ) -> EmbedRequest:
        engine: Any = self
        model = engine._loaded
        check_options(pooling, dimensions, model.config.get("hidden_size"))
        check_truncate_prompt_tokens(truncate)
        if hidden_model(model.model) is None:
            raise UnsupportedModelError(f"{engine.model_name}: this model does not expose its hidden states, so it cannot embed")
        if timeout is None:
            timeout = engine.config.request_timeout_s
        else:
            check_number("timeout", timeout, minimum=0.0)
            if timeout == 0:
                raise InvalidParameterError("timeout", "must be > 0 seconds (None disables it)")
        prompts = engine._prompts
        ids = input_ids(inputs, lambda text: prompts.encode_within_context(text, 0, truncate),
                        lambda given: prompts.encode_within_context(given, 0, truncate) if truncate is not None else engine.encode(given),
                        engine.context_length)
        now = time.monotonic()
        request = EmbedRequest(
            request_id=request_id or f"emb-{next(engine._ids)}-{uuid.uuid4().hex[:8]}", inputs=ids, pooling=pooling, sink=sink,
            dimensions=dimensions, arrival=now, deadline=None if timeout is None else now + timeout,
        )
        for _ in range(2):
            worker = engine._live_core()
            if worker.num_waiting >= engine.config.max_queue:
                raise EngineOverloadedError(
                    f"{worker.num_waiting} requests are already waiting (max_queue={engine.config.max_queue}); "
                    "retry later or raise EngineConfig.max_queue"
                )
            if worker.submit(request):
                return request
        raise RuntimeError("could not start the engine's worker")  # pragma: no cover


def _total_chars(inputs: object) -> int:
    if isinstance(inputs, (list, tuple)):
        return sum(len(x) for x in inputs if isinstance(x, str))
    return 0
