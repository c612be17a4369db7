"""The packed-weight kernel's standalone check (``tests/native/qmatmul_check.c``: every entry
point against float64 over the same packed weights, a row alone against that row in company),
built by this machine's C compiler with the flags the package builds it with, and for the
other x86 paths this CPU can run (AVX2 + FMA forced, the portable vectors). The same check
runs on arm64 under emulation in ``test_arm64_build.py``."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from mlx_parallm_provider.models import qmatmul

CHECK = Path(__file__).parents[1] / "native" / "qmatmul_check.c"


def _run(flags: list[str], tmp_path: Path) -> None:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        pytest.skip("no C compiler: the package keeps MLX's ops")
    exe = tmp_path / "check"
    build = subprocess.run([compiler, *flags, str(CHECK), str(qmatmul.SOURCE), f"-I{qmatmul.SOURCE.parent}", "-lm", "-lpthread",
                            "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAIL")]
    assert run.returncode == 0 and run.stdout.strip().endswith("ALL OK") and not failed, failed or run.stdout[-2000:]


def test_the_kernel_as_the_package_builds_it(tmp_path: Path) -> None:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        pytest.skip("no C compiler: the package keeps MLX's ops")
    _run([f for f in qmatmul.c_flags(compiler) if f != "-shared"], tmp_path)  # (an executable, not the library)


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "portable"])
def test_the_other_x86_paths(march: str, tmp_path: Path) -> None:
    if platform.machine() not in ("x86_64", "AMD64") or (march == "x86-64-v3" and not {"avx2", "fma"} <= qmatmul.cpu_flags()):
        pytest.skip("not an x86 CPU that runs this build")
    _run(["-O2", f"-march={march}", "-fno-signed-zeros", "-fno-trapping-math", "-Wno-psabi"], tmp_path)
