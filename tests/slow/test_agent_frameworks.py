"""Agent frameworks on the default model (issue 11): the OpenAI Agents SDK (``LitellmModel``)
and LangGraph's ``create_react_agent`` each complete a tool loop (call, tool result,
answer); pydantic-ai's ``NativeOutput`` validates through the LiteLLM proxy.

They run the examples' own code. The frameworks come with the optional ``[agents]`` extra;
without it these tests are skipped, saying so.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_litellm_engines")]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str, needs: str) -> ModuleType:
    pytest.importorskip(needs, reason=f"{needs} is not installed (pip install 'mlx-parallm-provider[agents]')")
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the module's annotations through it
    spec.loader.exec_module(module)
    return module


def test_openai_agents_sdk_completes_a_tool_loop() -> None:
    example = _example("openai_agents_tools", "agents")
    example.set_tracing_disabled(True)
    city, kinds, answer = asyncio.run(example.ask("Oslo"))
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert answer.strip()


def test_langgraph_react_agent_completes_a_tool_loop() -> None:
    example = _example("langgraph_react_agent", "langgraph")
    agent = example.create_react_agent(example.choose_model, example.TOOLS)
    result = asyncio.run(agent.ainvoke({"messages": [("user", "What is the weather in Oslo?")]}, config={"recursion_limit": 8}))
    kinds = [type(m).__name__ for m in result["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert result["messages"][1].tool_calls[0]["name"] == "get_weather"
    assert result["messages"][2].status == "success" and result["messages"][-1].content.strip()


def test_pydantic_ai_native_output_validates_through_the_proxy() -> None:
    example = _example("pydantic_ai_native_output", "pydantic_ai")
    pytest.importorskip("fastapi", reason="the LiteLLM proxy needs the [proxy] extra")
    with example.proxy() as (base_url, key):
        # pydantic-ai raises UnexpectedModelBehavior for an answer that does not validate.
        outputs = asyncio.run(example.city_facts(base_url, key, ["Paris", "Tokyo"]))
    assert [type(o) for o in outputs] == [example.CityFacts] * 2
