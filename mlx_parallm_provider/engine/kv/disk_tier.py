"""The disk tier of the prefix store: whole KV blocks as files in one folder, shared by every
process that opens it (replicas behind a Router, a restarted server).

A block's file is named by the chained hash of its tokens (the hash of the block before it and
its own tokens, as the prefix store names blocks in memory), seeded with the engine's
:func:`kv_identity`: the model's files, the KV dtype, the block size, windows, everything that
changes a block's values. Equal names therefore mean equal KV, whoever wrote them.

A file is written on a background thread (never on the step loop), to a temporary file in the
folder then renamed into place, so a reader sees a whole file or none (a process killed while
writing leaves a temporary file, removed by the next one). It holds a header (magic, the
identity, its name, each array's dtype and shape) and the arrays, then a CRC-32 of both; a
reader checks all of it: a truncated, corrupted or foreign file is skipped, counted and
removed, never served. The folder is kept under its bound by deleting the least recently used
files (a file read is touched); several processes may do so at once (a file gone under a
reader is a miss).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"MPKVBLK2"
"""A block file's first bytes (the format's version is its last character)."""
SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
STALE_TEMP_S = 120.0
"""A temporary file older than this was left by a process killed while writing: removed."""
DIGEST_BYTES = 16
CHECKSUM_BYTES = 4
"""A file ends with the CRC-32 of everything before it (6 GB/s here, 7x blake2b: a 5,000-token
prefix of the default model is 230 MB to check on load)."""
QUEUE_BYTES = 256 << 20
"""Blocks waiting for the writer past this many bytes are dropped (counted): a slow disk
never holds the engine's memory."""
RESCAN_WRITES = 64
"""The folder is measured again every this many writes (other processes write to it too)."""
LOW_WATER = 0.9
"""Eviction frees the folder down to this share of its bound, so it does not run at each write."""


