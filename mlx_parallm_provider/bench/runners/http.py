"""Any OpenAI-compatible chat endpoint over HTTP (streamed server-sent events), optionally
a server this benchmark starts on loopback and stops."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Optional

import httpx

from ..metrics import RequestRecord
from ..workloads import BenchRequest
from .base import Runner, Sampling


class HTTPFailure(Exception):
    """A non-200 answer; ``kind`` is ``http_<status>``."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.kind = f"http_{status}"


def normalize_base_url(url: str) -> str:
    """``http://host:port``, from a URL given with or without ``/v1``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class OpenAIHTTP(Runner):
    """POST ``/v1/chat/completions`` with ``stream=True`` and usage on the last chunk.

    Args:
        base_url: the server (None when ``launch`` starts one).
        served_model: the ``model`` field of each request.
        launch: starts a server (blocking) and returns a
            :class:`~mlx_parallm_provider.bench.servers.Server`.
        ignore_eos: send ``"ignore_eos": true`` (a vLLM extension that this package's LiteLLM
            provider, hence its proxy, accepts; plain OpenAI servers reject or drop it).
        explicit_filters: send every filter, off ones included (see :meth:`.Sampling.filters`);
            else only those that are on (``top_k`` and ``min_p`` are not OpenAI's).
    """

    def __init__(self, name: str, served_model: str, sampling: Sampling, *, base_url: Optional[str] = None,
                 api_key: Optional[str] = None, launch: Optional[Callable[[], Any]] = None, ignore_eos: bool = False,
                 explicit_filters: bool = False) -> None:
        super().__init__(name)
        self.ignore_eos = ignore_eos
        self.eos = "ignored" if ignore_eos else "honoured"
        self.served_model = served_model
        self.sampling, self.explicit_filters = sampling, explicit_filters
        self.base_url = normalize_base_url(base_url) if base_url else None
        self.api_key = api_key
        self.launch = launch
        self.server: Any = None
        self.client: Optional[httpx.AsyncClient] = None

    async def start(self) -> None:
        if self.launch is not None:
            self.server = await asyncio.to_thread(self.launch)
            self.base_url, self.api_key = self.server.base_url, self.server.api_key
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.AsyncClient(base_url=self.base_url or "", headers=headers, timeout=httpx.Timeout(900.0), limits=limits, trust_env=False)

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)

    def run_info(self) -> dict[str, Any]:
        if self.server is None:
            return {}
        peak = self.server.peak_rss_mb()
        return {"peak_memory_mb": peak, "peak_rss_mb": peak}

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        assert self.client is not None, "start() first"
        body: dict[str, Any] = {
            "model": self.served_model, "messages": request.messages, "max_tokens": request.max_tokens,
            "temperature": self.sampling.temperature, **self.sampling.filters(self.explicit_filters),
            "stream": True, "stream_options": {"include_usage": True},
        }
        if request.tools:
            body["tools"] = request.tools
            if request.tool_choice:
                body["tool_choice"] = request.tool_choice
        if self.ignore_eos:
            body["ignore_eos"] = True
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise HTTPFailure(response.status_code, (await response.aread()).decode(errors="replace"))
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    record.add_chunk()
                usage = chunk.get("usage") or {}
                if usage.get("completion_tokens"):
                    record.output_tokens = usage["completion_tokens"]
                if usage.get("prompt_tokens"):  # the server's own rendering of the messages
                    record.prompt_tokens = usage["prompt_tokens"]
        if not record.output_tokens:  # no usage reported: one token per chunk
            record.output_tokens = len(record.chunk_times)
