"""llama.cpp's own HTTP server (``llama-server``, prebuilt in the ``xllamacpp`` wheel), run in
a process of its own for the benchmark: one slot per concurrent request, on loopback.

    python -m mlx_parallm_provider.bench.llama_server --model F.gguf --port N --slots S
        [--ctx-per-slot C] [--threads T]

It serves until it is sent SIGTERM or SIGINT. The benchmark starts and stops it
(:func:`..servers.llama_server`); it is no part of the package's serving path.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--slots", type=int, default=1, help="sequences decoded together (llama-server's --parallel)")
    ap.add_argument("--ctx-per-slot", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.n_parallel = args.slots
    params.n_ctx = args.slots * args.ctx_per_slot
    # A KV stream per slot, as the benchmark's llama-cpp-python runner keeps: with one unified
    # pool every token attends over all the slots' cells (masked).
    params.kv_unified = False
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = args.threads
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = xllamacpp.Server(params)  # listens from here on
    print(f"llama-server listening at {server.listening_address}", flush=True)
    stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
