"""mlx-lm in this process, on the same weights as the engine: one request at a time with
``mlx_lm.stream_generate``, and ``mlx_lm.batch_generate``.

The peers get the checkpoint as mlx-lm alone runs it fastest on this device: dequantized to
float32 on the CPU, and nothing else: a copy of their own, on which no backend is installed
(:mod:`mlx_parallm_provider.models.backends`), so they run mlx-lm's own attention, norms and
matmuls whatever the engine in the same process runs (its kernels are the engine's own work)."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Optional, Sequence

from ..metrics import RequestRecord
from ..workloads import BenchRequest
from .base import OnDone, OneAtATime, Runner, Sampling
from .inprocess import mlx_peak_mb, reset_mlx_peak


class _MlxLmPeer(Runner):
    """Loads the model through the package's registry (the engine's weights, running mlx-lm's
    own code), with a tokenizer copy that has no EOS ids when EOS is ignored."""

    def __init__(self, name: str, model: str, sampling: Sampling, ignore_eos: bool) -> None:
        super().__init__(name)
        self.model_name = model
        self.sampling = sampling
        self.ignore_eos = ignore_eos
        self.eos = "ignored" if ignore_eos else "honoured"
        self.model: Any = None
        self.tokenizer: Any = None

    def _load(self) -> None:
        from ...models import registry

        loaded = registry.load(self.model_name, engine=False)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        if self.ignore_eos:  # a copy: the engine shares the original
            self.tokenizer = copy.copy(loaded.tokenizer)
            self.tokenizer.eos_token_ids = []

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    async def before_run(self) -> None:
        reset_mlx_peak()

    def run_info(self) -> dict[str, Any]:
        return {"peak_memory_mb": mlx_peak_mb()}

    def sampler(self) -> Any:
        from mlx_lm.sample_utils import make_sampler

        s = self.sampling
        return make_sampler(temp=s.temperature, top_p=s.top_p if s.top_p < 1.0 else 0.0, min_p=s.min_p, top_k=s.top_k)


class MlxLmSequential(_MlxLmPeer, OneAtATime):
    """``mlx_lm.stream_generate``, one request at a time (what a plain loop would do)."""

    def tokens(self, request: BenchRequest) -> Iterator[int]:
        from mlx_lm import stream_generate

        for response in stream_generate(self.model, self.tokenizer, request.prompt_ids, max_tokens=request.max_tokens, sampler=self.sampler()):
            # The last response carries no new token when generation stopped on EOS.
            yield 0 if response.finish_reason == "stop" else 1


class MlxLmBatch(_MlxLmPeer):
    """``mlx_lm.batch_generate``: not streamed (no TTFT / TPOT / ITL) and given whole waves
    of ``max_concurrency`` prompts (all at once without a cap), so arrival times are ignored;
    each wave is decoded as one batch (``BatchGenerator``'s ``completion_batch_size``, 32 by
    default, would split a wider wave in two)."""

    def _generate(self, requests: Sequence[BenchRequest]) -> list[list[int]]:
        from mlx_lm import batch_generate

        out = batch_generate(
            self.model, self.tokenizer, [r.prompt_ids for r in requests],
            max_tokens=[r.max_tokens for r in requests], return_token_ids=True, sampler=self.sampler(),
            completion_batch_size=len(requests),
        )
        return out.token_ids

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        [ids] = await asyncio.to_thread(self._generate, [request])
        record.output_tokens = len(ids)

    async def warm_up(self, requests: Sequence[BenchRequest], width: int) -> None:
        """One short wave as wide as the timed ones (a failure shows in the timed waves)."""
        try:
            await asyncio.to_thread(self._generate, [replace(r, max_tokens=min(4, r.max_tokens)) for r in requests[:width]])
        except Exception:
            pass

    async def timed(self, requests: Sequence[BenchRequest], offsets: Sequence[float], max_concurrency: Optional[int],
                    on_done: OnDone) -> tuple[list[RequestRecord], float]:
        wave = max_concurrency or len(requests)
        records = []
        start = time.perf_counter()
        for i in range(0, len(requests), wave):
            batch = requests[i : i + wave]
            sent = time.perf_counter()
            try:
                outputs: list[Optional[list[int]]] = list(await asyncio.to_thread(self._generate, batch))
                error = None
            except Exception as exc:
                outputs, error = [None] * len(batch), type(exc).__name__
            done = time.perf_counter()
            for request, ids in zip(batch, outputs):
                records.append(RequestRecord(request.prompt_tokens, sent, done, output_tokens=len(ids or []), error=error))
                if on_done is not None:
                    on_done()
        return records, time.perf_counter() - start
