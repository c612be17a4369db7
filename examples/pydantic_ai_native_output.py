"""pydantic-ai through the LiteLLM proxy: ``NativeOutput`` (OpenAI ``response_format``
``json_schema``) on the default model, four agents at once.

The proxy serves ``examples/litellm_proxy_config.yaml``; mlx-parallm constrains each answer
to the schema, so every run validates. Set ``OPENAI_BASE_URL`` and ``LITELLM_MASTER_KEY``
to use a proxy already running; otherwise this script starts one on a free port and
stops it at the end.

    pip install "mlx-parallm-provider[cpu,proxy,agents]"
    python examples/pydantic_ai_native_output.py
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Literal

import httpx
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.profiles.openai import OpenAIModelProfile
from pydantic_ai.providers.openai import OpenAIProvider

CONFIG = Path(__file__).with_name("litellm_proxy_config.yaml")
CITIES = ["Paris", "Oslo", "Lima", "Tokyo"]


class CityFacts(BaseModel):
    """Facts about a city."""

    city: str = Field(max_length=40)
    country: str = Field(max_length=40)
    continent: Literal["Africa", "Asia", "Europe", "North America", "Oceania", "South America"]
    population_millions: int = Field(ge=0, le=50)


@contextmanager
def proxy() -> Iterator[tuple[str, str]]:
    """``(base_url, key)`` of a running proxy: the environment's, or one started here."""
    if os.environ.get("OPENAI_BASE_URL") and os.environ.get("LITELLM_MASTER_KEY"):
        yield os.environ["OPENAI_BASE_URL"], os.environ["LITELLM_MASTER_KEY"]
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = "sk-" + secrets.token_hex(16)
    cli = shutil.which("litellm", path=str(Path(sys.executable).parent)) or shutil.which("litellm")
    env = {**os.environ, "LITELLM_MASTER_KEY": key, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    process = subprocess.Popen([cli, "--config", str(CONFIG), "--host", "127.0.0.1", "--port", str(port)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the proxy exited with code {process.returncode}")
            try:
                if httpx.get(f"{url}/health/liveliness", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the proxy did not start within 300 s")
            time.sleep(1)
        yield f"{url}/v1", key
    finally:
        process.terminate()
        process.wait(timeout=30)


async def city_facts(base_url: str, key: str, cities: list[str]) -> list[CityFacts]:
    """One agent run per city, all at once, through the proxy at ``base_url``."""
    model = OpenAIChatModel(
        "mlx-parallm/default",
        provider=OpenAIProvider(base_url=base_url, api_key=key),
        # The proxy's model is not one pydantic-ai knows: say it takes json_schema.
        profile=OpenAIModelProfile(supports_json_schema_output=True, supports_json_object_output=True),
    )
    agent = Agent(model, output_type=NativeOutput(CityFacts), model_settings={"max_tokens": 96})
    results = await asyncio.gather(*(agent.run(f"Facts about {city}.") for city in cities))
    return [r.output for r in results]


async def main() -> None:
    with proxy() as (base_url, key):
        start = time.perf_counter()
        outputs = await city_facts(base_url, key, CITIES)
        for city, output in zip(CITIES, outputs):
            print(f"{city}: {output!r}")
        valid = sum(isinstance(o, CityFacts) for o in outputs)
        print(f"{valid}/{len(CITIES)} validated CityFacts in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    asyncio.run(main())
