"""The package's own front doors, in this process: the engine, LiteLLM and LangChain.

All three share one engine per model (as in an application); each run starts a fresh one
with the run's :class:`~mlx_parallm_provider.EngineConfig`, so ``engine.stats()`` (largest
decode batch) and MLX's peak memory cover that run only.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

from ... import EngineConfig, SamplingParams, get_engine, shutdown_engines
from ..metrics import RequestRecord
from ..workloads import BenchRequest
from .base import Runner, Sampling


def reset_mlx_peak() -> None:
    """Start MLX's peak-memory count afresh."""
    import mlx.core as mx

    mx.reset_peak_memory()


def mlx_peak_mb() -> float:
    """MLX's peak memory since the last reset, in MiB."""
    import mlx.core as mx

    return mx.get_peak_memory() / 2**20


def draft_counts(stats: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``{"speculation" | "fast_forward": (draft tokens, accepted tokens)}`` from
    ``engine.stats()``, for what is on (n-gram drafts; grammar-forced and looked-up tokens)."""
    out = {}
    if stats.get("speculation"):
        out["speculation"] = (stats["speculation"]["draft_tokens"], stats["speculation"]["accepted_tokens"])
    if stats.get("fast_forward"):
        ff = stats["fast_forward"]
        out["fast_forward"] = (ff["forced_tokens"] + ff["lookup_tokens"], ff["accepted_tokens"] + ff["lookup_accepted_tokens"])
    return out


class _OnSharedEngine(Runner):
    def __init__(self, name: str, model: str, config: EngineConfig, sampling: Sampling, ignore_eos: bool) -> None:
        super().__init__(name)
        self.model = model
        self.config = config
        self.sampling = sampling
        self.ignore_eos = ignore_eos
        self.eos = "ignored" if ignore_eos else "honoured"
        self.engine: Any = None
        self._drafts_before: dict[str, tuple[int, int]] = {}  # draft counts when the timed requests began

    def _fresh_engine(self) -> Any:
        shutdown_engines()
        return get_engine(self.model, self.config)

    async def before_run(self) -> None:
        self.engine = await asyncio.to_thread(self._fresh_engine)
        reset_mlx_peak()

    async def timed(self, requests: Any, offsets: Any, max_concurrency: Optional[int], on_done: Any) -> Any:
        self._drafts_before = draft_counts(self.engine.stats())  # so the warm-up's drafts are left out
        return await super().timed(requests, offsets, max_concurrency, on_done)

    def run_info(self) -> dict[str, Any]:
        from ..servers import peak_rss_mb

        stats = self.engine.stats()
        info = {"max_decode_batch": stats.get("max_batch_size"), "peak_memory_mb": mlx_peak_mb(), "peak_rss_mb": peak_rss_mb(),
                "backend": stats.get("backend"), "attention": stats.get("attention"), "decode": stats.get("decode")}
        for kind, (drafted, accepted) in draft_counts(stats).items():
            drafted -= self._drafts_before.get(kind, (0, 0))[0]
            accepted -= self._drafts_before.get(kind, (0, 0))[1]
            if drafted:
                info[f"{kind}_draft_tokens"], info[f"{kind}_accepted_tokens"] = drafted, accepted
        return info

    async def stop(self) -> None:
        shutdown_engines()


class EngineRunner(_OnSharedEngine):
    """``Engine.stream`` on the rendered prompt's token ids."""

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        params = SamplingParams(max_tokens=request.max_tokens, temperature=self.sampling.temperature, ignore_eos=self.ignore_eos,
                                **self.sampling.filters())
        async for delta in self.engine.stream(request.prompt_ids, params):
            if delta.token_ids:
                record.add_chunk()
            if delta.usage is not None:
                record.output_tokens = delta.usage.completion_tokens
                record.prompt_tokens = delta.usage.prompt_tokens


class LiteLLMRunner(_OnSharedEngine):
    """``litellm.acompletion(model="mlx-parallm/...", stream=True)`` with the chat messages."""

    async def start(self) -> None:
        import litellm  # noqa: F401  (slow import, kept out of the timings)

        from ... import register

        register()

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        import litellm

        extra: dict[str, Any] = {"ignore_eos": True} if self.ignore_eos else {}
        if request.tools:
            extra["tools"] = request.tools
            if request.tool_choice:
                extra["tool_choice"] = request.tool_choice
        stream = await litellm.acompletion(
            model=f"mlx-parallm/{self.model}", messages=request.messages, max_tokens=request.max_tokens,
            temperature=self.sampling.temperature, stream=True, stream_options={"include_usage": True}, **self.sampling.filters(), **extra,
        )
        async for chunk in stream:
            if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].delta.tool_calls):
                record.add_chunk()
            usage = getattr(chunk, "usage", None)
            if usage is not None and usage.completion_tokens:
                record.output_tokens = usage.completion_tokens
                record.prompt_tokens = usage.prompt_tokens or record.prompt_tokens


class LangChainRunner(_OnSharedEngine):
    """``ChatMLXParallm(...).astream(messages)`` (``bind_tools`` when the request has tools)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._chats: dict[str, Any] = {}

    def _chat(self, request: BenchRequest) -> Any:
        from ...langchain import ChatMLXParallm

        key = json.dumps([request.max_tokens, request.tools, request.tool_choice])
        if key not in self._chats:
            chat: Any = ChatMLXParallm(model=self.model, max_tokens=request.max_tokens, temperature=self.sampling.temperature,
                                       ignore_eos=self.ignore_eos, **self.sampling.filters())
            self._chats[key] = (chat.bind_tools(request.tools, **({"tool_choice": request.tool_choice} if request.tool_choice else {}))
                                if request.tools else chat)
        return self._chats[key]

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        async for chunk in self._chat(request).astream(request.messages):
            if chunk.content or getattr(chunk, "tool_call_chunks", None):
                record.add_chunk()
            usage: Optional[dict] = getattr(chunk, "usage_metadata", None)
            if usage and usage.get("output_tokens"):
                record.output_tokens = usage["output_tokens"]
                record.prompt_tokens = usage.get("input_tokens") or record.prompt_tokens
