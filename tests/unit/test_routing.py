"""Prefix-aware routing: the hash ring, bounded loads, prefix keys, load bookkeeping, and the
LiteLLM strategy inside a real in-process ``litellm.Router`` (deployments answer with
``mock_response``, a dead one is a closed loopback port)."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter

import pytest

from mlx_parallm_provider.integrations.routing import HashRing, choose, prefix_key
from mlx_parallm_provider.integrations.routing.load import InFlight, ScrapedLoads, metrics_url, scraped_load


def test_ring_owner_is_stable_and_spreads_keys() -> None:
    ring = HashRing(["a", "b", "c"])
    keys = [f"prefix-{i}" for i in range(3000)]
    owners = Counter(ring.owner(k) for k in keys)
    assert set(owners) == {"a", "b", "c"}
    assert min(owners.values()) > 3000 / 3 * 0.6  # 64 points each: no replica starves
    assert [HashRing(["c", "a", "b"]).owner(k) for k in keys[:50]] == [ring.owner(k) for k in keys[:50]]


def test_removing_a_replica_moves_only_its_keys() -> None:
    keys = [f"prefix-{i}" for i in range(2000)]
    before, after = HashRing(["a", "b", "c"]), HashRing(["a", "b"])
    for k in keys:
        if before.owner(k) != "c":
            assert after.owner(k) == before.owner(k)
    assert before.owner(keys[0], among=["a"]) == "a"


def test_choose_keeps_the_owner_while_it_has_room() -> None:
    ring = HashRing(["a", "b"])
    key = next(k for k in (f"k{i}" for i in range(100)) if ring.owner(k) == "a")
    assert choose(ring, key, {"a": 5, "b": 0}).replica == "a"
    full = choose(ring, key, {"a": 5, "b": 3}, capacities={"a": 5, "b": 5})
    assert (full.replica, full.owner, full.reason) == ("b", "a", "full")
    # the least busy replica *with room*; the least busy of all only when none has room
    three = HashRing(["a", "b", "c"])
    key3 = next(k for k in (f"k{i}" for i in range(100)) if three.owner(k) == "a")
    assert choose(three, key3, {"a": 5, "b": 4, "c": 5}, capacities={"a": 5, "b": 4, "c": 9}).replica == "c"
    assert choose(three, key3, {"a": 5, "b": 4, "c": 9}, capacities={"a": 5, "b": 4, "c": 9}).replica == "b"
    # bounded loads: with balance 0.5, a may hold ceil(1.5 * 11 / 2) = 9 of 10 + 1
    assert choose(ring, key, {"a": 8, "b": 2}, balance=0.5).replica == "a"
    assert choose(ring, key, {"a": 9, "b": 1}, balance=0.5).replica == "b"
    # the owner cooled down (not among the loads): the next replica clockwise
    assert choose(ring, key, {"b": 7}).replica == "b"
    assert choose(ring, None, {"a": 2, "b": 1}).reason == "no-prefix"
    assert choose(ring, None, {"a": 2, "b": 1}).replica == "b"
    with pytest.raises(ValueError):
        choose(ring, key, {})


def test_prefix_key_is_the_system_prompt_and_tools_when_there_are_any() -> None:
    system = {"role": "system", "content": "You are a careful agent. " * 10}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    one = prefix_key([system, {"role": "user", "content": "q1"}], tools)
    two = prefix_key([system, {"role": "user", "content": "q2"}], tools)
    assert one == two and "careful agent" in one and '"name": "f"' in one
    assert prefix_key([system, {"role": "user", "content": "q1"}]) != one  # tools are part of it
    plain1 = prefix_key([{"role": "user", "content": "x" * 50 + "1"}], max_chars=20)
    plain2 = prefix_key([{"role": "user", "content": "x" * 50 + "2"}], max_chars=20)
    assert plain1 == plain2 and len(plain1) == 20
    assert prefix_key([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) == "<user>hi"
    assert prefix_key([{"role": "user", "content": "q"}], mode="system") is None
    assert prefix_key([]) is None
    with pytest.raises(ValueError):
        prefix_key([], mode="nope")


def test_in_flight_counts_moves_and_expires() -> None:
    now = [0.0]
    inflight = InFlight(ttl_s=10, clock=lambda: now[0])
    inflight.start("r1", "a")
    inflight.start("r2", "a")
    assert inflight.loads(["a", "b"]) == {"a": 2, "b": 0}
    inflight.start("r1", "b")  # a retry of r1 went to b
    inflight.finish("r1", "a")  # the late failure event of its first try changes nothing
    assert inflight.loads(["a", "b"]) == {"a": 1, "b": 1}
    inflight.finish("r1", "b")
    now[0] = 11.0
    assert inflight.loads(["a", "b"]) == {"a": 0, "b": 0} and len(inflight) == 0


def test_scraped_load_sums_running_and_waiting() -> None:
    text = (
        "# HELP mlx_parallm:num_requests_running Requests in the decode batch.\n"
        'mlx_parallm:num_requests_running{model_name="tiny"} 3.0\n'
        'mlx_parallm:num_requests_waiting{model_name="tiny"} 4.0\n'
        'mlx_parallm:num_requests_waiting{model_name="other"} 1.0\n'
        'mlx_parallm:prompt_tokens_total{model_name="tiny"} 99.0\n'
    )
    assert scraped_load(text) == 8
    assert scraped_load("nothing here 1\n") is None
    now = [0.0]
    loads = ScrapedLoads(max_age_s=2, clock=lambda: now[0])
    loads.record("a", 5)
    assert loads.get("a") == 5 and loads.get("b") is None
    now[0] = 3.0
    assert loads.get("a") is None
    assert metrics_url("http://h:4000/v1") == "http://h:4000/metrics"
    assert metrics_url("http://h:4000/") == "http://h:4000/metrics" and metrics_url(None) is None


# --------------------------------------------------------------------------- inside litellm.Router


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _router(dead: frozenset = frozenset(), delays: dict | None = None, **strategy):
    import litellm

    from mlx_parallm_provider.integrations.routing import PrefixAwareRouting

    model_list = []
    for name in ("a", "b"):
        params = {"model": "openai/tiny", "api_base": f"http://127.0.0.1:{_closed_port()}/v1", "api_key": "k"}
        if name not in dead:
            params["mock_response"] = f"from {name}"
        if delays and name in delays:
            params["mock_delay"] = delays[name]
        model_list.append({"model_name": "tiny", "litellm_params": params, "model_info": {"id": name}})
    router = litellm.Router(model_list=model_list, num_retries=2, retry_after=0)
    return router, PrefixAwareRouting(**strategy).install(router)


async def _drained(strategy, limit_s: float = 10.0) -> dict:
    """In-flight counts once every call's end event has arrived (they come just after the
    response, from LiteLLM's logging tasks), or as they are at ``limit_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while len(strategy.inflight) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return strategy.stats()["in_flight"]


