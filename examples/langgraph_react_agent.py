"""LangGraph's ``create_react_agent`` on the default model: a tool loop, four agents at once.

``agent.abatch`` runs the four graphs concurrently, so their model calls decode together.
The model is chosen per step (LangGraph's dynamic model): while the question has no tool
result yet, the tools are bound with ``tool_choice="any"`` (mlx-parallm constrains the
answer to a valid call); once a result is in, with the default ``auto``, so the model
answers from it. A 135M model left to decide alone rarely calls a tool; larger models
need only ``chat.bind_tools(TOOLS)``.

    pip install "mlx-parallm-provider[cpu,agents]"
    python examples/langgraph_react_agent.py
"""

from __future__ import annotations

import asyncio
import time
import warnings
from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.tools import tool

import mlx_parallm_provider.models  # noqa: F401  (first: fast CPU BLAS)
from mlx_parallm_provider import get_engine
from mlx_parallm_provider.langchain import ChatMLXParallm

with warnings.catch_warnings():  # create_react_agent moved to langchain.agents in LangGraph 1.x
    warnings.simplefilter("ignore", DeprecationWarning)
    from langgraph.prebuilt import create_react_agent

CITIES = ["Paris", "Oslo", "Lima", "Tokyo"]
FORECASTS = {"Paris": "rain, 14 C", "Oslo": "snow, -3 C", "Lima": "sunny, 24 C", "Tokyo": "cloudy, 18 C"}


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return FORECASTS.get(city.strip().title(), "sunny, 20 C")


TOOLS = [get_weather]
chat = ChatMLXParallm(model="default", max_tokens=64)


def choose_model(state: dict[str, Any], runtime: Any) -> Any:
    """Force a tool call until one has been answered, then let the model reply."""
    answered = any(isinstance(m, ToolMessage) for m in state["messages"])
    return chat.bind_tools(TOOLS) if answered else chat.bind_tools(TOOLS, tool_choice="any")


async def main() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        agent = create_react_agent(choose_model, TOOLS)
    inputs = [{"messages": [("user", f"What is the weather in {city}?")]} for city in CITIES]
    start = time.perf_counter()
    results = await agent.abatch(inputs, config={"recursion_limit": 8})
    loops = 0
    for city, result in zip(CITIES, results):
        messages = result["messages"]
        kinds = [type(m).__name__ for m in messages]
        calls = [c for m in messages for c in getattr(m, "tool_calls", [])]
        loops += bool(calls) and "ToolMessage" in kinds and kinds[-1] == "AIMessage"
        print(f"{city}: {' -> '.join(kinds)}; calls {[(c['name'], c['args']) for c in calls]}\n"
              f"  answer: {messages[-1].content.strip()[:200]!r}")
    stats = get_engine("default").stats()
    print(f"{loops}/{len(CITIES)} tool loops completed in {time.perf_counter() - start:.1f} s; "
          f"largest decode batch {stats['max_batch_size']}")


if __name__ == "__main__":
    asyncio.run(main())
