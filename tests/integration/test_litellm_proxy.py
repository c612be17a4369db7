"""The real LiteLLM proxy (``litellm --config``) serving the tiny model over loopback HTTP.

The proxy runs as a subprocess with ``examples/litellm_proxy_config.yaml``, its model
pointed at the tiny model folder, and is always stopped. Starting it imports the whole
LiteLLM proxy (10-20 s on two cores), so the tests that use it are marked ``slow``.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import yaml

import mlx_parallm_provider
from engine_helpers import sampled_while
from fakes import chat_prompt
from lora_helpers import write_random_adapter
from mlx_parallm_provider import Engine, SamplingParams
from mlx_parallm_provider.models.registry import LoadedModel
from proxy_helpers import REPO, start_proxy, stop, wait_ready

EXAMPLE = REPO / "examples" / "litellm_proxy_config.yaml"
ALIAS = "tiny"
ADAPTED = "tiny-adapted"  # the same model through a LoRA adapter (litellm_params' lora)
QUESTION = [{"role": "user", "content": "Say something about the sea."}]
START_LIMIT_S = 180.0


@dataclass
class Proxy:
    """A running proxy: where it listens and the key it wants."""

    base_url: str
    key: str
    log: Path
    stats_file: Path
    pid: int

    def stats(self, after: float = 0.0) -> dict[str, Any]:
        """The proxy's engine stats (published by scripts/proxy_with_stats.py), or {}; with
        ``after`` (a wall-clock time), {} unless they were read after it. The file lags the
        engine by up to ~50 ms, longer than the tiny model takes to start a burst of rows."""
        try:
            published = json.loads(self.stats_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        if published.get("_process", {}).get("time", 0.0) <= after:
            return {}
        return next((v for k, v in published.items() if not k.startswith("_")), {})

    def stats_since(self, moment: float, wait_s: float = 30.0) -> dict[str, Any]:
        """The first stats read after ``moment`` (waiting up to ``wait_s`` for them), or {}."""
        deadline = time.monotonic() + wait_s
        while not (stats := self.stats(after=moment)) and time.monotonic() < deadline:
            time.sleep(0.01)
        return stats

    def stats_age_s(self) -> float:
        """Seconds since the stats file was last written (inf before the first write)."""
        try:
            return time.time() - json.loads(self.stats_file.read_text())["_process"]["time"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return float("inf")

    def stacks(self) -> str:
        """Every thread's stack in the proxy (faulthandler on SIGUSR1), from the tail of its log."""
        os.kill(self.pid, signal.SIGUSR1)
        time.sleep(1.0)
        return self.log.read_text(errors="replace")[-6000:]

    def client(self) -> httpx.Client:
        """An HTTP client for the proxy that ignores any HTTP(S)_PROXY of the environment."""
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {self.key}"}, timeout=120, trust_env=False)


def _litellm_cli() -> str:
    beside = Path(sys.executable).with_name("litellm")
    found = str(beside) if beside.exists() else shutil.which("litellm")
    if found is None:
        pytest.fail("the `litellm` command is not installed (it comes with the litellm package)")
    return found


