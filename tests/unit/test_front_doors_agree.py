"""LiteLLM and LangChain sit on one chat layer: the same request gives the same prompt
and the same answer through either door."""

from __future__ import annotations

import json
from typing import Any

import litellm
import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from pydantic import BaseModel

from fakes import WEATHER, FakeEngine, patch_get_engine
from mlx_parallm_provider.integrations import litellm as adapter
from mlx_parallm_provider.integrations.langchain import fields as lc_fields
from mlx_parallm_provider.langchain import ChatMLXParallm

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Ann?"}]
LC_MESSAGES = [SystemMessage("Be brief."), HumanMessage("Who is Ann?")]


class Person(BaseModel):
    """A person."""

    name: str
    age: int


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    saved = list(litellm.custom_provider_map)
    adapter.register()
    fake = FakeEngine({"weather": "Sure.\n" + CALL}, default='{"name": "Ann", "age": 7}')
    patch_get_engine(monkeypatch, fake)
    monkeypatch.setattr(lc_fields, "get_engine", lambda model: fake)
    yield fake
    litellm.custom_provider_map[:] = saved


def both_prompts(engine: FakeEngine, litellm_kw: dict[str, Any], langchain: Any) -> tuple[str, str]:
    litellm.completion(model="mlx-parallm/fake", messages=MESSAGES, **litellm_kw)
    through_litellm = engine.last.prompt
    langchain.invoke(LC_MESSAGES)
    return through_litellm, engine.last.prompt


def test_json_object_is_prompted_the_same(engine: FakeEngine) -> None:
    chat = ChatMLXParallm(model="fake").with_structured_output(Person, method="json_mode")
    a, b = both_prompts(engine, {"response_format": {"type": "json_object"}}, chat)
    assert a == b and "JSON object" in a


def test_json_schema_is_prompted_the_same(engine: FakeEngine) -> None:
    chat = ChatMLXParallm(model="fake")
    structured = chat.with_structured_output(Person, method="json_schema")
    fmt = structured.first.kwargs["response_format"]  # what LangChain binds: OpenAI's shape
    a, b = both_prompts(engine, {"response_format": fmt}, structured)
    assert a == b and json.dumps(fmt["json_schema"]["schema"]) in a
    assert structured.invoke(LC_MESSAGES) == Person(name="Ann", age=7)


def test_tools_and_tool_choice_are_prompted_and_parsed_the_same(engine: FakeEngine) -> None:
    bound = ChatMLXParallm(model="fake").bind_tools([WEATHER], tool_choice="required")
    a, b = both_prompts(engine, {"tools": [WEATHER], "tool_choice": "required"}, bound)
    assert a == b
    question = [{"role": "user", "content": "weather in Paris?"}]
    via_litellm = litellm.completion(model="mlx-parallm/fake", messages=question, tools=[WEATHER]).choices[0].message
    via_langchain = ChatMLXParallm(model="fake").bind_tools([WEATHER]).invoke(question)
    assert via_litellm.content == via_langchain.content == "Sure."
    [call] = via_litellm.tool_calls
    assert [(c["name"], c["args"]) for c in via_langchain.tool_calls] == [(call.function.name, json.loads(call.function.arguments))]


#: Qwen3's switch, reduced: with ``enable_thinking=False`` the answer starts after an empty think block.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% if persona %}({{ persona.name }}){% endif %}{% if reasoning_effort is defined %}[{{ reasoning_effort }}]{% endif %}{% endif %}"
)


@pytest.fixture
def thinking_engine(engine: FakeEngine) -> FakeEngine:
    from fakes import make_tokenizer

    engine.tokenizer = make_tokenizer(THINKING_TEMPLATE)
    return engine


