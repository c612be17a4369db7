"""Run the LiteLLM proxy CLI in this process and publish every mlx-parallm engine's
``stats()`` to a JSON file, so tests and the soak suite can watch the engine inside a
real proxy (running / waiting rows, tokens generated) from outside.

    MLX_PARALLM_STATS_FILE=/tmp/stats.json python scripts/proxy_with_stats.py --config CONFIG ...

Arguments are the ``litellm`` command's. The file is replaced atomically every 50 ms:
``{"<model name>": {...engine.stats()...}, "_process": {"mlx_active_mb": ..., "time": ...}}``
(``time`` is the wall clock just before the stats were read: the file lags the engine by up to
its period, so a reader that needs the state after some moment waits for a later ``time``). SIGUSR1 writes
every thread's stack to stderr (the proxy log), for a test that finds the engine stuck.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time


def _publish(path: str, period_s: float = 0.05) -> None:
    from mlx_parallm_provider.engine import api as coordinator

    while True:
        try:
            taken = time.time()
            stats: dict = {name: engine.stats() for name, engine in list(coordinator._engines.items())}
            stats["_process"] = {"time": taken}
            if "mlx.core" in sys.modules:
                import mlx.core as mx

                stats["_process"]["mlx_active_mb"] = mx.get_active_memory() / 2**20
            with open(path + ".tmp", "w") as f:
                json.dump(stats, f)
            os.replace(path + ".tmp", path)
        except Exception as exc:  # never take the proxy down; say why once in a while
            print(f"proxy_with_stats: {exc!r}", file=sys.stderr)
        time.sleep(period_s)


def main() -> None:
    import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx; registers the provider)

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    path = os.environ.get("MLX_PARALLM_STATS_FILE")
    if path:
        threading.Thread(target=_publish, args=(path,), name="stats-publisher", daemon=True).start()
    from litellm_cli.main import proxy_server

    sys.argv[0] = "litellm"
    sys.exit(proxy_server())


if __name__ == "__main__":
    main()