def kv_identity(parts: dict[str, Any], model_path: Optional[Path]) -> bytes:
    """The digest that seeds every block name: ``parts`` (the settings that change KV values:
    dtype, block size, windows, ...) and the model's files (its config, and each weight
    file's name, size, first and last 64 KiB)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    if model_path is not None:
        path = Path(model_path)
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        for p in files:
            if p.name.startswith("."):
                continue
            size = p.stat().st_size
            h.update(f"{p.name}\0{size}\0".encode())
            with open(p, "rb") as f:
                h.update(f.read(1 << 16))
                if size > 1 << 17:
                    f.seek(-(1 << 16), os.SEEK_END)
                    h.update(f.read())
    return h.digest()


def check_folder(folder: str | Path) -> None:
    """Raise :class:`~...errors.InvalidParameterError` (``kv_disk_path``) unless ``folder``
    is, or can be made, a folder this process writes to."""
    from ...errors import InvalidParameterError

    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidParameterError("kv_disk_path", f"cannot create {str(path)!r}: {exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InvalidParameterError("kv_disk_path", f"{str(path)!r} is not writable")


@dataclass
class BlockData:
    """One block's arrays as a file holds them: each one's MLX dtype name and its data."""

    dtypes: list[str]
    arrays: list[np.ndarray]


@dataclass
class TierStats:
    """What the disk tier has done (counts since this process opened it)."""

    hits: int = 0  # blocks read back
    misses: int = 0  # lookups past the last block found
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    evictions: int = 0  # files deleted to keep the bound
    corrupt: int = 0  # files skipped: truncated, bad checksum, foreign, unreadable
    dropped: int = 0  # blocks not written: the writer was too far behind
    write_errors: int = 0
    files: int = 0  # in the folder, as last measured
    folder_bytes: int = 0


class DiskKVTier:
    """Block files in ``folder``, at most ``max_bytes`` of them, for KV of ``identity``.

    Args:
        folder: created if missing (:func:`check_folder`'s error where it cannot be); shared
            with other processes.
        max_bytes: the folder's bound (least recently used files are deleted past it).
        identity: :func:`kv_identity` of the engine's KV.
    """

    def __init__(self, folder: str | Path, max_bytes: int, identity: bytes) -> None:
        self.folder = Path(folder).expanduser()
        check_folder(self.folder)
        self.max_bytes = max(1, int(max_bytes))
        self.identity = identity
        self.stats = TierStats()
        self._lock = threading.Lock()  # stats and the folder's measure (the writer and the loop both count)
        self._queue: queue.Queue[Optional[tuple[bytes, BlockData, int]]] = queue.Queue()  # (name, block, its bytes)
        self._queued_bytes = 0
        self._since_scan = 0
        self._closed = False
        self._clean_temporaries()
        files = self._scan()
        self.stats.files, self.stats.folder_bytes = len(files), sum(size for _, size, _ in files)
        self._writer = threading.Thread(target=self._write_loop, name="mlx-parallm-kv-disk", daemon=True)
        self._writer.start()

    # -- names --------------------------------------------------------------------------

    def names(self, tokens: Sequence[int], blocks: int, block_size: int) -> list[bytes]:
        """The names of the first ``blocks`` whole blocks of ``tokens`` (each the hash of the
        one before it and its own tokens)."""
        names, parent = [], self.identity
        for i in range(blocks):
            h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
            h.update(np.asarray(tokens[i * block_size : (i + 1) * block_size], dtype=np.int64).tobytes())
            parent = h.digest()
            names.append(parent)
        return names

    def path(self, name: bytes) -> Path:
        return self.folder / (name.hex() + SUFFIX)

    # -- reading (the step loop) ---------------------------------------------------------

    def load(self, names: Iterable[bytes], most: int) -> list[BlockData]:
        """The blocks of ``names`` in order, up to the first missing or unusable one, at most
        ``most`` of them."""
        found: list[BlockData] = []
        for name in names:
            if len(found) >= most:
                break
            block = self._read(name)
            if block is None:
                with self._lock:
                    self.stats.misses += 1
                break
            found.append(block)
        return found

    def _read(self, name: bytes) -> Optional[BlockData]:
        path = self.path(name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            return self._reject(path, f"unreadable ({exc})")
        block, why = self._parse(data, name)
        if block is None:
            return self._reject(path, why)
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += len(data)
        return block

    def _parse(self, data: bytes, name: bytes) -> tuple[Optional[BlockData], str]:
        head = len(MAGIC) + 4
        if len(data) < head + CHECKSUM_BYTES or data[: len(MAGIC)] != MAGIC:
            return None, "not a block file (or truncated)"
        (header_len,) = struct.unpack("<I", data[len(MAGIC) : head])
        view = memoryview(data)
        body, (checksum,) = view[:-CHECKSUM_BYTES], struct.unpack("<I", data[-CHECKSUM_BYTES:])
        if len(body) < head + header_len:
            return None, "truncated"
        if zlib.crc32(body) != checksum:
            return None, "checksum mismatch (truncated or corrupted)"
        try:
            header = json.loads(bytes(body[head : head + header_len]))
            if header["identity"] != self.identity.hex() or header["name"] != name.hex():
                return None, "written for other KV (another model or settings)"
            arrays, at = [], head + header_len
            for dtype, shape in header["arrays"]:
                np_dtype, count = np.dtype(header["numpy"][len(arrays)]), int(np.prod(shape))
                if at + count * np_dtype.itemsize > len(body):
                    return None, "truncated"
                arrays.append(np.frombuffer(body, dtype=np_dtype, count=count, offset=at).reshape(shape))
                at += count * np_dtype.itemsize
            if at != len(body):
                return None, "unexpected length"
            return BlockData([d for d, _ in header["arrays"]], arrays), ""
        except (ValueError, KeyError, TypeError) as exc:
            return None, f"bad header ({exc})"

    def _reject(self, path: Path, why: str) -> None:
        logger.warning("KV disk tier: skipped %s: %s", path.name, why)
        with self._lock:
            self.stats.corrupt += 1
        try:
            path.unlink()
        except OSError:
            pass
        return None

    # -- writing (a background thread) -----------------------------------------------------

    def save(self, name: bytes, block: BlockData) -> None:
        """Queue ``block`` to be written as ``name`` (dropped, counted, when the writer is
        :data:`QUEUE_BYTES` behind)."""
        size = sum(a.nbytes for a in block.arrays)
        with self._lock:
            if self._closed or self._queued_bytes + size > QUEUE_BYTES:
                self.stats.dropped += 1
                return
            self._queued_bytes += size
        self._queue.put((name, block, size))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (or ``timeout`` passes); True if all were."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.005)
        return self._queue.unfinished_tasks == 0

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to ``timeout``), then stop the writer."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush(timeout)
        self._queue.put(None)
        self._writer.join(timeout)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                name, block, size = item
                try:
                    self._write(name, block)
                except OSError as exc:
                    logger.warning("KV disk tier: could not write a block: %s", exc)
                    with self._lock:
                        self.stats.write_errors += 1
                finally:
                    with self._lock:
                        self._queued_bytes -= size
            finally:
                self._queue.task_done()

    def _write(self, name: bytes, block: BlockData) -> None:
        path = self.path(name)
        if path.exists():  # another process (or an earlier turn) wrote it: the same KV
            try:
                os.utime(path)
            except OSError:
                pass
            return
        arrays = [np.ascontiguousarray(a) for a in block.arrays]
        header = json.dumps({
            "identity": self.identity.hex(), "name": name.hex(),
            "arrays": [[d, list(a.shape)] for d, a in zip(block.dtypes, arrays)],
            "numpy": [a.dtype.str for a in arrays],
        }).encode()
        parts = [MAGIC, struct.pack("<I", len(header)), header, *(memoryview(a).cast("B") for a in arrays)]
        checksum = 0
        for part in parts:
            checksum = zlib.crc32(part, checksum)
        size = sum(len(p) for p in parts) + CHECKSUM_BYTES
        self._make_room(size)
        temp = self.folder / f".{name.hex()}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"
        try:
            with open(temp, "wb") as f:
                for part in parts:
                    f.write(part)
                f.write(struct.pack("<I", checksum))
            os.replace(temp, path)
        except BaseException:
            try:
                temp.unlink()
            except OSError:
                pass
            raise
        with self._lock:
            self.stats.writes += 1
            self.stats.bytes_written += size
            self.stats.folder_bytes += size
            self.stats.files += 1
            self._since_scan += 1

    def _make_room(self, size: int) -> None:
        """Delete least recently used files until ``size`` more bytes fit the bound (the
        folder measured again every :data:`RESCAN_WRITES` writes, or when it seems full)."""
        with self._lock:
            rescan = self._since_scan >= RESCAN_WRITES or self.stats.folder_bytes + size > self.max_bytes
        if not rescan:
            return
        files = self._scan()
        total = sum(s for _, s, _ in files)
        if total + size > self.max_bytes:
            target = min(self.max_bytes * LOW_WATER, self.max_bytes - size)
            for path, file_size, _ in sorted(files, key=lambda f: f[2]):  # least recently used first
                if total <= target:
                    break
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass  # (another process evicted it)
                except OSError:
                    continue
                total -= file_size
                with self._lock:
                    self.stats.evictions += 1
        with self._lock:
            self.stats.folder_bytes, self.stats.files = total, len(files)
            self._since_scan = 0

    def _scan(self) -> list[tuple[Path, int, float]]:
        """Every block file: (path, size, last use)."""
        files = []
        with os.scandir(self.folder) as it:
            for entry in it:
                if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    files.append((Path(entry.path), st.st_size, st.st_mtime))
        return files

    def _clean_temporaries(self) -> None:
        """Remove temporary files a killed process left (older than :data:`STALE_TEMP_S`)."""
        now = time.time()
        try:
            with os.scandir(self.folder) as it:
                for entry in it:
                    if entry.name.endswith(TEMP_SUFFIX):
                        try:
                            if now - entry.stat().st_mtime > STALE_TEMP_S:
                                os.unlink(entry.path)
                        except OSError:
                            pass
        except OSError:
            pass

    def snapshot(self) -> dict[str, Any]:
        """The tier's counts and bound (``stats()["kv_disk"]``)."""
        with self._lock:
            s = self.stats
            return {"path": str(self.folder), "max_bytes": self.max_bytes, "hits": s.hits, "misses": s.misses,
                    "bytes_read": s.bytes_read, "writes": s.writes, "bytes_written": s.bytes_written, "evictions": s.evictions,
                    "corrupt": s.corrupt, "dropped": s.dropped, "write_errors": s.write_errors, "files": s.files,
                    "folder_bytes": s.folder_bytes, "queued_bytes": self._queued_bytes}