def _messages(group: int, i: int) -> list[dict]:
    return [{"role": "system", "content": f"group {group}: " + "shared instructions " * 30},
            {"role": "user", "content": f"question {i}"}]


def test_each_prefix_group_lands_on_its_owner() -> None:
    router, strategy = _router()

    async def run() -> tuple[list, dict]:
        out = await asyncio.gather(*(router.acompletion(model="tiny", messages=_messages(i % 4, i)) for i in range(32)))
        return out, await _drained(strategy)

    responses, in_flight = asyncio.run(run())
    placed = Counter((i % 4, r._hidden_params["model_id"]) for i, r in enumerate(responses))
    for group in range(4):
        owner = strategy.choice_for(router.registry().deployments("tiny"), _messages(group, 0)).owner
        assert placed[(group, owner)] == 8, placed
    assert strategy.decisions == {"owner": 32}
    assert in_flight == {"a": 0, "b": 0}  # every end was reported


def test_a_dead_replica_is_retried_elsewhere_and_cooled_down() -> None:
    router, strategy = _router(dead=frozenset({"a"}))

    async def run() -> tuple[list, list, dict]:
        out = await asyncio.gather(*(router.acompletion(model="tiny", messages=_messages(i % 4, i)) for i in range(16)))
        cooling = await router.health().cooldowns.async_get_active_cooldowns(model_ids=["a", "b"], parent_otel_span=None)
        return out, cooling, await _drained(strategy)

    responses, cooling, in_flight = asyncio.run(run())
    assert {r._hidden_params["model_id"] for r in responses} == {"b"}
    assert [r.choices[0].message.content for r in responses] == ["from b"] * 16
    assert "a" in {c[0] for c in cooling}
    assert in_flight == {"a": 0, "b": 0}


def test_a_metadata_dict_shared_by_calls_does_not_carry_one_call_over_to_the_next() -> None:
    """LiteLLM writes into the caller's metadata dict; the replicas a call tried must not
    steer the next call that passes the same dict."""
    router, strategy = _router()
    shared = {"team": "x"}
    owner = strategy.choice_for(router.registry().deployments("tiny"), _messages(0, 0)).owner

    async def run() -> list[str]:
        return [(await router.acompletion(model="tiny", messages=_messages(0, i), metadata=shared))._hidden_params["model_id"]
                for i in range(3)]

    assert asyncio.run(run()) == [owner] * 3
    assert strategy.decisions == {"owner": 3}