def _config(model_dir: Path, adapter: Path) -> dict[str, Any]:
    """The shipped example config, its one model (with the example's settings) replaced by
    the tiny model folder, and a second name for the same model through a LoRA adapter."""
    config = yaml.safe_load(EXAMPLE.read_text())
    [entry] = config["model_list"]
    params = {**entry["litellm_params"], "model": f"mlx-parallm/{model_dir}"}
    config["model_list"] = [{"model_name": ALIAS, "litellm_params": params},
                            {"model_name": ADAPTED, "litellm_params": {**params, "lora": str(adapter)}}]
    return config


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LoRA adapter of the tiny model (mlx-lm's format)."""
    return write_random_adapter(tmp_path_factory.mktemp("proxy-adapter") / "adapter", tiny_model_dir, seed=5)


@pytest.fixture(scope="module")
def proxy(tiny_model_dir: Path, adapter: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    import fastapi  # noqa: F401  (the proxy's server dependencies: the `proxy` extra, in `dev`)

    folder = tmp_path_factory.mktemp("litellm-proxy")
    key, stats_file = "sk-" + secrets.token_hex(16), folder / "stats.json"
    _litellm_cli()
    # The real `litellm` CLI, run by a wrapper that also publishes the engine's stats.
    running = start_proxy(_config(tiny_model_dir, adapter), folder, key, env={"MLX_PARALLM_STATS_FILE": str(stats_file)})
    try:
        wait_ready(running, START_LIMIT_S)
        yield Proxy(running.base_url, key, running.log, stats_file, running.process.pid)
    finally:
        stop(running)


@pytest.fixture(scope="module")
def reference(tiny_model: LoadedModel) -> Iterator[Any]:
    """Greedy answer to QUESTION with 12 tokens, computed in this process."""
    engine = Engine("tiny", loaded=tiny_model)
    try:
        yield engine.generate_sync(chat_prompt(engine, QUESTION), SamplingParams(max_tokens=12))
    finally:
        engine.shutdown()


def _sse_contents(response: httpx.Response) -> tuple[str, list[dict[str, Any]]]:
    """Joined delta contents and every chunk of a server-sent-events chat stream."""
    chunks = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        if payload.strip() == "[DONE]":
            break
        chunks.append(json.loads(payload))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return text, chunks


# --------------------------------------------------------------------------- the shipped config


def test_example_config_points_at_the_module_level_handler() -> None:
    config = yaml.safe_load(EXAMPLE.read_text())
    [entry] = config["litellm_settings"]["custom_provider_map"]
    assert entry["provider"] == "mlx-parallm"
    module, _, name = entry["custom_handler"].rpartition(".")
    from mlx_parallm_provider.integrations.litellm import MLXParallmCustomLLM

    handler = getattr(importlib.import_module(module), name)
    assert isinstance(handler, MLXParallmCustomLLM) and handler is mlx_parallm_provider.litellm_handler
    assert [m["litellm_params"]["model"] for m in config["model_list"]] == ["mlx-parallm/default"]


# --------------------------------------------------------------------------- over HTTP


@pytest.mark.slow
def test_httpx_chat_completion(proxy: Proxy, reference: Any) -> None:
    body = {"model": ALIAS, "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    with proxy.client() as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["choices"][0]["message"]["content"] == reference.text
    assert data["choices"][0]["finish_reason"] == reference.finish_reason
    assert data["usage"]["completion_tokens"] == reference.usage.completion_tokens
    assert data["usage"]["prompt_tokens"] == reference.usage.prompt_tokens
    assert data["model"] == ALIAS and data["id"]


@pytest.mark.slow
def test_a_model_entry_with_a_lora_adapter_answers_through_it(proxy: Proxy, reference: Any, adapter: Path, tiny_model: LoadedModel) -> None:
    body = {"model": ADAPTED, "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    with proxy.client() as client:
        adapted = client.post("/v1/chat/completions", json=body)
        plain = client.post("/v1/chat/completions", json={**body, "model": ALIAS})
    assert adapted.status_code == 200 and plain.status_code == 200, adapted.text
    engine = Engine("tiny", loaded=tiny_model)
    try:
        want = engine.generate_sync(chat_prompt(engine, QUESTION), SamplingParams(max_tokens=12, lora=str(adapter)))
    finally:
        engine.shutdown()
    assert adapted.json()["choices"][0]["message"]["content"] == want.text != reference.text
    assert plain.json()["choices"][0]["message"]["content"] == reference.text


@pytest.mark.slow
def test_a_prefix_message_is_continued_through_the_proxy(proxy: Proxy, reference: Any, tiny_model: LoadedModel) -> None:
    """LiteLLM's ``prefix: True`` reaches the provider through the proxy's request parsing."""
    from mlx_parallm_provider.chat import prepare_chat

    messages = [*QUESTION, {"role": "assistant", "content": "The sea", "prefix": True}]
    body = {"model": ALIAS, "messages": messages, "max_tokens": 12, "temperature": 0}
    with proxy.client() as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    engine = Engine("tiny", loaded=tiny_model)
    try:
        prompt = prepare_chat(engine.tokenizer, messages).prompt
        want = engine.generate_sync(prompt, SamplingParams(max_tokens=12))
    finally:
        engine.shutdown()
    assert prompt.endswith("<|im_start|>assistant\nThe sea")
    assert response.json()["choices"][0]["message"]["content"] == want.text != reference.text
    assert response.json()["usage"]["prompt_tokens"] == want.usage.prompt_tokens


def test_httpx_streaming_joins_to_the_same_text(proxy: Proxy, reference: Any) -> None:
    body = {"model": ALIAS, "messages": QUESTION, "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
    with proxy.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        text, chunks = _sse_contents(response)
    assert text == reference.text
    assert len([c for c in chunks if c.get("choices") and c["choices"][0]["delta"].get("content")]) > 1
    assert chunks[-1]["usage"]["completion_tokens"] == reference.usage.completion_tokens


@pytest.mark.slow
def test_concurrent_http_requests_all_answer(proxy: Proxy, reference: Any) -> None:
    body = {"model": ALIAS, "messages": QUESTION, "max_tokens": 12}

    async def many() -> list[httpx.Response]:
        headers = {"Authorization": f"Bearer {proxy.key}"}
        async with httpx.AsyncClient(base_url=proxy.base_url, headers=headers, timeout=120, trust_env=False) as client:
            return list(await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(8))))

    responses = asyncio.run(many())
    assert [r.status_code for r in responses] == [200] * 8
    assert {r.json()["choices"][0]["message"]["content"] for r in responses} == {reference.text}


@pytest.mark.slow
def test_errors_come_back_as_http_errors(proxy: Proxy) -> None:
    too_long = {"model": ALIAS, "messages": QUESTION, "max_tokens": 600, "stream": True}
    bad = {"model": ALIAS, "messages": QUESTION, "temperature": -1}
    with proxy.client() as client:
        too_long_response = client.post("/v1/chat/completions", json=too_long)
        bad_response = client.post("/v1/chat/completions", json=bad)
    assert too_long_response.status_code == 400 and "context window" in too_long_response.text
    assert bad_response.status_code == 400 and "temperature" in bad_response.text


@pytest.mark.slow
def test_openai_client_plain_and_streaming(proxy: Proxy, reference: Any) -> None:
    import openai
    with httpx.Client(timeout=120, trust_env=False) as http:
        client = openai.OpenAI(base_url=f"{proxy.base_url}/v1", api_key=proxy.key, max_retries=0, http_client=http)
        whole = client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=12)
        stream = client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=12, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert whole.choices[0].message.content == reference.text
    assert streamed == reference.text


@pytest.mark.slow
def test_openai_client_vllm_structured_outputs_through_the_proxy(proxy: Proxy) -> None:
    """What a client written for vLLM sends in ``extra_body`` reaches the engine (chat and
    completions, new and old field names; ``chat_template_kwargs``); a bad one is a 400 naming
    the field."""
    choices = ["red", "green", "blue"]
    with httpx.Client(timeout=120, trust_env=False) as http:
        client = _openai(proxy, http)
        picked = [client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=8, temperature=1.0, seed=i,
                                                 extra_body={"structured_outputs": {"choice": choices}}).choices[0].message.content
                  for i in range(4)]
        older = client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=8, extra_body={"guided_regex": "[0-9]{4}"})
        text = client.completions.create(model=ALIAS, prompt="The code is", max_tokens=8, extra_body={"structured_outputs": {"regex": "[a-f]{3}"}})
        bad = http.post(f"{proxy.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {proxy.key}"},
                        json={"model": ALIAS, "messages": QUESTION, "structured_outputs": {"choice": []}})
        variables = client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=4,
                                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True})
        bad_variables = http.post(f"{proxy.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {proxy.key}"},
                                  json={"model": ALIAS, "messages": QUESTION, "chat_template_kwargs": {"tokenize": True}})
    assert all(p in choices for p in picked), picked
    assert re.fullmatch("[0-9]{4}", older.choices[0].message.content)
    assert re.fullmatch("[a-f]{3}", text.choices[0].text)
    assert bad.status_code == 400 and "structured_outputs.choice" in bad.text
    assert variables.usage.completion_tokens == 4  # (SmolLM2's template has no such variable)
    assert bad_variables.status_code == 400 and "chat_template_kwargs.tokenize" in bad_variables.text


