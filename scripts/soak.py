"""Soak and fault suite: hostile traffic against the engine and the LiteLLM proxy.

    .venv/bin/python scripts/soak.py                      # default model, 1,000 + 512 requests
    .venv/bin/python scripts/soak.py --model PATH --requests 200 --http-requests 128

Phase 1 drives one in-process engine with mixed requests, ``--concurrency`` in flight:
plain greedy ones (checked token for token against the same prompt run alone), sampled,
streamed, streams broken off, cancelled, tiny timeouts, invalid parameters, a fault
injected at each per-request site (set-up, sampling, detokenising) and one fault of the
model step itself (the worker dies and restarts; requests in flight then get
``EngineDeadError`` by design). Phase 2 starts the real LiteLLM proxy on loopback and sends
``--http-requests`` over up to 256 concurrent connections: plain, malformed bodies, invalid
fields, issue 21's hostile bodies (:mod:`soak_hostile`: schemas that overflowed or stalled
the grammar compiler, a 10 MB message, a lone surrogate, role markers in user text, nested
pydantic tools), clients that hang up while waiting and streams dropped mid-way. (A message
without ``role`` is not among the bad bodies: LiteLLM itself turns it into an assistant
message.) It prints the longest time the proxy's loop was held (a probe of
``/health/liveliness``) and the innocent streams' gaps between chunks.

It prints what was sent, what came back (ok, typed errors by class), hangs, untyped errors,
crashes, harmed neighbours and memory before / after, and exits 1 if any of hangs, untyped
errors, crashes or harmed neighbours is not zero or memory did not return to within 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import random
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)

# isort: split
import mlx.core as mx
from soak_hostile import LoopProbe, hostile_cases, judge  # scripts/ is on the path: run as a script

from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import Engine, SamplingParams
from mlx_parallm_provider.engine import core as core_module
from mlx_parallm_provider.engine import sampling as sampling_module
from mlx_parallm_provider.errors import EngineDeadError, MLXParallmError, RequestFailedError

REPO = Path(__file__).resolve().parents[1]
HANG_S = 180.0
CHECK_PROMPTS = [f"Question {i}: name a colour, a number and an animal." for i in range(8)]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
FAULT_MARKERS = {"set_up": "\u00a7fault-set-up", "sample": "\u00a7fault-sample", "detokenize": "\u00a7fault-detok"}
INVALID_KWARGS = [
    {"logit_bias": {10**7: 5}}, {"logit_bias": {"99999999": 5}}, {"seed": 2**64}, {"top_k": 10**6, "temperature": 1.0},
    {"stop": 5}, {"stop_token_ids": 5}, {"stop_token_ids": [10**7]}, {"timeout": -1}, {"max_tokens": 0},
    {"temperature": float("nan")}, {"top_p": 0}, {"top_logprobs": 99},
]


# -- fault injection ---------------------------------------------------------------------


def install_faults() -> dict[str, Any]:
    """Make requests carrying a marker stop string fail at one per-request site, and let
    the caller fail the model step once. Returns the switch for the model-step fault."""
    real_init, real_filters = sampling_module.RowSampler.__init__, sampling_module.RowSampler.filters

    def init(self, params, grammar=None, **kwargs):
        if FAULT_MARKERS["set_up"] in params.stop:
            raise KeyError("injected set-up fault")
        real_init(self, params, grammar, **kwargs)

    def filters_(self):  # asked of every sampling row as its batch draws
        if FAULT_MARKERS["sample"] in self.params.stop:
            raise KeyError("injected sampling fault")
        return real_filters.fget(self)

    class FaultyText(core_module.TextStream):
        def add_token(self, token_id):
            if FAULT_MARKERS["detokenize"] in self.matcher.stops:
                raise KeyError("injected detokenizer fault")
            return super().add_token(token_id)

    sampling_module.RowSampler.__init__ = init
    sampling_module.RowSampler.filters = property(filters_)
    core_module.RowSampler = sampling_module.RowSampler
    core_module.TextStream = FaultyText
    return {"model_step": False}


class FaultyModel:
    """The model, failing its next forward once ``switch['model_step']`` is set."""

    def __init__(self, inner: Any, switch: dict[str, Any]) -> None:
        self.inner, self.switch, self.layers = inner, switch, inner.layers

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        if self.switch["model_step"]:
            self.switch["model_step"] = False
            raise RuntimeError("injected model-step fault")
        return self.inner(inputs, cache=cache)


# -- phase 1: the engine -----------------------------------------------------------------


class Tally:
    """Outcomes by kind, and the things that must stay zero."""

    def __init__(self) -> None:
        self.sent = 0
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.hangs = 0
        self.untyped: list[str] = []
        self.harmed: list[str] = []

    def line(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))


async def one_request(engine: Engine, kind: str, rng: random.Random, expected: dict[str, list[int]], tally: Tally) -> None:
    tally.sent += 1
    prompt = rng.choice(CHECK_PROMPTS)
    params: Optional[SamplingParams] = GREEDY
    try:
        if kind == "invalid":
            params = SamplingParams(**{"max_tokens": 8, **rng.choice(INVALID_KWARGS)})
        elif kind == "sampled":
            params = SamplingParams(max_tokens=rng.randint(1, 32), temperature=rng.uniform(0.1, 1.5), top_p=rng.uniform(0.5, 1.0),
                                    top_k=rng.choice([0, 5, 50]), seed=rng.choice([None, rng.randrange(2**64)]),
                                    logprobs=rng.random() < 0.2, repetition_penalty=rng.choice([1.0, 1.2]))
        elif kind == "timeout":
            params = SamplingParams(max_tokens=64, timeout=rng.uniform(0.001, 0.05))
        elif kind.startswith("fault:"):  # temperature > 0: the sampling fault sits in the filters
            params = SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True, stop=[FAULT_MARKERS[kind.split(":")[1]]])
        elif kind in ("cancel", "stream_break"):
            params = SamplingParams(max_tokens=64, ignore_eos=True)

        async def call() -> Any:
            if kind == "stream":
                return [d async for d in engine.stream(prompt, params)]
            if kind == "stream_break":
                async for _ in engine.stream(prompt, params):
                    break
                return "broken off"
            return await engine.generate(prompt, params)

        if kind == "cancel":
            task = asyncio.ensure_future(call())
            await asyncio.sleep(rng.uniform(0.0, 0.5))
            task.cancel()
            try:
                await asyncio.wait_for(task, HANG_S)
                tally.outcomes["ok (finished before its cancel)"] += 1
            except asyncio.CancelledError:
                tally.outcomes["cancelled"] += 1
            return
        result = await asyncio.wait_for(call(), HANG_S)
        tally.outcomes["ok"] += 1
        if kind == "greedy" and result.token_ids != expected[prompt]:
            tally.harmed.append(f"greedy output under load differs from solo for {prompt!r}")
        if kind in ("invalid", "timeout") or kind.startswith("fault:"):
            if kind != "timeout":
                tally.harmed.append(f"{kind} request was answered instead of refused")
    except MLXParallmError as error:  # first: RequestTimeoutError is also a TimeoutError
        tally.outcomes[type(error).__name__] += 1
        died_by_design = isinstance(error, EngineDeadError) and "injected model-step fault" in str(error)
        if kind in ("greedy", "sampled", "stream") and not died_by_design:
            tally.harmed.append(f"{kind} request failed: {error}")
        if kind.startswith("fault:") and not (isinstance(error, RequestFailedError) or died_by_design):
            tally.harmed.append(f"{kind} got {type(error).__name__}, not RequestFailedError")
    except asyncio.TimeoutError:
        tally.hangs += 1
    except Exception as error:  # noqa: BLE001  (anything untyped is what we count)
        tally.untyped.append(f"{kind}: {type(error).__name__}: {error}")


async def soak_engine(engine: Engine, switch: dict[str, Any], n: int, concurrency: int, rng: random.Random, expected: dict[str, list[int]]) -> Tally:
    kinds = (["greedy"] * 30 + ["sampled"] * 25 + ["stream"] * 10 + ["stream_break"] * 5 + ["cancel"] * 10
             + ["timeout"] * 5 + ["invalid"] * 5 + ["fault:set_up", "fault:sample", "fault:detokenize"] * 3)
    tally, gate = Tally(), asyncio.Semaphore(concurrency)

    async def limited(i: int) -> None:
        async with gate:
            if i == n // 2:  # once, mid-run: the model step fails, the worker restarts
                switch["model_step"] = True
            await one_request(engine, rng.choice(kinds), rng, expected, tally)

    await asyncio.gather(*(limited(i) for i in range(n)))
    return tally


def active_mb() -> float:
    return mx.get_active_memory() / 2**20


def wait_idle(engine: Engine, limit_s: float = 30) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["running"] == 0 and s["waiting"] == 0:
            return
        time.sleep(0.05)


# -- phase 2: the proxy ------------------------------------------------------------------


def start_proxy(model: str, folder: Path) -> tuple[subprocess.Popen, str, str, Path]:
    import yaml

    config = yaml.safe_load((REPO / "examples" / "litellm_proxy_config.yaml").read_text())
    config["model_list"] = [{"model_name": "soak", "litellm_params": {"model": f"mlx-parallm/{model}"}}]
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key, stats = "sk-" + secrets.token_hex(16), folder / "stats.json"
    env = {**os.environ, "LITELLM_MASTER_KEY": key, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "MLX_PARALLM_STATS_FILE": str(stats),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    log = (folder / "proxy.log").open("wb")
    process = subprocess.Popen([sys.executable, str(REPO / "scripts" / "proxy_with_stats.py"), "--config", str(folder / "config.yaml"),
                                "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    return process, f"http://127.0.0.1:{port}", key, stats


def read_stats(path: Path) -> dict[str, Any]:
    try:
        return next((v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")), {})
    except (FileNotFoundError, json.JSONDecodeError, StopIteration):
        return {}


def kept_mb(stats: dict[str, Any]) -> float:
    """What an engine keeps on purpose after a run (MiB): its KV pool with paged KV (cached
    prefixes included), else its prefix store."""
    kv = stats.get("kv_cache") or {}
    if kv.get("layout") == "paged":
        return kv.get("kv_cache_bytes", 0) / 2**20
    return (stats.get("prefix_cache") or {}).get("cached_bytes", 0) / 2**20


def mlx_mb(path: Path) -> float:
    """MLX active memory of the proxy process as it last published it, less what its engine
    keeps on purpose (:func:`kept_mb`)."""
    try:
        active = json.loads(path.read_text()).get("_process", {}).get("mlx_active_mb", float("nan"))
    except (FileNotFoundError, json.JSONDecodeError):
        return float("nan")
    return active - kept_mb(read_stats(path))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


KINDS = ["plain"] * 35 + ["stream"] * 15 + ["bad"] * 15 + ["hostile"] * 15 + ["hang_up"] * 10 + ["stream_drop"] * 10
"""Phase 2's mix of requests; ``--control`` first runs it without the bad and hostile bodies."""


