"""The interpreter exits within a bounded time while an engine step is still computing
(issue 21 item 3: exit hung when a step outlasted the shutdown window), the request in
flight fails with EngineDeadError, and the script's exit status is kept."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mlx_parallm_provider
from conftest import TINY_CONFIG, write_tiny_model

SCRIPT = Path(__file__).with_name("exit_during_step.py")
# Wider than the tiny model and with room for a long prompt, so that one prefill step of
# PROMPT_TOKENS takes seconds: far longer than WINDOW_S.
CONFIG = {**TINY_CONFIG, "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 16384}
PROMPT_TOKENS = 6000  # seconds here; a faster machine still outlasts 0.5 s + WINDOW_S
WINDOW_S = 0.2
BOUND_S = 60
EXIT_BOUND_S = 10  # from the script's last line to the process's end


@pytest.fixture(scope="module")
def long_step_model(smollm_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("long-step-llama"), smollm_tokenizer_dir, config=CONFIG)


@pytest.mark.parametrize("run", range(3))
def test_exit_while_a_step_computes_is_bounded_and_fails_the_waiter(run: int, long_step_model: Path) -> None:
    # MLX's own ops (no kernel build inside the step): the step is BLAS and MLX compute.
    root = str(Path(mlx_parallm_provider.__file__).parents[1])  # the package under test
    env = {**os.environ, "MLX_PARALLM_CPU_OPS": "0", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    status = 3 + run  # the script's own exit status survives the skipped native handlers
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(long_step_model), str(PROMPT_TOKENS), str(WINDOW_S), str(status)],
        env=env, capture_output=True, text=True, timeout=BOUND_S,
    )
    took = time.monotonic() - began
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, out
    assert "waiter: EngineDeadError" in proc.stdout, out
    assert "still inside a step at exit" in proc.stderr, out  # the step really outlasted the window
    assert took < BOUND_S, out
    line = next(x for x in proc.stdout.splitlines() if x.startswith("waiter:"))
    assert float(line.split()[2].rstrip("s")) < EXIT_BOUND_S, out
