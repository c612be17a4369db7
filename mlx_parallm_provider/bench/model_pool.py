"""Three models behind one LiteLLM proxy in a model pool whose budget holds two; then sleep and wake.

    python -m mlx_parallm_provider.bench.model_pool [--requests 300] [--concurrency 12] [--max-tokens 8]

The three models are the embedded default model (SmolLM2-135M) under three names: links to
its converted folder in a temporary folder, so the registry loads each on its own (the same
weights, three separate copies in memory).

1. In a child process: one model answers a greedy request, sleeps, wakes and answers again.
   Printed: its cost (weights + KV), the memory its sleep freed (the process's resident
   memory and the pool's count, as % of its cost; target >= 90%), and whether the answer
   after waking equals the one before (target: yes). Its cost sizes step 2's budget.
2. A real LiteLLM proxy (``litellm --config``, models ``chat``, ``coder``, ``embedder``) with
   a pool budget of ``--budget-models`` (2.4) models' cost, warmed up by 100 requests its mock
   answers (no model loaded) before its baseline is taken; ``--requests`` chat completions,
   each to a random model, ``--concurrency`` at a time. Printed: failed requests (target 0),
   the proxy's resident memory above its level before any model loaded (sampled every 20 ms)
   and the pool's counted peak, against the budget (target <= budget + 10%), MLX's own peak
   (its allocator's, load transients included), loads, sleeps and wakes per model.

Both children run with glibc's ``MALLOC_MMAP_THRESHOLD_`` (``--malloc-mmap-threshold``, 128 KiB;
0 leaves glibc's default): glibc otherwise raises its threshold after large frees and serves
later large buffers from its heap, whose freed pages a sleep cannot hand back to the system.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Sequence

from ..config import ENGINE_CONFIG_ENV, POOL_SETTINGS, child_environment
from ..cpu_info import cpu_model_name

NAMES = ("chat", "coder", "embedder")
KV_GB = 0.05
MEMORY_TARGET = 1.10
SLEEP_TARGET = 0.90
PROMPT = "Name three colours of the rainbow."
TOPICS = ("the sea", "a cat", "rain", "bread", "a violin", "the moon", "a river", "snow", "a garden", "trains")


def rss_bytes(pid: "int | str" = "self") -> int:
    """A process's resident memory now (Linux ``/proc/<pid>/statm``)."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def model_folders(root: Path) -> dict[str, str]:
    """Three names (links to the default model's converted folder) under ``root``."""
    from ..models.registry import resolve

    folder = resolve("default")
    names = {}
    for name in NAMES:
        (root / name).symlink_to(folder, target_is_directory=True)
        names[name] = str(root / name)
    return names


def _sleep_and_wake(model: str) -> dict[str, Any]:
    """Step 1, in this (child) process."""
    from .. import EngineConfig, SamplingParams, get_engine, pool_stats

    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    engine = get_engine(model, EngineConfig(kv_cache_memory_gb=KV_GB))
    before = engine.generate_sync(PROMPT, greedy).text
    cost = pool_stats()["models"][model]["bytes"]
    cycles = []
    for _ in range(2):
        awake = rss_bytes()
        engine.sleep()
        asleep = rss_bytes()
        counted = pool_stats()["models"][model]["bytes"]
        engine.wake()
        after = engine.generate_sync(PROMPT, greedy).text
        cycles.append({"rss_freed": awake - asleep, "counted_freed": cost - counted, "same_answer": after == before})
    return {"cost": cost, "memory": engine.memory_bytes(), "answer": before, "cycles": cycles}


def _serve(stats_path: str, litellm_args: list[str]) -> None:
    """The proxy process: LiteLLM's proxy, and a thread writing the pool's stats to ``stats_path``."""
    import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx; registers the provider)

    def publish() -> None:
        import mlx.core as mx

        from ..engine import pool_stats

        while True:
            Path(stats_path + ".tmp").write_text(json.dumps({**pool_stats(), "mlx_peak_bytes": mx.get_peak_memory()}))
            os.replace(stats_path + ".tmp", stats_path)
            time.sleep(0.05)

    threading.Thread(target=publish, name="pool-stats", daemon=True).start()
    from litellm_cli.main import proxy_server

    sys.argv = ["litellm", *litellm_args]
    proxy_server()