async def soak_proxy(base_url: str, key: str, n: int, connections: int, rng: random.Random, stats_file: Path,
                     kinds: list[str] = KINDS) -> tuple[Tally, dict[str, float]]:
    import httpx

    question = [{"role": "user", "content": "Name three rivers."}]
    bad_bodies: list[Any] = [
        b"{not json", b"", {"model": "soak"}, {"model": "soak", "messages": "hello"},
        {"model": "soak", "messages": question, "max_tokens": "abc"}, {"model": "soak", "messages": question, "logit_bias": {"99999999": 5}},
        {"model": "soak", "messages": question, "stop": 5}, {"model": "soak", "messages": question, "seed": 2**64},
        {"model": "soak", "messages": question, "top_k": 10**6, "temperature": 1}, {"model": "soak", "messages": question, "tools": "abc"},
        {"model": "soak", "messages": question, "n": 10**4},
    ]
    hostile = hostile_cases()
    gaps: list[float] = []
    tally = Tally()
    gate = asyncio.Semaphore(connections)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    headers = {"Authorization": f"Bearer {key}"}

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=HANG_S, limits=limits, trust_env=False) as client:
        async def one(kind: str) -> None:
            async with gate:
                tally.sent += 1
                body: Any = {"model": "soak", "messages": question, "max_tokens": rng.randint(4, 24)}
                try:
                    if kind == "bad":
                        bad = rng.choice(bad_bodies)
                        send = {"content": bad} if isinstance(bad, bytes) else {"json": bad}
                        r = await client.post("/v1/chat/completions", **send)
                        tally.outcomes[f"HTTP {r.status_code}"] += 1
                        if r.status_code >= 500 or r.status_code == 200:
                            tally.untyped.append(f"bad body {str(bad)[:60]} -> {r.status_code} {r.text[:120]}")
                    elif kind == "hostile":
                        name, expect, raw = rng.choice(hostile)
                        r = await client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
                        tally.outcomes[f"hostile HTTP {r.status_code}"] += 1
                        if not judge(expect, r.status_code):
                            tally.untyped.append(f"hostile {name} ({expect}) -> {r.status_code} {r.text[:120]}")
                        elif name.startswith("nested pydantic") and not _pet_call(r.json()):
                            tally.harmed.append(f"hostile {name}: no valid call in {r.text[:160]}")
                    elif kind == "stream":
                        body.update(stream=True, max_tokens=32)
                        last = None
                        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                            async for line in r.aiter_lines():
                                if line.startswith("data:"):
                                    now = time.perf_counter()
                                    if last is not None:
                                        gaps.append(now - last)
                                    last = now
                        tally.outcomes[f"stream HTTP {r.status_code}"] += 1
                        if r.status_code != 200:
                            tally.harmed.append(f"stream got {r.status_code}")
                    elif kind == "hang_up":
                        body["max_tokens"] = 200
                        call = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
                        await asyncio.sleep(rng.uniform(0.2, 1.0))
                        call.cancel()
                        await asyncio.gather(call, return_exceptions=True)
                        tally.outcomes["hung up"] += 1
                    elif kind == "stream_drop":
                        body.update(stream=True, max_tokens=200)
                        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                            async for _ in r.aiter_lines():
                                break
                        tally.outcomes["stream dropped"] += 1
                    else:
                        r = await asyncio.wait_for(client.post("/v1/chat/completions", json=body), HANG_S)
                        tally.outcomes[f"HTTP {r.status_code}"] += 1
                        if r.status_code != 200:
                            tally.harmed.append(f"plain request got {r.status_code}: {r.text[:160]}")
                except asyncio.TimeoutError:
                    tally.hangs += 1
                except httpx.HTTPError as error:
                    tally.untyped.append(f"{kind}: connection error {type(error).__name__}: {error}")

        with LoopProbe(base_url) as probe:
            await asyncio.gather(*(one(rng.choice(kinds)) for _ in range(n)))

    stats = read_stats(stats_file)
    deadline = time.monotonic() + 60
    while (stats.get("running") or stats.get("waiting")) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        stats = read_stats(stats_file)
    gaps.sort()
    return tally, {"engine idle after the run": not (stats.get("running") or stats.get("waiting")),
                   "proxy loop held at most (ms; /health/liveliness polled every 20 ms)": f"{probe.slowest_ms:.0f} over {probe.samples} polls",
                   "innocent streams' gap between chunks p50 / p99 / max (ms; a decode step at this batch)":
                       " / ".join(f"{1000 * gaps[int(q * (len(gaps) - 1))]:.0f}" for q in (0.5, 0.99, 1.0)) if gaps else "none"}