def test_openai_client_vllm_token_controls_through_the_proxy(proxy: Proxy, tiny_model) -> None:
    """vLLM's ``min_tokens``, ``allowed_token_ids``, ``bad_words``, ``skip_special_tokens``,
    ``truncate_prompt_tokens`` and ``prompt_logprobs`` in ``extra_body`` reach the engine; a bad
    one is a 400 naming the field."""
    words = tiny_model.tokenizer.encode(" yes no", add_special_tokens=False)  # (the default model's vocabulary)
    with httpx.Client(timeout=120, trust_env=False) as http:
        client = _openai(proxy, http)
        eager = {"logit_bias": {"2": 100}}  # (token 2: the EOS, at once)
        ended = client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=24, **eager)
        held = client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=24, extra_body={"min_tokens": 5}, **eager)
        allowed = client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=6,
                                                 extra_body={"allowed_token_ids": words, "ignore_eos": True})
        plain = client.completions.create(model=ALIAS, prompt="The capital of France is", max_tokens=6)
        first = plain.choices[0].text.split()[0]
        avoided = client.completions.create(model=ALIAS, prompt="The capital of France is", max_tokens=6,
                                            extra_body={"bad_words": [first], "skip_special_tokens": True})
        bad = http.post(f"{proxy.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {proxy.key}"},
                        json={"model": ALIAS, "messages": QUESTION, "max_tokens": 4, "min_tokens": 9})
        truncated = client.completions.create(model=ALIAS, prompt="The capital of France is " * 50, max_tokens=2,
                                              extra_body={"truncate_prompt_tokens": 8})
        scored = client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert truncated.usage.prompt_tokens == 8
    entries = scored.model_extra["prompt_logprobs"]  # (vLLM's shape, its token ids as JSON keys)
    assert len(entries) == scored.usage.prompt_tokens and entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in entries[1:])
    assert ended.usage.completion_tokens == 1 and not ended.choices[0].message.content
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"  # 5 tokens, then the EOS
    assert allowed.usage.completion_tokens == 6 and set(allowed.choices[0].message.content.split()) <= {"yes", "no"}
    assert first not in avoided.choices[0].text.split(), (plain.choices[0].text, avoided.choices[0].text)
    assert bad.status_code == 400 and "min_tokens" in bad.text


