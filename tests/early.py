"""Subprocess checks started early: when the session's tests are collected, each test marked
``@pytest.mark.early(command=...)`` has its child process queued, and the queue runs them one at a
time beside the other tests, at a low CPU priority (most tests keep one core of two busy; a
compile or a fuzz run fills the other). The test then waits for its child's result and
asserts on it as before; a child not yet started when its test comes is run by the test itself.

``command(params)`` (a keyword argument: pytest takes a marker's one positional callable for the
marked function; ``params``: the test's parametrization, a dict) returns a :class:`Command`,
or None where the test will skip without it. It runs at collection, before any fixture: it may
read the test's parameters, files and the environment set when the session started (the
kernel home, tests/conftest.py), not fixtures.

Under pytest-xdist (scripts/gpu_check.sh) every worker collects every test, so there nothing is
started early: each test runs its own child when it comes.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest


@dataclass
class Command:
    """A child process to run: ``subprocess.run(args, env=env, cwd=cwd, timeout=timeout)``, the
    timeout counted from when its test begins to wait for it."""

    args: list[str]
    env: Optional[dict[str, str]] = None
    cwd: Optional[Path] = None
    timeout: float = 600
    files: Optional[Path] = None  # a folder the child writes into, for its test to read


@dataclass
class _Job:
    command: Command
    folder: Path  # where the child's stdout and stderr are written
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    result: Optional[subprocess.CompletedProcess] = None
    process: Optional[subprocess.Popen] = None
    timed_out: bool = False


_jobs: dict[str, _Job] = {}
_queue: "queue.Queue[Optional[str]]" = queue.Queue()
_lock = threading.Lock()
_root: Optional[Path] = None
_stopping = threading.Event()
NICENESS = 10
"""The children's priority: at 10 a child gets ~10% of a core that a test's own threads want
(CFS weights 110 against 1024), enough that the fuzz runs' 60 s hang limit per call holds."""


def scratch(name: str) -> Path:
    """A fresh folder for a command's files (removed when the session ends)."""
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="early-checks-"))
    return Path(tempfile.mkdtemp(prefix=name.replace("/", "_")[:40] + "-", dir=_root))


def _run(job: _Job, low_priority: bool) -> None:
    """Run the job's child to its end; without a time limit, which :func:`result` applies."""
    command = job.command
    out, err = job.folder / "stdout", job.folder / "stderr"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        try:
            process = subprocess.Popen(command.args, env=command.env, cwd=command.cwd, stdout=stdout, stderr=stderr, start_new_session=True)
        except OSError as exc:
            job.result = subprocess.CompletedProcess(command.args, 1, "", str(exc))
            job.done.set()
            return
        if low_priority:  # (the processes it starts inherit it)
            try:
                os.setpriority(os.PRIO_PROCESS, process.pid, NICENESS)
            except OSError:
                pass
        with _lock:
            job.process = process
            if _stopping.is_set() or job.timed_out:
                _kill(process)
        code = process.wait()
        if job.timed_out:
            stderr.write(f"\n[killed: still running {command.timeout} s after its test began waiting]\n".encode())
    try:
        job.result = subprocess.CompletedProcess(command.args, code, out.read_text(errors="replace"), err.read_text(errors="replace"))
    except OSError as exc:  # (the session ended and removed the folder)
        job.result = subprocess.CompletedProcess(command.args, code, "", str(exc))
    job.done.set()


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, 9)
    except OSError:
        pass


def _worker() -> None:
    while not _stopping.is_set():
        key = _queue.get()
        if key is None:
            return
        with _lock:
            job = _jobs[key]
            if job.started:  # its test came first and runs it
                continue
            job.started = True
        _run(job, low_priority=True)


def _command_of(item: pytest.Item) -> Optional[Command]:
    marker = item.get_closest_marker("early")
    if marker is None:
        return None
    params = dict(item.callspec.params) if hasattr(item, "callspec") else {}
    return marker.kwargs["command"](params)


def start(items: list[pytest.Item]) -> None:
    """Queue the children of the marked tests among ``items``, in their order, and start the queue."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in items:
        command = _command_of(item)
        if command is not None:
            if command.env is None:  # the environment as collected: tests change os.environ while it waits
                command.env = dict(os.environ)
            _jobs[item.nodeid] = _Job(command, scratch(item.name))
            _queue.put(item.nodeid)
    if _jobs:
        threading.Thread(target=_worker, name="early-checks", daemon=True).start()


def result(request: pytest.FixtureRequest) -> subprocess.CompletedProcess:
    """The finished child of the calling test (run now, in the test, if it has not started)."""
    node = request.node
    with _lock:
        job = _jobs.get(node.nodeid)
        if job is None:
            command = _command_of(node)
            assert command is not None, f"{node.nodeid} has no early command (or it returned None: skip before asking)"
            job = _jobs[node.nodeid] = _Job(command, scratch(node.name))
        run_here = not job.started
        job.started = True
    if run_here:
        threading.Thread(target=_run, args=(job, False), name="early-check", daemon=True).start()
    if not job.done.wait(job.command.timeout):
        with _lock:
            job.timed_out = True
            if job.process is not None:
                _kill(job.process)
        job.done.wait()
    assert job.result is not None
    return job.result


def command(request: pytest.FixtureRequest) -> Command:
    """The command of the calling test's child (its environment included)."""
    return _jobs[request.node.nodeid].command


def stop() -> None:
    """Kill what still runs, drop what waits, remove the scratch folders (session end)."""
    _stopping.set()
    with _lock:
        for job in _jobs.values():
            job.started = True
            if job.process is not None and job.process.poll() is None:
                _kill(job.process)
    _queue.put(None)
    if _root is not None:
        shutil.rmtree(_root, ignore_errors=True)
