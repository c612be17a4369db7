"""Runs the fuzz suite (tests/fuzz) in a subprocess: a crash of the process (SIGSEGV, abort)
is then a failure of this test, with the fuzz output, instead of a lost CI run. The
subprocesses start early, beside the other tests (tests/early.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from early import Command, result

FUZZ_DIR = Path(__file__).resolve().parents[1] / "fuzz"


def _fuzz_run(params: dict) -> Command:
    profile = os.environ.get("MLX_PARALLM_FUZZ_PROFILE", "ci")
    return Command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_files=fuzz_*.py",
                    f"--hypothesis-profile={profile}", str(FUZZ_DIR / params["module"])], cwd=FUZZ_DIR.parents[1], timeout=900)


@pytest.mark.early(command=_fuzz_run)
@pytest.mark.parametrize("module", sorted(p.name for p in FUZZ_DIR.glob("fuzz_*.py")))
def test_fuzz_module_passes_in_a_subprocess(module: str, request: pytest.FixtureRequest) -> None:
    proc = result(request)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"fuzz run of {module} ended with rc {proc.returncode}:\n{tail}"
