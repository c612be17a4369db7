"""``GET /metrics`` on a LiteLLM proxy serving mlx-parallm: the engines' metrics with vLLM's
names (:mod:`mlx_parallm_provider.engine.prometheus`), next to LiteLLM's own when its
``prometheus`` callback is on too.

Turn it on in the proxy config::

    litellm_settings:
      callbacks: ["mlx_parallm_provider.integrations.prometheus.engine_metrics"]

Loading that callback registers the engines' collector with ``prometheus_client``'s global
registry and mounts ``/metrics`` on the proxy's own port (no key needed, as LiteLLM's own
``/metrics``). In a plain Python process, :func:`register_collector` alone does the first
part; serve the registry as you like (``prometheus_client.start_http_server``).
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Optional

from litellm.integrations.custom_logger import CustomLogger

from ..engine.prometheus import EngineCollector, register_collector

logger = logging.getLogger(__name__)

METRICS_PATH = "/metrics"


class EngineMetricsCallback(CustomLogger):
    """The proxy callback whose loading exports the engines' metrics at ``/metrics``.

    Args:
        prefix: metric name prefix (``"vllm:"`` for tools that expect vLLM's).
        mount: also mount ``/metrics`` on the LiteLLM proxy's app, if this runs in one.
    """

    def __init__(self, prefix: str = "mlx_parallm:", mount: bool = True) -> None:
        super().__init__()
        collector = register_collector(prefix=prefix)
        if collector is None:
            raise ImportError("GET /metrics needs prometheus_client: pip install 'mlx-parallm-provider[proxy]'")
        self.collector: EngineCollector = collector
        self.mounted = mount_metrics_endpoint() if mount else False


def mount_metrics_endpoint() -> bool:
    """Mount ``prometheus_client``'s global registry at ``/metrics`` on the running LiteLLM
    proxy's app unless something is mounted there already; False outside a proxy."""
    proxy_server = sys.modules.get("litellm.proxy.proxy_server")
    app = getattr(proxy_server, "app", None)
    if app is None:  # not in a proxy: importing one here would start building it
        return False
    if any(getattr(route, "path", None) == METRICS_PATH for route in app.routes):
        return True
    from prometheus_client import REGISTRY

    try:
        from litellm.integrations.prometheus_metrics_endpoint import make_metrics_asgi_app
    except ImportError:  # pragma: no cover - older LiteLLM
        from prometheus_client import make_asgi_app as make_metrics_asgi_app
    app.mount(METRICS_PATH, make_metrics_asgi_app(REGISTRY))
    logger.info("engine metrics served at %s", METRICS_PATH)
    return True


_lock = threading.Lock()
_callback: Optional[EngineMetricsCallback] = None


def __getattr__(name: str) -> Any:
    # Built on first access, so that importing this module alone changes nothing.
    global _callback
    if name == "engine_metrics":
        with _lock:
            if _callback is None:
                _callback = EngineMetricsCallback()
            return _callback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EngineMetricsCallback", "mount_metrics_endpoint", "register_collector"]  # and engine_metrics (lazy)
