"""Test doubles: offline chat tokenizers and a deterministic fake :class:`Engine`.

``FakeEngine`` satisfies :class:`~mlx_parallm_provider.engine.EngineLike` (``generate``,
``stream``, ``generate_sync``, ``stream_sync``, ``generate_many``, ``generate_many_sync``,
``stats``) without a model: each request's answer comes from a script, and every request
is recorded with its :class:`SamplingParams`. Its fan-out uses the engine's own
``expand`` (the ``seed + i`` rule). ``chat_prompt`` renders messages with the real chat
layer, as the adapters do. ``patch_get_engine`` makes the LiteLLM adapter use a fake.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from mlx_parallm_provider.chat import render_chat
from mlx_parallm_provider.engine.embed.request import EmbeddingResult
from mlx_parallm_provider.engine.fanout import expand
from mlx_parallm_provider.engine.request import Completion, Delta, SamplingParams, TokenLogprob, Usage

# SmolLM2-135M-Instruct's template (plain ChatML, no tool support), verbatim.
# OpenAI tool definitions shared by the tool-calling tests.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A Qwen2.5-Instruct-style template that renders tools, tool calls and tool results.
QWEN_TOOLS_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n\
<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def make_tokenizer(chat_template: Optional[str] = SMOLLM2_TEMPLATE) -> Any:
    """A real transformers tokenizer built offline: byte-level BPE (one token per byte)
    with ChatML special tokens and the given chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", extra_special_tokens=["<|im_start|>"]
    )
    tokenizer.chat_template = chat_template
    return tokenizer


# --------------------------------------------------------------------------- fake engine

Script = Union[str, Mapping[str, str], Callable[[str, SamplingParams], str]]


@dataclass
class FakeCall:
    """One request the fake engine received."""

    method: str  # generate | stream | generate_sync | stream_sync (generate_many's requests: generate / generate_sync)
    prompt: Union[str, list[int]]
    params: SamplingParams
    request_id: Optional[str]
    thread: str


