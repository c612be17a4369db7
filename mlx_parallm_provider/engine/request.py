"""Request-level data: what a caller asks for (:class:`SamplingParams`) and what it gets
back (:class:`Completion` for a whole answer, :class:`Delta` for a streamed piece)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable, Optional, Union

from .._validation import check_int as _check_int
from .._validation import check_number as _check_number
from ..errors import InvalidParameterError, RequestTimeoutError
from .grammar.constraint import Constraint

if TYPE_CHECKING:
    import asyncio

    from ..models.lora.slots import AdapterUse

Prompt = Union[str, list[int]]

MAX_SEED = 2**64 - 1
"""Largest accepted ``seed``: MLX's PRNG keys are 64-bit."""

MAX_BAD_WORDS = 1024
"""Most ``bad_words`` one request may name (each is looked for at every token)."""


@dataclass(slots=True)
class SamplingParams:
    """How one request is sampled. Every field is validated on construction.

    Defaults follow mlx-lm: greedy decoding (``temperature=0``), no top-p / top-k / min-p
    filtering, no penalties. Each request in a batch keeps its own settings.
    ``include_stop_str_in_output`` (vLLM's): the stop string that ends the answer stays at
    its end (by default it is cut off).

    vLLM's token controls: ``min_tokens``, the fewest tokens generated before the answer may
    end (EOS and ``stop_token_ids`` are not sampled before, stop strings are looked for only in
    the text of the tokens after them; a grammar that allows nothing else still ends);
    ``allowed_token_ids``, the only tokens the answer may use; ``bad_words``, words (each as
    the tokenizer writes it alone and after a space) the answer never ends with a token of;
    ``skip_special_tokens``, special tokens' text left out of the answer (by default it is
    kept, as mlx-lm keeps it).

    ``truncate_prompt_tokens`` (vLLM's): a longer prompt keeps only its last that many tokens
    (a leading BOS token stays first) instead of being refused; ``-1`` keeps as many as fit
    beside ``max_tokens`` in the model's context. ``Usage.prompt_tokens`` counts those kept.

    ``prompt_logprobs`` (vLLM's): each prompt token's log-probability given the tokens before
    it (the first has none), with that many top alternatives (0-20), from the model's raw
    logits; on :attr:`Completion.prompt_logprobs` and a stream's first :class:`Delta`. Such a
    request computes its whole prompt (no cached prefix is reused for it).

    ``prediction`` (OpenAI's Predicted Outputs): text the answer is expected to be much like
    (a file with a few lines edited), as a string or OpenAI's ``{"type": "content",
    "content": ...}``. It never changes the answer; with n-gram speculation on
    (``EngineConfig.speculative="ngram"``) the row drafts what follows its last tokens in it.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: Optional[int] = None
    logprobs: bool = False
    top_logprobs: int = 0
    timeout: Optional[float] = None
    constraint: Optional[Constraint] = None
    lora: Optional[str] = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    allowed_token_ids: Optional[list[int]] = None
    bad_words: list[str] = field(default_factory=list)
    skip_special_tokens: bool = False
    truncate_prompt_tokens: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    prediction: Optional[Union[str, dict[str, Any]]] = None

    def __post_init__(self) -> None:
        self.stop = _string_list("stop", self.stop)
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature, minimum=0.0)
        _check_number("top_p", self.top_p, minimum=0.0, maximum=1.0)
        if self.top_p == 0.0:
            raise InvalidParameterError("top_p", "must be > 0 (use temperature=0 for greedy)")
        _check_int("top_k", self.top_k, minimum=0)
        _check_number("min_p", self.min_p, minimum=0.0, maximum=1.0)
        _check_number("repetition_penalty", self.repetition_penalty, minimum=0.0)
        if self.repetition_penalty == 0.0:
            raise InvalidParameterError("repetition_penalty", "must be > 0 (1.0 disables it)")
        _check_number("presence_penalty", self.presence_penalty, minimum=-2.0, maximum=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, minimum=-2.0, maximum=2.0)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidParameterError("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _int_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise InvalidParameterError("allowed_token_ids", "must name at least one token id (None allows every token)")
        self.bad_words = _string_list("bad_words", self.bad_words)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidParameterError("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(name, f"must be a bool, got {getattr(self, name)!r}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0, maximum=20)
        if self.prediction is not None:
            self.prediction = _prediction_text(self.prediction)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0, maximum=MAX_SEED)
        if not isinstance(self.logprobs, bool):
            raise InvalidParameterError("logprobs", f"must be a bool, got {self.logprobs!r}")
        _check_int("top_logprobs", self.top_logprobs, minimum=0, maximum=20)
        if self.top_logprobs and not self.logprobs:
            self.logprobs = True
        if self.timeout is not None:
            _check_number("timeout", self.timeout, minimum=0.0)
            if self.timeout == 0:
                raise InvalidParameterError("timeout", "must be > 0 seconds (None disables it)")
        if self.lora is not None:
            self.lora = _lora_name(self.lora)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidParameterError("constraint", f"must be a Constraint (e.g. Constraint.json_schema(...)), got {self.constraint!r}")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Check the token ids this request names against a model's vocabulary size.

        Raises :class:`InvalidParameterError` naming the field and the allowed range. The
        engine calls this at submit, since an out-of-range id would index past the logits.
        """
        last = vocab_size - 1
        if self.top_k > vocab_size:
            raise InvalidParameterError("top_k", f"must be <= the vocabulary size {vocab_size} (0 disables it), got {self.top_k}")
        for token in self.logit_bias or {}:
            if token > last:
                raise InvalidParameterError("logit_bias", f"token id {token} is not in this model's vocabulary (0..{last})")
        for name in ("stop_token_ids", "allowed_token_ids"):
            for i, token in enumerate(getattr(self, name) or []):
                if token > last:
                    raise InvalidParameterError(f"{name}[{i}]", f"token id {token} is not in this model's vocabulary (0..{last})")

    @property
    def is_greedy(self) -> bool:
        """True when the next token is always the arg-max (no randomness)."""
        return self.temperature == 0.0