def test_a_full_owner_sends_the_request_to_the_least_busy_replica() -> None:
    router, strategy = _router(max_inflight=2)
    deployments = router.registry().deployments("tiny")
    first = strategy.choice_for(deployments, _messages(0, 0))
    for token in ("x", "y"):
        strategy.inflight.start(token, first.owner)
    spilled = strategy.choice_for(deployments, _messages(0, 0))
    assert spilled.reason == "full" and spilled.replica != first.owner
    strategy.inflight.finish("x")
    assert strategy.choice_for(deployments, _messages(0, 0)).replica == first.owner


def test_the_sync_router_uses_the_strategy_too() -> None:
    router, strategy = _router()
    response = router.completion(model="tiny", messages=_messages(1, 0))
    owner = strategy.choice_for(router.registry().deployments("tiny"), _messages(1, 0)).owner
    assert response._hidden_params["model_id"] == owner


def test_a_slow_replica_does_not_hold_the_others_back() -> None:
    """Requests of one prefix arrive 50 ms apart; their owner takes 1 s per answer. Once it
    holds ``max_inflight`` of them the rest go to the other replica and are answered at once
    instead of waiting on the slow one."""
    import time

    probe, probe_strategy = _router()
    messages = _messages(0, 0)
    slow = probe_strategy.choice_for(probe.registry().deployments("tiny"), messages).owner
    router, strategy = _router(delays={slow: 1.0}, max_inflight=2)
    for deployment in router.registry().deployments("tiny"):  # the fast one takes them all
        if deployment["model_info"]["id"] != slow:
            deployment["litellm_params"]["max_parallel_requests"] = 100

    async def one(i: int) -> tuple[str, float]:
        await asyncio.sleep(0.05 * i)
        start = time.monotonic()
        response = await router.acompletion(model="tiny", messages=messages)
        return response._hidden_params["model_id"], time.monotonic() - start

    async def run() -> list[tuple[str, float]]:
        return list(await asyncio.gather(*(one(i) for i in range(8))))

    answered = asyncio.run(run())
    served = Counter(replica for replica, _ in answered)
    assert served[slow] == 2 and sum(served.values()) == 8, served
    assert strategy.decisions == {"owner": 2, "full": 6}
    assert all(latency >= 1.0 for replica, latency in answered if replica == slow)
    assert all(latency < 0.5 for replica, latency in answered if replica != slow), answered


def test_scraped_metrics_count_as_load_when_higher() -> None:
    """Another front router's requests show in the replica's /metrics, not in our counts."""
    import httpx

    router, strategy = _router(scrape_interval_s=1.0)
    port_of = {d["model_info"]["id"]: httpx.URL(d["litellm_params"]["api_base"]).port for d in router.registry().deployments("tiny")}
    seen: list[tuple[str, str]] = []

    def replica_metrics(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization", "")))
        running = 64 if request.url.port == port_of["a"] else 1
        return httpx.Response(200, text=f'mlx_parallm:num_requests_running{{model_name="tiny"}} {running}\n')

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(replica_metrics)) as client:
            await strategy.scrape_once(client)

    asyncio.run(run())
    assert seen == [("/metrics", "Bearer k")] * 2
    assert strategy.stats()["in_flight"] == {"a": 64, "b": 1}
    deployments = router.registry().deployments("tiny")
    owned_by_a = next(m for m in (_messages(g, 0) for g in range(64)) if strategy.choice_for(deployments, m).owner == "a")
    assert strategy.choice_for(deployments, owned_by_a).replica == "b"  # a is full (64 by its metrics)


def test_in_a_proxy_the_strategy_installs_itself_on_the_proxys_router(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    import litellm

    from mlx_parallm_provider.integrations.routing import PrefixAwareRouting

    plain, _ = _router()  # a Router as the proxy builds it, without the strategy
    fake_proxy = types.ModuleType("litellm.proxy.proxy_server")
    fake_proxy.llm_router = litellm.Router(model_list=plain.registry().deployments(), num_retries=0)
    monkeypatch.setitem(sys.modules, "litellm.proxy.proxy_server", fake_proxy)
    strategy = PrefixAwareRouting()

    async def run() -> str:
        data = {"model": "tiny", "messages": _messages(2, 0)}
        assert await strategy.async_pre_call_hook(None, None, data, "completion") is data
        return (await fake_proxy.llm_router.acompletion(**data))._hidden_params["model_id"]

    served = asyncio.run(run())
    assert strategy.decisions == {"owner": 1}
    assert served == strategy.choice_for(fake_proxy.llm_router.registry().deployments("tiny"), _messages(2, 0)).owner
