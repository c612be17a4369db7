"""llama.cpp's own server, ``llama-server`` (prebuilt in the ``xllamacpp`` wheel: no compile),
over HTTP: the peer a llama.cpp user runs. Started on loopback for each run with one slot
per concurrent request and room for the run's longest request in each, as
:class:`~.llama_cpp.LlamaCpp` sizes its context, and stopped after it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional, Sequence

from ..metrics import RequestRecord
from ..workloads import BenchRequest
from .base import OnDone, Sampling, SkipSystem
from .http import OpenAIHTTP
from .llama_cpp import MAX_SEQUENCES, default_threads, gguf_path

CTX_ROUNDING = 256
"""Each slot's context is the run's longest prompt + max_tokens, rounded up to this (the
server's prompt rendering may add a few tokens to ours)."""


class LlamaServer(OpenAIHTTP):
    """``llama-server`` on the model's GGUF, ``threads`` threads (default: one per two CPUs,
    as llama-cpp-python's), a fresh server per run (its peak RSS is the run's)."""

    def __init__(self, name: str, model: str, sampling: Sampling, ignore_eos: bool = False, threads: Optional[int] = None,
                 workdir: Path = Path(".")) -> None:
        # (llama-server filters with top_k 40, top_p 0.95, min_p 0.05 unless told otherwise)
        super().__init__(name, "bench", sampling, ignore_eos=ignore_eos, explicit_filters=True)
        self.model_name, self.workdir = model, workdir
        self.threads = threads or default_threads()
        self.gguf: Optional[Path] = None
        self._peak_mb: Optional[float] = None

    async def start(self) -> None:
        if importlib.util.find_spec("xllamacpp") is None:
            raise SkipSystem("llama-server needs the xllamacpp wheel: pip install 'mlx-parallm-provider[llama-server]'")
        self.gguf = gguf_path(self.model_name)
        if not self.gguf.is_file():
            raise SkipSystem(f"{self.gguf}: no such GGUF file")

    async def run(self, requests: Sequence[BenchRequest], offsets: Sequence[float], max_concurrency: Optional[int],
                  on_done: OnDone = None) -> tuple[list[RequestRecord], float]:
        """A server sized for this run (its concurrency and longest request), then the run."""
        from .. import servers

        assert self.gguf is not None, "start() first"
        slots = max(1, min(max_concurrency or len(requests), len(requests), MAX_SEQUENCES))
        longest = max((r.prompt_tokens + r.max_tokens for r in requests), default=1)
        ctx = -(-(longest + 32) // CTX_ROUNDING) * CTX_ROUNDING
        self.launch = lambda: servers.llama_server(self.gguf, self.workdir, slots, ctx, self.threads)
        await super().start()
        try:
            return await super().run(requests, offsets, max_concurrency, on_done)
        finally:
            self._peak_mb = self.server.peak_rss_mb()
            await super().stop()
            self.server = self.client = None

    def run_info(self) -> dict[str, Any]:
        return {"peak_memory_mb": self._peak_mb, "peak_rss_mb": self._peak_mb}
