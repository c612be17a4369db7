"""A cluster on loopback: 2 replica proxies (examples/cluster/replica.yaml, tiny model) and
1 front proxy (examples/cluster/front.yaml: LiteLLM's Router with prefix-aware routing).

Each replica batches 2 rows and its prefix store (``MLX_PARALLM_ENGINE_CONFIG``) holds two
prompts with their answers: the two prefix groups of the four that the ring gives it, and
no more, as when a cluster serves more agents than one host's cache holds. Then where a
request lands decides whether its prefix is still cached: routed by prefix, each replica
cycles over its own 2 groups and keeps both; shuffled, it cycles over all 4 and its least
recently used store keeps a prefix only while at most one other group came between (or
was still being prefilled). With R replicas, routing by prefix shrinks each replica's
working set R times, so with 2 the effect is about 2.5x and shuffle's own rate moves with
its random spread (see the hit-rate test). The real ``litellm`` CLI runs all three (30-60 s
to start on two busy cores), so every test here is ``slow``; the last one kills a replica.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy_helpers import REPO, RunningProxy, start_proxy, stop, wait_ready

pytestmark = pytest.mark.slow

ALIAS = "tiny"
IDS = ("rep-a", "rep-b")
REPLICA_ARGS = ("--keepalive_timeout", "75")  # as the README says: longer than the front's pool keeps connections
ROWS = 2
MAX_TOKENS = 8  # per answer in the measured runs
BURST, BURST_TOKENS = 12, 64  # the requests and answer length of the run whose queue is watched
SYSTEM = "You are assistant {g} of team {team}. " + " ".join(f"Rule {k}: be precise about item {k}." for k in range(30))


@dataclass
class Cluster:
    replicas: dict[str, RunningProxy]
    front: RunningProxy
    key: str
    deployments: list[dict[str, Any]] = field(default_factory=list)

    def scrape(self, replica: str) -> dict[str, float]:
        """The replica's engine metrics: ``{name: value}`` summed over label sets."""
        with self.replicas[replica].client(timeout=10) as client:
            return engine_metrics(client.get("/metrics", follow_redirects=True).text)


def engine_metrics(text: str) -> dict[str, float]:
    """The engine metrics of a /metrics page: ``{name: value}`` summed over label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    values: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("mlx_parallm:") and sample.labels.get("le") in (None, "+Inf"):
                values[sample.name] += sample.value
    return dict(values)


@pytest.fixture(scope="module")
def cluster(tiny_model: Any, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    import fastapi  # noqa: F401  (the proxy's server dependencies: the `proxy` extra, in `dev`)
    import prometheus_client  # noqa: F401  (/metrics on the replicas: the `proxy` extra too)

    folder = tmp_path_factory.mktemp("cluster")
    key = "sk-" + secrets.token_hex(16)
    replica_config = yaml.safe_load((REPO / "examples" / "cluster" / "replica.yaml").read_text())
    replica_config["model_list"] = [{"model_name": ALIAS, "litellm_params": {"model": f"mlx-parallm/{tiny_model_dir}"}}]
    engine = {"MLX_PARALLM_ENGINE_CONFIG": _engine_config(tiny_model)}
    replicas = {rid: start_proxy(replica_config, folder / rid, key, engine, REPLICA_ARGS) for rid in IDS}
    started: list[RunningProxy] = list(replicas.values())
    try:
        # The front starts beside the replicas (their ports are known once started; it does
        # not call them until a request comes), and all three are waited for.
        front_config = yaml.safe_load((REPO / "examples" / "cluster" / "front.yaml").read_text())
        assert len(front_config["model_list"]) == len(IDS)
        for deployment, rid in zip(front_config["model_list"], IDS):
            deployment["model_name"] = ALIAS
            deployment["litellm_params"].update(model=f"openai/{ALIAS}", api_base=f"{replicas[rid].base_url}/v1")
            deployment["model_info"]["id"] = rid
        front = start_proxy(front_config, folder / "front", key)
        started.append(front)
        for proxy in started:
            wait_ready(proxy)
        yield Cluster(replicas, front, key, front_config["model_list"])
    finally:
        for proxy in started:
            stop(proxy)


def _engine_config(tiny_model: Any) -> str:
    """ROWS rows and a prefix store of ROWS prompts with their answers (the longest prompt
    this module sends plus MAX_TOKENS, at the tiny model's KV bytes per token)."""
    from mlx_parallm_provider.engine.kv.budget import kv_bytes_per_token

    template = tiny_model.tokenizer.apply_chat_template
    prompt = max(len(template(_messages(team, g, i), add_generation_prompt=True, tokenize=True))
                 for team in ("warm-up", "shuffle", "prefix") for g in range(16) for i in range(64))
    store_bytes = ROWS * (prompt + MAX_TOKENS) * kv_bytes_per_token(tiny_model.model, tiny_model.config)
    return json.dumps({"max_num_seqs": ROWS, "prefix_cache_memory_gb": store_bytes / 1024**3})


def _messages(team: str, group: int, i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM.format(g=group, team=team)}, {"role": "user", "content": f"Question {i}?"}]


