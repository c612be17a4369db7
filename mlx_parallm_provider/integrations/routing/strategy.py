"""Prefix-aware routing for LiteLLM's Router over many mlx-parallm replicas.

:class:`PrefixAwareRouting` is a LiteLLM custom routing strategy (``CustomRoutingStrategyBase``)
and callback (``CustomLogger``) in one object: it picks a deployment for each call, and the
success / failure events tell it when the call ended, so it knows how many requests each
replica holds without asking anyone. Requests sharing a prompt prefix go to the replica that
owns the prefix on a consistent-hash ring (:mod:`.hashring`) while it has room; the least busy
replica otherwise. Replicas in the Router's cooldown, and replicas this request already
failed on (a retry), are skipped, so ``num_retries`` moves a dead replica's requests to the
others at once, before the cooldown has even begun.

In process::

    router = litellm.Router(model_list=replicas, num_retries=2)
    PrefixAwareRouting().install(router)

In a LiteLLM proxy: list ``mlx_parallm_provider.integrations.routing.prefix_aware_routing``
under ``litellm_settings.callbacks``; it installs itself on the proxy's Router at the first
request (the proxy config has no key for a custom strategy).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import httpx
import litellm
from litellm.integrations.custom_logger import CustomLogger
from litellm.types.router import CustomRoutingStrategyBase

from .hashring import Choice, HashRing, choose
from .load import InFlight, ScrapedLoads, metrics_url, scraped_load
from .prefix_key import prefix_key

logger = logging.getLogger(__name__)

TOKEN_KEY = "mlx_parallm_route"
TRIED_KEY = "mlx_parallm_tried"
TRACE_KEY = "mlx_parallm_trace"


def deployment_id(deployment: Mapping[str, Any]) -> str:
    """A deployment's id (``model_info.id``, which LiteLLM always fills in)."""
    return str((deployment.get("model_info") or {}).get("id"))


def _metadata(kwargs: Mapping[str, Any]) -> Optional[dict]:
    for name in ("metadata", "litellm_metadata"):
        value = kwargs.get(name)
        if isinstance(value, dict):
            return value
    return None


class _CallEnds(CustomLogger):
    """A LiteLLM callback whose success and failure events, sync or async, all go to
    ``self._ended(kwargs)``."""

    def _ended(self, kwargs: Any) -> None:
        raise NotImplementedError

    async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._ended(kwargs)

    async def async_log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._ended(kwargs)

    def log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._ended(kwargs)

    def log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._ended(kwargs)


