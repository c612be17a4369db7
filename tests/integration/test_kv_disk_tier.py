"""The prefix store's disk tier: blocks written by one engine are loaded by the next (another
process, a restart) instead of prefilled, with the same answers; damaged, foreign or partly
written files are skipped and counted; the folder stays under its bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine_helpers import scrape
from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.engine.kv.disk_tier import SUFFIX, BlockData, DiskKVTier
from mlx_parallm_provider.errors import InvalidParameterError

PREFIX = [100 + j % 50 for j in range(200)]  # 12 whole blocks of 16, and 8 tokens more
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def _engine(make_engine, folder: Path, **config):
    return make_engine(kv_disk_path=str(folder), **config)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIX))


def _written(engine) -> None:
    engine._core.memory.disk.flush()  # noqa: SLF001 (the writer runs behind the loop)


def test_a_new_engine_loads_a_prefix_another_wrote_and_answers_as_a_cold_one(make_engine, tmp_path) -> None:
    first = _engine(make_engine, tmp_path)
    first.generate_sync(PREFIX + [7, 8], PARAMS)
    first.shutdown()  # (writes what is queued)
    assert len(_files(tmp_path)) >= 12  # the prompt's whole blocks (and the answer's)

    second = _engine(make_engine, tmp_path)
    got = second.generate_sync(PREFIX + [9, 10], PARAMS)
    cold = make_engine(enable_prefix_caching=False).generate_sync(PREFIX + [9, 10], PARAMS)
    assert got.token_ids == cold.token_ids
    stats = second.stats()
    assert stats["kv_disk"]["hits"] == 12 and stats["kv_disk"]["loaded_tokens"] == 192
    assert stats["cached_prompt_tokens"] == 192  # counted as cached, as a memory hit is
    assert got.usage.cached_tokens == 192  # (OpenAI's usage.prompt_tokens_details.cached_tokens)
    assert stats["kv_tiers"]["disk"]["hit_tokens"] == 192 and stats["kv_tiers"]["memory"]["hit_tokens"] == 0
    assert stats["kv_tiers"]["disk"]["bytes"] > 0
    metrics = scrape(second)
    assert metrics["vllm:prefix_cache_tier_hit_tokens_total{'model_name': 'tiny', 'tier': 'disk'}"] == 192
    assert metrics["vllm:kv_disk_skipped_files_total{'model_name': 'tiny'}"] == 0


def test_damaged_and_foreign_block_files_are_skipped_counted_and_never_served(make_engine, tmp_path) -> None:
    first = _engine(make_engine, tmp_path)
    first.generate_sync(PREFIX + [7, 8], PARAMS)
    first.shutdown()
    files = _files(tmp_path)
    cold = make_engine(enable_prefix_caching=False).generate_sync(PREFIX + [9, 10], PARAMS).token_ids
    # Which file holds which block is not known from outside: damage all but a few, differently.
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if i % 3 == 0:
            path.write_bytes(data[: len(data) // 2])  # truncated
        elif i % 3 == 1:
            data[len(data) // 2] ^= 0x10  # one bit flipped
            path.write_bytes(bytes(data))
    second = _engine(make_engine, tmp_path)
    got = second.generate_sync(PREFIX + [9, 10], PARAMS)
    assert got.token_ids == cold
    disk = second.stats()["kv_disk"]
    assert disk["corrupt"] >= 1 and disk["hits"] < 12

    # A folder written for another KV dtype: names differ, nothing is read as ours.
    third = _engine(make_engine, tmp_path, kv_cache_dtype="float16")
    third.generate_sync(PREFIX + [9, 10], PARAMS)
    assert third.stats()["kv_disk"]["hits"] == 0


def test_a_foreign_file_under_our_name_is_refused(tmp_path) -> None:
    ours, theirs = DiskKVTier(tmp_path, 1 << 30, b"a" * 16), DiskKVTier(tmp_path, 1 << 30, b"b" * 16)
    name = ours.names([1, 2, 3, 4], 1, 4)[0]
    theirs.save(name, BlockData(["float32"], [np.ones((4, 2, 8), np.float32)]))  # under our name, their identity
    theirs.flush()
    assert ours.load([name], 8) == [] and ours.stats.corrupt == 1
    ours.save(name, BlockData(["float32"], [np.full((4, 2, 8), 3.0, np.float32)]))
    ours.flush()
    (block,) = ours.load([name], 8)
    assert block.dtypes == ["float32"] and np.array_equal(block.arrays[0], np.full((4, 2, 8), 3.0, np.float32))
    for tier in (ours, theirs):
        tier.close()


def test_the_folder_stays_under_its_bound_evicting_the_least_recently_used(tmp_path) -> None:
    block = BlockData(["float32"], [np.zeros((16, 2, 64), np.float32)])  # 8 KiB of data a file
    size = 8192 + 200
    tier = DiskKVTier(tmp_path, 20 * size, b"c" * 16)
    names = tier.names(list(range(16 * 60)), 60, 16)
    tier.save(names[0], block)
    tier.flush()
    for i, name in enumerate(names[1:], 1):
        tier.save(name, block)
        tier.flush()
        os.utime(tier.path(names[0]), (time.time() + i, time.time() + i))  # the first block stays in use
        total = sum(p.stat().st_size for p in _files(tmp_path))
        assert total <= 20 * size
    assert tier.stats.evictions > 0
    assert tier.path(names[0]).exists() and not tier.path(names[1]).exists()
    tier.close()


def test_the_disk_tier_needs_the_prefix_store_and_a_folder_it_can_write(make_engine, tmp_path) -> None:
    from mlx_parallm_provider import EngineConfig

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(InvalidParameterError, match="kv_disk_path"):
        make_engine(kv_disk_path=str(blocker / "kv"))  # a folder under a regular file

    with pytest.raises(InvalidParameterError, match="kv_disk_path"):
        EngineConfig(kv_disk_path="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(InvalidParameterError, match="kv_disk_gb"):
        EngineConfig(kv_disk_path="/tmp/x", kv_disk_gb=0)


_WRITER = """
import sys, numpy as np
from mlx_parallm_provider.engine.kv.disk_tier import DiskKVTier, BlockData
tier = DiskKVTier(sys.argv[1], 1 << 34, b"d" * 16)
block = BlockData(["float32"], [np.ones((16, 8, 4096), np.float32)])  # 2 MiB a file: writes take a while
names = tier.names(list(range(16 * 100000)), 100000, 16)
print("ready", flush=True)
for name in names:
    tier.save(name, block)
    tier.flush()