def _owner(cluster: Cluster, messages: list[dict[str, str]]) -> str:
    from mlx_parallm_provider.integrations.routing import PrefixAwareRouting

    return PrefixAwareRouting().choice_for(cluster.deployments, messages).owner


def _balanced_groups(cluster: Cluster, team: str) -> list[int]:
    """Four groups of which the ring gives two to each replica. With 4 keys on 2 replicas,
    hashing alone splits 2/2 only 3 times in 8; a 3/1 split would make one replica's small
    store thrash whatever the routing (real traffic has many more prefixes than replicas)."""
    chosen: dict[str, list[int]] = {rid: [] for rid in IDS}
    for group in range(64):
        owned = chosen[_owner(cluster, _messages(team, group, 0))]
        if len(owned) < 2:
            owned.append(group)
        if all(len(v) == 2 for v in chosen.values()):
            return [g for pair in zip(*chosen.values()) for g in pair]
    raise AssertionError("no balanced groups among 64")  # pragma: no cover


class Watcher:
    """Scrapes one replica's /metrics every 20 ms while a run goes: over one connection, the
    pages parsed once the run ends (parsing each as it came took ~150 ms a sample, in the
    process sending the run's requests, and left a run of a few tenths of a second with as
    few as one sample of its queue)."""

    def __init__(self, cluster: Cluster, replica: str) -> None:
        self.cluster, self.replica = cluster, replica
        self.pages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def samples(self) -> list[dict[str, float]]:
        return [engine_metrics(page) for page in self.pages]

    def _run(self) -> None:
        with self.cluster.replicas[self.replica].client(timeout=10) as client:
            while not self._stop.is_set():
                self.pages.append(client.get("/metrics", follow_redirects=True).text)
                time.sleep(0.02)

    def __enter__(self) -> "Watcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _hit_rate(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> float:
    """Prompt tokens found cached / looked up, over both replicas, between two scrapes."""
    hits = sum(after[r]["mlx_parallm:prefix_cache_hits_total"] - before[r].get("mlx_parallm:prefix_cache_hits_total", 0) for r in IDS)
    queries = sum(after[r]["mlx_parallm:prefix_cache_queries_total"] - before[r].get("mlx_parallm:prefix_cache_queries_total", 0) for r in IDS)
    return hits / queries


async def _post_all(proxy: RunningProxy, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {proxy.key}"}
    async with httpx.AsyncClient(base_url=proxy.base_url, headers=headers, timeout=300, trust_env=False) as client:
        return list(await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies)))


