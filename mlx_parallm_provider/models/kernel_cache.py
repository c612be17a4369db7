"""Built kernels in ``$MLX_PARALLM_HOME/kernels``, written and read back safely.

A kernel is a shared library that is ``dlopen``-ed: a truncated one (a crash during a build,
a full disk) is mapped and then read past its end, which is a SIGBUS, not an exception. So
:func:`install` writes a build through a temporary file in the same folder, fsyncs it and
renames it into place, after a record of its size and sha256 (``<name>.record``, written the
same way); :func:`verified` checks a cached file against its record before anyone loads it,
and removes a file that does not match (or has no record) so that it is built again.

:func:`writable` tells whether a build can be cached at all (an unwritable or invalid home,
e.g. a path under a regular file): where not, the loaders keep MLX's ops, with one warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".record"
_warned: set[str] = set()
_warned_lock = threading.Lock()


def record_path(target: Path) -> Path:
    """Where ``target``'s size and sha256 are recorded."""
    return target.with_name(target.name + RECORD_SUFFIX)


def _digest(path: Path) -> tuple[int, str]:
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def _warn_once(key: str, message: str, *args: object) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message, *args)


def write_error(folder: Path) -> Optional[OSError]:
    """Why ``folder`` cannot be created or written to, or None when it can (it is created)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return exc
    return None


def writable(folder: Path) -> bool:
    """Whether builds can be cached in ``folder`` (created if needed); False, with one warning
    per folder, where it cannot be created or written (callers then keep MLX's ops)."""
    exc = write_error(folder)
    if exc is not None:
        _warn_once(str(folder), "kernel cache %s is not writable (%s): native kernels are not used, MLX's ops are", folder, exc)
    return exc is None


def write_atomic(target: Path, data: bytes, mode: int) -> None:
    """Write ``target`` whole or not at all: a temporary file in its folder, fsynced, renamed
    (a kernel, its record, a benchmark's results)."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def install(built: Path, target: Path) -> Optional[Path]:
    """Put the library ``built`` at ``target`` with its record (see the module docstring) and
    return ``target``; None (logged) where it cannot be written."""
    try:
        data = built.read_bytes()
        record = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        write_atomic(record_path(target), json.dumps(record).encode(), 0o644)  # first: a kernel never lacks its record
        write_atomic(target, data, 0o755)
    except OSError as exc:
        logger.warning("could not write %s (%s): native kernels are not used, MLX's ops are", target, exc)
        return None
    return target


def verified(target: Path) -> bool:
    """Whether ``target`` exists and matches its record. A file that does not (truncated,
    changed, or cached without a record) is removed with a warning so it is built again."""
    if not target.exists():
        return False
    try:
        record = json.loads(record_path(target).read_text())
        expected = (int(record["size"]), str(record["sha256"]))
    except (OSError, ValueError, KeyError, TypeError):
        problem = "has no valid record"
    else:
        try:
            if target.stat().st_size != expected[0]:
                problem = f"is {target.stat().st_size} bytes, {expected[0]} were written"
            elif _digest(target) != expected:
                problem = "does not match the sha256 recorded at build"
            else:
                return True
        except OSError as exc:
            problem = f"cannot be read ({exc})"
    logger.warning("cached kernel %s %s: building it again", target, problem)
    for path in (target, record_path(target)):
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
    return False
