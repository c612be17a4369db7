"""The benchmark's llama.cpp peer on the default model's GGUF, when llama-cpp-python is installed
(the ``[llama-cpp]`` extra): it gets the engine's prompt ids, and batching does not change what
a sequence generates."""

from __future__ import annotations

import asyncio

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the [llama-cpp] extra)")

from mlx_parallm_provider.bench import workloads  # noqa: E402
from mlx_parallm_provider.bench.runners.llama_cpp import LlamaCpp  # noqa: E402
from mlx_parallm_provider.engine import Engine  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runner():
    runner = LlamaCpp("llama-cpp", "default", 0.0)
    asyncio.run(runner.start())
    yield runner
    asyncio.run(runner.stop())


@pytest.fixture(scope="module")
def renderer() -> workloads.ChatRenderer:
    """The engine's chat template and tokenizer (no worker starts)."""
    return workloads.ChatRenderer(Engine("default"))


def test_llama_cpp_tokenizes_the_rendered_prompt_as_the_engine_does(runner: LlamaCpp, renderer: workloads.ChatRenderer) -> None:
    for request in workloads.agent(2, 8) + workloads.chat(2, 8):
        text = renderer.apply_chat_template(request.messages, tools=request.tools).encode()
        ids = (llama_cpp.llama_token * (len(text) + 8))()
        n = llama_cpp.llama_tokenize(runner.vocab, text, len(text), ids, len(ids), False, True)  # no BOS; parse <|im_start|>
        assert 0 < n and list(ids[:n]) == renderer.encode(text.decode())


def test_sequences_batched_together_generate_what_they_generate_alone(runner: LlamaCpp, renderer: workloads.ChatRenderer) -> None:
    prompts = [r.prompt_ids for r in workloads.prepare(workloads.chat(4, 16), renderer)]
    together = runner.generate_ids(prompts, 16, width=4)
    assert runner.run_info()["max_decode_batch"] == 4  # the four decoded side by side
    alone = [runner.generate_ids([p], 16, width=1)[0] for p in prompts]
    assert together == alone
    assert all(0 < len(ids) <= 16 for ids in together)


def test_generation_stops_at_eos(runner: LlamaCpp, renderer: workloads.ChatRenderer) -> None:
    [prompt] = [r.prompt_ids for r in workloads.prepare(workloads.chat(1, 256), renderer)]  # the capital of France
    [ids] = runner.generate_ids([prompt], 256, width=1)
    assert 0 < len(ids) < 256  # ended by an end-of-generation token, which is not counted
    assert not any(llama_cpp.llama_vocab_is_eog(runner.vocab, t) for t in ids)
