"""Embedding requests: what a caller asks for (inputs, pooling, dimensions), the request's
engine-side state while the scheduler plans its inputs into steps, and the result.

No MLX here: the forward pass and pooling are :mod:`.forward`'s, run on the engine's core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from ..._validation import check_int
from ...errors import ContextWindowExceededError, InvalidParameterError, RequestTimeoutError
from ..request import ResultSink, Usage

POOLINGS = ("mean", "last")
"""``mean``: the average of the final hidden state over the input's tokens; ``last``: the
final hidden state of its last token (what decoder embedding models such as Qwen3-Embedding use)."""

MAX_INPUTS = 2048
"""Most inputs one embedding call may carry (OpenAI's limit for ``/v1/embeddings``)."""


@dataclass(slots=True)
class EmbeddingResult:
    """The vectors of one embedding call, in the order of its inputs, each L2-normalised,
    and its usage (``prompt_tokens``: the inputs' tokens; nothing is generated)."""

    request_id: str
    embeddings: list[list[float]]
    usage: Usage
    pooling: str


@dataclass(eq=False)
class EmbedRequest:
    """One embedding call's engine-side state. The scheduler hands out its inputs
    (``order``: shortest first, so a step's right-padded batch wastes little) and the worker
    fills ``vectors``; it finishes once every input has its vector. ``cancelled`` may be set
    from any thread."""

    request_id: str
    inputs: list[list[int]]
    pooling: str
    sink: ResultSink
    dimensions: Optional[int] = None
    arrival: float = 0.0
    deadline: Optional[float] = None
    cancelled: bool = False
    finished: bool = False
    num_planned: int = 0  # inputs (in ``order``) the scheduler has put into steps
    order: list[int] = field(default_factory=list)
    vectors: list[Optional[list[float]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.order = sorted(range(len(self.inputs)), key=lambda i: len(self.inputs[i]))
        self.vectors = [None] * len(self.inputs)

    @property
    def num_tokens(self) -> int:
        return sum(len(x) for x in self.inputs)

    @property
    def done(self) -> bool:
        return all(v is not None for v in self.vectors)

    def result(self) -> EmbeddingResult:
        return EmbeddingResult(self.request_id, list(self.vectors), Usage(prompt_tokens=self.num_tokens), self.pooling)  # type: ignore[arg-type]

    def time_left(self, now: float) -> Optional[float]:
        """Seconds until the deadline (may be negative), or None without one."""
        return None if self.deadline is None else self.deadline - now

    def timeout_error(self) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"embedding request {self.request_id} timed out after {(self.deadline or self.arrival) - self.arrival:.3g}s; "
            "raise its timeout or send fewer inputs per call"
        )


def check_options(pooling: object, dimensions: object, hidden_size: Optional[int]) -> None:
    """Raise :class:`InvalidParameterError` for an unknown ``pooling`` or a ``dimensions``
    outside 1..the model's hidden size."""
    if pooling not in POOLINGS:
        raise InvalidParameterError("pooling", f"must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    if dimensions is not None:
        check_int("dimensions", dimensions, minimum=1, maximum=hidden_size)


def input_ids(
    inputs: object, encode_text: Callable[[str], list[int]], check_ids: Callable[[list[int]], list[int]], context_length: int
) -> list[list[int]]:
    """Each input's token ids: ``inputs`` is a non-empty list of non-empty strings or of
    non-empty token-id lists, at most :data:`MAX_INPUTS`, none over the context window.
    ``encode_text`` tokenizes a text (refusing one far too long from its length),
    ``check_ids`` checks a list of ids against the vocabulary."""
    if isinstance(inputs, str) or not isinstance(inputs, Sequence):
        raise InvalidParameterError("input", f"must be a list of strings or of token-id lists, got {type(inputs).__name__}")
    if not inputs:
        raise InvalidParameterError("input", "is empty: give at least one text")
    if len(inputs) > MAX_INPUTS:
        raise InvalidParameterError("input", f"has {len(inputs)} items, more than the {MAX_INPUTS} one call may carry; split it")
    out = []
    for i, item in enumerate(inputs):
        name = f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise InvalidParameterError(name, "is an empty string")
            ids = _named(name, lambda: encode_text(item))
        elif isinstance(item, (list, tuple)):
            if not item:
                raise InvalidParameterError(name, "is an empty list of token ids")
            ids = _named(name, lambda: check_ids(list(item)))
        else:
            raise InvalidParameterError(name, f"must be a string or a list of token ids, got {type(item).__name__}")
        if not ids:
            raise InvalidParameterError(name, "has no tokens")
        if len(ids) > context_length:
            raise ContextWindowExceededError(len(ids), 0, context_length, what=name)
        out.append(ids)
    return out


def _named(name: str, encode: Callable[[], list[int]]) -> list[int]:
    """``encode()``, its errors naming the input they are about."""
    try:
        return encode()
    except InvalidParameterError as error:  # the engine's encode names "prompt" / "prompt[j]"
        where = name + error.field[len("prompt"):] if error.field.startswith("prompt") else name
        raise InvalidParameterError(where, str(error)[len(error.field) + 2:]) from None
    except ContextWindowExceededError as error:
        raise ContextWindowExceededError(error.prompt_tokens, 0, error.context_length, what=name, at_least=True) from None


def plan_embeddings(queue: Iterable[EmbedRequest], plan: Any, budget: int, before: Optional[float] = None) -> int:
    """Add to ``plan`` (a :class:`~.plan.StepPlan`) embedding inputs from ``queue`` (of calls that arrived no later than ``before``, in arrival
    order, each call's shortest first) to the plan while what they add to the step's
    right-padded embedding batch (rows x longest) fits ``budget``; returns the budget
    left. The step's first input always goes, so one longer than the whole budget runs
    in a step of its own rather than never."""
    rows = sum(len(indices) for _, indices in plan.embed)
    width = max((len(r.inputs[i]) for r, indices in plan.embed for i in indices), default=0)
    spent = rows * width
    for request in queue:
        if before is not None and request.arrival > before:
            break
        taken: list[int] = []
        while request.num_planned < len(request.inputs):
            i = request.order[request.num_planned]
            wider = max(width, len(request.inputs[i]))
            if (rows + 1) * wider - spent > budget and (rows or budget <= 0):
                break
            taken.append(i)
            request.num_planned += 1
            rows, width = rows + 1, wider
        if taken:
            plan.embed.append((request, taken))
        if request.num_planned < len(request.inputs):
            break
    return budget - (rows * width - spent)