def test_openai_client_streams_logprobs_through_the_proxy(proxy: Proxy) -> None:
    """A stream's chunks carry the logprobs of their tokens: joined, the whole answer's."""
    kw: dict[str, Any] = {"model": ALIAS, "messages": QUESTION, "max_tokens": 10, "logprobs": True, "top_logprobs": 2,
                          "extra_body": {"ignore_eos": True}}
    with httpx.Client(timeout=120, trust_env=False) as http:
        client = _openai(proxy, http)
        whole = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content or []]
    assert [lp.token for lp in streamed] == [lp.token for lp in whole.choices[0].logprobs.content] and len(streamed) == 10
    assert all(len(lp.top_logprobs) == 2 for lp in streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_reasoning_effort_and_thinking_through_the_proxy(proxy: Proxy) -> None:
    """OpenAI's ``reasoning_effort``, the Responses API's ``reasoning`` and Anthropic's
    ``thinking`` (which LiteLLM's bridges turn into ``reasoning_effort``) are answered (the
    example config lets ``reasoning_effort`` through LiteLLM); a bad level is a 400."""
    import anthropic

    with httpx.Client(timeout=120, trust_env=False) as http:
        client = _openai(proxy, http)
        chat = client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=4, reasoning_effort="none")
        response = client.responses.create(model=ALIAS, input=QUESTION[0]["content"], max_output_tokens=4, reasoning={"effort": "low"})
        bad = http.post(f"{proxy.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {proxy.key}"},
                        json={"model": ALIAS, "messages": QUESTION, "max_tokens": 4, "reasoning_effort": "max"})
    with anthropic.DefaultHttpxClient(timeout=120, trust_env=False) as http:
        claude = anthropic.Anthropic(base_url=proxy.base_url, api_key=proxy.key, max_retries=0, http_client=http)
        thought = claude.messages.create(model=ALIAS, messages=QUESTION, max_tokens=8, thinking={"type": "enabled", "budget_tokens": 1024},
                                         stop_sequences=["."])
    assert chat.usage.completion_tokens > 0 and response.usage.output_tokens > 0 and thought.usage.output_tokens > 0
    assert bad.status_code == 400 and "reasoning_effort: must be one of" in bad.text, bad.text  # (ours: it reached the provider)


