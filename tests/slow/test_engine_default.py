"""The engine on the real embedded default model."""

from __future__ import annotations

import ast
import asyncio
import sys

import pytest

from early import Command, result
from fakes import chat_prompt
from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import Engine, SamplingParams
from mlx_parallm_provider.models import registry

QUESTIONS = [
    "What is the capital of France?", "Name a primary color.", "What is 2 + 2?",
    "Write one sentence about the sea.", "What do bees make?", "Who wrote Hamlet?",
    "Give a synonym for happy.", "What is the largest planet in our solar system? Answer briefly.",
    "Translate 'hello' into French.", "What is water made of?", "How many legs does a spider have?",
    "Name a fruit that is yellow.", "What is the opposite of cold?", "What season comes after winter?",
    "Describe the moon in five words.", "Tell me a fun fact about cats, in one short sentence please.",
]


@pytest.mark.slow
def test_batched_greedy_equals_one_at_a_time_on_default_model() -> None:
    loaded = registry.load("default")
    params = SamplingParams(max_tokens=24, temperature=0.0)
    alone = Engine("default", EngineConfig(max_num_seqs=1), loaded=loaded)
    together = Engine("default", loaded=loaded)
    try:
        prompts = [chat_prompt(alone, [{"role": "user", "content": q}]) for q in QUESTIONS]
        expected = [alone.generate_sync(p, params) for p in prompts]

        async def burst():
            return await asyncio.gather(*(together.generate(p, params) for p in prompts))

        got = asyncio.run(burst())
        assert [g.token_ids for g in got] == [e.token_ids for e in expected]
        assert together.stats()["max_batch_size"] == 16
        assert "Paris" in got[0].text
    finally:
        alone.shutdown()
        together.shutdown()


EXIT_SCRIPT = """
import asyncio, sys
import mlx_parallm_provider as m
engine = m.get_engine(sys.argv[1])
async def main():
    await asyncio.gather(*(engine.generate("hi there", m.SamplingParams(max_tokens=8)) for _ in range(8)))
asyncio.run(main())
if sys.argv[2] == "shutdown":
    m.shutdown_engines()
print("clean exit")
"""


EXITS = """
import subprocess, sys
for _ in range(3):
    done = subprocess.run([sys.executable, "-c", sys.argv[1], "default", sys.argv[2]], capture_output=True, text=True)
    print(repr((done.returncode, done.stdout.strip(), done.stderr[-2000:])))
"""


def _three_exits(params: dict) -> Command:
    return Command([sys.executable, "-c", EXITS, EXIT_SCRIPT, params["ending"]], timeout=360)


@pytest.mark.slow
@pytest.mark.early(command=_three_exits)
@pytest.mark.parametrize("ending", ["shutdown", "interpreter-exit"])
def test_process_exits_cleanly_after_batched_work(ending: str, request: pytest.FixtureRequest) -> None:
    # MLX's per-thread compile cache is destroyed after the worker's Python state; the
    # engine must not let that race the interpreter's finalization (it aborted about one
    # run in two on the default model; the tiny model rarely shows it). Three runs, each a
    # process of its own, started early (beside the other tests).
    out = result(request)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [ast.literal_eval(line) for line in out.stdout.splitlines()]
    assert len(runs) == 3, out.stdout[-2000:]
    for returncode, stdout, stderr in runs:
        assert returncode == 0, stderr
        assert stdout == "clean exit" and "terminate called" not in stderr