"""


def test_a_process_killed_while_writing_leaves_a_folder_the_next_one_uses(tmp_path) -> None:
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "ready"
    deadline = time.time() + 60
    while len(_files(tmp_path)) < 3 and time.time() < deadline:
        time.sleep(0.05)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    tier = DiskKVTier(tmp_path, 1 << 34, b"d" * 16)
    names = tier.names(list(range(16 * 100000)), 100000, 16)
    written = len(_files(tmp_path))
    found = tier.load(names, written + 5)
    assert len(found) >= written - 1 and tier.stats.corrupt == 0  # every whole file reads back; none half-written
    for old in tmp_path.glob(".*.tmp"):  # what the killed writer left: removed once stale
        os.utime(old, (time.time() - 3600, time.time() - 3600))
    tier.close()
    DiskKVTier(tmp_path, 1 << 34, b"d" * 16).close()
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_last_answer_is_saved_though_nothing_follows_it(make_engine, tmp_path) -> None:
    # One token: the prompt's blocks and the answer are named in the step that ends it; no
    # later step would copy them out for the writer.
    engine = _engine(make_engine, tmp_path)
    engine.generate_sync(PREFIX, SamplingParams(max_tokens=1))
    deadline = time.monotonic() + 10
    while len(_files(tmp_path)) < 12 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_files(tmp_path)) == 12  # all 200 tokens' whole blocks, saved by an idle step
