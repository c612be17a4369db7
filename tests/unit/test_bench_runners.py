"""Runners that need no model: the OpenAI-compatible HTTP client (on a mock transport) and
the skip paths of peers that are not installed."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Optional

import httpx
import pytest

from mlx_parallm_provider.bench.metrics import RequestRecord
from mlx_parallm_provider.bench.runners import RunnerOptions, Sampling, SkipSystem, make_runner
from mlx_parallm_provider.bench.runners.http import OpenAIHTTP, normalize_base_url
from mlx_parallm_provider.bench.runners.llama_cpp import gguf_path
from mlx_parallm_provider.bench.workloads import AGENT_TOOLS, BenchRequest, build
from mlx_parallm_provider.config import EngineConfig

REQUEST = BenchRequest([{"role": "user", "content": "hi"}], 16, tools=AGENT_TOOLS, prompt_ids=[1, 2, 3])


def _sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def _send(handler, request: BenchRequest = REQUEST, sampling: Sampling = Sampling(), **runner_options) -> tuple[RequestRecord, list[dict]]:
    bodies: list[dict] = []

    def recording(req: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(req.content))
        assert req.url.path == "/v1/chat/completions" and req.headers["authorization"] == "Bearer k"
        return handler(req)

    async def main() -> RequestRecord:
        runner = OpenAIHTTP("http", "served", sampling, base_url="http://server/v1", api_key="k", **runner_options)
        await runner.start()
        runner.client = httpx.AsyncClient(base_url=runner.base_url, headers=runner.client.headers, transport=httpx.MockTransport(recording))
        record = RequestRecord()
        try:
            await runner.send(request, record)
        finally:
            await runner.stop()
        return record

    return asyncio.run(main()), bodies


def test_the_body_carries_the_sampling_filters_that_are_on_or_all_of_them() -> None:
    ok = lambda r: httpx.Response(200, content=_sse({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}))  # noqa: E731
    [body] = _send(ok)[1]
    assert body["temperature"] == 0.0 and not {"top_p", "top_k", "min_p"} & set(body)  # (not OpenAI's own, unless asked)
    [body] = _send(ok, sampling=Sampling(0.7, top_p=0.9, top_k=20))[1]
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.9, 20) and "min_p" not in body
    [body] = _send(ok, sampling=Sampling(0.7, min_p=0.1), explicit_filters=True)[1]  # (llama-server: its defaults off)
    assert (body["top_p"], body["top_k"], body["min_p"]) == (1.0, 0, 0.1)


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 0.3}, {"min_p": 0.99}])
def test_mlx_lm_peers_sample_with_the_filters(filters: dict) -> None:
    """At a high temperature, a filter that keeps only the likeliest token makes every draw it."""
    import mlx.core as mx

    from mlx_parallm_provider.bench.runners.mlx_lm import MlxLmBatch

    logprobs = mx.log(mx.softmax(mx.array([[0.0, 5.0, 1.0, 4.9]]), axis=-1))
    hot = MlxLmBatch("mlx-lm-batch", "default", Sampling(5.0), False).sampler()
    assert len({hot(logprobs).item() for _ in range(60)}) > 1
    filtered = MlxLmBatch("mlx-lm-batch", "default", Sampling(5.0, **filters), False).sampler()
    assert {filtered(logprobs).item() for _ in range(60)} == {1}


def test_stream_chunks_and_usage_are_recorded() -> None:
    body = _sse(
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": "Hel"}}]},
        {"choices": [{"delta": {"content": "lo"}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "get_time"}}]}}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}},
    )
    record, bodies = _send(lambda r: httpx.Response(200, content=body))
    assert len(record.chunk_times) == 3 and record.output_tokens == 7
    assert record.prompt_tokens == 5  # the server's count replaces the workload's
    [sent] = bodies
    assert sent["model"] == "served" and sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["max_tokens"] == 16 and sent["tools"] == AGENT_TOOLS and "ignore_eos" not in sent
    assert "tool_choice" not in sent


def test_a_workload_s_tool_choice_is_sent_with_its_tools() -> None:
    [required] = build("agent", 1, 16, tool_choice="required")
    _, [sent] = _send(lambda r: httpx.Response(200, content=_sse()), request=required)
    assert sent["tool_choice"] == "required" and sent["tools"] == AGENT_TOOLS
    assert [r.tool_choice for r in build("chat", 1, 16, tool_choice="required")] == [None]  # no tools, no choice


def test_ignore_eos_is_sent_when_asked() -> None:
    _, [sent] = _send(lambda r: httpx.Response(200, content=_sse()), ignore_eos=True)
    assert sent["ignore_eos"] is True
    assert make_runner("litellm-proxy", RunnerOptions(model="default", ignore_eos=True)).eos == "ignored"
    assert make_runner("mlx-lm-server", RunnerOptions(model="default", ignore_eos=True)).eos == "honoured"


def test_without_usage_each_chunk_counts_one_token() -> None:
    body = _sse({"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]})
    record, _ = _send(lambda r: httpx.Response(200, content=body))
    assert record.output_tokens == 2 and record.prompt_tokens == 0  # RequestRecord() default kept


def test_an_http_error_raises_with_its_status_as_kind() -> None:
    with pytest.raises(Exception) as info:
        _send(lambda r: httpx.Response(503, json={"error": "busy"}))
    assert getattr(info.value, "kind") == "http_503" and "busy" in str(info.value)


def test_base_url_with_or_without_v1() -> None:
    assert normalize_base_url("http://h:1/v1/") == normalize_base_url("http://h:1") == "http://h:1"


def test_llama_cpp_skips_with_one_line_when_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    runner = make_runner("llama-cpp", RunnerOptions(model="default"))
    with pytest.raises(SkipSystem) as info:
        asyncio.run(runner.start())
    assert "llama-cpp-python is not installed" in str(info.value) and "\n" not in str(info.value)


def test_llama_cpp_needs_a_gguf_model() -> None:
    with pytest.raises(SkipSystem, match="needs a .gguf model"):
        gguf_path("some/folder")
    assert str(gguf_path("/x/model.gguf")) == "/x/model.gguf"


def test_http_needs_a_url_and_the_proxy_keeps_default_settings() -> None:
    with pytest.raises(SkipSystem, match="--url"):
        make_runner("http", RunnerOptions(model="default"))
    with pytest.raises(SkipSystem, match="default EngineConfig"):
        make_runner("litellm-proxy", RunnerOptions(model="default"), EngineConfig(max_num_seqs=8))
    with pytest.raises(ValueError, match="unknown system"):
        make_runner("vllm", RunnerOptions(model="default"))


def test_a_started_server_is_waited_for_measured_and_stopped(tmp_path) -> None:
    from mlx_parallm_provider.bench import servers

    port = servers.free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    server = servers.start(command, {}, port, "/", tmp_path / "server.log")
    try:
        assert httpx.get(server.base_url + "/", trust_env=False).status_code == 200
        if sys.platform == "linux":
            assert server.peak_rss_mb() > 1
    finally:
        server.stop()
    assert server.process.poll() is not None


def test_a_server_that_exits_is_skipped_with_its_last_log_line(tmp_path) -> None:
    from mlx_parallm_provider.bench import servers

    command = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(SkipSystem, match="exited with 3 \\(no model here"):
        servers.start(command, {}, servers.free_port(), "/health", tmp_path / "server.log")


SIGNAL_MID_RUN = """
import os, signal, sys, time
from pathlib import Path
from mlx_parallm_provider.bench import servers
folder = Path(sys.argv[1])
with servers.stopped_on_signal("stopped, and the servers"):
    started = []
    for name in ("a", "b"):
        port = servers.free_port()
        started.append(servers.start([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(folder)],
                                     {}, port, "/", folder / f"{name}.log"))
    started[0].stop()  # stopped already: nothing to pass on to
    print(*(s.process.pid for s in started), flush=True)
    os.kill(os.getpid(), int(sys.argv[2]))
    time.sleep(30)
