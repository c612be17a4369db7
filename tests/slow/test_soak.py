"""The soak and fault suite (scripts/soak.py), small, on the tiny model: its verdict must be
PASS (no hang, no untyped error, no crash, no harmed neighbour, memory back to idle)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_soak_suite_passes_on_the_tiny_model(tiny_model_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "soak.py"), "--model", str(tiny_model_dir), "--requests", "160",
         "--concurrency", "32", "--http-requests", "96", "--connections", "64"],
        capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    report = proc.stdout[proc.stdout.find("## engine"):]
    assert proc.returncode == 0 and "verdict: PASS" in report, report + proc.stderr[-3000:]
    assert "hangs 0, untyped errors 0, harmed neighbours 0" in report
