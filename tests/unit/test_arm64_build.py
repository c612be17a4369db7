"""The CPU kernels' arm64 paths (NEON through GCC's vector extensions, the portable fallbacks)
compiled for arm64 with Zig's clang as a cross compiler, where no arm64 machine runs the suite:
each source must compile for a plain ARMv8 core and for one with dot products and SVE
(Neoverse V1, Graviton 3). The packed-weight kernel also runs there, under QEMU's user-mode
emulator where it and arm64's C library are installed (``scripts/setup.sh --dev`` installs both
on x86-64 Linux with apt): ``tests/native/qmatmul_check.c`` checks every entry point against
float64 and a row alone against the same row in company, and runs natively too."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from mlx_parallm_provider.models import qmatmul, qmatmul_ext

EM_AARCH64 = 183
"""The ELF header's e_machine of an arm64 object."""

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ziglang") is None, reason="ziglang (a dev dependency on x86-64) is not installed")


def _zig(language: str) -> list[str]:
    """Zig's clang for ``language`` ("cc" or "c++"), targeting arm64 Linux with glibc."""
    return [sys.executable, "-m", "ziglang", language, "-target", "aarch64-linux-gnu"]


def _compile(language: str, source: Path, cpu: str, out: Path, includes: list[str]) -> tuple[int, str]:
    flags = ["-std=c++20", "-DNDEBUG", "-DNB_COMPACT_ASSERTIONS", "-DNB_DOMAIN=mlx"] if language == "c++" else []
    cmd = [*_zig(language), f"-mcpu={cpu}", "-O2", "-fno-signed-zeros", "-fno-trapping-math", *flags, *[f"-I{p}" for p in includes],
           "-c", str(source), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr[-3000:]


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


def test_the_extensions_sources_compile_for_arm64(tmp_path: Path) -> None:
    nanobind = pytest.importorskip("nanobind")
    import mlx.core as mx

    nb = Path(nanobind.source_dir()).parent
    includes = [sysconfig.get_paths()["include"], str(nb / "include"), str(nb / "ext" / "robin_map" / "include"),
                str(Path(mx.__file__).resolve().parent / "include")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = {source.name: pool.submit(_compile, "c++", source, "neoverse_v1", tmp_path / f"{source.stem}.o", includes)
                for source in qmatmul_ext.SOURCES}
        results = {name: job.result() for name, job in jobs.items()}
    failed = {name: errors for name, (status, errors) in results.items() if status != 0}
    assert not failed, failed
    assert {_machine(tmp_path / f"{source.stem}.o") for source in qmatmul_ext.SOURCES} == {EM_AARCH64}


CHECK = Path(__file__).parents[1] / "native" / "qmatmul_check.c"
"""The packed-weight kernel's standalone check (prints "ALL OK" when every case holds)."""
ARM64_LIBC = Path("/usr/aarch64-linux-gnu")
"""Where Debian's libc6-arm64-cross puts arm64's glibc, the emulator's root for the check's loader."""


def _verdict(run: subprocess.CompletedProcess) -> None:
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAIL")]
    assert run.returncode == 0 and run.stdout.strip().endswith("ALL OK") and not failed, (failed or run.stdout[-2000:]) + run.stderr[-2000:]


@pytest.mark.parametrize("cpu", ["generic", "cortex_a76"])  # NEON; NEON with dot products
def test_the_packed_weight_kernel_computes_right_on_arm64(cpu: str, tmp_path: Path) -> None:
    """(SVE builds, Neoverse V1, are compiled above: QEMU emulates SVE ~30x slower than NEON.)"""
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    if qemu is None or not (ARM64_LIBC / "lib" / "libc.so.6").exists():
        pytest.skip("no arm64 emulator (qemu-user-static) or C library (libc6-arm64-cross): the arm64 build is compiled above, not run")
    objects = [tmp_path / f"{source.stem}.o" for source in (CHECK, qmatmul.SOURCE)]
    for source, obj in zip((CHECK, qmatmul.SOURCE), objects):
        status, errors = _compile("cc", source, cpu, obj, [str(qmatmul.SOURCE.parent)])
        assert status == 0, errors
    # Linked against the system's arm64 glibc, as Zig's stubs of it: ~10 s the first time, where
    # a static musl build of Zig's own was ~90 s. -O2 and no sanitizer here too, or Zig builds
    # its UB sanitizer's runtime for the link.
    exe = tmp_path / "check"
    build = subprocess.run([*_zig("cc"), "-mcpu=generic", "-O2", "-fno-sanitize=undefined", *map(str, objects), "-lm", "-lpthread", "-o", str(exe)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    _verdict(subprocess.run([qemu, "-L", str(ARM64_LIBC), "-cpu", "max", str(exe)], capture_output=True, text=True, timeout=600))