class FakeEngine:
    """A deterministic stand-in for ``mlx_parallm_provider.engine.Engine``.

    ``script`` decides each answer: a fixed string, a mapping whose first key found in
    the prompt selects the answer (else ``default``), or ``f(prompt, params) -> str``.
    Tokens are characters: ``max_tokens`` cuts the answer to that many characters
    (``finish_reason="length"``), a stop string cuts it before the stop
    (``"stop"``). Streams yield ``chunk_size`` characters per delta. ``error``, when
    set, is raised by every request. ``delay`` seconds of sleep per request lets tests
    observe concurrency (``max_in_flight``).
    """

    def __init__(
        self,
        script: Script = "Hello from the fake engine.",
        *,
        default: str = "Hello from the fake engine.",
        model_name: str = "fake",
        tokenizer: Any = None,
        context_length: int = 2048,
        chunk_size: int = 3,
        delay: float = 0.0,
        error: Optional[BaseException] = None,
        by_tokens: bool = False,
    ) -> None:
        self.model_name = model_name
        self.by_tokens = by_tokens  # token ids from the tokenizer, deltas of chunk_size tokens (else a char each)
        self.tokenizer = tokenizer if tokenizer is not None else make_tokenizer()
        self.context_length = context_length
        self.script = script
        self.default = default
        self.chunk_size = chunk_size
        self.delay = delay
        self.error = error
        self.calls: list[FakeCall] = []
        self.embedded: list[list[Any]] = []  # each embed call's inputs
        self.closed_streams = 0
        self.max_in_flight = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        self._ids = itertools.count()

    # -- the Engine API

    async def generate(self, prompt: Union[str, list[int]], params: Optional[SamplingParams] = None, *, request_id: Optional[str] = None) -> Completion:
        params, request_id = self._record("generate", prompt, params, request_id)
        with self._flight():
            if self.delay:
                await asyncio.sleep(self.delay)
            return self._complete(prompt, params, request_id)

    async def stream(self, prompt: Union[str, list[int]], params: Optional[SamplingParams] = None, *, request_id: Optional[str] = None) -> AsyncIterator[Delta]:
        params, request_id = self._record("stream", prompt, params, request_id)
        try:
            for delta in self._deltas(prompt, params, request_id):
                await asyncio.sleep(0)
                yield delta
        finally:
            with self._lock:
                self.closed_streams += 1

    def generate_sync(self, prompt: Union[str, list[int]], params: Optional[SamplingParams] = None, *, request_id: Optional[str] = None) -> Completion:
        params, request_id = self._record("generate_sync", prompt, params, request_id)
        with self._flight():
            if self.delay:
                time.sleep(self.delay)
            return self._complete(prompt, params, request_id)

    def stream_sync(self, prompt: Union[str, list[int]], params: Optional[SamplingParams] = None, *, request_id: Optional[str] = None) -> Iterator[Delta]:
        params, request_id = self._record("stream_sync", prompt, params, request_id)
        try:
            yield from self._deltas(prompt, params, request_id)
        finally:
            with self._lock:
                self.closed_streams += 1

    async def generate_many(
        self,
        prompts: Sequence[Union[str, list[int]]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        n: int = 1,
        request_id: Optional[str] = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        jobs = expand(prompts, params, n)
        ids = [None if request_id is None else f"{request_id}-{i}" for i in range(len(jobs))]
        results = await asyncio.gather(
            *(self.generate(p, sp, request_id=rid) for (p, sp), rid in zip(jobs, ids)), return_exceptions=return_exceptions
        )
        return list(results)

    def generate_many_sync(
        self,
        prompts: Sequence[Union[str, list[int]]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        n: int = 1,
        request_id: Optional[str] = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Every request is recorded (as ``generate_sync``) and in flight at once, from
        the calling thread, as the real engine submits them."""
        jobs = expand(prompts, params, n)
        recorded = []
        for i, (prompt, job_params) in enumerate(jobs):
            try:
                rid = None if request_id is None else f"{request_id}-{i}"
                recorded.append((prompt, *self._record("generate_sync", prompt, job_params, rid)))
            except Exception as error:  # noqa: BLE001
                if not return_exceptions:
                    raise
                recorded.append(error)
        with self._flight(len(jobs)):
            if self.delay:
                time.sleep(self.delay)
            return [r if isinstance(r, BaseException) else self._complete(*r) for r in recorded]

    async def embed(self, inputs, *, pooling="mean", dimensions=None, timeout=None, request_id=None,
                    truncate_prompt_tokens=None) -> EmbeddingResult:
        return self.embed_sync(inputs, pooling=pooling, dimensions=dimensions, timeout=timeout, request_id=request_id,
                               truncate_prompt_tokens=truncate_prompt_tokens)

    def embed_sync(self, inputs, *, pooling="mean", dimensions=None, timeout=None, request_id=None,
                   truncate_prompt_tokens=None) -> EmbeddingResult:
        """One-hot-ish unit vectors of 4 components (characters are tokens, the last
        ``truncate_prompt_tokens`` of them kept); ``error`` raises."""
        if self.error is not None:
            raise self.error
        if truncate_prompt_tokens:
            inputs = [x[-truncate_prompt_tokens:] for x in inputs]
        self.embedded.append(list(inputs))
        vectors = [[1.0, 0.0, 0.0, 0.0][: dimensions or 4] if len(x) % 2 else [0.0, 1.0, 0.0, 0.0][: dimensions or 4] for x in inputs]
        return EmbeddingResult(request_id or f"fake-emb-{next(self._ids)}", vectors, Usage(prompt_tokens=sum(map(len, inputs))), pooling)

    def stats(self) -> dict:
        return {"requests": len(self.calls), "max_in_flight": self.max_in_flight}

    # -- helpers for tests

    @property
    def last(self) -> FakeCall:
        """The most recent call."""
        return self.calls[-1]

    def answer_for(self, prompt: Union[str, list[int]], params: SamplingParams) -> str:
        """The scripted full answer before max_tokens / stop are applied."""
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        if isinstance(self.script, str):
            return self.script
        if callable(self.script):
            return self.script(text, params)
        return next((answer for key, answer in self.script.items() if key in text), self.default)

    # -- internals

    def _record(self, method: str, prompt: Any, params: Optional[SamplingParams], request_id: Optional[str]) -> tuple[SamplingParams, str]:
        params = params if params is not None else SamplingParams()
        request_id = request_id or f"fake-{next(self._ids)}"
        with self._lock:
            self.calls.append(FakeCall(method, prompt, params, request_id, threading.current_thread().name))
        if self.error is not None:
            raise self.error
        return params, request_id

    def _flight(self, count: int = 1) -> Any:
        engine = self

        class _Flight:
            def __enter__(self) -> None:
                with engine._lock:
                    engine._in_flight += count
                    engine.max_in_flight = max(engine.max_in_flight, engine._in_flight)

            def __exit__(self, *exc: Any) -> None:
                with engine._lock:
                    engine._in_flight -= count

        return _Flight()

    def encode(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return list(prompt)

    def _prompt_tokens(self, prompt: Union[str, list[int]]) -> int:
        return len(self.encode(prompt))

    def _answer(self, prompt: Union[str, list[int]], params: SamplingParams) -> tuple[str, str]:
        text, finish = self.answer_for(prompt, params), "stop"
        if len(text) > params.max_tokens:
            text, finish = text[: params.max_tokens], "length"
        cuts = [text.find(s) for s in params.stop if s in text]
        if cuts:
            text, finish = text[: min(cuts)], "stop"
        return text, finish

    def _logprobs(self, text: str, params: SamplingParams) -> Optional[list[TokenLogprob]]:
        if not params.logprobs:
            return None
        return [
            TokenLogprob(ord(ch), ch, -0.5, [(ord(ch), ch, -0.5)] + [(0, "!", -3.0)] * (params.top_logprobs - 1))
            if params.top_logprobs
            else TokenLogprob(ord(ch), ch, -0.5)
            for ch in text
        ]

    def _complete(self, prompt: Union[str, list[int]], params: SamplingParams, request_id: str) -> Completion:
        text, finish = self._answer(prompt, params)
        ids = self.tokenizer.encode(text, add_special_tokens=False) if self.by_tokens else [ord(c) for c in text]
        usage = Usage(prompt_tokens=self._prompt_tokens(prompt), completion_tokens=len(ids))
        return Completion(request_id, text, ids, finish, usage, self._logprobs(text, params))

    def _deltas(self, prompt: Union[str, list[int]], params: SamplingParams, request_id: str) -> Iterator[Delta]:
        text, finish = self._answer(prompt, params)
        if self.by_tokens:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            groups = [ids[i : i + self.chunk_size] for i in range(0, len(ids), self.chunk_size)] or [[]]
            pieces = [(self.tokenizer.decode(g), g) for g in groups]
        else:
            pieces = [(text[i : i + self.chunk_size], [ord(c) for c in text[i : i + self.chunk_size]])
                      for i in range(0, len(text), self.chunk_size)] or [("", [])]
        tokens = sum(len(g) for _, g in pieces)
        for i, (piece, group) in enumerate(pieces):
            last = i == len(pieces) - 1
            yield Delta(
                request_id,
                piece,
                group,
                finish_reason=finish if last else None,
                usage=Usage(self._prompt_tokens(prompt), tokens) if last else None,
            )


def chat_prompt(engine: Any, messages: list, tools: Optional[list] = None) -> str:
    """The prompt the adapters send for ``messages`` (and ``tools``) to ``engine``."""
    return render_chat(engine.tokenizer, messages, tools)


def patch_get_engine(monkeypatch: Any, engine: FakeEngine) -> list[str]:
    """Make the LiteLLM adapter's ``get_engine`` return ``engine``.

    Returns the list the model names asked for are appended to.
    """
    from mlx_parallm_provider.integrations import litellm as adapter

    requested: list[str] = []

    def fake_get_engine(model: str = "default", config: Any = None) -> FakeEngine:
        requested.append(model)
        return engine

    monkeypatch.setattr(adapter, "get_engine", fake_get_engine)
    return requested
