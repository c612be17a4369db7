"""The OpenAI Agents SDK on the default model: a tool loop through ``LitellmModel``.

Four agents run at once (``asyncio.gather``); their model calls decode together in one
batch. Each agent is forced to call its tool on the first turn (``tool_choice="required"``,
which mlx-parallm constrains to a valid call of the tool's JSON schema), then the SDK
resets the choice to ``auto`` (its default ``reset_tool_choice``) and the model answers
from the tool's result: call, tool result, answer.

    pip install "mlx-parallm-provider[cpu,agents]"   # [agents]: openai-agents, langgraph, pydantic-ai
    python examples/openai_agents_tools.py
"""

from __future__ import annotations

import asyncio
import time

from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
from agents.extensions.models.litellm_model import LitellmModel

import mlx_parallm_provider.models  # noqa: F401  (first: fast CPU BLAS, registers the LiteLLM provider)
from mlx_parallm_provider import get_engine

CITIES = ["Paris", "Oslo", "Lima", "Tokyo"]
FORECASTS = {"Paris": "rain, 14 C", "Oslo": "snow, -3 C", "Lima": "sunny, 24 C", "Tokyo": "cloudy, 18 C"}


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return FORECASTS.get(city.strip().title(), "sunny, 20 C")


def make_agent() -> Agent:
    return Agent(
        name="weather",
        instructions="You answer questions about the weather. Use the get_weather tool.",
        model=LitellmModel(model="mlx-parallm/default"),
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", max_tokens=64),
    )


async def ask(city: str) -> tuple[str, list[str], str]:
    result = await Runner.run(make_agent(), f"What is the weather in {city}?", max_turns=4,
                              run_config=RunConfig(tracing_disabled=True))
    kinds = [item.type for item in result.new_items]
    return city, kinds, str(result.final_output)


async def main() -> None:
    set_tracing_disabled(True)
    start = time.perf_counter()
    results = await asyncio.gather(*(ask(city) for city in CITIES))
    for city, kinds, answer in results:
        print(f"{city}: {' -> '.join(kinds)}\n  answer: {answer.strip()[:200]!r}")
    loops = sum("tool_call_item" in k and "tool_call_output_item" in k for _, k, _ in results)
    stats = get_engine("default").stats()
    print(f"{loops}/{len(CITIES)} tool loops completed in {time.perf_counter() - start:.1f} s; "
          f"largest decode batch {stats['max_batch_size']}")


if __name__ == "__main__":
    asyncio.run(main())