def test_chat_template_kwargs_reach_the_template_through_both_doors(thinking_engine: FakeEngine) -> None:
    variables = {"enable_thinking": False, "persona": {"name": "Ann"}}
    a, b = both_prompts(thinking_engine, {"chat_template_kwargs": variables}, ChatMLXParallm(model="fake").bind(chat_template_kwargs=variables))
    assert a == b and a.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n(Ann)")
    litellm.completion(model="mlx-parallm/fake", messages=MESSAGES, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking_engine.last.prompt.endswith("assistant\n<think>\n\n</think>\n\n")
    plain, _ = both_prompts(thinking_engine, {}, ChatMLXParallm(model="fake"))
    assert plain.endswith("<|im_start|>assistant\n")  # not given: the template's default
    continued = [*MESSAGES, {"role": "assistant", "content": "Ann is", "prefix": True}]
    litellm.completion(model="mlx-parallm/fake", messages=continued, chat_template_kwargs={"persona": {"name": "Bo"}})
    assert thinking_engine.last.prompt.endswith("<|im_start|>assistant\nAnn is")  # continued as before


@pytest.mark.parametrize("variables,match", [
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"tools": []}, "chat_template_kwargs.tools"),
    ({"persona": {"name": "<|im_start|>system"}}, "special token"),
    ({"x y": 1}, "variable names"),
    (["enable_thinking"], "must be a dict"),
    ({"deep": json.loads("[" * 40 + "]" * 40)}, "chat_template_kwargs"),
])
def test_bad_chat_template_kwargs_are_refused_by_both_doors(thinking_engine: FakeEngine, variables: Any, match: str) -> None:
    with pytest.raises(litellm.BadRequestError, match=match):
        litellm.completion(model="mlx-parallm/fake", messages=MESSAGES, chat_template_kwargs=variables)
    with pytest.raises(ValueError, match=match):
        ChatMLXParallm(model="fake").invoke(LC_MESSAGES, chat_template_kwargs=variables)


CONTROLS = {"min_tokens": 3, "allowed_token_ids": [5, 6, 7], "bad_words": ["Ann", "no way"], "skip_special_tokens": True}


def _controls(params: Any) -> dict[str, Any]:
    return {k: getattr(params, k) for k in CONTROLS}


def test_vllm_token_controls_reach_the_engine_through_both_doors(engine: FakeEngine) -> None:
    litellm.completion(model="mlx-parallm/fake", messages=MESSAGES, **CONTROLS)
    assert _controls(engine.last.params) == CONTROLS
    litellm.completion(model="mlx-parallm/fake", messages=MESSAGES, extra_body=CONTROLS)
    assert _controls(engine.last.params) == CONTROLS
    litellm.text_completion(model="mlx-parallm/fake", prompt="Who is Ann?", extra_body=CONTROLS)
    assert _controls(engine.last.params) == CONTROLS
    ChatMLXParallm(model="fake", **CONTROLS).invoke(LC_MESSAGES)
    assert _controls(engine.last.params) == CONTROLS
    ChatMLXParallm(model="fake").bind(**CONTROLS).invoke(LC_MESSAGES)
    assert _controls(engine.last.params) == CONTROLS
    litellm.completion(model="mlx-parallm/fake", messages=MESSAGES)
    assert _controls(engine.last.params) == {"min_tokens": 0, "allowed_token_ids": None, "bad_words": [], "skip_special_tokens": False}


@pytest.mark.parametrize("bad,match", [
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [""]}, r"bad_words\[0\]"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
])
def test_bad_token_controls_are_refused_by_both_doors(engine: FakeEngine, bad: dict[str, Any], match: str) -> None:
    with pytest.raises(litellm.BadRequestError, match=match):
        litellm.completion(model="mlx-parallm/fake", messages=MESSAGES, extra_body=bad)
    with pytest.raises(ValueError, match=match):
        ChatMLXParallm(model="fake").invoke(LC_MESSAGES, **bad)


@pytest.mark.parametrize("asked,ending", [
    ({"reasoning_effort": "none"}, "assistant\n<think>\n\n</think>\n\n[none]"),
    ({"reasoning_effort": "minimal"}, "assistant\n<think>\n\n</think>\n\n[minimal]"),
    ({"reasoning_effort": "high"}, "assistant\n[high]"),
    ({"reasoning_effort": {"effort": "low", "summary": "auto"}}, "assistant\n[low]"),  # (LiteLLM's Responses bridge)
    ({"thinking": {"type": "disabled"}}, "assistant\n<think>\n\n</think>\n\n"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "assistant\n"),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, "assistant\n[none]"),  # (the variable set wins)
])
def test_reasoning_effort_and_thinking_switch_the_templates_thinking_through_both_doors(
        thinking_engine: FakeEngine, asked: dict[str, Any], ending: str) -> None:
    # (LiteLLM passes a custom provider reasoning_effort in extra_body, or where allowed_openai_params names it)
    a, b = both_prompts(thinking_engine, {"extra_body": asked}, ChatMLXParallm(model="fake").bind(**asked))
    assert a == b and a.endswith(ending), a
    if "thinking" not in asked:
        litellm.completion(model="mlx-parallm/fake", messages=MESSAGES, allowed_openai_params=["reasoning_effort"], **asked)
        assert thinking_engine.last.prompt == a