@pytest.mark.slow
def test_abandoned_non_streaming_requests_free_their_rows(proxy: Proxy) -> None:
    """Issue 8 #5: clients that hang up must not leave their rows decoding."""
    body = {"model": ALIAS, "messages": QUESTION, "max_tokens": 400, "temperature": 0}
    n = 8

    async def abandon() -> int:
        headers = {"Authorization": f"Bearer {proxy.key}"}
        async with httpx.AsyncClient(base_url=proxy.base_url, headers=headers, timeout=120, trust_env=False) as client:
            calls = [asyncio.ensure_future(client.post("/v1/chat/completions", json=body)) for _ in range(n)]
            deadline = time.monotonic() + 60
            while proxy.stats().get("running", 0) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            generated_at_hangup = proxy.stats()["generated_tokens"]
            for call in calls:
                call.cancel()  # closes the connections: the clients hang up
            await asyncio.gather(*calls, return_exceptions=True)
            return generated_at_hangup

    _assert_rows_freed(proxy, asyncio.run(abandon()), n * 400)


def _assert_rows_freed(proxy: Proxy, generated_at_hangup: int, tokens_if_not_freed: int) -> None:
    """The engine goes idle soon after the clients left, having decoded little for them.

    Rows nobody cancels finish their tokens within seconds on the tiny model, which the
    token count catches; the wait is long only so that a loaded machine does not fail it.
    On failure the message has the stats seen each second and the proxy's thread stacks."""
    left, deadline, history, last = time.time(), time.monotonic() + 60, [], 0.0
    # Only stats read after the clients left count: an older file can show none of the rows yet.
    stats = proxy.stats(after=left)
    while (not stats or stats["running"] or stats["waiting"]) and time.monotonic() < deadline:
        if stats and time.monotonic() - last >= 1.0:
            last = time.monotonic()
            history.append((stats["running"], stats["waiting"], stats["generated_tokens"], round(proxy.stats_age_s(), 2)))
        time.sleep(0.05)
        stats = proxy.stats(after=left)
    if not stats or stats["running"] or stats["waiting"]:
        pytest.fail(f"rows still held a minute after the clients left: (running, waiting, generated, stats age s) "
                    f"each second {history}; generated at hang-up {generated_at_hangup}\n{proxy.stacks()}")
    assert stats["generated_tokens"] - generated_at_hangup < tokens_if_not_freed // 4, (generated_at_hangup, stats)


@pytest.mark.slow
def test_dropped_streams_free_their_rows(proxy: Proxy) -> None:
    """A streaming client that goes away mid-stream must not leave its row decoding."""
    body = {"model": ALIAS, "messages": QUESTION, "max_tokens": 400, "temperature": 0, "stream": True}
    n = 8

    async def drop() -> int:
        headers = {"Authorization": f"Bearer {proxy.key}"}
        async with httpx.AsyncClient(base_url=proxy.base_url, headers=headers, timeout=120, trust_env=False) as client:
            async def one() -> None:
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for _ in response.aiter_lines():
                        break  # leave after the first line: the connection closes

            await asyncio.gather(*(one() for _ in range(n)))
            return proxy.stats_since(time.time()).get("generated_tokens", 0)

    _assert_rows_freed(proxy, asyncio.run(drop()), n * 400)


# --------------------------------------------------------------------------- other client APIs (issue 25)

# An enum: the random tiny model, free inside a string, would write until max_tokens.
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}


def _openai(proxy: Proxy, http: httpx.Client) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{proxy.base_url}/v1", api_key=proxy.key, max_retries=0, http_client=http)