class Sampler:
    """A process's resident memory sampled every 20 ms by a thread: its peak."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except OSError:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _child_env(malloc_threshold: int, **overrides: str) -> dict[str, str]:
    return child_environment(**overrides, **({"MALLOC_MMAP_THRESHOLD_": str(malloc_threshold)} if malloc_threshold else {}))


def _proxy_run(names: dict[str, str], budget_bytes: int, requests: int, concurrency: int, max_tokens: int, folder: Path,
               malloc_threshold: int) -> dict[str, Any]:
    """Step 2: start the proxy, measure its baseline, send the requests, read the pool's stats."""
    import httpx

    from .servers import free_port, start

    key = "sk-" + secrets.token_hex(16)
    config = {
        "model_list": [*({"model_name": name, "litellm_params": {"model": f"mlx-parallm/{path}"}} for name, path in names.items()),
                       {"model_name": "warm-up", "litellm_params": {"model": "openai/warm-up", "api_key": "none", "mock_response": "warm-up"}}],
        "litellm_settings": {"custom_provider_map": [{"provider": "mlx-parallm", "custom_handler": "mlx_parallm_provider.litellm_handler"}]},
        "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY"},
    }
    (folder / "config.yaml").write_text(json.dumps(config, indent=2))  # JSON is YAML
    stats_path = folder / "pool_stats.json"
    port = free_port()
    env = _child_env(malloc_threshold, LITELLM_MASTER_KEY=key, LITELLM_LOCAL_MODEL_COST_MAP="True", **{
        POOL_SETTINGS["memory_gb"].env or "": repr(budget_bytes / 1024**3), ENGINE_CONFIG_ENV: json.dumps({"kv_cache_memory_gb": KV_GB})})
    command = [sys.executable, "-m", "mlx_parallm_provider.bench.model_pool", "--serve", str(stats_path),
               "--config", str(folder / "config.yaml"), "--host", "127.0.0.1", "--port", str(port)]
    server = start(command, env, port, "/health/liveliness", folder / "proxy.log", api_key=key)
    try:
        rng = random.Random(0)
        jobs = [(rng.choice(NAMES), f"Write one sentence about {rng.choice(TOPICS)} (#{i}).") for i in range(requests)]
        failures: list[str] = []
        with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=300, trust_env=False) as client:
            def ask(job: tuple[str, str], **extra: Any) -> None:
                model, text = job
                try:
                    r = client.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": text}],
                                                                  "max_tokens": max_tokens, "temperature": 0.7, **extra})
                    if r.status_code != 200 or not r.json()["choices"][0]["message"]["content"]:
                        failures.append(f"{model}: HTTP {r.status_code} {r.text[:200]}")
                except Exception as exc:  # a failed request is counted, not fatal
                    failures.append(f"{model}: {type(exc).__name__}: {exc}")

            # The proxy's own warm-up (LiteLLM's request path, answered by its mock, no model loaded)
            # before the baseline, so the growth measured is the models'.
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(lambda job: ask(("warm-up", job[1])), jobs[:100]))
            if failures:
                raise RuntimeError(f"the proxy's warm-up failed: {failures[:3]}")
            time.sleep(1.0)
            baseline = statistics.median(rss_bytes(server.process.pid) for _ in range(5))
            sampler = Sampler(server.process.pid)
            started = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(ask, jobs))
            elapsed = time.perf_counter() - started
        peak = sampler.stop()
        time.sleep(0.2)
        stats = json.loads(stats_path.read_text())
    finally:
        server.stop()
    return {"failures": failures, "baseline": baseline, "peak_rss": peak, "stats": stats, "elapsed_s": elapsed}


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1024**2:.0f} MiB"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve"]:
        _serve(argv[1], argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--budget-models", type=float, default=2.4, help="the pool's budget, in models' cost (holds two of three)")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=128 * 1024, help="glibc's MALLOC_MMAP_THRESHOLD_ for the children (0: glibc's default)")
    ap.add_argument("--child", metavar="MODEL", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_sleep_and_wake(args.child)))
        return 0
    print(f"CPU: {cpu_model_name()}; {os.cpu_count()} CPUs; models: the default model (SmolLM2-135M) under three names "
          f"{', '.join(NAMES)} (links to one converted folder, loaded separately); kv_cache_memory_gb={KV_GB}; "
          f"MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold or 'unset'}")
    with tempfile.TemporaryDirectory(prefix="mlx-parallm-pool-bench-") as tmp:
        folder = Path(tmp)
        names = model_folders(folder)
        out = subprocess.run([sys.executable, "-m", "mlx_parallm_provider.bench.model_pool", "--child", names["chat"]],
                             check=True, capture_output=True, text=True, env=_child_env(args.malloc_mmap_threshold)).stdout
        s = json.loads(out.strip().splitlines()[-1])
        cost = s["cost"]
        print(f"\n1. sleep / wake (one model, in-process): cost {_mb(cost)} (weights {_mb(s['memory']['weights'])} + KV {_mb(s['memory']['kv'])})")
        print("   | cycle | RSS freed | % of cost | counted freed | % of cost | answer after wake = before |")
        print("   |---|---|---|---|---|---|")
        for i, c in enumerate(s["cycles"], 1):
            print(f"   | {i} | {_mb(c['rss_freed'])} | {100 * c['rss_freed'] / cost:.0f}% | {_mb(c['counted_freed'])} | "
                  f"{100 * c['counted_freed'] / cost:.0f}% | {'yes' if c['same_answer'] else 'NO'} |")
        freed = min(c["rss_freed"] for c in s["cycles"]) / cost
        print(f"   target: sleep frees >= {SLEEP_TARGET:.0%} (RSS, worst cycle {freed:.0%}: {'met' if freed >= SLEEP_TARGET else 'missed'}); "
              f"wake answers as before: {'met' if all(c['same_answer'] for c in s['cycles']) else 'missed'}")

        budget = int(args.budget_models * cost)
        r = _proxy_run(names, budget, args.requests, args.concurrency, args.max_tokens, folder, args.malloc_mmap_threshold)
    stats, above = r["stats"], r["peak_rss"] - r["baseline"]
    print(f"\n2. LiteLLM proxy, 3 models, budget {_mb(budget)} ({args.budget_models} models' cost): {args.requests} requests, "
          f"{args.concurrency} at a time, max_tokens {args.max_tokens}, {r['elapsed_s']:.1f} s")
    print(f"   failed requests: {len(r['failures'])} (target 0)")
    for failure in r["failures"][:3]:
        print(f"     {failure}")
    print(f"   peak RSS above the proxy's baseline ({_mb(r['baseline'])}): {_mb(above)} = {above / budget:.2f}x budget; "
          f"pool's counted peak {_mb(stats['peak_bytes'])} = {stats['peak_bytes'] / budget:.2f}x budget "
          f"(target <= {MEMORY_TARGET:.2f}x: {'met' if max(above, stats['peak_bytes']) <= MEMORY_TARGET * budget else 'missed'}); "
          f"MLX's peak {_mb(stats['mlx_peak_bytes'])} = {stats['mlx_peak_bytes'] / budget:.2f}x budget")
    print("   | model | loads | sleeps (unloads) | wakes (reloads) | idle sleeps | loads that waited | state at end |")
    print("   |---|---|---|---|---|---|---|")
    by_path = {path: name for name, path in names.items()}
    for path, m in stats["models"].items():
        print(f"   | {by_path.get(path, path)} | {m['loads']} | {m['sleeps']} | {m['wakes']} | {m['idle_sleeps']} | {m['waits']} | {m['state']} |")
    print(f"   | all | {stats['loads']} | {stats['sleeps']} | {stats['wakes']} | {stats['idle_sleeps']} | {stats['waits']} | |")
    return 0 if not r["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
