"""Workloads: the requests a benchmark sends, built once and sent identically to every system.

``chat`` is short single questions; ``agent`` is parallel calls sharing one long system prompt
and three tool schemas, each with its own question; ``long`` mixes prompt lengths up to the
context; a ``.jsonl`` path reads OpenAI-style requests (one JSON object a line:
``{"messages": [...], "max_tokens": 64, "tools": [...]}``, or ``{"prompt": "..."}``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

WORKLOADS = ("chat", "agent", "long")

QUESTIONS = (
    "What is the capital of France?", "Explain photosynthesis briefly.", "Write a haiku about rain.",
    "List three uses of copper.", "Why is the sky blue?", "What does a compiler do?",
    "Give me a tip for learning Python.", "Describe a cat in one sentence.", "What is 17 times 3?",
    "Name a famous painter and one painting.", "How do vaccines work?", "What is a prime number?",
    "Suggest a name for a bakery.", "What causes tides?", "Summarize the plot of Cinderella.",
    "What is the boiling point of water?",
)

CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Sydney", "Toronto", "Nairobi")

AGENT_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_web", "description": "Search the web and return the top results",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]}}},
]

_AGENT_SUBJECTS = ("weather", "time zones", "travel plans", "opening hours", "news", "prices", "directions", "events")
_AGENT_ACTIONS = (
    "call the matching tool before answering and quote its result",
    "answer from memory only if the user asks for general knowledge",
    "ask one short clarifying question when the city is missing",
    "prefer metric units unless the user writes in fahrenheit",
    "keep the final answer under three sentences",
    "never invent tool results; say so when a tool fails",
)


class Tokenizer(Protocol):
    """What the ``long`` workload needs of a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload.

    ``group`` ties the ``n`` samples of one prompt together (they arrive together);
    ``prompt_ids`` is the prompt as rendered by the model's chat template and tokenized,
    filled by :func:`prepare` and sent as is to the in-process systems.
    """

    messages: list[dict[str, Any]]
    max_tokens: int
    tools: Optional[list[dict[str, Any]]] = None
    group: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    tool_choice: Optional[str] = None  # OpenAI's, sent with the tools by the systems that take messages

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def agent_system_prompt() -> str:
    """A fixed ~600-token system prompt of an agent (rules it follows), the same every call."""
    rules = [
        f"Rule {i + 1}: when the user asks about {_AGENT_SUBJECTS[i % len(_AGENT_SUBJECTS)]}, "
        f"{_AGENT_ACTIONS[i % len(_AGENT_ACTIONS)]}."
        for i in range(36)
    ]
    return "You are a travel assistant with tools. Follow every rule below.\n" + "\n".join(rules)


def chat(num_prompts: int, max_tokens: int) -> list[BenchRequest]:
    """``num_prompts`` short, distinct chat questions."""
    out = []
    for i in range(num_prompts):
        q = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            q += f" (variant {i // len(QUESTIONS)})"
        out.append(BenchRequest([{"role": "user", "content": q}], max_tokens, group=i))
    return out


def agent(num_prompts: int, max_tokens: int) -> list[BenchRequest]:
    """Parallel agent calls: one long shared system prompt and tool schemas, a question each."""
    system = {"role": "system", "content": agent_system_prompt()}
    kinds = ("What's the weather in {}?", "What time is it in {}?", "Find a good museum in {}.")
    out = []
    for i in range(num_prompts):
        city = CITIES[i % len(CITIES)]
        question = kinds[i % len(kinds)].format(city) + ("" if i < len(CITIES) * len(kinds) else f" (#{i})")
        out.append(BenchRequest([system, {"role": "user", "content": question}], max_tokens, tools=AGENT_TOOLS, group=i))
    return out


_FILLER = (
    "The committee met on a grey morning to review the harbour project. Costs had risen, the "
    "tide tables were revised, and two contractors disagreed about the foundations. "
)


def long(num_prompts: int, max_tokens: int, tokenizer: Tokenizer, max_prompt_len: int) -> list[BenchRequest]:
    """Prompts whose lengths cycle through 1/16, 1/8, 1/4, 1/2 and all of ``max_prompt_len``
    tokens (of filler text; the instruction and chat template add a few more)."""
    base = tokenizer.encode(_FILLER * (max_prompt_len // 20 + 1))
    out = []
    for i in range(num_prompts):
        length = max(16, max_prompt_len >> (4 - i % 5))
        text = tokenizer.decode(base[:length])
        content = f"Summarise these notes in two sentences (document {i}):\n{text}"
        out.append(BenchRequest([{"role": "user", "content": content}], max_tokens, group=i))
    return out


def from_jsonl(path: Path, num_prompts: Optional[int], max_tokens: int) -> list[BenchRequest]:
    """Requests from a JSONL file, cycled to ``num_prompts`` (all lines when None).

    A line's own ``max_tokens`` (or ``max_completion_tokens``) wins over ``max_tokens``.
    """
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            messages = [{"role": "user", "content": obj["prompt"]}]
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]:
            messages = obj["messages"]
        else:
            raise ValueError(f"{path}:{number}: expected an object with 'messages' (a list) or 'prompt' (a string)")
        limit = obj.get("max_tokens", obj.get("max_completion_tokens", max_tokens))
        rows.append((messages, int(limit), obj.get("tools") or None))
    if not rows:
        raise ValueError(f"{path}: no requests")
    count = len(rows) if num_prompts is None else num_prompts
    return [BenchRequest(*rows[i % len(rows)], group=i) for i in range(count)]


def build(
    workload: str,
    num_prompts: Optional[int],
    max_tokens: int,
    *,
    tokenizer: Optional[Tokenizer] = None,
    max_prompt_len: int = 1024,
    n: int = 1,
    tool_choice: Optional[str] = None,
) -> list[BenchRequest]:
    """The requests of a named workload (or a ``.jsonl`` path), each prompt repeated ``n``
    times; ``tool_choice`` goes with every request that has tools."""
    check_name(workload)
    if workload.endswith(".jsonl"):
        requests = from_jsonl(Path(workload), num_prompts, max_tokens)
    elif num_prompts is None:
        raise ValueError(f"workload {workload!r} needs a number of prompts")
    elif workload == "chat":
        requests = chat(num_prompts, max_tokens)
    elif workload == "agent":
        requests = agent(num_prompts, max_tokens)
    else:
        if tokenizer is None:
            raise ValueError("the 'long' workload needs the model's tokenizer")
        requests = long(num_prompts, max_tokens, tokenizer, max_prompt_len)
    if tool_choice is not None:
        requests = [replace(r, tool_choice=tool_choice) if r.tools else r for r in requests]
    return [r for r in requests for _ in range(n)]


def check_name(workload: str) -> None:
    """Raise ValueError unless ``workload`` is a known name or a ``.jsonl`` path."""
    if not workload.endswith(".jsonl") and workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}: expected one of {', '.join(WORKLOADS)} or a .jsonl file")


class Renderer(Protocol):
    """What :func:`prepare` needs: the engine's chat template and tokenizer."""

    def apply_chat_template(self, messages: list[dict], tools: Optional[list[dict]] = None) -> str: ...

    def encode(self, prompt: str) -> list[int]: ...


class ChatRenderer:
    """A :class:`Renderer` over an engine: prompts prepared as the front doors prepare them
    (the chat layer's :func:`~mlx_parallm_provider.chat.prepare_chat`), encoded by the engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def apply_chat_template(self, messages: list[dict], tools: Optional[list[dict]] = None) -> str:
        from ..chat import prepare_chat

        return prepare_chat(self.engine.tokenizer, messages, tools=tools).prompt

    def encode(self, prompt: str) -> list[int]:
        return self.engine.encode(prompt)


def prepare(requests: Sequence[BenchRequest], renderer: Renderer) -> list[BenchRequest]:
    """Fill each request's ``prompt_ids`` with the rendered, tokenized prompt."""
    cache: dict[str, list[int]] = {}
    out = []
    for r in requests:
        key = json.dumps([r.messages, r.tools], sort_keys=True)
        if key not in cache:
            cache[key] = renderer.encode(renderer.apply_chat_template(r.messages, tools=r.tools))
        out.append(replace(r, prompt_ids=cache[key]))
    return out
