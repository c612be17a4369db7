"""Threads with a large stack for llguidance's grammar work.

Rust code called through pyo3 runs on the calling thread's stack, and llguidance converts,
validates and builds grammars recursively: deep enough input overflowed a caller's 8 MiB
stack and killed the process (SIGSEGV), where a deeper stack simply finishes.
:func:`run_compiler` runs a function on one of a few daemon threads started with
:data:`STACK_BYTES` of stack (address space, mapped only as it is used) and waits for it.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

logger = logging.getLogger(__name__)

#: Stack of each compiler thread: 10,000 chained ``$ref`` s use about 100 MiB.
STACK_BYTES = 512 << 20
#: Compiler threads: grammars of different requests compile side by side.
THREADS = 2

T = TypeVar("T")

_jobs: "queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple[Any, ...]]]" = queue.SimpleQueue()
_threads: list[threading.Thread] = []
_start_lock = threading.Lock()
_local = threading.local()


def run_compiler(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a compiler thread; its result, or its exception re-raised here."""
    if getattr(_local, "compiler", False):  # already on one: no deadlock waiting on ourselves
        return fn(*args)
    _start_threads()
    future: Future = Future()
    _jobs.put((future, fn, args))
    return future.result()


def _start_threads() -> None:
    with _start_lock:
        if len(_threads) >= THREADS:
            return
        try:
            previous = threading.stack_size(STACK_BYTES)
        except (ValueError, RuntimeError) as error:  # pragma: no cover - a platform without it
            logger.warning("grammar compiler threads keep the default stack: %s", error)
            previous = None
        try:
            while len(_threads) < THREADS:
                thread = threading.Thread(target=_serve, name=f"mlx-parallm-grammar-{len(_threads)}", daemon=True)
                thread.start()
                _threads.append(thread)
        finally:
            if previous is not None:
                threading.stack_size(previous)


def _serve() -> None:
    _local.compiler = True
    while True:
        future, fn, args = _jobs.get()
        if not future.set_running_or_notify_cancel():  # pragma: no cover - never cancelled
            continue
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # handed to the caller
            future.set_exception(error)
