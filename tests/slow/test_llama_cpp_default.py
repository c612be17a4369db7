"""The benchmark's llama.cpp peer on the default model's GGUF, when llama-cpp-python is installed
(the ``[llama-cpp]`` extra): it gets the engine's prompt ids, decodes a burst side by side and
stops at EOS unless told not to.

(llama.cpp's CPU kernels round differently with a token's row in the batch, so on this small
quantized model a sequence batched with others may pick a different near-tie token than alone:
outputs are compared run to run, not batched to alone.)
"""

from __future__ import annotations

import asyncio

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the [llama-cpp] extra)")

from mlx_parallm_provider.bench import workloads  # noqa: E402
from mlx_parallm_provider.bench.runners import Sampling  # noqa: E402
from mlx_parallm_provider.bench.runners.llama_cpp import LlamaCpp  # noqa: E402
from mlx_parallm_provider.engine import Engine  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def renderer() -> workloads.ChatRenderer:
    """The engine's chat template and tokenizer (no worker starts)."""
    return workloads.ChatRenderer(Engine("default"))


def _runner(ignore_eos: bool = False) -> LlamaCpp:
    runner = LlamaCpp("llama-cpp", "default", Sampling(), ignore_eos=ignore_eos)
    asyncio.run(runner.start())
    return runner


def test_llama_cpp_tokenizes_the_rendered_prompt_as_the_engine_does(renderer: workloads.ChatRenderer) -> None:
    runner = _runner()
    try:
        for request in workloads.agent(2, 8) + workloads.chat(2, 8):
            text = renderer.apply_chat_template(request.messages, tools=request.tools).encode()
            ids = (llama_cpp.llama_token * (len(text) + 8))()
            n = llama_cpp.llama_tokenize(runner.vocab, text, len(text), ids, len(ids), False, True)  # no BOS; parse <|im_start|>
            assert 0 < n and list(ids[:n]) == renderer.encode(text.decode())
    finally:
        asyncio.run(runner.stop())


def test_a_burst_decodes_side_by_side_stops_at_eos_and_repeats_exactly(renderer: workloads.ChatRenderer) -> None:
    prompts = [r.prompt_ids for r in workloads.prepare(workloads.chat(6, 48), renderer)]
    runner = _runner()
    try:
        first = runner.generate_ids(prompts, 160, width=6)  # long enough for some answers to end
        assert runner.run_info()["max_decode_batch"] == 6
        assert runner.generate_ids(prompts, 160, width=6) == first  # same batch, same tokens
        n_vocab = llama_cpp.llama_vocab_n_tokens(runner.vocab)
        assert all(0 < len(ids) <= 160 and all(0 <= t < n_vocab for t in ids) for ids in first)
        assert not any(llama_cpp.llama_vocab_is_eog(runner.vocab, t) for ids in first for t in ids)  # EOS not counted
        assert min(len(ids) for ids in first) < 160  # some answer ended at EOS
    finally:
        asyncio.run(runner.stop())
    runner = _runner(ignore_eos=True)
    try:
        assert [len(ids) for ids in runner.generate_ids(prompts, 48, width=6)] == [48] * 6
    finally:
        asyncio.run(runner.stop())
