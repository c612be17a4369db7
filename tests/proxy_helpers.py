"""Starting and stopping real ``litellm --config`` proxies on loopback for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningProxy:
    """A proxy subprocess (its own process group), where it listens, and its log."""

    process: subprocess.Popen
    port: int
    key: str
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, timeout: float = 120) -> httpx.Client:
        """An HTTP client that ignores any HTTP(S)_PROXY of the environment."""
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {self.key}"}, timeout=timeout, trust_env=False)


def start_proxy(
    config: dict[str, Any], folder: Path, key: str, env: Optional[dict[str, str]] = None, args: tuple[str, ...] = ()
) -> RunningProxy:
    """Write ``config`` into ``folder`` and start the real ``litellm`` CLI on it (through
    scripts/proxy_with_stats.py, which also publishes engine stats if asked) with the extra
    command-line ``args``, not waiting."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        "LITELLM_MASTER_KEY": key,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        **(env or {}),
    }
    command = [sys.executable, str(REPO / "scripts" / "proxy_with_stats.py"), "--config", str(path), "--host", "127.0.0.1", "--port", str(port), *args]
    log = folder / "proxy.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=full_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return RunningProxy(process, port, key, log)


def wait_ready(proxy: RunningProxy, limit_s: float = 240.0) -> None:
    """Block until the proxy answers its liveliness probe; fail with its log if it exits or
    takes longer than ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proxy.process.poll() is not None:
            raise AssertionError(f"the proxy exited with {proxy.process.returncode}:\n{proxy.log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{proxy.base_url}/health/liveliness", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"the proxy was not ready after {limit_s:.0f}s:\n{proxy.log.read_text()[-4000:]}")


def stop(proxy: RunningProxy, sig: int = signal.SIGTERM) -> None:
    """Signal the proxy's process group (SIGKILL if it lingers after SIGTERM)."""
    process = proxy.process
    if process.poll() is not None:
        return
    for s, wait_s in ((sig, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, s)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
