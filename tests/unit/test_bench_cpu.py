"""The CPU benchmarks' reports: targets judged met or missed from the figures, tables complete."""

from __future__ import annotations

from mlx_parallm_provider.bench import cpu_compare, cpu_profile


def test_compare_report_judges_each_target():
    results = {"engine": {1: 40.0, 32: 250.0, 64: 300.0}, "llama-cpp": {1: 100.0, 32: 240.0, 64: 270.0}, "mlx-lm": {1: 25.0}}
    text = cpu_compare.report(results, {"128": 200.0, "512": 450.0})
    lines = text.splitlines()
    assert "| engine | 40.0 | 250.0 | 300.0 |" in lines
    assert "| mlx-lm | 25.0 | - | - |" in lines
    assert any("llama-cpp at 64" in ln and "1.11x" in ln and "missed" in ln for ln in lines)
    assert any("llama-cpp at 32" in ln and "1.04x" in ln and ln.endswith("met)") for ln in lines)
    assert any("mlx-lm at 1" in ln and "1.60x" in ln and "missed" in ln for ln in lines)
    assert any("2.25x" in ln and "missed" in ln for ln in lines if ln.startswith("decode step"))
    assert not any("llama-server" in ln for ln in lines)  # a peer that did not run: no verdict


def test_compare_report_judges_issue_23s_targets_against_llama_server_with_peak_memory():
    results = {"engine": {1: 40.0, 64: 300.0}, "litellm-proxy": {1: 30.0, 64: 170.0}, "llama-server": {1: 100.0, 64: 150.0}}
    peaks = {"engine": {1: 120.0, 64: 700.0}, "litellm-proxy": {1: None, 64: 1900.0}, "llama-server": {1: 240.0, 64: 300.0}}
    lines = cpu_compare.report(results, None, peaks).splitlines()
    assert "| engine | 40.0 (120 MB) | 300.0 (700 MB) |" in lines
    assert "| litellm-proxy | 30.0 | 170.0 (1900 MB) |" in lines
    assert any(ln.startswith("engine vs llama-server at 64") and "2.00x" in ln and ln.endswith("met)") for ln in lines)
    assert any(ln.startswith("litellm-proxy vs llama-server at 64") and "1.13x" in ln and "missed" in ln for ln in lines)
    assert any(ln.startswith("engine vs llama-server at 1 ") and "0.40x" in ln and "missed" in ln for ln in lines)


def test_compare_report_judges_the_memory_targets():
    results = {"engine": {1: 40.0, 64: 300.0}, "litellm-proxy": {64: 170.0}, "llama-server": {1: 100.0, 64: 150.0}}
    rss = {"engine": {1: 300.0, 64: 900.0}, "litellm-proxy": {64: 1400.0}, "llama-server": {1: 240.0, 64: 700.0}}
    lines = cpu_compare.report(results, None, None, rss, {"mlx_mb": 141.0, "checkpoint_mb": 94.0}).splitlines()
    assert "peak RSS at 1 concurrent: engine 300 MB vs llama-server 240 MB = 1.25x (target <= 1.5x: met)" in lines
    assert "peak RSS at 64 concurrent: litellm-proxy 1400 MB vs llama-server 700 MB = 2.00x (target <= 1.5x: missed)" in lines
    assert "MLX memory after loading: 141 MB for a 94 MB checkpoint = 1.50x (target <= 1.5x: met)" in lines
    assert not any("RSS" in ln for ln in cpu_compare.report(results, None).splitlines())  # not measured: no verdict


def test_load_memory_child_reports_the_loaded_model(tiny_model_dir):
    load = cpu_compare.load_memory(str(tiny_model_dir))
    assert load is not None and load["mlx_mb"] > 0 and load["checkpoint_mb"] == 0


def test_compare_report_says_what_was_not_measured():
    text = cpu_compare.report({"engine": {64: 300.0}, "llama-cpp": {1: 90.0}}, None)
    assert "engine vs llama-cpp at 64: not measured" in text
    assert "decode step" not in text


def test_profile_report_has_every_row_with_its_speed_up():
    rows = [{"batch": 64, "context": 128, "op": op, "before_ms": 10.0, "after_ms": 5.0} for op in (*cpu_profile.FAMILIES, "full step")]
    rows.append({"batch": 64, "context": 128, "op": "other (dispatch, glue)", "before_ms": -1.0, "after_ms": 2.0})
    text = cpu_profile.report(rows, {64: {"decode_ms": 300.0, "bookkeeping_ms": 0.9}}, {"false": 150.0, "true": 180.0})
    assert "prefill of a 512-token prompt, batch 1: 150 tok/s before, 180 tok/s after (1.20x)" in text
    for op in cpu_profile.FAMILIES:
        assert f"| {op} | 10.00 | 5.00 | 2.00x |" in text
    assert "| other (dispatch, glue) | -1.00 | 2.00 |  |" in text
    assert "| worker bookkeeping (engine run, after) | | 0.90 | |" in text


def test_compare_runs_each_level_in_its_own_process(tmp_path, monkeypatch):
    import json
    import subprocess

    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        level = int(cmd[cmd.index("--concurrency") + 1])
        folder = cmd[cmd.index("--output-dir") + 1]
        system = cmd[cmd.index("--systems") + 1]
        metrics = {"total_output_tokens": 64 * level, "output_throughput": 10.0 * level}
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "results.json").write_text(json.dumps({"rows": [{"system": system, "concurrency": level, "metrics": metrics}]}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cpu_compare.subprocess, "run", fake_run)
    got = cpu_compare.run_system("llama-cpp", [1, 32], 64, tmp_path / "out", llama_cpp_threads=2)
    assert got == ({1: 10.0, 32: 320.0}, {1: None, 32: None}, {1: None, 32: None})
    assert [c[c.index("--num-prompts") + 1] for c in calls] == [str(cpu_compare.ONE_STREAM_PROMPTS), "32"]
    assert all(c[c.index("--llama-cpp-threads") + 1] == "2" for c in calls)
    calls.clear()
    cpu_compare.run_system("llama-server", [8], 64, tmp_path / "out3", llama_cpp_threads=2)
    assert calls[0][calls[0].index("--systems") + 1] == "llama-server" and calls[0][calls[0].index("--llama-cpp-threads") + 1] == "2"
    env_calls = []
    monkeypatch.setattr(cpu_compare.subprocess, "run", lambda cmd, **kw: env_calls.append(kw["env"]) or fake_run(cmd))
    cpu_compare.run_system("engine-before", [4], 64, tmp_path / "out2")
    assert env_calls[0]["MLX_PARALLM_CPU_OPS"] == "0" and env_calls[0]["MLX_PARALLM_SMALL_BATCH_ROWS"] == "0"


def test_step_ratio_child_measures_both_contexts(tiny_model_dir):
    # The child process imports cpu_profile's helpers by name: a rename there broke it once.
    steps = cpu_compare.step_ratio(repeats=1, model=str(tiny_model_dir), batch=2)
    assert steps is not None and set(steps) == {"128", "512"}
    assert all(ms > 0 for ms in steps.values())
