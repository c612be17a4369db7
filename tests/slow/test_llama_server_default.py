"""The benchmark's llama-server peer (llama.cpp's own server from the ``xllamacpp`` wheel, the
``[llama-server]`` extra) on the default model's GGUF, over HTTP on loopback."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("xllamacpp", reason="xllamacpp is not installed (the [llama-server] extra)")

from mlx_parallm_provider.bench import workloads  # noqa: E402
from mlx_parallm_provider.bench.runners import RunnerOptions, make_runner  # noqa: E402
from mlx_parallm_provider.engine import Engine  # noqa: E402

pytestmark = pytest.mark.slow


def test_llama_server_answers_a_burst_with_every_token_and_reports_its_memory(tmp_path) -> None:
    requests = workloads.prepare(workloads.chat(4, 12), workloads.ChatRenderer(Engine("default")))
    runner = make_runner("llama-server", RunnerOptions(model="default", ignore_eos=True, workdir=tmp_path, llama_cpp_threads=1))

    async def run():
        await runner.start()
        try:
            return await runner.run(requests, [0.0] * len(requests), len(requests))
        finally:
            await runner.stop()

    records, duration = asyncio.run(run())
    assert [(r.error, r.output_tokens) for r in records] == [(None, 12)] * 4  # EOS ignored, as the engine's rows
    assert all(len(r.chunk_times) >= 1 and r.prompt_tokens > 0 for r in records)  # streamed, usage reported
    assert duration > 0 and runner.run_info()["peak_memory_mb"] > 0
    assert (tmp_path / "llama-server-4.log").read_text().strip()  # a server of 4 slots ran and was stopped
