"""What ``/proc/cpuinfo`` says about this machine's CPU: its text and the CPU's model name.

One reader for ``mlx-parallm doctor``, the benchmarks' ``CPU:`` lines and the kernel cache
key (:func:`mlx_parallm_provider.models.qmatmul.cpu_signature`).
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Optional

CPUINFO = Path("/proc/cpuinfo")


def cpuinfo_text() -> Optional[str]:
    """The text of ``/proc/cpuinfo``; None where it cannot be read (not Linux)."""
    try:
        return CPUINFO.read_text()
    except OSError:
        return None


def cpu_model_name(cpuinfo: Optional[str] = None, *, with_machine: bool = False) -> str:
    """The CPU's model name: the first ``model name`` line of ``cpuinfo`` (default: this
    machine's ``/proc/cpuinfo``), followed by `` (x86_64)`` (:func:`platform.machine`) when
    ``with_machine``; without such a line (arm64 kernels print none, macOS has no file),
    :func:`platform.processor` or else :func:`platform.machine`."""
    text = cpuinfo_text() if cpuinfo is None else cpuinfo
    for line in (text or "").splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
            return f"{name} ({platform.machine()})" if with_machine else name
    return platform.processor() or platform.machine()
