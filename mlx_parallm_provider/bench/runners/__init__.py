"""The systems a benchmark can run, by name: this package's front doors and its peers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ...config import EngineConfig
from .base import OneAtATime, Runner, Sampling, SkipSystem

#: this package's front doors: engine settings (sweeps) apply to these
OURS = ("engine", "litellm", "langchain", "litellm-proxy")
#: what a user would pick instead
PEERS = ("mlx-lm", "mlx-lm-batch", "mlx-lm-server", "llama-cpp", "llama-server")
#: any OpenAI-compatible server at --url
SYSTEMS = OURS + PEERS + ("http",)

DESCRIPTIONS = {
    "engine": "Engine.stream (in process)",
    "litellm": "litellm.acompletion (in process)",
    "langchain": "ChatMLXParallm.astream (in process)",
    "litellm-proxy": "LiteLLM proxy over HTTP (started on loopback)",
    "mlx-lm": "mlx_lm.stream_generate, one request at a time",
    "mlx-lm-batch": "mlx_lm.batch_generate, waves of the concurrency, each decoded as one batch",
    "mlx-lm-server": "mlx_lm.server over HTTP (started on loopback), decoding the widest run's requests at once",
    "llama-cpp": "llama-cpp-python, one context, a sequence per concurrent request",
    "llama-server": "llama.cpp's llama-server (xllamacpp) over HTTP, a slot per concurrent request (started on loopback)",
    "http": "OpenAI-compatible server at --url",
}


@dataclass(frozen=True)
class RunnerOptions:
    """What every runner may need."""

    model: str
    sampling: Sampling = Sampling()
    ignore_eos: bool = False
    workdir: Path = Path(".")
    url: Optional[str] = None
    api_key: Optional[str] = None
    served_model: Optional[str] = None
    llama_cpp_threads: Optional[int] = None
    max_concurrency: Optional[int] = None
    """The widest run's requests in flight: mlx-lm's server decodes that many at once."""


def make_runner(system: str, options: RunnerOptions, config: Optional[EngineConfig] = None) -> Runner:
    """The runner of ``system``; ``config`` is the engine's (the package's front doors only)."""
    config = config or EngineConfig()
    o = options
    if system in ("engine", "litellm", "langchain"):
        from .inprocess import EngineRunner, LangChainRunner, LiteLLMRunner

        cls = {"engine": EngineRunner, "litellm": LiteLLMRunner, "langchain": LangChainRunner}[system]
        return cls(system, o.model, config, o.sampling, o.ignore_eos)
    if system in ("mlx-lm", "mlx-lm-batch"):
        from .mlx_lm import MlxLmBatch, MlxLmSequential

        return (MlxLmSequential if system == "mlx-lm" else MlxLmBatch)(system, o.model, o.sampling, o.ignore_eos)
    if system == "llama-cpp":
        from .llama_cpp import LlamaCpp

        return LlamaCpp(system, o.model, o.sampling, o.ignore_eos, o.llama_cpp_threads)
    if system == "llama-server":
        from .llama_server import LlamaServer

        return LlamaServer(system, o.model, o.sampling, o.ignore_eos, o.llama_cpp_threads, o.workdir)
    from .. import servers
    from .http import OpenAIHTTP

    if system == "litellm-proxy":
        if config != EngineConfig():
            raise SkipSystem("the proxy runs its engine with the default EngineConfig (settings are not passed to it)")
        return OpenAIHTTP(system, "bench", o.sampling, launch=lambda: servers.litellm_proxy(o.model, o.workdir), ignore_eos=o.ignore_eos)
    if system == "mlx-lm-server":
        from ...models.registry import resolve

        return OpenAIHTTP(system, "default_model", o.sampling, launch=lambda: servers.mlx_lm_server(resolve(o.model), o.workdir, o.max_concurrency))
    if system == "http":
        if not o.url:
            raise SkipSystem("system 'http' needs --url")
        return OpenAIHTTP(system, o.served_model or o.model, o.sampling, base_url=o.url, api_key=o.api_key)
    raise ValueError(f"unknown system {system!r}: expected one of {', '.join(SYSTEMS)}")


__all__ = ["DESCRIPTIONS", "OURS", "PEERS", "SYSTEMS", "OneAtATime", "Runner", "RunnerOptions", "Sampling", "SkipSystem", "make_runner"]