@pytest.mark.slow
def test_responses_api_text_streaming_and_a_function_call_turn(proxy: Proxy, reference: Any) -> None:
    """The OpenAI Responses API (Codex CLI, the Agents SDK's default model) through the
    proxy's bridge onto chat completions."""
    tool = {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER_PARAMETERS}
    with httpx.Client(timeout=120, trust_env=False) as http:
        client = _openai(proxy, http)
        whole = client.responses.create(model=ALIAS, input=QUESTION[0]["content"], max_output_tokens=12, temperature=0)
        events = list(client.responses.create(model=ALIAS, input=QUESTION[0]["content"], max_output_tokens=12, temperature=0, stream=True))
        called = client.responses.create(model=ALIAS, input="Weather in Paris?", tools=[tool], tool_choice="required", max_output_tokens=60)
        calls = [item for item in called.output if item.type == "function_call"]
        assert calls and calls[0].name == "get_weather", called.output
        assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
        answered = client.responses.create(model=ALIAS, tools=[tool], max_output_tokens=8, input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C and sunny"},
        ])
    assert whole.output_text == reference.text
    assert whole.usage.output_tokens == reference.usage.completion_tokens
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reference.text
    assert answered.status in ("completed", "incomplete") and answered.output_text  # incomplete: max_output_tokens


@pytest.mark.slow
def test_responses_api_json_schema_output_holds(proxy: Proxy) -> None:
    """``text.format`` of the Responses API becomes the chat call's ``response_format``: the
    random model's output validates, and with ``parse`` comes back as the model."""
    from pydantic import BaseModel

    class Reading(BaseModel):
        ok: bool
        city: Literal["Paris", "Oslo"]

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "city": {"enum": ["Paris", "Oslo"]}},
              "required": ["ok", "city"], "additionalProperties": False}
    with httpx.Client(timeout=120, trust_env=False) as http:
        client = _openai(proxy, http)
        whole = client.responses.create(model=ALIAS, input="A reading, as JSON", max_output_tokens=64, temperature=1.0,
                                        text={"format": {"type": "json_schema", "name": "reading", "schema": schema, "strict": True}})
        parsed = client.responses.parse(model=ALIAS, input="Another reading", max_output_tokens=64, text_format=Reading)
    value = json.loads(whole.output_text)
    assert set(value) == {"ok", "city"} and isinstance(value["ok"], bool) and value["city"] in ("Paris", "Oslo")
    assert isinstance(parsed.output_parsed, Reading)


