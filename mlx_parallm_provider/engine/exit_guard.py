"""Interpreter exit never waits on a step still computing.

MLX cannot interrupt a step (one prefill piece of a long prompt can take minutes on a CPU),
and the process must not reach the native exit handlers while one computes: OpenBLAS's
handler joins its threads while MLX still uses them and can hang for good, and MLX's
thread-local destructors abort the process if the worker's thread ends during
finalization. So at exit every worker gets ``shutdown_timeout_s`` to finish its step
(:meth:`EngineCore.stop`, which past it fails the requests still in flight with
``EngineDeadError``), and if a step still computes then, the native exit handlers are
skipped: Python's own exit (the other ``atexit`` handlers, flushing ``sys.stdout``) runs as
usual, then the C library's ``exit`` ends the process at once with the interpreter's exit
status (glibc ``on_exit(_exit)``). Without ``on_exit``, ``os._exit(1)`` after flushing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

_workers: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register(worker: Any) -> None:
    """Track a worker (its running thread keeps it alive) until the process exits."""
    _workers.add(worker)


def shut_down_at_exit(shutdown_engines: Callable[[], None]) -> None:
    """Run ``shutdown_engines``, stop workers already shut down but still inside a step,
    and if a step still computes, make the process end without the native exit handlers."""
    shutdown_engines()
    stuck = [w for w in list(_workers) if w.computing and not w.stop()]
    if not stuck:
        return
    logger.warning("%d mlx-parallm worker(s) still inside a step at exit; skipping native exit handlers", len(stuck))
    if not skip_native_exit_handlers():
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(1)


def skip_native_exit_handlers() -> bool:
    """Make the C library's ``exit`` call ``_exit`` with its status before any handler
    registered so far (C++ static destructors, OpenBLAS's, MLX's). True if registered."""
    try:
        libc = ctypes.CDLL(None)
        on_exit, exit_now = libc.on_exit, libc._exit
    except (OSError, AttributeError):
        return False
    on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    on_exit.restype = ctypes.c_int
    return on_exit(ctypes.cast(exit_now, ctypes.c_void_p), None) == 0


def wait_for_native_exit(thread: threading.Thread, timeout: float) -> None:
    """Wait until the OS thread behind ``thread`` is gone, not only its Python state.

    ``join()`` returns before the thread's C++ thread-local destructors run, and MLX's
    per-thread compile cache releases Python objects there. If the interpreter starts
    finalizing meanwhile (a script ending right after shutdown), that destructor cannot get
    the GIL and the process aborts ("terminate called without an active exception").
    """
    native_id = thread.native_id
    task = Path(f"/proc/self/task/{native_id}")
    if native_id is None or not Path("/proc/self/task").is_dir():
        time.sleep(0.05)  # no /proc (macOS): give the destructors a moment
        return
    deadline = time.monotonic() + timeout
    while task.exists() and time.monotonic() < deadline:
        time.sleep(0.002)
