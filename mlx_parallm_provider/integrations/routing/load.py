"""Load signals for routing: requests the router itself has in flight on each replica, and
what each replica's ``/metrics`` last said it was running and queueing."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable
from typing import Callable, Optional

Clock = Callable[[], float]

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFaN]+)")


class InFlight:
    """Requests sent to each replica and not yet answered, keyed by a per-request token.

    A retry of the same request (same token) moves it to its new replica; an entry older
    than ``ttl_s`` is dropped, so a request whose end was never reported cannot hold a
    replica's count up for ever. Thread-safe.
    """

    def __init__(self, ttl_s: float = 600.0, clock: Clock = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._where: dict[str, tuple[str, float]] = {}

    def start(self, token: str, replica: str) -> None:
        """The request ``token`` was sent to ``replica``."""
        with self._lock:
            self._where[token] = (replica, self._clock())

    def finish(self, token: str, replica: Optional[str] = None) -> None:
        """The request ``token`` ended on ``replica`` (None: wherever it is)."""
        with self._lock:
            where = self._where.get(token)
            if where is not None and (replica is None or where[0] == replica):
                del self._where[token]

    def loads(self, replicas: Iterable[str]) -> dict[str, int]:
        """Requests in flight per replica (0 for those with none)."""
        counts = {r: 0 for r in replicas}
        cutoff = self._clock() - self._ttl_s
        with self._lock:
            for token, (replica, since) in list(self._where.items()):
                if since < cutoff:
                    del self._where[token]
                elif replica in counts:
                    counts[replica] += 1
        return counts

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)


def scraped_load(text: str, names: tuple[str, ...] = ("num_requests_running", "num_requests_waiting")) -> Optional[int]:
    """Requests running plus waiting in a Prometheus text exposition (every series whose
    name ends with one of ``names``, whatever its prefix or labels, summed); None if none."""
    total, found = 0.0, False
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1).endswith(names):
            try:
                total += float(match.group(3))
            except ValueError:
                continue
            found = True
    return int(round(total)) if found else None


class ScrapedLoads:
    """The last load each replica's ``/metrics`` reported, trusted for ``max_age_s``."""

    def __init__(self, max_age_s: float = 5.0, clock: Clock = time.monotonic) -> None:
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, tuple[int, float]] = {}

    def record(self, replica: str, load: int) -> None:
        """``replica`` reported ``load`` requests running or waiting just now."""
        with self._lock:
            self._last[replica] = (load, self._clock())

    def get(self, replica: str) -> Optional[int]:
        """The replica's last reported load, if recent enough."""
        with self._lock:
            last = self._last.get(replica)
        if last is None or self._clock() - last[1] > self._max_age_s:
            return None
        return last[0]


def metrics_url(api_base: Optional[str]) -> Optional[str]:
    """A replica's ``/metrics`` address from its OpenAI ``api_base`` (``http://h:p/v1``)."""
    if not api_base:
        return None
    base = api_base.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base + "/metrics"
