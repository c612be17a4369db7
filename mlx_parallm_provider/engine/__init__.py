"""The batching engine: coordinator (callers' side), scheduler (policy), worker (MLX)."""

from .coordinator import Engine, get_engine, shutdown_engines
from .request import Completion, Delta, SamplingParams, TokenLogprob, Usage

__all__ = ["Completion", "Delta", "Engine", "SamplingParams", "TokenLogprob", "Usage", "get_engine", "shutdown_engines"]