def _pet_call(response: dict[str, Any]) -> bool:
    """Whether a forced ``adopt`` call came back with arguments its nested schema allows."""
    try:
        call = response["choices"][0]["message"]["tool_calls"][0]["function"]
        pet = json.loads(call["arguments"])["pet"]
        return call["name"] == "adopt" and isinstance(pet["name"], str) and pet["kind"] in ("cat", "dog")
    except (KeyError, IndexError, TypeError, ValueError):
        return False


async def abandoned_rows(base_url: str, key: str, stats_file: Path, rows: int = 16) -> dict[str, float]:
    """Hang up on ``rows`` long non-streaming requests once all decode; count what the
    engine decoded for them afterwards, in decode steps."""
    import httpx

    body = {"model": "soak", "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 400}
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=HANG_S, trust_env=False) as client:
        calls = [asyncio.ensure_future(client.post("/v1/chat/completions", json=body)) for _ in range(rows)]
        deadline = time.monotonic() + 120
        while read_stats(stats_file).get("running", 0) < rows and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        before = read_stats(stats_file)
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        hung_up = time.monotonic()
    stats = read_stats(stats_file)
    while stats.get("running") and time.monotonic() < hung_up + 60:
        await asyncio.sleep(0.01)
        stats = read_stats(stats_file)
    freed_s = time.monotonic() - hung_up
    step = (stats.get("step_s") or {}).get("p50") or float("nan")
    decoded = stats["generated_tokens"] - before["generated_tokens"]
    return {"rows": rows, "tokens decoded for them after the hang-up": decoded,
            "decode steps after the hang-up (tokens / rows)": round(decoded / rows, 2),
            "seconds until the stats showed them gone": round(freed_s, 3), "decode step p50 (s)": round(step, 4)}