def check_truncate_prompt_tokens(value: object) -> None:
    """Refuse a ``truncate_prompt_tokens`` that is not None, -1 or a positive integer."""
    if value is None:
        return
    _check_int("truncate_prompt_tokens", value)
    if value < 1 and value != -1:  # type: ignore[operator]
        raise InvalidParameterError("truncate_prompt_tokens", f"must be >= 1, or -1 for as many as fit (None keeps the whole prompt), got {value}")


@dataclass(slots=True)
class Usage:
    """Token counts of one request (OpenAI's usage, its details' ``cached_tokens`` and ``reasoning_tokens`` flat)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those whose KV was reused from the prefix store
    reasoning_tokens: int = 0  # of the completion tokens, a reasoning model's thinking (counted by the chat layer)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one token, with the most likely alternatives (``(id, text,
    logprob)``, likeliest first); ``rank``, the token's place among all (1: the likeliest),
    is counted for prompt logprobs."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[tuple[int, str, float]] = field(default_factory=list)
    rank: Optional[int] = None


@dataclass(slots=True)
class Completion:
    """A finished request: the whole text and token ids, why it stopped, and its usage.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string) or ``"length"``
    (``max_tokens`` reached). ``prompt_logprobs``, if asked for: one entry per prompt token,
    None for the first.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: Optional[list[TokenLogprob]] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None


@dataclass(slots=True)
class Delta:
    """One streamed piece of a request's output.

    ``text`` is safe to show (never half a UTF-8 character, never part of a stop string).
    ``token_ids`` (and ``logprobs``, if asked for) are those of every token not yet
    streamed: a token whose text is held back rides on the next delta, or the last one,
    so over a stream they concatenate to the :class:`Completion`'s. Every delta but the
    last has text; the last has ``finish_reason`` and ``usage`` set. The first carries
    ``prompt_logprobs``, if asked for.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    usage: Optional[Usage] = None
    logprobs: Optional[list[TokenLogprob]] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None


class ResultSink:
    """Where the worker delivers a request's results: :class:`Delta` pieces (streaming
    requests), then a final :class:`Completion`, or an exception. Implementations hand
    items to the caller's event loop or thread."""

    loop: Optional["asyncio.AbstractEventLoop"] = None
    """The event loop the results go to, where :meth:`put_on_loop` hands them over on it (a
    step's results for one loop then go in one call, :func:`.sinks.deliver_all`); None: by
    :meth:`put` alone."""

    def put(self, item: object) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def put_on_loop(self, item: object) -> None:
        """Hand ``item`` over, called on :attr:`loop`'s thread."""
        raise NotImplementedError(f"{type(self).__name__} delivers by put() alone")

    def abandoned(self) -> bool:
        """True once nobody can receive the results (the caller's event loop is closed): the
        worker then drops the request at its next step instead of decoding for nobody."""
        return False


