"""llama.cpp through ``llama-cpp-python`` (the optional ``[llama-cpp]`` extra), on the GGUF
file itself: its high-level chat API, one request at a time."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..workloads import BenchRequest
from .base import OneAtATime, SkipSystem


def gguf_path(model: str) -> Path:
    """The GGUF file behind a model name; :class:`SkipSystem` when there is none."""
    if model == "default":
        from ...models.registry import default_gguf_path

        return default_gguf_path()
    if model.endswith(".gguf"):
        return Path(model)
    raise SkipSystem(f"llama.cpp needs a .gguf model, not {model!r}")


class LlamaCpp(OneAtATime):
    """``Llama.create_chat_completion(stream=True)`` (EOS honoured)."""

    def __init__(self, name: str, model: str, temperature: float) -> None:
        super().__init__(name)
        self.model = model
        self.temperature = temperature
        self.llm: Any = None

    async def start(self) -> None:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise SkipSystem("llama-cpp-python is not installed (pip install 'mlx-parallm-provider[llama-cpp]')") from None
        path = gguf_path(self.model)
        self.llm = await asyncio.to_thread(Llama, model_path=str(path), n_ctx=0, n_threads=os.cpu_count(), verbose=False)

    def tokens(self, request: BenchRequest) -> Iterator[int]:
        extra = {"tools": request.tools} if request.tools else {}
        for chunk in self.llm.create_chat_completion(
            messages=request.messages, max_tokens=request.max_tokens, temperature=self.temperature, stream=True, **extra
        ):
            delta = chunk["choices"][0].get("delta") or {}
            yield 1 if delta.get("content") or delta.get("tool_calls") else 0
