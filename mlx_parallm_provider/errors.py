"""The package's exception hierarchy.

Every error raised on purpose by mlx-parallm-provider subclasses :class:`MLXParallmError`,
so callers can catch one class. The LiteLLM and LangChain adapters map these to their own
ecosystems' classes at their boundary only.
"""

from __future__ import annotations

from typing import Optional


class MLXParallmError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidParameterError(MLXParallmError, ValueError):
    """A request or configuration parameter is out of range or of the wrong type."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class ContextWindowExceededError(MLXParallmError, ValueError):
    """The prompt plus ``max_tokens`` does not fit the model's context window.

    ``at_least``: ``prompt_tokens`` is a lower bound (a text refused from its length,
    without tokenizing it). ``what``: the input named in the message, for an input that
    generates nothing (an embedding input)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context_length: int, *, at_least: bool = False,
                 what: Optional[str] = None) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length
        if what is not None:  # an input with nothing generated after it (an embedding's)
            super().__init__(
                f"{what} ({'at least ' if at_least else ''}{prompt_tokens} tokens) exceeds the model's context "
                f"window of {context_length} tokens; shorten it"
            )
            return
        super().__init__(
            f"prompt ({'at least ' if at_least else ''}{prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
            f"{'at least ' if at_least else ''}"
            f"{prompt_tokens + max_tokens} exceeds the model's context window of "
            f"{context_length} tokens; shorten the prompt or lower max_tokens"
        )


class EngineOverloadedError(MLXParallmError):
    """The engine's waiting queue is full; retry later or raise ``max_queue``."""


class RequestTimeoutError(MLXParallmError, TimeoutError):
    """A request did not finish within its timeout."""


class EngineDeadError(MLXParallmError, RuntimeError):
    """The engine's worker thread died; the request could not complete."""


class RequestFailedError(MLXParallmError, RuntimeError):
    """One request failed inside the engine (while being set up, sampled, detokenised or
    delivered). Only that request fails; the cause is chained as ``__cause__``."""


def as_request_error(request_id: str, exc: BaseException, during: str = "") -> BaseException:
    """``exc`` if it is one of this package's errors, else a :class:`RequestFailedError`
    saying which request failed and where, ``exc`` chained as its cause."""
    if isinstance(exc, MLXParallmError):
        return exc
    error = RequestFailedError(f"request {request_id} failed {during}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class ModelNotFoundError(MLXParallmError, FileNotFoundError):
    """The model name, path or repository could not be found."""


class ModelLoadError(MLXParallmError):
    """A model was found but could not be loaded or converted."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture or tokenizer is not supported."""


class BackendError(MLXParallmError, RuntimeError):
    """This process cannot run models on its device as set up (for example ``mlx`` was
    imported before this package and OpenBLAS cannot be bound otherwise); the message says
    how to fix it."""


__all__ = [
    "MLXParallmError",
    "InvalidParameterError",
    "ContextWindowExceededError",
    "EngineOverloadedError",
    "RequestTimeoutError",
    "EngineDeadError",
    "RequestFailedError",
    "ModelNotFoundError",
    "ModelLoadError",
    "UnsupportedModelError",
    "BackendError",
]