# -- report ------------------------------------------------------------------------------


def report(name: str, tally: Tally, extra: dict[str, Any]) -> bool:
    print(f"\n## {name}")
    print(f"sent {tally.sent}; {tally.line()}")
    print(f"hangs {tally.hangs}, untyped errors {len(tally.untyped)}, harmed neighbours {len(tally.harmed)}")
    for k, v in extra.items():
        print(f"{k}: {v}")
    for problem in (tally.untyped + tally.harmed)[:20]:
        print(f"  - {problem}")
    return tally.hangs == 0 and not tally.untyped and not tally.harmed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="default | a model folder | a .gguf file")
    parser.add_argument("--requests", type=int, default=1000, help="phase 1 requests")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--http-requests", type=int, default=512, help="phase 2 requests (0 skips the proxy)")
    parser.add_argument("--connections", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--control", action="store_true",
                        help="before phase 2, run its traffic without the bad and hostile bodies: the loop's pauses and stream gaps of the "
                             "proxy's own load, to compare with the hostile run's")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    switch = install_faults()
    from mlx_parallm_provider.models import registry

    loaded = registry.load(args.model)
    loaded = registry.LoadedModel(loaded.name, loaded.path, FaultyModel(loaded.model, switch), loaded.tokenizer, loaded.config)
    engine = Engine(args.model, EngineConfig(max_queue=4096), loaded=loaded)
    expected = {p: engine.generate_sync(p, GREEDY).token_ids for p in CHECK_PROMPTS}
    wait_idle(engine)
    mx.clear_cache()
    idle_mb = active_mb()
    tic = time.perf_counter()
    tally = asyncio.run(soak_engine(engine, switch, args.requests, args.concurrency, rng, expected))
    wall = time.perf_counter() - tic
    wait_idle(engine)
    gc.collect()
    mx.clear_cache()
    after_mb = active_mb()
    stats = engine.stats()
    # The KV pool (paged KV) or the prefix store keeps memory on purpose: idle plus it.
    cache_mb = kept_mb(stats)
    engine_ok = report("engine (in process)", tally, {
        "wall time (s)": round(wall, 1),
        "MLX active memory idle -> after, less the KV pool / prefix store (MiB)":
            f"{idle_mb:.1f} -> {after_mb - cache_mb:.1f} ({(after_mb - cache_mb - idle_mb) / idle_mb:+.1%}; kept {cache_mb:.1f})",
        "requests still tracked by the metrics": engine.metrics.num_tracked,
        "largest decode batch": stats["max_batch_size"],
    })
    memory_ok = after_mb - cache_mb <= idle_mb * 1.05 and engine.metrics.num_tracked == 0
    engine.shutdown()

    proxy_ok = True
    if args.http_requests:
        with tempfile.TemporaryDirectory() as folder:
            process, base_url, key, stats_file = start_proxy(args.model, Path(folder))
            try:
                import httpx

                deadline = time.monotonic() + 240
                while time.monotonic() < deadline:
                    if process.poll() is not None:
                        print((Path(folder) / "proxy.log").read_text()[-3000:])
                        return 1
                    try:
                        if httpx.get(f"{base_url}/health/liveliness", timeout=2, trust_env=False).status_code == 200:
                            break
                    except httpx.HTTPError:
                        time.sleep(0.5)
                warm = httpx.post(f"{base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, trust_env=False, timeout=HANG_S,
                                  json={"model": "soak", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                assert warm.status_code == 200, warm.text
                time.sleep(0.2)
                if args.control:
                    innocent = [k for k in KINDS if k not in ("bad", "hostile")]
                    control, figures = asyncio.run(soak_proxy(base_url, key, args.http_requests, args.connections, rng, stats_file, innocent))
                    proxy_ok = report("LiteLLM proxy, control (the same traffic without bad or hostile bodies)", control, figures)
                rss_before, mlx_before = rss_mb(process.pid), mlx_mb(stats_file)
                tally, freed = asyncio.run(soak_proxy(base_url, key, args.http_requests, args.connections, rng, stats_file))
                abandoned = asyncio.run(abandoned_rows(base_url, key, stats_file))
                alive = process.poll() is None
                rss_after = rss_mb(process.pid) if alive else 0.0
                time.sleep(0.2)
                mlx_after = mlx_mb(stats_file)
                crashes = 0 if alive else 1
                proxy_ok = report("LiteLLM proxy over HTTP", tally, {
                    "crashes": crashes, **freed, "abandoned non-streaming requests": abandoned,
                    "proxy RSS before -> after (MiB)": f"{rss_before:.0f} -> {rss_after:.0f}",
                    "proxy MLX active memory before -> after, less the KV pool / prefix store (MiB)": f"{mlx_before:.1f} -> {mlx_after:.1f}",
                }) and alive and mlx_after <= mlx_before * 1.05 and proxy_ok
            finally:
                os.killpg(process.pid, 15)
                process.wait(30)
    ok = engine_ok and memory_ok and proxy_ok
    print(f"\nverdict: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
