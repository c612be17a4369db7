"""Every live engine's metrics for Prometheus, under vLLM's metric names.

:class:`EngineCollector` is a ``prometheus_client`` collector: at each scrape it reads the
engines of this process (one series per engine, label ``model_name``), so engines created
after it was registered are exported too and nothing is recorded twice. Names are vLLM's
with this package's prefix (``mlx_parallm:`` unless told otherwise; ``"vllm:"`` makes
dashboards and routers written for vLLM read it unchanged):

- gauges ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``
  (0..1: used / total KV blocks), ``kv_cache_blocks_total`` / ``kv_cache_blocks_free`` and
  ``prefix_cache_usage_perc`` (0..1 of the prefix store's memory);
- counter ``num_preemptions`` (requests whose KV blocks were taken back, to be recomputed);
- counters ``prompt_tokens``, ``generation_tokens``, ``prefix_cache_queries`` (prompt
  tokens looked up) and ``prefix_cache_hits`` (prompt tokens found cached),
  ``request_success`` (requests finished), ``prefix_cache_hit_requests``;
- counters ``spec_decode_num_drafts`` (steps that verified n-gram drafts),
  ``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` (vLLM's speculative
  decoding names) and ``grammar_fast_forward_steps``, ``grammar_fast_forward_forced_tokens``,
  ``grammar_fast_forward_accepted_tokens`` (tokens a grammar forced, verified / kept); 0 where off;
- per tier of the prefix store (label ``tier``: ``memory``, ``disk``): counters
  ``prefix_cache_tier_hit_tokens`` (prompt tokens found there) and
  ``prefix_cache_tier_evictions`` (blocks evicted), gauge ``prefix_cache_tier_bytes``; and
  the disk tier's counter ``kv_disk_skipped_files`` (damaged or foreign files);
- the model pool's (:mod:`.pool`): gauges ``model_memory_bytes`` (label ``kind``: ``weights``,
  ``kv``) and ``model_awake`` (1 awake, 0 asleep), counters ``model_loads``, ``model_wakes`` and
  ``model_sleeps`` (evictions, idle sleeps and ``Engine.sleep`` calls);
- histograms ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``request_time_per_output_token_seconds``, ``request_queue_time_seconds``.

``prometheus_client`` is needed only to register it (:func:`register_collector`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

from .metrics import LATENCY_BUCKETS

HISTOGRAMS = {
    "ttft_s": ("time_to_first_token_seconds", "Time to first token."),
    "itl_s": ("inter_token_latency_seconds", "Time between two tokens of a request."),
    "tpot_s": ("request_time_per_output_token_seconds", "Mean time per output token of each request."),
    "queue_s": ("request_queue_time_seconds", "Time a request waited before it was admitted."),
}
COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens of admitted requests."),
    "generated_tokens": ("generation_tokens", "Generated tokens."),
    "prompt_tokens_queried": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "cached_prompt_tokens": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "finished": ("request_success", "Requests that ended."),
    "prefix_cache_hits": ("prefix_cache_hit_requests", "Requests that reused a cached prefix."),
}

DRAFT_COUNTERS = {  # (stats() section, its key) -> metric name, help
    ("speculation", "speculative_steps"): ("spec_decode_num_drafts", "Decode steps that verified n-gram drafts."),
    ("speculation", "draft_tokens"): ("spec_decode_num_draft_tokens", "n-gram draft tokens verified."),
    ("speculation", "accepted_tokens"): ("spec_decode_num_accepted_tokens", "n-gram draft tokens accepted."),
    ("fast_forward", "fast_forward_steps"): ("grammar_fast_forward_steps", "Decode steps that verified grammar-forced tokens."),
    ("fast_forward", "forced_tokens"): ("grammar_fast_forward_forced_tokens", "Grammar-forced tokens verified."),
    ("fast_forward", "accepted_tokens"): ("grammar_fast_forward_accepted_tokens", "Grammar-forced tokens kept."),
}


def draft_counts(engine: Any) -> dict[tuple[str, str], float]:
    """The :data:`DRAFT_COUNTERS` of an engine (0 for what is off or not started)."""
    core = engine._core
    stats = core.drafting_stats() if core is not None else {}
    return {key: float((stats.get(key[0]) or {}).get(key[1], 0)) for key in DRAFT_COUNTERS}


def engine_gauges(engine: Any) -> dict[str, float]:
    """``running``, ``waiting``, ``kv_usage`` (used / total KV blocks), ``prefix_usage`` and the
    KV blocks total / free of an engine, read without blocking its core (a racy but
    consistent-enough snapshot)."""
    core = engine._core
    if core is None or not core.alive:
        return {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "prefix_usage": 0.0, "kv_blocks_total": 0.0, "kv_blocks_free": 0.0}
    running, waiting = core.num_running, core.num_waiting
    kv_usage = core.scheduler.kv_usage()
    store = core.prefix_store_stats()
    prefix_usage = store["nbytes"] / store["max_bytes"] if store and store["max_bytes"] else 0.0
    kv = core.kv_stats()
    return {
        "running": float(running), "waiting": float(waiting), "kv_usage": min(kv_usage, 1.0), "prefix_usage": min(prefix_usage, 1.0),
        "kv_blocks_total": float(kv.get("kv_blocks_total", 0)), "kv_blocks_free": float(kv.get("kv_blocks_free", 0)),
    }


class EngineCollector:
    """A ``prometheus_client`` collector over the engines ``engines()`` returns.

    Args:
        engines: the engines to export at each scrape (default: the process-wide engines
            of :func:`~mlx_parallm_provider.get_engine`, the ones every front door shares).
        prefix: prepended to every metric name.
    """

    def __init__(self, engines: Optional[Callable[[], Iterable[Any]]] = None, prefix: str = "mlx_parallm:") -> None:
        self._engines = engines or _live_engines
        self.prefix = prefix

    def describe(self) -> list:
        return []  # names are only known at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        p, labels = self.prefix, ["model_name"]
        gauges = {
            "running": GaugeMetricFamily(p + "num_requests_running", "Requests in the decode batch.", labels=labels),
            "waiting": GaugeMetricFamily(p + "num_requests_waiting", "Requests waiting to be admitted.", labels=labels),
            "kv_usage": GaugeMetricFamily(p + "kv_cache_usage_perc", "KV cache usage (1 = full).", labels=labels),
            "prefix_usage": GaugeMetricFamily(p + "prefix_cache_usage_perc", "Prefix store usage (1 = full).", labels=labels),
            "kv_blocks_total": GaugeMetricFamily(p + "kv_cache_blocks_total", "KV blocks in the pool (paged KV).", labels=labels),
            "kv_blocks_free": GaugeMetricFamily(p + "kv_cache_blocks_free", "Free KV blocks (paged KV).", labels=labels),
        }
        counters = {k: CounterMetricFamily(p + name, doc, labels=labels) for k, (name, doc) in COUNTERS.items()}
        histograms = {k: HistogramMetricFamily(p + name, doc, labels=labels) for k, (name, doc) in HISTOGRAMS.items()}
        preemptions = CounterMetricFamily(p + "num_preemptions", "Requests preempted for want of KV blocks.", labels=labels)
        drafts = {k: CounterMetricFamily(p + name, doc, labels=labels) for k, (name, doc) in DRAFT_COUNTERS.items()}
        tiered = ["model_name", "tier"]
        tiers = {
            "hit_tokens": CounterMetricFamily(p + "prefix_cache_tier_hit_tokens", "Prompt tokens found in this tier.", labels=tiered),
            "evictions": CounterMetricFamily(p + "prefix_cache_tier_evictions", "Blocks evicted from this tier.", labels=tiered),
            "bytes": GaugeMetricFamily(p + "prefix_cache_tier_bytes", "Bytes this tier holds.", labels=tiered),
        }
        skipped = CounterMetricFamily(p + "kv_disk_skipped_files", "Disk tier files skipped: damaged or foreign.", labels=labels)
        adapted = ["model_name", "lora_name"]
        loras = {"finished_requests": CounterMetricFamily(p + "lora_requests", "Requests finished through this LoRA adapter.", labels=adapted),
                 "generation_tokens": CounterMetricFamily(p + "lora_generation_tokens", "Tokens generated through this LoRA adapter.",
                                                          labels=adapted)}
        resident = GaugeMetricFamily(p + "lora_resident_adapters", "LoRA adapters resident on the model.", labels=labels)
        memory = GaugeMetricFamily(p + "model_memory_bytes", "Bytes the model holds (weights, KV arrays).", labels=["model_name", "kind"])
        awake = GaugeMetricFamily(p + "model_awake", "1 while the model is loaded, 0 asleep.", labels=labels)
        pooled = {k: CounterMetricFamily(p + f"model_{k}", doc, labels=labels) for k, doc in POOL_COUNTERS.items()}
        pool_models = _pool_models()
        for engine in list(self._engines()):
            name = [str(engine.model_name)]
            for kind, value in engine.memory_bytes().items():
                memory.add_metric([*name, kind], float(value))
            awake.add_metric(name, 1.0 if engine.state == "awake" else 0.0)
            for key, family in pooled.items():
                family.add_metric(name, float(pool_models.get(engine.model_name, {}).get(key, 0)))
            lora = engine.list_loras()
            resident.add_metric(name, float(len(lora["resident"])))
            for key, family in loras.items():
                for adapter, count in lora[key].items():
                    family.add_metric([*name, adapter], float(count))
            for key, value in engine_gauges(engine).items():
                gauges[key].add_metric(name, value)
            core = engine._core
            preemptions.add_metric(name, float(core.kv_stats().get("num_preemptions", 0)) if core is not None else 0.0)
            for key, value in draft_counts(engine).items():
                drafts[key].add_metric(name, value)
            snap = engine.metrics.snapshot()
            if core is not None:
                for tier, counts in core.tier_stats(snap["cached_prompt_tokens"]).items():
                    for key, family in tiers.items():
                        family.add_metric([*name, tier], float(counts[key]))
                disk = core.disk_stats()
                skipped.add_metric(name, float(disk["corrupt"]) if disk else 0.0)
            snap["prompt_tokens_queried"] = snap["prompt_tokens"]
            for key, family in counters.items():
                family.add_metric(name, float(snap[key]))
            for key, hist in engine.metrics.histograms().items():
                if key in histograms:
                    buckets = [(repr(float(b)), float(c)) for b, c in zip(LATENCY_BUCKETS, hist.buckets)]
                    histograms[key].add_metric(name, [*buckets, ("+Inf", float(hist.count))], hist.sum)
        yield from gauges.values()
        yield preemptions
        yield from counters.values()
        yield from drafts.values()
        yield from tiers.values()
        yield skipped
        yield memory
        yield awake
        yield from pooled.values()
        yield from loras.values()
        yield resident
        yield from histograms.values()


POOL_COUNTERS = {
    "loads": "Times the model was loaded by the model pool (first loads).",
    "wakes": "Times the model was woken (loaded again after a sleep).",
    "sleeps": "Times the model was put to sleep (evicted, idle, or asked).",
}


def _live_engines() -> list[Any]:
    from .pool import _pool

    return _pool.list_engines()


def _pool_models() -> dict[str, dict[str, Any]]:
    from .pool import _pool

    return _pool.stats()["models"]


def register_collector(registry: Any = None, prefix: str = "mlx_parallm:") -> Optional[EngineCollector]:
    """Register an :class:`EngineCollector` of the shared engines with ``registry``
    (default: ``prometheus_client``'s global one) once per registry and prefix; returns it,
    or None when ``prometheus_client`` is not installed."""
    try:
        import prometheus_client
    except ImportError:
        return None
    target = registry if registry is not None else prometheus_client.REGISTRY
    for existing in _registered:
        if existing[0] is target and existing[1].prefix == prefix:
            return existing[1]
    collector = EngineCollector(prefix=prefix)
    target.register(collector)
    _registered.append((target, collector))
    return collector


_registered: list[tuple[Any, EngineCollector]] = []