@dataclass(eq=False)
class Request:
    """One request's engine-side state, shared by the coordinator, scheduler and worker.

    The coordinator creates it; the scheduler moves it between queues; the worker fills
    ``output_ids`` and delivers results to ``sink``. ``cancelled`` may be set from any
    thread; the worker honours it at its next step.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: ResultSink
    stream: bool = False
    arrival: float = 0.0
    deadline: Optional[float] = None
    output_ids: list[int] = field(default_factory=list)
    num_prefilled: int = 0
    num_cached: int = 0  # leading prompt tokens whose KV came from the prefix store
    cancelled: bool = False
    finished: bool = False
    num_preemptions: int = 0  # times its KV blocks were taken back, to be recomputed
    draft: list[int] = field(default_factory=list)  # speculative tokens its next step verifies
    state: object = None  # worker-private per-request state (sampler, text stream, ...)
    adapter: Optional["AdapterUse"] = None  # the LoRA adapter its rows run through (None: the base model)
    bad_word_ids: list[list[int]] = field(default_factory=list)  # its params' bad_words as token ids (:func:`.token_bans.bad_word_ids`)
    predicted_ids: list[int] = field(default_factory=list)  # its params' prediction as token ids (drafts may follow them)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def computed_ids(self) -> list[int]:
        """The tokens whose KV an admitted request computes before it samples: its prompt,
        plus its output so far when it was preempted and is recomputed."""
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    def time_left(self, now: float) -> Optional[float]:
        """Seconds until the deadline (may be negative), or None without one."""
        return None if self.deadline is None else self.deadline - now

    def timeout_error(self) -> RequestTimeoutError:
        """The error a caller gets when this request's deadline passes."""
        return RequestTimeoutError(
            f"request {self.request_id} timed out after {(self.deadline or self.arrival) - self.arrival:.3g}s; "
            "raise its timeout or lower max_tokens"
        )

    @property
    def cache_namespace(self) -> Hashable:
        """What its KV blocks are named under in the prefix store: 0 for the base model, its
        adapter's content id under a LoRA adapter (never shared across adapters)."""
        return 0 if self.adapter is None else ("lora", self.adapter.uid)

    @property
    def reads_cached_prefix(self) -> bool:
        """Whether a prefix of its prompt computed for another request may stand for its own:
        not where it asks for prompt logprobs, which need every prompt position's logits."""
        return self.params.prompt_logprobs is None

    @property
    def max_kv_tokens(self) -> int:
        """KV entries this request may need at most (prompt + max_tokens)."""
        return len(self.prompt_ids) + self.params.max_tokens


def _lora_name(value: object) -> str:
    """A LoRA adapter: a registered name or an adapter folder's path (a path object becomes its string)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise InvalidParameterError("lora", f"must be an adapter name or an adapter folder's path, got {value!r}")
    return value


def _prediction_text(value: object) -> str:
    """OpenAI's ``prediction`` (``{"type": "content", "content": text or text parts}``), or
    the text itself, as one string."""
    if isinstance(value, str):
        return value
    if not isinstance(value, dict) or value.get("type") != "content" or "content" not in value:
        raise InvalidParameterError("prediction", f'must be a string or {{"type": "content", "content": ...}}, got {value!r:.80}')
    content = value["content"]
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidParameterError("prediction.content", "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts")


def _string_list(name: str, value: object) -> list[str]:
    """A list of strings (``stop``, ``bad_words``) from ``None``, one string or a sequence of non-empty strings."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise InvalidParameterError(name, f"must be a string or a list of strings, got {type(value).__name__}")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise InvalidParameterError(f"{name}[{i}]", f"must be a non-empty string, got {s!r}")
    return list(value)


def _int_list(name: str, value: object) -> list[int]:
    """A token-id list from ``None`` or a sequence of non-negative ints."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InvalidParameterError(name, f"must be a list of token ids, got {type(value).__name__}")
    for i, token in enumerate(value):
        _check_int(f"{name}[{i}]", token, minimum=0)
    return list(value)


def _logit_bias(value: object) -> dict[int, float]:
    """``{token id: bias}`` with int (or int-string, as JSON sends) keys and biases in [-100, 100]."""
    if not isinstance(value, dict):
        raise InvalidParameterError("logit_bias", f"must be a dict of token id -> bias, got {type(value).__name__}")
    bias: dict[int, float] = {}
    for key, amount in value.items():
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise InvalidParameterError("logit_bias", f"key {key!r} is not a token id")
        try:
            token = int(key)
        except ValueError:
            raise InvalidParameterError("logit_bias", f"key {key!r} is not a token id") from None
        if token < 0:
            raise InvalidParameterError("logit_bias", f"token id {token} is negative")
        _check_number(f"logit_bias[{token}]", amount, minimum=-100.0, maximum=100.0)
        bias[token] = float(amount)
    return bias