class PrefixAwareRouting(_CallEnds, CustomRoutingStrategyBase):
    """Consistent hashing of prompt prefixes onto replicas, with bounded loads.

    Args:
        prefix_chars: characters of the rendered prefix that form the routing key.
        key_mode: see :func:`~.prefix_key.prefix_key` (``"auto"``, ``"messages"``, ``"system"``).
        vnodes: ring points per replica.
        max_inflight: requests a replica holds before it counts as full (a deployment's
            ``litellm_params.max_parallel_requests`` overrides it); None: no such bound.
        balance: a replica is also full above ``(1 + balance)`` times the mean load
            (consistent hashing with bounded loads); None: no such bound.
        scrape_interval_s: if set, each replica's ``/metrics`` (``model_info.metrics_url``,
            else ``api_base`` without ``/v1`` plus ``/metrics``) is read this often and its
            ``num_requests_running + num_requests_waiting`` counts as its load when higher
            than what this router has in flight there (other routers' requests included).
        inflight_ttl_s: an in-flight request whose end is never reported stops counting
            after this long.
    """

    def __init__(
        self,
        *,
        prefix_chars: int = 1024,
        key_mode: str = "auto",
        vnodes: int = 64,
        max_inflight: Optional[int] = 64,
        balance: Optional[float] = None,
        scrape_interval_s: Optional[float] = None,
        inflight_ttl_s: float = 600.0,
    ) -> None:
        CustomLogger.__init__(self)
        prefix_key([], max_chars=prefix_chars, mode=key_mode)  # validates the mode early
        self.prefix_chars = prefix_chars
        self.key_mode = key_mode
        self.vnodes = vnodes
        self.max_inflight = max_inflight
        self.balance = balance
        self.scrape_interval_s = scrape_interval_s
        self.inflight = InFlight(ttl_s=inflight_ttl_s)
        self.scraped = ScrapedLoads(max_age_s=3 * scrape_interval_s if scrape_interval_s else 5.0)
        self.decisions: Counter[str] = Counter()
        self._router: Any = None
        self._rings: dict[tuple[str, ...], HashRing] = {}
        self._scraper: Optional[asyncio.Task] = None

    # -- installing -----------------------------------------------------------------------

    def install(self, router: Any) -> "PrefixAwareRouting":
        """Make this strategy pick every deployment of ``router`` and receive the call
        events it counts in-flight requests with; returns self."""
        register = getattr(router, "register_plugin", None) or router.set_custom_routing_strategy
        register(self)
        self._router = router
        _relay.strategies.add(self)
        if not any(cb is _relay for cb in litellm.callbacks):
            litellm.callbacks.append(_relay)
        return self

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict, call_type: Any) -> dict:
        """Proxy hook, run before each request is routed: install on the proxy's Router
        (again after the proxy rebuilt it)."""
        proxy_server = sys.modules.get("litellm.proxy.proxy_server")  # never import (build) one
        router = getattr(proxy_server, "llm_router", None)
        if router is not None and router is not self._router:
            self.install(router)
            logger.info("prefix-aware routing installed on the proxy's Router")
        return data

    # -- picking --------------------------------------------------------------------------

    async def async_get_available_deployment(
        self,
        model: str,
        messages: Optional[list[dict[str, str]]] = None,
        input: Any = None,
        specific_deployment: Optional[bool] = False,
        request_kwargs: Optional[dict[str, Any]] = None,
    ) -> Optional[dict[str, Any]]:
        """LiteLLM's async pick: the deployment this request goes to."""
        deployments = self._deployments(model)
        ids = [deployment_id(d) for d in deployments]
        cooling = await self._router.health().cooldowns.async_get_active_cooldowns(model_ids=ids, parent_otel_span=None)
        self._ensure_scraper()
        return self._pick(deployments, {c[0] for c in cooling or []}, messages, request_kwargs)

    def get_available_deployment(
        self,
        model: str,
        messages: Optional[list[dict[str, str]]] = None,
        input: Any = None,
        specific_deployment: Optional[bool] = False,
        request_kwargs: Optional[dict[str, Any]] = None,
    ) -> Optional[dict[str, Any]]:
        """LiteLLM's sync pick (``Router.completion``)."""
        deployments = self._deployments(model)
        ids = [deployment_id(d) for d in deployments]
        cooling = self._router.health().cooldowns.get_active_cooldowns(model_ids=ids, parent_otel_span=None)
        return self._pick(deployments, {c[0] for c in cooling or []}, messages, request_kwargs)

    def choice_for(self, deployments: Sequence[Mapping[str, Any]], messages: Any, tools: Any = None) -> Choice:
        """Where a request would go now, without sending it (for inspection and tests)."""
        ids = [deployment_id(d) for d in deployments]
        return self._choose(deployments, ids, messages, tools)

    def stats(self) -> dict[str, Any]:
        """Decisions so far by reason, and requests in flight per replica."""
        ids = [deployment_id(d) for d in self._deployments(None)] if self._router is not None else []
        return {"decisions": dict(self.decisions), "in_flight": self._loads(ids)}

    def _deployments(self, model: Optional[str]) -> list[dict[str, Any]]:
        if self._router is None:
            raise RuntimeError("PrefixAwareRouting is not installed on a Router (call install(router))")
        if model is None:
            return list(self._router.registry().deployments())
        found = list(self._router.registry().deployments(model) or [])
        if not found:
            raise litellm.BadRequestError(f"no deployment serves model {model!r}", model=model, llm_provider="")
        return found

    def _pick(
        self, deployments: list[dict[str, Any]], cooling: set, messages: Any, request_kwargs: Optional[dict[str, Any]]
    ) -> dict[str, Any]:
        kwargs = request_kwargs if request_kwargs is not None else {}
        meta = _metadata(kwargs)
        if meta is None:
            meta = kwargs.setdefault("metadata", {})
        # LiteLLM writes into the caller's metadata dict, which a caller may pass to many
        # calls: the token and the replicas tried belong to one call (its trace id, the same
        # across the Router's retries), never to the next call with the same dict.
        trace = kwargs.get("litellm_trace_id")
        if trace is None or meta.get(TRACE_KEY) != trace or TOKEN_KEY not in meta:
            meta.update({TRACE_KEY: trace, TOKEN_KEY: uuid.uuid4().hex, TRIED_KEY: []})
        token, tried = meta[TOKEN_KEY], meta[TRIED_KEY]
        ids = [deployment_id(d) for d in deployments]
        eligible = [i for i in ids if i not in cooling and i not in tried] or [i for i in ids if i not in cooling] or ids
        choice = self._choose(deployments, eligible, messages if messages is not None else kwargs.get("messages"), kwargs.get("tools"))
        self.decisions[choice.reason] += 1
        self.inflight.start(token, choice.replica)
        tried.append(choice.replica)
        return deployments[ids.index(choice.replica)]

    def _choose(self, deployments: Sequence[Mapping[str, Any]], eligible: list[str], messages: Any, tools: Any) -> Choice:
        all_ids = tuple(sorted(deployment_id(d) for d in deployments))
        ring = self._rings.get(all_ids)
        if ring is None:
            ring = self._rings[all_ids] = HashRing(all_ids, self.vnodes)
        caps = {}
        for d in deployments:
            limit = (d.get("litellm_params") or {}).get("max_parallel_requests")
            caps[deployment_id(d)] = int(limit) if limit else self.max_inflight
        key = prefix_key(messages, tools, max_chars=self.prefix_chars, mode=self.key_mode)
        return choose(ring, key, self._loads(eligible), caps, self.balance)

    def _loads(self, ids: Sequence[str]) -> dict[str, int]:
        loads = self.inflight.loads(ids)
        for replica in ids:
            scraped = self.scraped.get(replica)
            if scraped is not None and scraped > loads[replica]:
                loads[replica] = scraped
        return loads

    # -- call events: the request left the replica ------------------------------------------

    def _ended(self, kwargs: Mapping[str, Any]) -> None:
        params = kwargs.get("litellm_params") or {}
        meta = _metadata(params) or {}
        token = meta.get(TOKEN_KEY)
        if token is not None:
            replica = (params.get("model_info") or {}).get("id")
            self.inflight.finish(str(token), None if replica is None else str(replica))

    # -- scraping /metrics ------------------------------------------------------------------

    def _ensure_scraper(self) -> None:
        if self.scrape_interval_s is None or (self._scraper is not None and not self._scraper.done()):
            return
        self._scraper = asyncio.get_running_loop().create_task(self._scrape_forever())

    async def _scrape_forever(self) -> None:
        async with httpx.AsyncClient(timeout=max(0.5, self.scrape_interval_s or 1.0), trust_env=False) as client:
            while True:
                await self.scrape_once(client)
                await asyncio.sleep(self.scrape_interval_s or 1.0)

    async def scrape_once(self, client: httpx.AsyncClient) -> None:
        """Read every replica's ``/metrics`` once and record its load."""
        for d in self._deployments(None):
            params = d.get("litellm_params") or {}
            url = (d.get("model_info") or {}).get("metrics_url") or metrics_url(params.get("api_base"))
            if not url:
                continue
            key = params.get("api_key")  # a LiteLLM replica asks for its key on /metrics
            headers = {"Authorization": f"Bearer {key}"} if isinstance(key, str) and key else {}
            try:
                response = await client.get(url, headers=headers, follow_redirects=True)
                load = scraped_load(response.text) if response.status_code == 200 else None
            except httpx.HTTPError:
                continue
            if load is not None:
                self.scraped.record(deployment_id(d), load)


class _EndRelay(_CallEnds):
    """One callback that tells every installed strategy a call ended. (Each strategy as its
    own callback did not work: with two installed in one process, litellm 1.110 delivered
    the events of the second one's calls to the first only.)"""

    def __init__(self) -> None:
        super().__init__()
        self.strategies: "weakref.WeakSet[PrefixAwareRouting]" = weakref.WeakSet()

    def _ended(self, kwargs: Any) -> None:
        for strategy in list(self.strategies):
            strategy._ended(kwargs)


_relay = _EndRelay()

prefix_aware_routing = PrefixAwareRouting()
"""The instance a LiteLLM proxy config names under ``litellm_settings.callbacks``."""
