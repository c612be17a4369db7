"""The CPU kernels' arm64 paths (NEON through GCC's vector extensions, the portable fallbacks)
compiled for arm64 with Zig's clang as a cross compiler, where no arm64 machine runs the suite:
each source must compile for a plain ARMv8 core and for one with dot products and SVE
(Neoverse V1, Graviton 3). The packed-weight kernel also runs there, under QEMU's user-mode
emulator where it and arm64's C library are installed (``scripts/setup.sh --dev`` installs both
on x86-64 Linux with apt): ``tests/native/qmatmul_check.c`` checks every entry point against
float64 and a row alone against the same row in company, and runs natively too."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Optional

import pytest

import early
from early import Command
from mlx_parallm_provider.models import qmatmul, qmatmul_ext

EM_AARCH64 = 183
"""The ELF header's e_machine of an arm64 object."""

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ziglang") is None, reason="ziglang (a dev dependency on x86-64) is not installed")


def _zig(language: str) -> list[str]:
    """Zig's clang for ``language`` ("cc" or "c++"), targeting arm64 Linux with glibc."""
    return [sys.executable, "-m", "ziglang", language, "-target", "aarch64-linux-gnu"]


def _compile_command(language: str, source: Path, cpu: str, out: Path, includes: list[str]) -> list[str]:
    flags = ["-std=c++20", "-DNDEBUG", "-DNB_COMPACT_ASSERTIONS", "-DNB_DOMAIN=mlx"] if language == "c++" else []
    return [*_zig(language), f"-mcpu={cpu}", "-O2", "-fno-signed-zeros", "-fno-trapping-math", *flags, *[f"-I{p}" for p in includes],
            "-c", str(source), "-o", str(out)]


