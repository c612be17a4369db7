"""Benchmark workloads: what each builds, JSONL parsing, n samples, and prompt rendering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import pytest

from mlx_parallm_provider.bench import workloads
from mlx_parallm_provider.bench.workloads import AGENT_TOOLS, build, prepare


class CharTokenizer:
    """One token per character."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(map(chr, ids))


class Renderer(CharTokenizer):
    def __init__(self) -> None:
        self.rendered = 0

    def apply_chat_template(self, messages: list[dict], tools: Optional[list[dict]] = None) -> str:
        self.rendered += 1
        return "|".join(m["content"] for m in messages) + ("+tools" if tools else "")


def test_chat_prompts_are_distinct_beyond_the_question_list() -> None:
    requests = build("chat", 40, 16)
    texts = [r.messages[-1]["content"] for r in requests]
    assert len(set(texts)) == 40 and all(r.max_tokens == 16 and r.tools is None for r in requests)
    assert [r.group for r in requests] == list(range(40))


def test_agent_calls_share_a_long_system_prompt_and_tools_with_own_questions() -> None:
    requests = build("agent", 32, 48)
    assert {r.messages[0]["content"] for r in requests} == {workloads.agent_system_prompt()}
    assert len(workloads.agent_system_prompt()) > 2000  # ~600 tokens of English
    assert all(r.tools == AGENT_TOOLS for r in requests) and len(AGENT_TOOLS) == 3
    assert len({r.messages[1]["content"] for r in requests}) == 32


def test_long_prompts_mix_lengths_up_to_the_limit() -> None:
    requests = build("long", 5, 8, tokenizer=CharTokenizer(), max_prompt_len=800)
    lengths = [len(r.messages[0]["content"]) for r in requests]
    assert lengths == sorted(lengths) and lengths[-1] > 800 > lengths[-2] * 1.5
    assert lengths[0] < 120
    with pytest.raises(ValueError, match="tokenizer"):
        build("long", 2, 8)


def test_n_repeats_each_prompt_in_one_group() -> None:
    requests = build("chat", 3, 8, n=2)
    assert [r.group for r in requests] == [0, 0, 1, 1, 2, 2]
    assert requests[0].messages == requests[1].messages != requests[2].messages


def test_jsonl_messages_prompts_max_tokens_and_cycling(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "tools": AGENT_TOOLS[:1]},
        {"prompt": "plain text"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    all_lines = build(str(path), None, 32)
    assert [r.max_tokens for r in all_lines] == [5, 32]
    assert all_lines[0].tools == AGENT_TOOLS[:1] and all_lines[1].messages == [{"role": "user", "content": "plain text"}]
    assert [r.messages[0]["content"] for r in build(str(path), 5, 32)] == ["hi", "plain text", "hi", "plain text", "hi"]


@pytest.mark.parametrize("line, message", [("not json", "not JSON"), ('{"messages": []}', "expected an object")])
def test_jsonl_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: {message}"):
        build(str(path), None, 8)


def test_unknown_workload() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build("poems", 2, 8)


def test_prepare_renders_each_distinct_prompt_once() -> None:
    renderer = Renderer()
    requests = prepare(build("agent", 2, 8, n=3), renderer)
    assert renderer.rendered == 2
    assert requests[0].prompt_ids == requests[2].prompt_ids != requests[3].prompt_ids
    assert requests[0].prompt_tokens == len(renderer.apply_chat_template(requests[0].messages, AGENT_TOOLS))