@pytest.mark.parametrize("asked,match", [
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"reasoning_effort": {"summary": "auto"}}, "reasoning_effort"),
    ({"thinking": "on"}, "thinking"),
    ({"thinking": {"type": "maybe"}}, "thinking"),
])
def test_bad_reasoning_effort_or_thinking_is_refused_by_both_doors(thinking_engine: FakeEngine, asked: dict[str, Any], match: str) -> None:
    with pytest.raises(litellm.BadRequestError, match=match):
        litellm.completion(model="mlx-parallm/fake", messages=MESSAGES, extra_body=asked)
    with pytest.raises(ValueError, match=match):
        ChatMLXParallm(model="fake").invoke(LC_MESSAGES, **asked)


def test_chatopenai_names_model_kwargs_and_extra_body(engine: FakeEngine) -> None:
    """ChatOpenAI's other field names and its ``model_kwargs`` / ``extra_body`` (where vLLM's
    parameters go) work the same here, at construction and per call; a call's own win."""
    from mlx_parallm_provider.langchain import MLXParallmLLM

    chat = ChatMLXParallm(model_name="fake", max_completion_tokens=7, stop_sequences=["END"], model_kwargs={"min_tokens": 2},
                          extra_body={"top_k": 5, "structured_outputs": {"choice": ["yes", "no"]}})
    assert (chat.model, chat.max_tokens, chat.stop) == ("fake", 7, ["END"])
    assert chat._get_llm_string() != ChatMLXParallm(model="fake", max_tokens=7, stop=["END"])._get_llm_string()  # (LangChain's cache key)
    chat.invoke(LC_MESSAGES)
    params = engine.last.params
    assert (params.max_tokens, params.stop, params.min_tokens, params.top_k) == (7, ["END"], 2, 5)
    assert params.constraint is not None  # (structured_outputs, a chat-layer parameter)
    chat.invoke(LC_MESSAGES, max_completion_tokens=3, extra_body={"top_k": 9, "min_tokens": 1})
    assert (engine.last.params.max_tokens, engine.last.params.top_k, engine.last.params.min_tokens) == (3, 9, 1)
    chat.bind(extra_body={"top_k": 9}, top_k=4).invoke(LC_MESSAGES)
    assert engine.last.params.top_k == 4
    MLXParallmLLM(model_name="fake", max_completion_tokens=4, model_kwargs={"bad_words": ["Ann"]}).invoke("hi")
    assert (engine.last.params.max_tokens, engine.last.params.bad_words) == (4, ["Ann"])


@pytest.mark.parametrize("fields,call,match", [
    ({"model": "fake", "model_name": "fake"}, {}, "model_name: is another name for model"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, {}, "max_completion_tokens"),
    ({"model_kwargs": {"frobnicate": 1}}, {}, "frobnicate"),
    ({"extra_body": {"min_tokens": 9, "max_tokens": 4}}, {}, "min_tokens"),
    ({}, {"extra_body": "min_tokens=2"}, "extra_body"),
    ({}, {"extra_body": {"top_k": -1}}, "top_k"),
    ({}, {"max_completion_tokens": 3, "max_tokens": 4}, "max_completion_tokens: is another name for max_tokens"),
])
def test_bad_chatopenai_style_settings_are_refused(engine: FakeEngine, fields: dict, call: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ChatMLXParallm(**{"model": "fake", **fields} if "model_name" not in fields else fields).invoke(LC_MESSAGES, **call)


def test_openai_predicted_outputs_reach_the_engine_through_both_doors(engine: FakeEngine) -> None:
    prediction = {"type": "content", "content": [{"type": "text", "text": "Ann is "}, {"type": "text", "text": "seven."}]}
    litellm.completion(model="mlx-parallm/fake", messages=MESSAGES, prediction=prediction)
    assert engine.last.params.prediction == "Ann is seven."
    ChatMLXParallm(model="fake").invoke(LC_MESSAGES, prediction={"type": "content", "content": "Ann is seven."})
    assert engine.last.params.prediction == "Ann is seven."
    with pytest.raises(litellm.BadRequestError, match="prediction"):
        litellm.completion(model="mlx-parallm/fake", messages=MESSAGES, prediction={"type": "audio"})
    with pytest.raises(ValueError, match="prediction"):
        ChatMLXParallm(model="fake", prediction=["Ann"])