def _compile(language: str, source: Path, cpu: str, out: Path, includes: list[str]) -> tuple[int, str]:
    done = subprocess.run(_compile_command(language, source, cpu, out, includes), capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr[-3000:]


STAGES = """
import concurrent.futures, json, subprocess, sys
def run(command):
    done = subprocess.run(command, capture_output=True, text=True)
    return [done.returncode, done.stdout, done.stderr[-3000:]]
results = []
with concurrent.futures.ThreadPoolExecutor(2) as pool:
    for stage in json.loads(sys.argv[1]):
        results.append(list(pool.map(run, stage)))
        if any(code != 0 for code, _, _ in results[-1]):
            break
print(json.dumps(results))
"""
"""A child that runs stages of commands, each stage's side by side (two at a time), until one fails."""


def _stages(stages: list[list[list[str]]], folder: Path) -> Command:
    return Command([sys.executable, "-c", STAGES, json.dumps(stages)], files=folder, timeout=900)


def _stage_results(request: pytest.FixtureRequest) -> list[list[tuple[int, str, str]]]:
    """Each stage's ``(returncode, stdout, stderr tail)`` per command, up to the first that failed."""
    out = early.result(request)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _machine(obj: Path) -> int:
    header = obj.read_bytes()[:20]
    assert header[:4] == b"\x7fELF", obj
    return int.from_bytes(header[18:20], "little")


@pytest.mark.parametrize("cpu", ["generic", "neoverse_v1"])
def test_the_packed_weight_kernel_compiles_for_arm64(cpu: str, tmp_path: Path) -> None:
    out = tmp_path / "qmatmul.o"
    status, errors = _compile("cc", qmatmul.SOURCE, cpu, out, [])
    assert status == 0, errors
    assert _machine(out) == EM_AARCH64


def _extension_objects(params: dict) -> Optional[Command]:
    """The extension's sources compiled for Neoverse V1, side by side, into a folder of their own."""
    if importlib.util.find_spec("nanobind") is None or importlib.util.find_spec("ziglang") is None:
        return None
    import mlx.core as mx
    import nanobind

    nb = Path(nanobind.source_dir()).parent
    includes = [sysconfig.get_paths()["include"], str(nb / "include"), str(nb / "ext" / "robin_map" / "include"),
                str(Path(mx.__file__).resolve().parent / "include")]
    folder = early.scratch("arm64-extension")
    return _stages([[_compile_command("c++", source, "neoverse_v1", folder / f"{source.stem}.o", includes) for source in qmatmul_ext.SOURCES]],
                   folder)


@pytest.mark.early(command=_extension_objects)
def test_the_extensions_sources_compile_for_arm64(request: pytest.FixtureRequest) -> None:
    pytest.importorskip("nanobind")
    [compiled] = _stage_results(request)
    failed = {source.name: errors for source, (status, _, errors) in zip(qmatmul_ext.SOURCES, compiled) if status != 0}
    assert not failed, failed
    folder = early.command(request).files
    assert {_machine(folder / f"{source.stem}.o") for source in qmatmul_ext.SOURCES} == {EM_AARCH64}


CHECK = Path(__file__).parents[1] / "native" / "qmatmul_check.c"
"""The packed-weight kernel's standalone check (prints "ALL OK" when every case holds)."""
ARM64_LIBC = Path("/usr/aarch64-linux-gnu")
"""Where Debian's libc6-arm64-cross puts arm64's glibc, the emulator's root for the check's loader."""


def _verdict(code: int, stdout: str, stderr: str) -> None:
    failed = [line for line in stdout.splitlines() if line.startswith("FAIL")]
    assert code == 0 and stdout.strip().endswith("ALL OK") and not failed, (failed or stdout[-2000:]) + stderr[-2000:]


def _emulator() -> Optional[str]:
    """QEMU's arm64 user-mode emulator, where it and arm64's C library are installed."""
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    return qemu if qemu is not None and (ARM64_LIBC / "lib" / "libc.so.6").exists() else None


def _checked_on_arm64(params: dict) -> Optional[Command]:
    """The check and the kernel compiled for ``params["cpu"]``, linked, and run under QEMU."""
    qemu = _emulator()
    if qemu is None or importlib.util.find_spec("ziglang") is None:
        return None
    folder = early.scratch(f"arm64-check-{params['cpu']}")
    objects = [folder / f"{source.stem}.o" for source in (CHECK, qmatmul.SOURCE)]
    compiles = [_compile_command("cc", source, params["cpu"], obj, [str(qmatmul.SOURCE.parent)]) for source, obj in zip((CHECK, qmatmul.SOURCE), objects)]
    # Linked against the system's arm64 glibc, as Zig's stubs of it: ~10 s the first time, where
    # a static musl build of Zig's own was ~90 s. -O2 and no sanitizer here too, or Zig builds
    # its UB sanitizer's runtime for the link.
    exe = folder / "check"
    link = [*_zig("cc"), "-mcpu=generic", "-O2", "-fno-sanitize=undefined", *map(str, objects), "-lm", "-lpthread", "-o", str(exe)]
    return _stages([compiles, [link], [[qemu, "-L", str(ARM64_LIBC), "-cpu", "max", str(exe)]]], folder)


@pytest.mark.early(command=_checked_on_arm64)
@pytest.mark.parametrize("cpu", ["generic", "cortex_a76"])  # NEON; NEON with dot products
def test_the_packed_weight_kernel_computes_right_on_arm64(cpu: str, request: pytest.FixtureRequest) -> None:
    """(SVE builds, Neoverse V1, are compiled above: QEMU emulates SVE ~30x slower than NEON.)"""
    if _emulator() is None:
        pytest.skip("no arm64 emulator (qemu-user-static) or C library (libc6-arm64-cross): the arm64 build is compiled above, not run")
    *built, ran = _stage_results(request)
    for code, _, errors in [result for stage in built for result in stage]:
        assert code == 0, errors
    assert len(built) == 2 and len(ran) == 1, "the check was not built"
    _verdict(*ran[0])
