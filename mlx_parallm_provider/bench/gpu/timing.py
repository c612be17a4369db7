"""Timing for the GPU checks: functions timed in turns, and hooks on one engine's steps and
forward passes (that engine's own attributes, no other)."""

from __future__ import annotations

import io
import statistics
import time
from typing import Any, Callable, Optional

import mlx.core as mx


def timed(fns: dict[str, Callable[[], Any]], repeats: int = 7) -> dict[str, float]:
    """Median milliseconds of each ``fn()`` evaluated (one warm-up each first), the functions
    taking turns in every round so that the machine's drift falls on all of them alike."""
    for fn in fns.values():
        mx.eval(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def timing_steps(core: Any, rows: int) -> list[float]:
    """Time each step of engine ``core`` from now on while ``rows`` requests run (this core's
    only): the whole step, as its worker runs it."""
    times: list[float] = []
    step = core.step

    def timed_step() -> Any:
        full = core.scheduler.num_running == rows
        start = time.perf_counter()
        try:
            return step()
        finally:
            if full:
                times.append(time.perf_counter() - start)

    core.step = timed_step
    return times


def timing_forwards(runner: Any) -> list[tuple[int, int, float, Optional[int]]]:
    """Time each forward pass ``runner`` builds from now on (this runner's only): ``(rows,
    width, seconds, ops)`` of Python and MLX building the pass's graph, evaluating nothing (the
    host's share of a step, which overlaps the device's work on the step before); ``ops``: the
    ops in that graph, counted (after the timing) in the first decode pass (width 1) of each
    row count, else None."""
    timings: list[tuple[int, int, float, Optional[int]]] = []
    counted: set[int] = set()
    build = runner.forward

    def forward(rows: list, pieces: list, starts: list, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = build(rows, pieces, starts, *args, **kwargs)
        seconds = time.perf_counter() - start
        width = max(len(p) for p in pieces)
        nodes = graph_nodes(out) if width == 1 and len(rows) not in counted else None
        if nodes is not None:
            counted.add(len(rows))
        timings.append((len(rows), width, seconds, nodes))
        return out

    runner.forward = forward
    return timings


def graph_nodes(*outputs: mx.array) -> int:
    """The ops (primitives) in the unevaluated graph computing ``outputs``."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return dot.getvalue().count("shape=rectangle")
