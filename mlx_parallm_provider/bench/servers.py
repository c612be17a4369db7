"""OpenAI-compatible servers the benchmark starts on loopback and always stops: the LiteLLM
proxy serving this package, ``mlx_lm.server`` and llama.cpp's ``llama-server``."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import httpx

from ..config import child_environment
from .runners.base import SkipSystem

START_LIMIT_S = 300.0

# Started here and not yet stopped, by process id: each runs in its own session, which a signal
# to this process does not reach, so SIGTERM and ^C pass on to them (see stopped_on_signal).
_running: dict[int, "Server"] = {}


def peak_rss_mb(pid: "int | str" = "self") -> Optional[float]:
    """A process's peak resident memory in MiB (Linux ``VmHWM``; ``"self"``: this process),
    or None where ``/proc`` does not tell."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


@dataclass
class Server:
    """A started server process: where it listens and the key it wants."""

    process: subprocess.Popen
    base_url: str
    api_key: Optional[str]
    log: Path

    def peak_rss_mb(self) -> Optional[float]:
        """The server process's peak resident memory (Linux ``VmHWM``), or None."""
        return peak_rss_mb(self.process.pid)

    def stop(self) -> None:
        """SIGTERM the server's process group, then SIGKILL it if it lingers."""
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if self.process.poll() is not None:
                break
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(timeout=wait_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        _running.pop(self.process.pid, None)


@contextlib.contextmanager
def stopped_on_signal(note: str = "") -> Iterator[None]:
    """While inside (in the main thread), SIGTERM (a time limit, a process manager) or SIGINT
    (^C) ends this process as it would have, the servers started here and not yet stopped
    first: each runs in its own session, which neither signal reaches, so each process group
    is sent SIGTERM, and ``note`` goes to stderr. Outside, the signals keep their handlers."""

    def pass_on(signum: int, frame: object) -> None:
        for pid in list(_running):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        if note:
            print(f"{note} ({signal.Signals(signum).name})", file=sys.stderr, flush=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    ours = (signal.SIGTERM, signal.SIGINT)
    try:
        previous = {sig: signal.signal(sig, pass_on) for sig in ours}
    except ValueError:  # not the main thread: signals are not ours to handle
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], env: dict[str, str], port: int, health_path: str, log: Path, api_key: Optional[str] = None) -> Server:
    """Start ``command`` in its own process group and wait until ``health_path`` answers 200."""
    base_url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    server = _running[process.pid] = Server(process, base_url, api_key, log)
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            _running.pop(process.pid, None)
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise SkipSystem(f"{command[0]} exited with {process.returncode} ({tail[0][:200]}; log: {log})")
        try:
            if httpx.get(base_url + health_path, timeout=2, trust_env=False).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop()
    raise SkipSystem(f"{command[0]} was not ready after {START_LIMIT_S:.0f}s (log: {log})")


def litellm_proxy(model: str, folder: Path) -> Server:
    """The LiteLLM proxy (``litellm --config``) serving ``mlx-parallm/<model>`` as ``bench``."""
    try:
        import fastapi  # noqa: F401
    except ImportError:
        raise SkipSystem("the LiteLLM proxy needs its server dependencies: pip install 'mlx-parallm-provider[proxy]'") from None
    beside = Path(sys.executable).with_name("litellm")
    cli = str(beside) if beside.exists() else shutil.which("litellm")
    if cli is None:
        raise SkipSystem("the `litellm` command is not installed")
    key = "sk-" + secrets.token_hex(16)
    config = {
        "model_list": [{"model_name": "bench", "litellm_params": {"model": f"mlx-parallm/{model}"}}],
        "litellm_settings": {"custom_provider_map": [{"provider": "mlx-parallm", "custom_handler": "mlx_parallm_provider.litellm_handler"}]},
        "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY"},
    }
    path = folder / "litellm_proxy_config.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    port = free_port()
    env = child_environment(LITELLM_MASTER_KEY=key, LITELLM_LOCAL_MODEL_COST_MAP="True")
    command = [cli, "--config", str(path), "--host", "127.0.0.1", "--port", str(port)]
    return start(command, env, port, "/health/liveliness", folder / "litellm-proxy.log", api_key=key)


MLX_LM_DECODE_CONCURRENCY = 32
"""``mlx_lm.server``'s own ``--decode-concurrency`` (requests it decodes at once)."""


def mlx_lm_server(model_dir: Path, folder: Path, concurrency: Optional[int] = None) -> Server:
    """``mlx_lm.server`` on the model folder, with the same BLAS as this package loads,
    decoding at least ``concurrency`` requests at once (its default, 32, where fewer: a
    wider run would otherwise queue behind its cap, as a llama-server with too few slots)."""
    port = free_port()
    decode = max(MLX_LM_DECODE_CONCURRENCY, concurrency or 0)
    # Importing the package first preloads OpenBLAS for MLX's CPU backend, as for the engine.
    bootstrap = "import sys, mlx_parallm_provider; from mlx_lm.server import main; sys.exit(main())"
    command = [sys.executable, "-c", bootstrap, "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING",
               "--decode-concurrency", str(decode)]
    return start(command, child_environment(), port, "/health", folder / "mlx-lm-server.log")


def llama_server(gguf: Path, folder: Path, slots: int, ctx_per_slot: int, threads: int) -> Server:
    """llama.cpp's ``llama-server`` (the ``xllamacpp`` wheel's) on ``gguf``, ``slots`` sequences
    of ``ctx_per_slot`` tokens each, on loopback (:mod:`.llama_server`)."""
    port = free_port()
    command = [sys.executable, "-m", "mlx_parallm_provider.bench.llama_server", "--model", str(gguf), "--port", str(port),
               "--slots", str(slots), "--ctx-per-slot", str(ctx_per_slot), "--threads", str(threads)]
    return start(command, child_environment(), port, "/health", folder / f"llama-server-{slots}.log")
