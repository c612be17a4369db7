"""The engines' Prometheus metrics (vLLM's names) on the tiny model: gauges, counters and
histograms as a scrape sees them."""

from __future__ import annotations

import asyncio

import prometheus_client  # the `proxy` extra (in `dev`)
import pytest

from engine_helpers import sampled_while, scrape
from mlx_parallm_provider import SamplingParams


def test_a_scrape_during_and_after_a_run(make_engine) -> None:
    engine = make_engine(max_num_seqs=4, batch_window_ms=0)
    label = "{'model_name': 'tiny'}"
    prompt = "The shared instructions of every request. " * 12

    async def run() -> None:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        await asyncio.gather(*(engine.generate(prompt + f"question {i}", params) for i in range(12)))

    seen = sampled_while(lambda: scrape(engine), run)
    after = scrape(engine)

    running = [s[f"vllm:num_requests_running{label}"] for s in seen]
    waiting = [s[f"vllm:num_requests_waiting{label}"] for s in seen]
    assert max(running) == 4 and max(waiting) >= 1  # 12 requests, 4 rows: the rest wait
    assert after[f"vllm:num_requests_running{label}"] == 0 and after[f"vllm:num_requests_waiting{label}"] == 0
    stats = engine.stats()
    # Paged KV: usage is used / total blocks, as the engine's own stats count them.
    total = stats["kv_cache"]["kv_blocks_total"]
    assert {s[f"vllm:kv_cache_blocks_total{label}"] for s in seen} <= {0, total}  # 0: no worker yet
    busiest = max(seen, key=lambda s: s[f"vllm:kv_cache_usage_perc{label}"])
    used = total - busiest[f"vllm:kv_cache_blocks_free{label}"]
    assert 0 < busiest[f"vllm:kv_cache_usage_perc{label}"] == pytest.approx(used / total, abs=1 / total)
    assert after[f"vllm:kv_cache_usage_perc{label}"] == 0 and after[f"vllm:kv_cache_blocks_free{label}"] == total
    assert after[f"vllm:num_preemptions_total{label}"] == stats["kv_cache"]["num_preemptions"] == 0
    assert after[f"vllm:time_to_first_token_seconds_count{label}"] == 12
    assert after[f"vllm:generation_tokens_total{label}"] == stats["generated_tokens"]
    assert after[f"vllm:inter_token_latency_seconds_count{label}"] == stats["generated_tokens"] - 12
    assert after["vllm:time_to_first_token_seconds_bucket{'le': '+Inf', 'model_name': 'tiny'}"] == 12
    assert after[f"vllm:prefix_cache_queries_total{label}"] == stats["prompt_tokens"]
    assert 0 < after[f"vllm:prefix_cache_hits_total{label}"] == stats["cached_prompt_tokens"]
    assert after[f"vllm:request_success_total{label}"] == 12


def test_the_proxy_callback_registers_one_collector_and_mounts_only_inside_a_proxy(monkeypatch) -> None:
    import sys

    from mlx_parallm_provider.engine.prometheus import register_collector
    from mlx_parallm_provider.integrations import prometheus as exporter

    monkeypatch.delitem(sys.modules, "litellm.proxy.proxy_server", raising=False)  # no proxy here
    callback = exporter.engine_metrics
    assert callback is exporter.engine_metrics and callback.mounted is False
    assert register_collector() is callback.collector  # once per registry and prefix
    assert callback.collector in prometheus_client.REGISTRY._collector_to_names