print("not reached")
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_is_passed_on_to_the_servers_started_and_then_ends_the_run(sig: str, tmp_path) -> None:
    """A time limit's SIGTERM or a ^C reaches the servers too (each in its own session), then
    ends the run as the signal would: no server is left holding the machine for what runs next."""
    import signal
    import subprocess
    import time

    number = signal.Signals[sig].value
    done = subprocess.run([sys.executable, "-c", SIGNAL_MID_RUN, str(tmp_path), str(number)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -number, done.stderr
    assert "not reached" not in done.stdout and f"stopped, and the servers ({sig})" in done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 20
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(p) for p in pids)


def test_the_signals_handlers_are_put_back_after_the_run() -> None:
    import signal

    from mlx_parallm_provider.bench import servers

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with servers.stopped_on_signal():
        assert all(signal.getsignal(s) is not handler for s, handler in before.items())
    assert {s: signal.getsignal(s) for s in before} == before


def test_llama_server_skips_with_one_line_when_xllamacpp_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xllamacpp" else real(name, *a))
    runner = make_runner("llama-server", RunnerOptions(model="default"))
    with pytest.raises(SkipSystem) as info:
        asyncio.run(runner.start())
    assert "xllamacpp" in str(info.value) and "\n" not in str(info.value)
    assert runner.explicit_filters  # (its own default filters off unless asked for)


def test_llama_server_sizes_a_server_per_run_for_its_concurrency_and_longest_request(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Each run starts a server with one slot per concurrent request and room for its longest
    request in each, and stops it after, keeping its peak memory for the run's row."""
    from mlx_parallm_provider.bench import servers
    from mlx_parallm_provider.bench.runners import llama_server

    launched, stopped = [], []

    class FakeServer:
        base_url, api_key = "http://127.0.0.1:1", None

        def peak_rss_mb(self) -> float:
            return 123.0

        def stop(self) -> None:
            stopped.append(True)

    monkeypatch.setattr(servers, "llama_server", lambda gguf, folder, slots, ctx, threads: launched.append((slots, ctx, threads)) or FakeServer())
    monkeypatch.setattr(llama_server.importlib.util, "find_spec", lambda name, *a: object())
    runner = make_runner("llama-server", RunnerOptions(model=str(tmp_path / "m.gguf"), llama_cpp_threads=3, workdir=tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    sent = []

    async def send(request, record):
        sent.append(runner.client.base_url)
        record.output_tokens = request.max_tokens

    runner.send = send  # type: ignore[method-assign]
    requests = [BenchRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=16, prompt_ids=list(range(n))) for n in (10, 300, 40)]

    async def two_runs():
        await runner.start()
        await runner.run(requests, [0.0] * 3, 2)
        await runner.run(requests[:1], [0.0], 1)
        await runner.stop()

    asyncio.run(two_runs())
    assert launched == [(2, 512, 3), (1, 256, 3)]  # 300 + 16 (+32) -> 512; 10 + 16 (+32) -> 256
    assert len(stopped) == 2 and runner.run_info() == {"peak_memory_mb": 123.0, "peak_rss_mb": 123.0}
    assert sent and all(str(url).startswith("http://127.0.0.1:1") for url in sent)


def test_the_report_prints_each_runs_draft_acceptance_from_its_timed_requests() -> None:
    from mlx_parallm_provider.bench import report
    from mlx_parallm_provider.bench.runners.inprocess import draft_counts

    stats = {"speculation": {"draft_tokens": 120, "accepted_tokens": 66},
             "fast_forward": {"forced_tokens": 30, "accepted_tokens": 30, "lookup_tokens": 10, "lookup_accepted_tokens": 4}}
    assert draft_counts(stats) == {"speculation": (120, 66), "fast_forward": (40, 34)}
    assert draft_counts({"speculation": None, "fast_forward": None}) == {}
    row = {"system": "engine", "setting_label": "speculative=ngram", "concurrency": 1, "num_requests": 4,
           "metrics": {"failures": {}, "speculation_draft_tokens": 120, "speculation_accepted_tokens": 66}}
    text = report.notes([row], {}, [])
    assert "- engine (speculative=ngram, concurrency 1) speculation: 66 of 120 draft tokens accepted (55%), 16.5 a request" in text


def test_in_process_runs_count_the_drafts_of_their_timed_requests_only(tiny_model) -> None:
    from mlx_parallm_provider.bench.runners.inprocess import EngineRunner

    runner = EngineRunner("engine", "tiny", EngineConfig(speculative="ngram"), Sampling(), True)

    class Stats:
        def __init__(self) -> None:
            self.counts = [(10, 4), (25, 13)]

        def stats(self) -> dict:
            drafted, accepted = self.counts[0] if len(self.counts) > 1 else self.counts[-1]
            if len(self.counts) > 1:
                self.counts.pop(0)
            return {"max_batch_size": 1, "speculation": {"draft_tokens": drafted, "accepted_tokens": accepted}, "fast_forward": None}

    runner.engine = Stats()
    asyncio.run(runner.timed([], [], 1, None))  # the warm-up's 10 / 4 are counted before
    info = runner.run_info()
    assert (info["speculation_draft_tokens"], info["speculation_accepted_tokens"]) == (15, 9)
    assert "fast_forward_draft_tokens" not in info


def test_the_report_gives_each_settings_median_against_the_first_settings() -> None:
    from mlx_parallm_provider.bench import report

    def row(label: str, concurrency: int, tok_s: float) -> dict:
        return {"system": "engine", "setting_label": label, "concurrency": concurrency, "num_requests": 8,
                "metrics": {"failures": {}, "output_throughput": tok_s}}

    rows = [row("speculative=None", 1, 100.0), row("speculative=ngram", 1, 96.0), row("speculative=None", 1, 90.0),
            row("speculative=ngram", 1, 99.0), row("speculative=None", 1, 95.0), row("speculative=ngram", 1, 101.0),
            row("speculative=None", 64, 600.0), row("speculative=ngram", 64, 594.0)]
    lines = report.sweep_ratios(rows)
    assert lines == [
        "engine, concurrency 1, output tok/s against speculative=None (median 95.0 of 3: 100.0 / 90.0 / 95.0): "
        "speculative=ngram 1.04x (median 99.0 of 3: 96.0 / 99.0 / 101.0)",
        "engine, concurrency 64, output tok/s against speculative=None (600.0): speculative=ngram 0.99x (594.0)",
    ]
    assert report.sweep_ratios(rows[:1]) == [] and lines[0] in report.notes(rows, {}, [])


def test_the_report_names_the_attention_path_each_setting_of_the_engine_ran_with() -> None:
    from mlx_parallm_provider.bench import report

    def row(system: str, label: str, concurrency: int, attention: Optional[str]) -> dict:
        metrics = {"failures": {}, "output_throughput": 1.0}
        if attention is not None:
            metrics.update(backend="gpu", attention=attention)
        return {"system": system, "setting_label": label, "concurrency": concurrency, "num_requests": 8, "metrics": metrics}

    kernels, failed = "paged kernels (cuda)", "gather (the paged kernels failed their check: differs from the gather path by 0.1)"
    rows = [row("engine", "dequantize=False", 1, kernels), row("engine", "dequantize=True", 1, failed),
            row("engine", "dequantize=False", 64, kernels), row("engine", "dequantize=True", 64, kernels),
            row("mlx-lm-batch", "defaults", 1, None)]
    assert report.attention_lines(rows) == [
        f"engine (dequantize=False): gpu backend, attention: {kernels}",
        f"engine (dequantize=True): gpu backend, attention: {failed}; then gpu backend, attention: {kernels}",
    ]
    assert f"- engine (dequantize=False): gpu backend, attention: {kernels}" in report.notes(rows, {}, [])
