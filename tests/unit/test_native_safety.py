"""Native code loaded safely (issue 21, items 2, 5, 6): a damaged cached kernel is rebuilt,
never loaded (each case in a child process, so a SIGBUS fails the test instead of killing
pytest); an unwritable home keeps MLX's ops and the default model loads; out-of-range thread
counts are clamped."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
import pytest

import early
from early import Command
from mlx_parallm_provider.models import attention, backends, kernel_cache, qmatmul, qmatmul_ext, registry, small_batch
from mlx_parallm_provider.models.backends import CPUKernels, cpu_kernels

REPO = Path(__file__).resolve().parents[2]

# The child loads the kernel from the (damaged) cache and compares it with MLX's ops.
CHILD = """
import mlx_parallm_provider.models  # (the BLAS before mlx)
import mlx.core as mx, mlx.nn as nn, numpy as np
from mlx_parallm_provider.models import {module} as m, small_batch
kernel = m.load()
assert kernel is not None, "no kernel"
w = mx.random.normal((40, 128), key=mx.random.key(0))
layer = nn.QuantizedLinear(128, 40, bias=False, group_size=32, bits=4)
layer.weight, layer.scales, layer.biases = mx.quantize(w, group_size=32, bits=4)
x = mx.random.normal((3, 128), key=mx.random.key(1))
got = small_batch.PackedWeight.from_module(layer).for_kernel(kernel).matmul(kernel, x)
expected = x @ small_batch._float32_weight(layer).T
assert np.allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-4)
print("matches MLX ops")
"""


TRUNCATED = {"ctypes-half": (qmatmul, "half"), "ctypes-4k": (qmatmul, "4k"), "extension-half": (qmatmul_ext, "half")}
"""The kernel and how much of it is left (the extension's rebuild takes ~45 s, so its child starts early)."""


def _load_truncated(params: dict) -> Optional[Command]:
    """A home whose cache holds the built kernel cut short (its record intact), and the
    child that loads the kernel from there."""
    module, size = TRUNCATED[params["case"]]
    built = module.build()  # in the session's home: built once for all tests
    if built is None:
        return None
    home = early.scratch(params["case"])
    cached = home / "kernels" / built.name
    cached.parent.mkdir()
    shutil.copyfile(built, cached)
    if kernel_cache.record_path(built).exists():
        shutil.copyfile(kernel_cache.record_path(built), kernel_cache.record_path(cached))
    os.truncate(cached, built.stat().st_size // 2 if size == "half" else 4096)  # ELF headers intact either way
    env = dict(os.environ, MLX_PARALLM_HOME=str(home), PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return Command([sys.executable, "-c", CHILD.format(module=module.__name__.rsplit(".", 1)[1])], env=env, timeout=300, files=home)


@pytest.mark.early(command=_load_truncated)
@pytest.mark.parametrize("case", list(TRUNCATED))
def test_a_truncated_cached_kernel_is_rebuilt_not_loaded(case: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also, for the extension, what test_small_batch.py's test_build_is_cached_per_source_and_machine
    checks for the ctypes kernel (a second build of its own would cost another ~45 s): the
    build lands in ``$MLX_PARALLM_HOME/kernels`` with its record and nothing else, and is
    found there, not built again."""
    module, _ = TRUNCATED[case]
    built = module.build()
    if built is None:
        pytest.skip(f"{module.__name__} does not build here")
    child = early.result(request)
    home = early.command(request).files
    cached = home / "kernels" / built.name
    assert child.returncode == 0, f"child exited {child.returncode}:\n{child.stderr[-3000:]}"
    assert "matches MLX ops" in child.stdout
    assert "building it again" in child.stderr
    assert cached.stat().st_size == built.stat().st_size and kernel_cache.verified(cached)
    monkeypatch.setenv("MLX_PARALLM_HOME", str(home))
    stamp = cached.stat().st_mtime_ns
    assert module.build() == cached and cached.stat().st_mtime_ns == stamp  # found in the home, not built again
    assert sorted(p.name for p in cached.parent.iterdir()) == [cached.name, cached.name + kernel_cache.RECORD_SUFFIX]


def test_builds_are_recorded_and_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_PARALLM_HOME", str(tmp_path))
    built = qmatmul.build()
    if built is None:
        pytest.skip("no C compiler on this machine")
    assert kernel_cache.verified(built)
    assert sorted(p.name for p in built.parent.iterdir()) == [built.name, built.name + kernel_cache.RECORD_SUFFIX]
    with open(built, "r+b") as f:  # same size, other bytes
        f.seek(100)
        f.write(b"\0" * 16)
    assert not kernel_cache.verified(built) and not built.exists()
    assert qmatmul.build() == built and kernel_cache.verified(built)
    kernel_cache.record_path(built).unlink()  # a file cached without a record is not trusted
    assert not kernel_cache.verified(built) and not built.exists()


@pytest.fixture
def unwritable_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """$MLX_PARALLM_HOME under a regular file (tests run as root, who may write anywhere),
    with the kernels not loaded yet; loaded afresh from the session's home afterwards."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MLX_PARALLM_HOME", str(blocker / "home"))
    qmatmul.reset()
    qmatmul_ext.reset()
    yield blocker / "home"
    qmatmul.reset()
    qmatmul_ext.reset()


def test_an_unwritable_home_keeps_mlx_ops_and_requests_succeed(unwritable_home: Path, make_engine, tiny_model,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from mlx_parallm_provider.engine import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = make_engine()
    with backends.using(tiny_model.model, "cpu"):  # decoding asks for the extension's attention kernel
        with caplog.at_level(logging.WARNING):
            outputs = engine.generate_many_sync([[1, 5, 9], [1, 7]], params)
            assert small_batch.load_kernel() is None  # the kernels report "not used"
    assert [len(o.token_ids) for o in outputs] == [6, 6]
    assert qmatmul.load() is None and qmatmul_ext.load() is None
    warnings = [r for r in caplog.records if "not writable" in r.getMessage()]
    assert len(warnings) == 1 and "MLX's ops" in warnings[0].getMessage()


def test_an_unwritable_home_still_converts_gguf_models(unwritable_home: Path, default_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_fallback_root", None, raising=False)
    folder = registry.converted_gguf_folder(default_gguf)
    assert (folder / "config.json").is_file() and not str(folder).startswith(str(unwritable_home))
    assert registry.converted_gguf_folder(default_gguf) == folder  # converted once per process
    shutil.rmtree(folder.parent, ignore_errors=True)


@pytest.mark.parametrize("raw, expected", [("2147483648", (256, 16)), ("999", (256, 16)), ("0", (1, 1)), ("-1", (1, 1)), ("abc", None), ("3", (3, 3))])
def test_thread_counts_are_bounded(raw: str, expected, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(attention.THREADS_ENV, raw)
    monkeypatch.setenv(cpu_kernels.QMATMUL_THREADS_ENV, raw)
    kernels = CPUKernels()  # the environment is read when a model's backend is made
    assert kernels.attention_threads == (expected[0] if expected else min(os.cpu_count() or 1, 8))
    assert kernels.qmatmul_threads == (expected[1] if expected else min(os.cpu_count() or 1, 2))


def test_a_huge_thread_count_does_not_fail_requests(make_engine, tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_parallm_provider.engine import SamplingParams

    if qmatmul_ext.load() is None:
        pytest.skip("the MLX extension does not build here (no C++ compiler or nanobind)")
    monkeypatch.setenv(attention.THREADS_ENV, "2147483648")
    kernels = CPUKernels()
    assert kernels.attention_threads == attention.MAX_THREADS
    with backends.using(tiny_model.model, kernels):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outputs = make_engine().generate_many_sync([[1, 5, 9], [1, 7]], params)
        q, k = mx.random.normal((2, 4, 1, 16)), mx.random.normal((2, 2, 5, 16))
        got = kernels.decode_attention(q, k, k, 0.25, None)
    assert [len(o.token_ids) for o in outputs] == [6, 6]
    expected = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.25, mask=None)
    assert got is not None and np.allclose(np.asarray(got), np.asarray(expected), atol=2e-6)


def test_every_kernel_source_is_part_of_the_build_keys() -> None:
    """A cached build is keyed by the text of its sources: a kernel file left out of the key
    (a header, the AMX switch in qmatmul_tiles.h) would let an old build be loaded after it changed."""
    from mlx_parallm_provider.models import qmatmul

    keyed = {qmatmul.SOURCE, qmatmul.INT8_HEADER, qmatmul.TILES_HEADER, qmatmul.GEMM_HEADER, qmatmul.LANE_SUMS_HEADER,
             *qmatmul_ext.SOURCES, *qmatmul_ext.HEADERS}
    on_disk = {p for p in qmatmul.SOURCE.parent.iterdir() if p.suffix in (".c", ".cpp", ".h")}
    assert on_disk - keyed == set()
    assert all(p.read_text() in qmatmul.source_text() for p in (qmatmul.SOURCE, qmatmul.TILES_HEADER))