async def _through_front(cluster: Cluster, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    return await _post_all(cluster.front, bodies)


@pytest.fixture(scope="module")
def runs(cluster: Cluster) -> dict[str, Any]:
    """In one run, each phase 64 concurrent requests in 4 new prefix groups: a warm-up that
    fills the replicas' prefix stores, then an in-process ``litellm.Router`` with LiteLLM's
    ``simple-shuffle``, then the front proxy (prefix-aware). Both measured phases thus start
    with stores full of other prefixes. Last, a burst straight to one replica, its /metrics
    watched meanwhile."""
    import litellm

    model_list = [{"model_name": ALIAS, "litellm_params": {**d["litellm_params"], "api_key": cluster.key}, "model_info": d["model_info"]}
                  for d in cluster.deployments]
    router = litellm.Router(model_list=model_list, routing_strategy="simple-shuffle", num_retries=2)

    async def shuffled(team: str, groups: list[int]) -> list[Any]:
        return list(await asyncio.gather(*(
            router.acompletion(model=ALIAS, messages=_messages(team, groups[i % 4], i), max_tokens=MAX_TOKENS, temperature=0)
            for i in range(64)
        )))

    out: dict[str, Any] = {}
    asyncio.run(shuffled("warm-up", _balanced_groups(cluster, "warm-up")))
    before = {r: cluster.scrape(r) for r in IDS}
    out["shuffle_responses"] = asyncio.run(shuffled("shuffle", _balanced_groups(cluster, "shuffle")))
    time.sleep(0.3)
    out["shuffle_hit_rate"] = _hit_rate(before, {r: cluster.scrape(r) for r in IDS})

    groups = _balanced_groups(cluster, "prefix")
    bodies = [{"model": ALIAS, "messages": _messages("prefix", groups[i % 4], i), "max_tokens": MAX_TOKENS, "temperature": 0} for i in range(64)]
    before = {r: cluster.scrape(r) for r in IDS}
    out["prefix_responses"] = asyncio.run(_through_front(cluster, bodies))
    time.sleep(0.3)
    after = {r: cluster.scrape(r) for r in IDS}
    out.update(prefix_groups=groups, prefix_hit_rate=_hit_rate(before, after), watched_before=before[IDS[0]], watched_after=after[IDS[0]])

    # The gauges are watched over a burst sent straight to one replica, with answers long
    # enough that its 2 rows are still busy when the last request arrives: through the front,
    # 8-token answers on a loaded machine could be answered as fast as they came in.
    burst = [{**body, "messages": _messages("burst", 0, i), "max_tokens": BURST_TOKENS, "ignore_eos": True} for i, body in enumerate(bodies[:BURST])]
    with Watcher(cluster, IDS[0]) as watcher:
        out["burst_responses"] = asyncio.run(_post_all(cluster.replicas[IDS[0]], burst))
    time.sleep(0.3)
    out.update(watched=watcher.samples, burst_after=cluster.scrape(IDS[0]))
    return out


def test_each_prefix_group_is_answered_by_its_own_replica(cluster: Cluster, runs: dict[str, Any]) -> None:
    responses = runs["prefix_responses"]
    assert [r.status_code for r in responses] == [200] * 64, [r.text for r in responses if r.status_code != 200][:3]
    assert all(r.json()["choices"][0]["message"]["content"] is not None for r in responses)
    placed = Counter((runs["prefix_groups"][i % 4], r.headers["x-litellm-model-id"]) for i, r in enumerate(responses))
    owners = {g: _owner(cluster, _messages("prefix", g, 0)) for g in runs["prefix_groups"]}
    assert placed == Counter({(g, owners[g]): 16 for g in runs["prefix_groups"]}), placed
    assert sorted(Counter(owners.values()).values()) == [2, 2]


def test_prefix_aware_routing_hits_the_prefix_cache_far_more_often_than_shuffle(runs: dict[str, Any]) -> None:
    assert len(runs["shuffle_responses"]) == 64
    assert {r._hidden_params["model_id"] for r in runs["shuffle_responses"]} == set(IDS)
    prefix, shuffle = runs["prefix_hit_rate"], runs["shuffle_hit_rate"]
    print(f"prefix-cache hit rate: prefix-aware {prefix:.3f}, simple-shuffle {shuffle:.3f} ({prefix / shuffle:.2f}x)")
    # Prefix-aware gives 0.919 every run. Shuffle's rate depends on how its 64 random picks
    # interleave the groups on each replica: 0.21-0.50 over 28 runs of this scenario on
    # in-process engines (median 0.36, 2.6x; one run in 28 under 2x, at 1.84x) and 0.36-0.47
    # in four runs of this test (2.53x, 2.34x, 2.10x, 1.96x). A second row still prefilling
    # also keeps a prefix alive a little longer under shuffle. Hence 1.6x here: 2x fails now and then (one run in 28
    # there, one in 4 here; one in 7 runs with an earlier store of about 2.5 prompts).
    assert prefix >= 0.8 and prefix >= 1.6 * shuffle, (prefix, shuffle)


def test_replica_metrics_move_during_a_run(runs: dict[str, Any]) -> None:
    samples = runs["watched"]
    assert [r.status_code for r in runs["burst_responses"]] == [200] * BURST
    assert all(r.json()["usage"]["completion_tokens"] == BURST_TOKENS for r in runs["burst_responses"])
    assert len(samples) >= 5
    running = [s.get("mlx_parallm:num_requests_running", 0) for s in samples]
    waiting = [s.get("mlx_parallm:num_requests_waiting", 0) for s in samples]
    assert max(running) == ROWS and max(waiting) > 0, (running, waiting)  # 12 requests, 2 rows: the others queue
    for after in (runs["burst_after"], runs["watched_after"]):
        assert after["mlx_parallm:num_requests_running"] == 0 and after["mlx_parallm:num_requests_waiting"] == 0
    before, after = runs["watched_before"], runs["watched_after"]
    answered = sum(r.headers["x-litellm-model-id"] == IDS[0] for r in runs["prefix_responses"])
    for name in ("time_to_first_token_seconds", "request_queue_time_seconds"):
        grew = after[f"mlx_parallm:{name}_count"] - before.get(f"mlx_parallm:{name}_count", 0)
        assert grew == answered, name
    assert after["mlx_parallm:inter_token_latency_seconds_count"] > before.get("mlx_parallm:inter_token_latency_seconds_count", 0)
    assert after["mlx_parallm:time_to_first_token_seconds_sum"] > before.get("mlx_parallm:time_to_first_token_seconds_sum", 0)


def test_killing_a_replica_mid_run_loses_no_request(cluster: Cluster, runs: dict[str, Any]) -> None:
    """Runs last: it kills a replica (SIGKILL to its PID) while it is decoding."""
    victim, survivor = IDS
    groups = _balanced_groups(cluster, "kill")
    bodies = [{"model": ALIAS, "messages": _messages("kill", groups[i % 4], i), "max_tokens": 64, "temperature": 0} for i in range(64)]
    in_flight_at_kill: list[float] = []

    async def run() -> list[httpx.Response]:
        calls = asyncio.ensure_future(_through_front(cluster, bodies))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not calls.done():
            load = await asyncio.to_thread(cluster.scrape, victim)
            if load.get("mlx_parallm:num_requests_running", 0) >= ROWS:
                in_flight_at_kill.append(load["mlx_parallm:num_requests_running"] + load.get("mlx_parallm:num_requests_waiting", 0))
                os.kill(cluster.replicas[victim].process.pid, signal.SIGKILL)
                break
            await asyncio.sleep(0.02)
        return await calls

    responses = asyncio.run(run())
    assert in_flight_at_kill and in_flight_at_kill[0] >= ROWS, "the victim was never busy"
    assert cluster.replicas[victim].process.wait(timeout=10) == -signal.SIGKILL
    assert [r.status_code for r in responses] == [200] * 64, [r.text for r in responses if r.status_code != 200][:3]
    served = Counter(r.headers["x-litellm-model-id"] for r in responses)
    # What the victim still held when it died was retried on the survivor and answered there.
    # The router may send either replica more than half (it weighs load as well as prefixes),
    # so only the rows in flight at the kill are known to have left the victim.
    assert served[victim] <= 64 - in_flight_at_kill[0] and served[survivor] >= in_flight_at_kill[0], served
    with cluster.replicas[survivor].client() as client:  # and the survivor keeps serving
        after = client.post("/v1/chat/completions", json=bodies[0])
    assert after.status_code == 200
