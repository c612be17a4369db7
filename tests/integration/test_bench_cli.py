"""``mlx-parallm bench --quick`` end to end on the tiny model: the CI smoke test of the
benchmark (every metric in the JSON, the plots written; never a speed)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest

from mlx_parallm_provider.cli import main

METRICS = {
    "completed", "failed", "failures", "duration_s", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "max_concurrent_requests", "ttft_ms", "tpot_ms",
    "itl_ms", "e2el_ms", "max_decode_batch", "peak_memory_mb", "peak_rss_mb", "backend", "attention",
    "decode",
}
STREAMED = ("engine", "litellm", "langchain", "mlx-lm")
OURS = ("engine", "litellm", "langchain")


@pytest.fixture(scope="module")
def quick(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main(["bench", "--quick", "--model", str(tiny_model_dir), "--output-dir", str(out), "--no-progress",
                       "--sweep", "max_num_seqs=2,4", "--slo", "ttft=60s,tpot=10s"])
    assert status == 0
    return json.loads((out / "results.json").read_text()), stdout.getvalue(), out


def test_every_system_setting_and_level_has_every_metric(quick: tuple[dict, str, Path], tiny_model_dir: Path) -> None:
    from mlx_parallm_provider.models import backends, registry

    result, stdout, _ = quick
    ours = backends.describe(registry.load(str(tiny_model_dir)).model)  # what the engine systems' stats() say
    rows = result["rows"]
    seen = {(r["system"], r["setting_label"], r["concurrency"]) for r in rows}
    expected = {(s, f"max_num_seqs={q}", c) for s in OURS for q in (2, 4) for c in (1, 4)}
    expected |= {(s, "defaults", c) for s in ("mlx-lm", "mlx-lm-batch") for c in (1, 4)}
    assert expected <= seen
    for r in rows:
        m = r["metrics"]
        assert set(m) == METRICS, r["system"]
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(m[name]) == {"mean", "p50", "p90", "p99"}
        assert m["completed"] == r["num_requests"] == r["concurrency"] and m["failed"] == 0
        assert m["total_output_tokens"] > 0 and m["peak_memory_mb"] > 0
        if r["system"] == "engine" and sys.platform == "linux":
            assert m["peak_rss_mb"] > 0  # the benchmark process's own, from /proc
        assert len(r["samples"]["e2el_ms"]) == r["num_requests"]
        described = ours if r["system"] in OURS else {"backend": None, "attention": None}  # (none for the peers)
        assert (m["backend"], m["attention"]) == (described["backend"], described["attention"]), r["system"]
        assert m["decode"] == ("uncompiled (the backend has no GPU paged kernels)" if r["system"] in OURS else None)
    assert f"- engine (max_num_seqs=2): {ours['backend']} backend, attention: {ours['attention']}" in stdout
    for level in (1, 4):  # the same prompts everywhere: every system counts the same prompt tokens
        assert len({r["metrics"]["total_input_tokens"] for r in rows if r["concurrency"] == level}) == 1


def test_streamed_systems_have_latencies_and_goodput(quick: tuple[dict, str, Path]) -> None:
    result, _, _ = quick
    for r in result["rows"]:
        m = r["metrics"]
        if r["system"] in STREAMED:
            assert m["ttft_ms"]["p50"] > 0 and m["e2el_ms"]["p99"] >= m["ttft_ms"]["p50"]
            assert m["request_goodput"] == pytest.approx(m["request_throughput"])  # a lax SLO: every request is good
        else:  # batch_generate does not stream
            assert m["ttft_ms"]["p50"] is None and m["request_goodput"] is None
        if r["system"] in OURS:
            assert 1 <= m["max_decode_batch"] <= min(r["concurrency"], r["setting"]["max_num_seqs"])
        else:
            assert m["max_decode_batch"] is None


def test_plots_table_best_setting_and_skips(quick: tuple[dict, str, Path]) -> None:
    result, stdout, out = quick
    for name in ("throughput.png", "latency_cdf.png", "sweep.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "| system | setting | concurrency |" in stdout
    assert set(result["best"]) == set(OURS)
    assert "best engine setting for ttft<=60000 ms and tpot<=10000 ms" in stdout
    # the tiny model is a folder, not a GGUF: llama.cpp is skipped either way, in one line
    reason = "llama-cpp-python is not installed" if importlib.util.find_spec("llama_cpp") is None else "needs a .gguf model"
    assert reason in result["skipped"]["llama-cpp"] and f"skipped llama-cpp: {result['skipped']['llama-cpp']}\n" in stdout
    assert result["meta"]["slo_ms"] == {"ttft": 60000.0, "tpot": 10000.0}
    assert result["complete"] is True


@pytest.mark.parametrize("args, message", [
    (["--slo", "latency=5"], "bad SLO"), (["--sweep", "temperature=1"], "bad --sweep"),
    (["--sweep", "max_num_seqs=0"], "max_num_seqs"), (["--workload", "poems"], "unknown workload"),
])
def test_bad_options_are_one_line_errors(args: list[str], message: str, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert main(["bench", "--output-dir", str(tmp_path), "--systems", "engine", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_peers_that_cannot_run_are_one_line_notes(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # imports fail as if not installed
    monkeypatch.setitem(sys.modules, "fastapi", None)
    status = main(["bench", "--model", str(tiny_model_dir), "--output-dir", str(tmp_path), "--no-progress", "--max-tokens", "2",
                   "--systems", "engine,llama-cpp,litellm-proxy,http", "--concurrency", "1"])
    out, err = capsys.readouterr()
    assert status == 0 and "Traceback" not in out + err
    skipped = json.loads((tmp_path / "results.json").read_text())["skipped"]
    assert set(skipped) == {"llama-cpp", "litellm-proxy", "http"}
    for system, reason in skipped.items():
        assert "\n" not in reason and f"skipping {system}: {reason}\n" in err and f"skipped {system}: {reason}\n" in out
    assert "| engine | 1 | 1 / 0 |" in out


@pytest.mark.parametrize("cut_at, kept", [(2, [({"max_num_seqs": 4}, 1)]), (3, [({"max_num_seqs": 4}, 1), ({"max_num_seqs": 8}, 1)])])
def test_a_run_cut_short_keeps_the_runs_it_measured(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    cut_at: int, kept: list) -> None:
    """results.json is rewritten after every system's run at a level, so a run stopped by a time
    limit keeps them: the levels done, and at the level cut short the systems done before."""
    from mlx_parallm_provider import __version__
    from mlx_parallm_provider.bench.runners import base

    measure = base.Runner.run
    calls: list[int] = []

    async def cut(self, requests, offsets, max_concurrency, on_done):
        calls.append(max_concurrency)
        if len(calls) == cut_at:
            raise RuntimeError("cut")
        return await measure(self, requests, offsets, max_concurrency, on_done)

    monkeypatch.setattr(base.Runner, "run", cut)
    with pytest.raises(RuntimeError, match="cut"), contextlib.redirect_stdout(io.StringIO()):
        main(["bench", "--model", str(tiny_model_dir), "--output-dir", str(tmp_path), "--no-progress", "--max-tokens", "2",
              "--systems", "engine", "--sweep", "max_num_seqs=4,8", "--concurrency", "1,2"])
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["complete"] is False
    assert [(r["setting"], r["concurrency"]) for r in result["rows"]] == kept
    assert all(r["system"] == "engine" and r["metrics"]["completed"] == 1 for r in result["rows"])
    assert result["meta"]["versions"]["mlx-parallm-provider"] == __version__ and result["meta"]["machine"]["device"]
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # written beside, then renamed: no temporary left


@pytest.mark.slow
def test_servers_started_on_loopback(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """mlx_lm.server and the LiteLLM proxy, each started, measured over HTTP and stopped."""
    status = main(["bench", "--quick", "--model", str(tiny_model_dir), "--output-dir", str(tmp_path), "--no-progress",
                   "--systems", "mlx-lm-server,litellm-proxy", "--concurrency", "2", "--ignore-eos"])
    assert status == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["system"] for r in rows] == ["mlx-lm-server", "litellm-proxy"]
    assert [r["eos"] for r in rows] == ["honoured", "ignored"]  # the proxy passes ignore_eos to the provider
    assert rows[1]["metrics"]["total_output_tokens"] == 2 * 8
    for r in rows:
        assert r["metrics"]["completed"] == 2 and r["metrics"]["ttft_ms"]["p50"] > 0
        if sys.platform == "linux":
            assert r["metrics"]["peak_memory_mb"] == r["metrics"]["peak_rss_mb"] > 0  # the server's peak RSS, from /proc


def test_counts_must_be_positive(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--max-tokens", "0"])
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_mlx_lm_peers_decode_the_whole_wave_at_once(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-lm caps a batch at 32 rows by default: a wave of 40 would decode as 32 then 8,
    and its server would queue past 32; the peers are given the run's width instead."""
    import asyncio

    from mlx_parallm_provider.bench import servers
    from mlx_parallm_provider.bench.runners import RunnerOptions, make_runner
    from mlx_parallm_provider.bench.workloads import BenchRequest

    runner = make_runner("mlx-lm-batch", RunnerOptions(model=str(tiny_model_dir), ignore_eos=True))
    asyncio.run(runner.start())
    model, widths = runner.model, []

    class Counting:  # the model as BatchGenerator calls it: records each decode step's rows
        def __getattr__(self, name: str):
            return getattr(model, name)

        def __call__(self, inputs, *args, **kwargs):
            if inputs.shape[1] == 1:
                widths.append(inputs.shape[0])
            return model(inputs, *args, **kwargs)

    runner.model = Counting()
    requests = [BenchRequest([{"role": "user", "content": "hi"}], 12, prompt_ids=[1, 2 + i % 5, 3]) for i in range(40)]
    records, _ = asyncio.run(runner.timed(requests, [0.0] * 40, None, None))
    assert [r.output_tokens for r in records] == [12] * 40 and max(widths) == 40

    commands: list[list[str]] = []
    monkeypatch.setattr(servers, "start", lambda command, *args, **kwargs: commands.append(command))
    for widest, decoded in ((64, "64"), (8, "32"), (None, "32")):  # mlx-lm's own 32 where the runs are narrower
        make_runner("mlx-lm-server", RunnerOptions(model=str(tiny_model_dir), max_concurrency=widest)).launch()
        assert commands[-1][commands[-1].index("--decode-concurrency") + 1] == decoded