@pytest.mark.slow
def test_the_agents_sdk_default_model_runs_a_tool_loop_through_the_proxy(proxy: Proxy) -> None:
    """The OpenAI Agents SDK with its default model (the Responses API) pointed at the proxy:
    a forced call of a function tool, run by the SDK, whose result ends the run
    (``stop_on_first_tool``: the tiny model's free text never ends before ``max_tokens``, which
    the SDK raises on; the result turn itself is the Responses test's)."""
    import agents
    from openai import AsyncOpenAI

    called: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather of a city."""
        called.append(city)
        return f"18C and sunny in {city}"

    async def run() -> Any:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
            client = AsyncOpenAI(base_url=f"{proxy.base_url}/v1", api_key=proxy.key, max_retries=0, http_client=http)
            agents.set_default_openai_client(client, use_for_tracing=False)
            agents.set_default_openai_api("responses")
            agents.set_tracing_disabled(True)
            agent = agents.Agent(name="weather", instructions="Answer with the weather.", model=ALIAS, tools=[get_weather],
                                 model_settings=agents.ModelSettings(tool_choice="required", max_tokens=48, temperature=0),
                                 tool_use_behavior="stop_on_first_tool")
            return await agents.Runner.run(agent, "Weather in Paris?", max_turns=4)

    result = asyncio.run(run())
    kinds = [item.type for item in result.new_items]
    assert called and called[0] in ("Paris", "Oslo"), kinds
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert result.new_items[1].output == result.final_output == f"18C and sunny in {called[0]}"


@pytest.mark.slow
def test_messages_api_text_streaming_and_a_tool_use_turn(proxy: Proxy, reference: Any) -> None:
    """The Anthropic Messages API (Claude-Code-style clients) through the proxy."""
    import anthropic

    tool = {"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER_PARAMETERS}
    with anthropic.DefaultHttpxClient(timeout=120, trust_env=False) as http:  # its own httpx
        client = anthropic.Anthropic(base_url=proxy.base_url, api_key=proxy.key, max_retries=0, http_client=http)
        whole = client.messages.create(model=ALIAS, messages=QUESTION, max_tokens=12)  # greedy: the engine's default
        with client.messages.stream(model=ALIAS, messages=QUESTION, max_tokens=12) as stream:
            streamed = "".join(stream.text_stream)
        called = client.messages.create(model=ALIAS, max_tokens=60, tools=[tool], tool_choice={"type": "any"},
                                        messages=[{"role": "user", "content": "Weather in Paris?"}])
        uses = [block for block in called.content if block.type == "tool_use"]
        assert uses and uses[0].name == "get_weather" and uses[0].input["city"] in ("Paris", "Oslo"), called.content
        answered = client.messages.create(model=ALIAS, max_tokens=8, tools=[tool], messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18C and sunny"}]},
        ])
    assert "".join(b.text for b in whole.content if b.type == "text") == reference.text
    assert whole.usage.output_tokens == reference.usage.completion_tokens
    assert streamed == reference.text
    assert called.stop_reason == "tool_use"
    assert answered.usage.output_tokens > 0


@pytest.mark.slow
def test_openai_client_embeddings(proxy: Proxy, tiny_model: LoadedModel) -> None:
    """``/v1/embeddings`` with the official client (which asks for base64 unless told
    otherwise: the example config drops that, so floats come back and it reads them)."""
    import openai

    texts = ["hello world", "The sea is calm tonight.", "x"]
    engine = Engine("tiny", loaded=tiny_model)
    try:
        expected = engine.embed_sync(texts)
    finally:
        engine.shutdown()
    with httpx.Client(timeout=120, trust_env=False) as http:
        client = _openai(proxy, http)
        got = client.embeddings.create(model=ALIAS, input=texts)
        floats = client.embeddings.create(model=ALIAS, input=texts[0], encoding_format="float", extra_body={"pooling": "last"})
        with pytest.raises(openai.BadRequestError) as empty:
            client.embeddings.create(model=ALIAS, input=[""])
        with pytest.raises(openai.BadRequestError) as too_long:
            client.embeddings.create(model=ALIAS, input=["word " * 600])
    assert [d.index for d in got.data] == [0, 1, 2]
    for d, v in zip(got.data, expected.embeddings):
        assert max(abs(a - b) for a, b in zip(d.embedding, v)) < 1e-4
    assert got.usage.prompt_tokens == got.usage.total_tokens == expected.usage.prompt_tokens
    assert len(floats.data[0].embedding) == len(expected.embeddings[0])
    assert empty.value.status_code == 400 and "input[0]" in str(empty.value)
    assert too_long.value.status_code == 400 and "context window" in str(too_long.value)


@pytest.mark.slow
@pytest.mark.parametrize("api", ["responses", "messages"])
def test_32_concurrent_calls_of_each_client_api_decode_as_one_batch(proxy: Proxy, api: str) -> None:
    n = 32

    async def calls() -> None:
        import anthropic
        import openai

        if api == "responses":
            http: Any = httpx.AsyncClient(timeout=300, trust_env=False, limits=httpx.Limits(max_connections=n))
            client: Any = openai.AsyncOpenAI(base_url=f"{proxy.base_url}/v1", api_key=proxy.key, max_retries=0, http_client=http)
            one = lambda i: client.responses.create(model=ALIAS, input=f"Story {i}:", max_output_tokens=400)  # noqa: E731
        else:
            http = anthropic.DefaultAsyncHttpxClient(timeout=300, trust_env=False)
            client = anthropic.AsyncAnthropic(base_url=proxy.base_url, api_key=proxy.key, max_retries=0, http_client=http)
            one = lambda i: client.messages.create(model=ALIAS, max_tokens=400, messages=[{"role": "user", "content": f"Story {i}:"}])  # noqa: E731
        async with http:
            await asyncio.gather(*(one(i) for i in range(n)))

    peak = max(sampled_while(lambda: proxy.stats().get("running", 0), calls, period_s=0.02), default=0)
    print(f"{api}: {n} concurrent calls, largest decode batch seen {peak}")
    assert peak == n
