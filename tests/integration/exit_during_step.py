"""Run as a script by ``test_exit_during_step.py``: submit one request whose prefill is a
single long step, then let the interpreter exit while that step computes.

Prints ``waiter: <outcome>`` once the request's caller (a daemon thread) has its answer;
an exit handler registered before the engine's (so it runs after it) waits for that line.
Usage: ``exit_during_step.py MODEL_DIR PROMPT_TOKENS SHUTDOWN_TIMEOUT_S EXIT_STATUS``
"""

import atexit
import sys
import threading
import time

outcome: list[str] = []


def _report() -> None:  # runs after the engine's own exit handler (registered later)
    waiter.join(30)
    print(f"waiter: {outcome[0] if outcome else 'no answer'} {time.monotonic() - exit_began:.2f}s after exit began", flush=True)


atexit.register(_report)

from mlx_parallm_provider.config import EngineConfig  # noqa: E402
from mlx_parallm_provider.engine import Engine, SamplingParams  # noqa: E402

folder, prompt_tokens, window = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
config = EngineConfig(prefill_chunk_size=16384, max_num_batched_tokens=16384, shutdown_timeout_s=window)
engine = Engine(folder, config)
started = threading.Event()


def _wait() -> None:
    started.set()
    try:
        engine.generate_sync(list(range(100, 100 + prompt_tokens)), SamplingParams(max_tokens=4, ignore_eos=True))
        outcome.append("completed")
    except BaseException as exc:
        outcome.append(type(exc).__name__)


waiter = threading.Thread(target=_wait, daemon=True)
waiter.start()
started.wait()
time.sleep(0.3 + window)  # the prefill step is under way (the batch window is 5 ms)
exit_began = time.monotonic()
print("exiting", flush=True)
sys.exit(int(sys.argv[4]))
